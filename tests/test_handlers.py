"""The handlers one at a time, against the local cloud: bad input named, duplicate and late
events acting once or not at all, task tokens answered exactly once with what the state
machine catches.

Task tokens are real: a one-state machine waits on `sqs:sendMessage.waitForTaskToken` and the
test reads the token from the queue, so success and failure are seen by Step Functions itself.
"""

import json
import logging
import math
import os
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from trainfleet.adapters.ec2_fleet import TAG_RUN, TAG_STACK, run_instance_ids
from trainfleet.adapters.liveness import write_liveness
from trainfleet.adapters.node_roles import node_role_name
from trainfleet.adapters.run_store import RunStore
from trainfleet.core.events import instance_arn, node_event_source
from trainfleet.core.records import (FAILURE_ERROR, CheckpointRef, FailureClass, FailureRecord, FailureReport,
                                     GoodputLedger, NodeLiveness, NodeRecord, NodeRole, NodeState, ParallelPlan,
                                     RecoveryKind, RunRecord, RunState, TaskWait, WorldRepair)
from trainfleet.core.runspec import RunSpec

from localcloud.glue import ec2 as ec2_glue
from localcloud_helpers import forget_functions, node_network_from_template, table_from_template

REPO = Path(__file__).resolve().parent.parent
STACK = "handlers-test"


@pytest.fixture(scope="module")
def cloud():
    from localcloud import LocalCloud

    with LocalCloud(time_scale=0.02) as started:
        yield started


@pytest.fixture(scope="module")
def resources(cloud):
    """The run table, idempotency table and bucket, created from template.yaml's own properties."""
    dynamodb = cloud.client("dynamodb")
    names = {logical_id: table_from_template(dynamodb, logical_id)
             for logical_id in ("RunTable", "LivenessTable", "IdempotencyTable")}
    bucket = f"checkpoints-{uuid.uuid4().hex[:8]}"
    cloud.client("s3").create_bucket(Bucket=bucket)
    write_shard_set(cloud, bucket, "data/tokens", vocab_size=257)  # where the RunSpecs here train: Validate reads it
    node_policy = cloud.client("iam").create_policy(PolicyName=f"nodes-{uuid.uuid4().hex[:6]}", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]}))
    return {"run_table": names["RunTable"], "liveness_table": names["LivenessTable"], "idempotency_table": names["IdempotencyTable"], "bucket": bucket,
            "node_policy_arn": node_policy["Policy"]["Arn"]}


@pytest.fixture(scope="module")
def node_network(cloud, tmp_path_factory) -> tuple[list[str], list[str]]:
    """The nodes' subnets (one a zone) and security group, as template.yaml makes them."""
    return node_network_from_template(cloud, tmp_path_factory.mktemp("network"))


@pytest.fixture
def handlers(cloud, resources, node_network, monkeypatch):
    """The functions package with the settings template.yaml gives every function; dropped from
    sys.modules afterwards, so that the local cloud can later import the deployed copy."""
    for name, value in {**cloud.env(), "TRAINFLEET_STACK": STACK, "TRAINFLEET_RUN_TABLE": resources["run_table"],
                        "TRAINFLEET_LIVENESS_TABLE": resources["liveness_table"],
                        "TRAINFLEET_IDEMPOTENCY_TABLE": resources["idempotency_table"],
                        "TRAINFLEET_BUCKET": resources["bucket"], "TRAINFLEET_EVENT_BUS": f"{STACK}-agents",
                        "TRAINFLEET_NODE_POLICY_ARN": resources["node_policy_arn"],
                        "TRAINFLEET_NODE_SUBNETS": ",".join(node_network[0]),
                        "TRAINFLEET_NODE_SECURITY_GROUPS": ",".join(node_network[1]),
                        "POWERTOOLS_TRACE_DISABLED": "true", "POWERTOOLS_METRICS_NAMESPACE": "Trainfleet"}.items():
        monkeypatch.setenv(name, value)
    # A copy imported before these settings (by another test in this process) would keep its
    # module-level clients and its Metrics without a namespace.
    forget_functions()
    import functions.agent_events
    import functions.allocate
    import functions.await_nodes
    import functions.events
    import functions.late_workers
    import functions.launch
    import functions.recover
    import functions.validate

    yield functions
    forget_functions()


class Context:
    """The attributes of Lambda's context object the handlers and Powertools read."""

    function_name = "test"
    memory_limit_in_mb = 512
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:test"
    aws_request_id = "00000000-0000-4000-8000-000000000000"

    @staticmethod
    def get_remaining_time_in_millis() -> int:
        return 60_000


ON_THE_STACKS_NETWORK = {"capacity": {"kind": "on-demand"}}
"""A RunSpec's capacity that names no network: Validate fills in the stack's node network."""


def spec_document(bucket: str, run_name: str, **changes) -> dict:
    # The example names its bucket my-training-bucket: the stack's bucket goes there.
    document = json.loads((REPO / "events" / "example-run.json").read_text().replace("my-training-bucket", bucket))
    document.update(run_name=run_name, checkpoint={"s3_uri": f"s3://{bucket}/runs/{run_name}/checkpoints"},
                    **changes)
    return document


def recorded_run(cloud, resources, workers: int = 2, spares: int = 0) -> tuple[RunStore, RunRecord, list[str]]:
    """A run recorded in TRAINING at attempt 0 with its nodes REGISTERED."""
    store = RunStore(cloud.client("dynamodb"), resources["run_table"])
    name = f"run-{uuid.uuid4().hex[:6]}"
    spec = RunSpec.model_validate(spec_document(
        resources["bucket"], name, instance_type="c5.large", node_count=workers, spare_count=spares,
        min_nodes=None, trainer={"model": {"n_layers": 2}, "training": {"batch_size": 2},
                                 "parallel": {"pp": workers, "dp": 1, "schedule": "gpipe", "microbatches": 2}}))
    store.create_run(RunRecord(run_name=name, spec=spec,
                               plan=ParallelPlan(nodes=workers, ranks_per_node=1, pp=workers, dp=1)))
    for state in (RunState.ALLOCATING, RunState.AWAITING_NODES, RunState.TRAINING):
        store.transition_run(name, state)
    ids = [f"i-{uuid.uuid4().hex[:17]}" for _ in range(workers + spares)]
    for index, instance_id in enumerate(ids):
        store.add_node(NodeRecord(run_name=name, instance_id=instance_id, private_ip=f"10.0.0.{index + 1}",
                                  role=NodeRole.WORKER if index < workers else NodeRole.SPARE))
        store.transition_node(name, instance_id, NodeState.REGISTERED)
    return store, store.run(name), ids


def parked_token(cloud) -> tuple[str, str]:
    """Start a one-state execution waiting on a task token; (execution arn, token)."""
    sqs, sfn = cloud.client("sqs"), cloud.client("stepfunctions")
    queue = sqs.create_queue(QueueName=f"tokens-{uuid.uuid4().hex[:6]}")["QueueUrl"]
    definition = {"StartAt": "Wait", "States": {"Wait": {
        "Type": "Task", "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken", "End": True,
        "Parameters": {"QueueUrl": queue, "MessageBody": {"token.$": "$$.Task.Token"}}}}}
    machine = sfn.create_state_machine(name=f"wait-{uuid.uuid4().hex[:6]}", definition=json.dumps(definition),
                                       roleArn="arn:aws:iam::123456789012:role/sfn")["stateMachineArn"]
    execution = sfn.start_execution(stateMachineArn=machine, name=uuid.uuid4().hex)["executionArn"]
    messages = []
    cloud.wait_until(lambda: messages.extend(sqs.receive_message(QueueUrl=queue).get("Messages", [])) or messages, "the task token")
    return execution, json.loads(messages[0]["Body"])["token"]


def finished(cloud, execution: str) -> dict:
    sfn = cloud.client("stepfunctions")
    cloud.wait_until(lambda: sfn.describe_execution(executionArn=execution)["status"] != "RUNNING",
                     "the execution to end")
    return sfn.describe_execution(executionArn=execution)


def agent_event(detail_type: str, detail: dict, sender: str | None = None) -> dict:
    """The event as the agents' rule delivers it, sent by `sender` (default: the instance it names)."""
    sender = sender or detail.get("instance_id")
    source = node_event_source(instance_arn("aws", "us-east-1", "123456789012", sender)) if sender else "trainfleet"
    return {"version": "0", "id": str(uuid.uuid4()), "source": source, "detail-type": detail_type,
            "account": "123456789012", "time": "2026-01-01T00:00:00Z", "region": "us-east-1",
            "resources": [], "detail": detail}


def arn(cloud, instance_id: str) -> str:
    """An instance's ARN: the key of its liveness record."""
    return instance_arn("aws", cloud.region, cloud.account_id, instance_id)


def state_change(instance_id: str, state: str) -> dict:
    event = json.loads((REPO / "events" / "aws" / "ec2-instance-state-change-terminated.json").read_text())
    event.update(id=str(uuid.uuid4()))
    event["detail"].update({"instance-id": instance_id, "state": state})
    return event


# --- Validate -------------------------------------------------------------------------------

def test_a_bad_run_spec_is_refused_naming_the_field_and_nothing_is_recorded(handlers, resources, cloud):
    document = spec_document(resources["bucket"], "bad-spec", node_count=0)
    with pytest.raises(handlers.errors.InvalidRunSpec, match=r"node_count: Input should be greater than or equal to 1"):
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:x"}, Context())
    with pytest.raises(handlers.errors.InvalidRunSpec, match=r"^checkpoint\.s3_uri: the nodes write checkpoints only under s3://"):
        handlers.validate.handler({"run_spec": spec_document("another-bucket", "elsewhere"),
                                   "execution_arn": "arn:x"}, Context())
    # A RunSpec copied under a new name, its checkpoints still another run's: refused, so the
    # copy cannot resume from, prune or retain that run's steps.
    copied = spec_document(resources["bucket"], "the-copy")
    copied["checkpoint"]["s3_uri"] = f"s3://{resources['bucket']}/runs/the-original/checkpoints"
    with pytest.raises(handlers.errors.InvalidRunSpec, match=rf"^checkpoint\.s3_uri: a run's checkpoints are its own, "
                                                             rf"under s3://{resources['bucket']}/runs/the-copy/"):
        handlers.validate.handler({"run_spec": copied, "execution_arn": "arn:x"}, Context())
    items = cloud.client("dynamodb").scan(TableName=resources["run_table"])["Items"]
    assert not [item for item in items if item["pk"]["S"] in ("RUN#bad-spec", "RUN#elsewhere", "RUN#the-copy")]


@pytest.mark.parametrize("section, changes, message", [
    ("optim", {"lr": -0.001}, "trainer: optim.lr must be > 0"),
    ("training", {"steps": 0}, "trainer: training.steps must be >= 1, got 0"),
    ("model", {"n_heads": 12}, "trainer: model.n_heads=12 must divide model.d_model=2048"),
    ("optim", {"lr": "fast"}, "trainer: optim.lr='fast' is not a valid float"),
])
def test_settings_the_trainer_refuses_are_refused_before_anything_is_allocated(
        handlers, resources, cloud, section, changes, message):
    document = spec_document(resources["bucket"], "refused-by-trainer")
    document["trainer"][section] = {**document["trainer"].get(section, {}), **changes}
    with pytest.raises(handlers.errors.InvalidRunSpec) as refused:
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:x"}, Context())
    assert str(refused.value).startswith(message), str(refused.value)
    items = cloud.client("dynamodb").scan(TableName=resources["run_table"])["Items"]
    assert not [item for item in items if item["pk"]["S"] == "RUN#refused-by-trainer"]


def test_a_layout_that_does_not_fit_in_gpu_memory_is_refused_with_the_figures(handlers, resources, cloud):
    # Jurassic-1 Jumbo's shape on 2 p4d nodes: 181 B parameters cannot fit 16 x 40 GiB.
    document = spec_document(resources["bucket"], "too-big", instance_type="p4d.24xlarge", node_count=2,
                             spare_count=0, min_nodes=None, trainer={
                                 "model": {"n_layers": 76, "d_model": 13824, "n_heads": 96, "vocab_size": 256000,
                                           "seq_len": 2048},
                                 "parallel": {"pp": 2, "dp": 1, "tp": 8, "schedule": "1f1b", "microbatches": 16},
                                 "training": {"batch_size": 16},
                                 "data": {"shards": f"s3://{resources['bucket']}/data/tokens"}})
    with pytest.raises(handlers.errors.InvalidRunSpec) as refused:
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:x"}, Context())
    message = str(refused.value)
    assert message.startswith("trainer: the layout needs"), message
    assert "optimizer" in message and "activations" in message and "device memory" in message
    assert "smallest fleet that fits:" in message and "x p4d.24xlarge" in message
    items = cloud.client("dynamodb").scan(TableName=resources["run_table"])["Items"]
    assert not [item for item in items if item["pk"]["S"] == "RUN#too-big"]


def test_in_memory_checkpoints_that_do_not_fit_host_memory_are_refused(handlers, resources, cloud):
    # Jurassic-1 Jumbo on 8 p4de: its GPUs hold it, its nodes' tmpfs not four copies of their share.
    trainer = {"model": {"n_layers": 76, "d_model": 13824, "n_heads": 96, "vocab_size": 256000, "seq_len": 2048},
               "parallel": {"pp": 8, "dp": 1, "tp": 8, "schedule": "1f1b", "microbatches": 32},
               "training": {"batch_size": 64, "activation_checkpoint": "full"},
               "data": {"shards": f"s3://{resources['bucket']}/data/tokens"}}
    document = spec_document(resources["bucket"], "copies-too-big", instance_type="p4de.24xlarge", node_count=8,
                             spare_count=0, min_nodes=None, trainer=trainer, **ON_THE_STACKS_NETWORK)
    with pytest.raises(handlers.errors.InvalidRunSpec) as refused:
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:x"}, Context())
    assert str(refused.value).startswith("checkpoint: the in-memory checkpoints need 1025.5 GiB"), str(refused.value)
    document["checkpoint"]["memory_interval_steps"] = 0  # S3 alone
    handlers.validate.handler({"run_spec": document, "execution_arn": "arn:y"}, Context())


def write_shard_set(cloud, bucket: str, prefix: str, vocab_size: int, tokenizer_spec: str = "bytes") -> None:
    """An index at s3://bucket/prefix as `trainfleet data prepare` writes one (its shards need not be there:
    Validate reads the index alone)."""
    from trainer import tokenizer
    from trainer.shards import index_of

    index = index_of([], "tokenizer.json", tokenizer.sha256_of(tokenizer_spec), vocab_size)
    cloud.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/index.json", Body=json.dumps(index).encode())


def test_a_shard_location_without_an_index_is_refused_before_anything_is_allocated(handlers, resources, cloud):
    document = spec_document(resources["bucket"], "typo")
    document["trainer"]["data"] = {"shards": f"s3://{resources['bucket']}/data/tokns"}
    with pytest.raises(handlers.errors.InvalidRunSpec, match=(
            rf"^trainer.data.shards: s3://{resources['bucket']}/data/tokns holds no index.json: no shard set is there")):
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:typo"}, Context())
    items = cloud.client("dynamodb").scan(TableName=resources["run_table"])["Items"]
    assert not [item for item in items if item["pk"]["S"] == "RUN#typo"]


def test_a_vocabulary_or_tokenizer_that_does_not_fit_the_shards_is_refused_naming_both(handlers, resources, cloud):
    write_shard_set(cloud, resources["bucket"], "data/llama", vocab_size=128_256)
    document = spec_document(resources["bucket"], "small-vocab")
    document["trainer"]["model"].pop("vocab_size", None)  # the default: the byte tokenizer's 257
    document["trainer"]["data"] = {"shards": f"s3://{resources['bucket']}/data/llama"}
    with pytest.raises(handlers.errors.InvalidRunSpec) as refused:
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:small"}, Context())
    assert str(refused.value).startswith(
        f"trainer: model.vocab_size=257 is smaller than the vocabulary of the shards at s3://{resources['bucket']}"
        "/data/llama (128256, tokenizer tokenizer.json)"), str(refused.value)
    write_shard_set(cloud, resources["bucket"], "data/other", vocab_size=257, tokenizer_spec="bytes")
    cloud.client("s3").put_object(Bucket=resources["bucket"], Key="data/tok/tokenizer.json", Body=b"{}")
    document["trainer"]["data"] = {"shards": f"s3://{resources['bucket']}/data/other",
                                   "tokenizer": f"s3://{resources['bucket']}/data/tok/tokenizer.json"}
    with pytest.raises(handlers.errors.InvalidRunSpec, match=(
            rf"^trainer: data.tokenizer=s3://{resources['bucket']}/data/tok/tokenizer.json \(sha256 44136fa355b3\) "
            r"is not the tokenizer the shards at .*/data/other were made with \(tokenizer.json, sha256 ")):
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:tok"}, Context())


def test_validate_records_the_run_and_passes_on_a_reference_of_constant_size(handlers, resources):
    small = spec_document(resources["bucket"], "small-run", **ON_THE_STACKS_NETWORK)
    large = spec_document(resources["bucket"], "large-run", node_count=512, spare_count=16, **ON_THE_STACKS_NETWORK,
                          trainer={**small["trainer"], "parallel": {**small["trainer"]["parallel"], "dp": 1024},
                                   "training": {**small["trainer"]["training"], "batch_size": 8192}})
    outputs = [handlers.validate.handler({"run_spec": document, "execution_arn": f"arn:{document['run_name']}"},
                                         Context()) for document in (small, large)]
    assert outputs[1] == {"run": {"run_name": "large-run", "attempt": 0},
                          "timeouts": {"boot_seconds": 2400, "late_worker_seconds": 600,
                                       "heartbeat_seconds": 600}}
    assert len(json.dumps(outputs[1])) < 200  # 512 nodes or 4: the fleet stays in DynamoDB
    # A retry of the same execution is fine; another execution may not take the name.
    assert handlers.validate.handler({"run_spec": small, "execution_arn": "arn:small-run"}, Context()) == outputs[0]
    with pytest.raises(handlers.errors.InvalidRunSpec, match="run_name: a run named 'small-run' exists already"):
        handlers.validate.handler({"run_spec": small, "execution_arn": "arn:other"}, Context())


def test_validate_records_the_trainer_section_with_the_trainers_defaults(handlers, resources, cloud):
    document = spec_document(resources["bucket"], "defaults-run", **ON_THE_STACKS_NETWORK)
    assert "vocab_size" not in document["trainer"]["model"] and "tp" not in document["trainer"]["parallel"]
    handlers.validate.handler({"run_spec": document, "execution_arn": "arn:defaults-run"}, Context())
    trainer = RunStore(cloud.client("dynamodb"), resources["run_table"]).run("defaults-run").spec.trainer
    model = trainer.model.model_dump()
    assert model["vocab_size"] == 257 and trainer.parallel.tp == 1  # trainer/config.py's defaults
    assert model["d_model"] == document["trainer"]["model"]["d_model"]  # what was given stays


def test_validate_fills_in_the_stacks_checkpoint_location_and_node_network(handlers, resources, cloud, node_network):
    document = spec_document(resources["bucket"], "bare-run", **ON_THE_STACKS_NETWORK)
    del document["checkpoint"]["s3_uri"]
    handlers.validate.handler({"run_spec": document, "execution_arn": "arn:bare-run"}, Context())
    spec = RunStore(cloud.client("dynamodb"), resources["run_table"]).run("bare-run").spec
    assert spec.checkpoint.s3_uri == f"s3://{resources['bucket']}/runs/bare-run/checkpoints"
    # moto offers p5.48xlarge in every zone of the region: every node subnet, in order
    assert (spec.capacity.subnet_ids, spec.capacity.security_group_ids) == node_network


def test_validate_refuses_a_subnet_the_nodes_could_not_reach_aws_from_naming_it_and_the_services(
        handlers, resources, cloud):
    """The default VPC's subnets (what a RunSpec without a network got before): an EFA node there
    gets no public IPv4 address, and no endpoint leads anywhere. Nothing is recorded."""
    ec2 = cloud.client("ec2")
    default = ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": ["us-east-1a"]},
                                            {"Name": "default-for-az", "Values": ["true"]}])["Subnets"][0]
    group = ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [default["VpcId"]]},
                                                  {"Name": "group-name", "Values": ["default"]}])["SecurityGroups"][0]
    document = spec_document(resources["bucket"], "no-way-out", capacity={
        "kind": "on-demand", "subnet_ids": [default["SubnetId"]], "security_group_ids": [group["GroupId"]]})
    with pytest.raises(handlers.errors.InvalidRunSpec) as refused:
        handlers.validate.handler({"run_spec": document, "execution_arn": "arn:no-way-out"}, Context())
    lines = str(refused.value).splitlines()
    services = ", ".join(line.split("could not reach ")[1].split(" from ")[0] for line in lines)
    for service in ("S3 (s3)", "DynamoDB (dynamodb)", "EventBridge (events)", "Step Functions (states)",
                    "CloudWatch Logs (logs)"):
        assert service in services
    assert all(f"from {default['SubnetId']} (us-east-1a)" in line and
               line.endswith("EC2 gives none to a launch of 32 network interfaces)") for line in lines)
    items = cloud.client("dynamodb").scan(TableName=resources["run_table"])["Items"]
    assert not [item for item in items if item["pk"]["S"] == "RUN#no-way-out"]


def test_validate_resumes_only_an_ended_run_of_this_model_that_committed_a_checkpoint(handlers, resources, cloud):
    from test_adapters_checkpoints import save

    bucket, store = resources["bucket"], RunStore(cloud.client("dynamodb"), resources["run_table"])
    handlers.validate.handler({"run_spec": spec_document(bucket, "ended-run", **ON_THE_STACKS_NETWORK),
                               "execution_arn": "arn:ended-run"}, Context())

    def validate(name: str, **changes) -> None:
        handlers.validate.handler({"run_spec": spec_document(bucket, name, **ON_THE_STACKS_NETWORK, **changes),
                                   "execution_arn": f"arn:{name}"}, Context())

    def refused(problem: str, **changes) -> None:
        with pytest.raises(handlers.errors.InvalidRunSpec, match=problem):
            validate("resumed-run", **changes)

    refused("resume_from: this stack has no run named 'never-ran'", resume_from="never-ran")
    refused("resume_from: a run resumes another run, not itself", resume_from="resumed-run")
    example = spec_document(bucket, "x")["trainer"]
    initialised = {**example, "training": {**example["training"], "init_from": f"s3://{bucket}/models/base"}}
    refused("resume_from: a resumed run starts from the other run's newest checkpoint, whole; "
            r"trainer.training.init_from \(weights to start from\) cannot be given with it",
            resume_from="ended-run", trainer=initialised)
    refused(r"resume_from: run 'ended-run' is REQUESTED: a run resumes one that has ended \(`trainfleet run stop "
            r"ended-run` ends it\)", resume_from="ended-run")
    for state in (RunState.TEARING_DOWN, RunState.FAILED):
        store.transition_run("ended-run", state)
    refused("resume_from: run 'ended-run' committed no checkpoint under "
            f"s3://{bucket}/runs/ended-run/checkpoints: nothing to resume from", resume_from="ended-run")
    save(cloud.client("s3"), f"s3://{bucket}/runs/ended-run/checkpoints", 40)
    other = {**example, "model": {**example["model"], "n_heads": example["model"]["n_heads"] * 2}}
    refused(f"resume_from: trainer.model.n_heads is {other['model']['n_heads']} here and was "
            f"{example['model']['n_heads']} in run 'ended-run': a checkpoint loads only into the model it was "
            "saved from", resume_from="ended-run", trainer=other)
    validate("resumed-run", resume_from="ended-run")
    spec = store.run("resumed-run").spec
    assert (spec.resume_from, spec.resume_from_uri) == ("ended-run", f"s3://{bucket}/runs/ended-run/checkpoints")


# --- Allocate -------------------------------------------------------------------------------

ZONE, INSTANCE_TYPE = "us-east-1c", "c5.large"


def validated_run(handlers, cloud, resources, monkeypatch, nodes: int = 2, parallel: dict | None = None,
                  **changes) -> dict:
    """Validate's output for a run of `nodes` c5.large workers (one rank each, pp = nodes, with
    `parallel` settings besides) in ZONE's node subnet; instances boot no agent (EC2 semantics
    only)."""
    monkeypatch.setattr(cloud.fleet, "boot", lambda instance: None)
    # The handlers are called one by one here: no state machine retries an Allocate that met its
    # new node profile before IAM showed it to EC2 (test_a_runs_nodes_get_a_role_of_their_own...).
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 0.0)
    # The stack's node network, as the handlers fixture gives it to the functions.
    subnets, groups = (os.environ[variable].split(",") for variable in ("TRAINFLEET_NODE_SUBNETS",
                                                                       "TRAINFLEET_NODE_SECURITY_GROUPS"))
    ec2 = cloud.client("ec2")
    (subnet,) = [subnet for subnet in ec2.describe_subnets(SubnetIds=subnets)["Subnets"]
                 if subnet["AvailabilityZone"] == ZONE]
    name = f"run-{uuid.uuid4().hex[:6]}"
    document = spec_document(resources["bucket"], name, **{
        "instance_type": INSTANCE_TYPE, "node_count": nodes, "spare_count": 0, "min_nodes": None,
        "image_id": "ami-0123456789abcdef0",
        "capacity": {"kind": "on-demand", "subnet_ids": [subnet["SubnetId"]], "security_group_ids": groups},
        "trainer": {"model": {"n_layers": nodes}, "training": {"batch_size": nodes},
                    "parallel": {"pp": nodes, "dp": 1, "schedule": "gpipe", "microbatches": nodes,
                                 **(parallel or {})}},
        **changes})
    return handlers.validate.handler({"run_spec": document, "execution_arn": f"arn:{name}"}, Context())


def instance_states(cloud, instance_ids: list[str]) -> dict[str, str]:
    reservations = cloud.client("ec2").describe_instances(InstanceIds=instance_ids)["Reservations"]
    return {instance["InstanceId"]: instance["State"]["Name"]
            for reservation in reservations for instance in reservation["Instances"]}


def test_allocate_retried_for_capacity_asks_ec2_anew_and_a_retry_after_a_launch_does_not(
        handlers, cloud, resources, monkeypatch):
    payload = validated_run(handlers, cloud, resources, monkeypatch)
    name, ec2 = payload["run"]["run_name"], cloud.client("ec2")

    cloud.set_capacity(INSTANCE_TYPE, ZONE, 0)
    with pytest.raises(handlers.errors.CapacityUnavailable, match="InsufficientInstanceCapacity"):
        handlers.allocate.handler(payload, Context())
    cloud.set_capacity(INSTANCE_TYPE, ZONE, None)
    # The state machine's Retry sends the same input; capacity has come back meanwhile.
    assert handlers.allocate.handler(payload, Context())["instances"] == 2
    launched = sorted(node.instance_id for node in RunStore(cloud.client("dynamodb"),
                                                            resources["run_table"]).nodes(name))
    # A retry of an invocation that did launch (its answer lost) gets the same fleet back.
    assert handlers.allocate.handler(payload, Context())["instances"] == 2
    assert run_instance_ids(ec2, name, STACK) == launched and len(launched) == 2
    ec2.terminate_instances(InstanceIds=launched)


def test_a_runs_nodes_get_a_role_of_their_own_made_by_allocate_and_deleted_by_teardown(
        handlers, cloud, resources, monkeypatch):
    import functions.teardown
    payload = validated_run(handlers, cloud, resources, monkeypatch)
    name, ec2, iam = payload["run"]["run_name"], cloud.client("ec2"), cloud.client("iam")
    # EC2 does not see a profile IAM made a moment ago: that launch is refused, and tried again.
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 3600.0)
    with pytest.raises(handlers.errors.TransientError, match="instance profile is not visible to EC2 yet"):
        handlers.allocate.handler(payload, Context())
    assert run_instance_ids(ec2, name, STACK) == []
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 0.0)
    assert handlers.allocate.handler(payload, Context())["instances"] == 2

    role_name = node_role_name(name, STACK)
    role = iam.get_role(RoleName=role_name)["Role"]
    assert role["Path"] == f"/trainfleet/{STACK}/" and {"Key": "trainfleet:run", "Value": name} in role["Tags"]
    attached = iam.list_attached_role_policies(RoleName=role_name)["AttachedPolicies"]
    assert [policy["PolicyArn"] for policy in attached] == [resources["node_policy_arn"]]
    profile = iam.get_instance_profile(InstanceProfileName=role_name)["InstanceProfile"]
    assert [role["RoleName"] for role in profile["Roles"]] == [role_name]
    reservations = ec2.describe_instances(InstanceIds=run_instance_ids(ec2, name, STACK))["Reservations"]
    assert {instance["IamInstanceProfile"]["Arn"] for reservation in reservations
            for instance in reservation["Instances"]} == {profile["Arn"]}

    functions.teardown.handler(payload, Context())
    for lookup in (lambda: iam.get_role(RoleName=role_name), lambda: iam.get_instance_profile(InstanceProfileName=role_name)):
        with pytest.raises(iam.exceptions.NoSuchEntityException):
            lookup()


def test_allocate_terminates_a_fleet_no_layout_runs_on_and_asks_anew(handlers, cloud, resources, monkeypatch):
    # Three stages pinned to three nodes: no layout runs on two, though one node may remain.
    payload = validated_run(handlers, cloud, resources, monkeypatch, nodes=3, min_nodes=1,
                            parallel={"layers_per_stage": [1, 1, 1]})
    name, ec2 = payload["run"]["run_name"], cloud.client("ec2")
    store = RunStore(cloud.client("dynamodb"), resources["run_table"])
    cloud.set_capacity(INSTANCE_TYPE, ZONE, 2)
    try:
        with pytest.raises(handlers.errors.CapacityUnavailable, match="no layout"):
            handlers.allocate.handler(payload, Context())
    finally:
        cloud.set_capacity(INSTANCE_TYPE, ZONE, None)
    assert run_instance_ids(ec2, name, STACK) == [], "the two instances no layout can use were left running"
    assert store.run(name).fleet_requests_unfilled == 1 and store.nodes(name) == []
    # The retry asks EC2 anew (a new ClientToken), and capacity is back.
    assert handlers.allocate.handler(payload, Context())["instances"] == 3
    ec2.terminate_instances(InstanceIds=run_instance_ids(ec2, name, STACK))


# --- transient errors -----------------------------------------------------------------------

@pytest.mark.parametrize("code, status, transient", [
    ("RequestLimitExceeded", 503, True),  # EC2's throttle
    ("ThrottlingException", 400, True),
    ("ProvisionedThroughputExceededException", 400, True),
    ("SlowDown", 503, True),  # S3
    ("InternalError", 500, True),
    ("SomethingNew", 502, True),  # any 5xx
    ("InsufficientInstanceCapacity", 500, False),  # a 5xx, but capacity: CapacityUnavailable decides
    ("InvalidParameterValue", 400, False),
    ("AccessDenied", 403, False),
])
def test_aws_errors_are_classified_transient_or_not(handlers, code, status, transient):
    from botocore.exceptions import ClientError

    error = ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                        "AnyOperation")
    assert handlers.common.is_transient(error) is transient


def test_a_transient_aws_error_leaves_the_handler_as_transient_error(handlers, cloud, resources, monkeypatch):
    """S3 out of reach while the report is written: the state machine must see TransientError,
    the name it retries with backoff, not the client's own exception, which would end the run."""
    import boto3
    import functions.report
    from botocore.config import Config
    from conftest import free_port

    store, run, _ = recorded_run(cloud, resources)
    working = handlers.common.aws()
    unreachable = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{free_port()}",
                               config=Config(retries={"mode": "standard", "max_attempts": 1}))
    monkeypatch.setitem(working.__dict__, "s3", unreachable)  # the function's client, made on first use
    payload = {"run": {"run_name": run.run_name, "attempt": 0}, "timeouts": {"boot_seconds": 60,
                                                                             "late_worker_seconds": 60,
                                                                             "heartbeat_seconds": 60}}
    with pytest.raises(handlers.errors.TransientError, match="EndpointConnectionError"):
        functions.report.handler(payload, Context())
    del working.__dict__["s3"]  # made afresh, reachable, on next use
    with pytest.raises(handlers.errors.InvalidRunSpec):  # any other error keeps its own name
        handlers.validate.handler({"run_spec": {"run_name": "x"}, "execution_arn": "arn:x"}, Context())


# --- events ---------------------------------------------------------------------------------

def test_the_last_ready_worker_succeeds_await_nodes_once(handlers, cloud, resources):
    store, run, (first, second) = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="await_nodes", attempt=0, token=token))
    ready = [agent_event("NodeReady", {"run_name": run.run_name, "attempt": 0, "instance_id": instance_id})
             for instance_id in (first, second)]
    outcomes = [handlers.events.handler(event, Context())["outcome"] for event in ready]
    assert outcomes == ["node ready", "node ready, world complete"]
    assert handlers.events.handler(ready[1], Context())["outcome"] == "node ready, world complete"  # redelivery
    result = finished(cloud, execution)
    assert result["status"] == "SUCCEEDED" and json.loads(result["output"]) == {"ready_workers": 2}
    assert store.run(run.run_name).waiting is None


def sqs_batch(*events: dict) -> dict:
    return {"Records": [{"messageId": f"m-{index}", "receiptHandle": f"h-{index}", "body": json.dumps(event),
                         "attributes": {"ApproximateReceiveCount": "1"}, "messageAttributes": {},
                         "md5OfBody": "", "eventSource": "aws:sqs", "awsRegion": "us-east-1",
                         "eventSourceARN": "arn:aws:sqs:us-east-1:123456789012:agent-events"}
                        for index, event in enumerate(events)]}


def test_a_batch_of_agent_events_completes_the_world_and_returns_only_the_record_that_failed(handlers, cloud,
                                                                                           resources):
    store, run, workers = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="await_nodes", attempt=0, token=token))
    ready = [agent_event("NodeReady", {"run_name": run.run_name, "attempt": 0, "instance_id": instance_id})
             for instance_id in workers]
    unreadable = agent_event("NodeReady", {"run_name": run.run_name})  # no attempt, no instance

    answer = handlers.agent_events.handler(sqs_batch(ready[0], unreadable, ready[1]), Context())

    assert answer == {"batchItemFailures": [{"itemIdentifier": "m-1"}]}
    assert finished(cloud, execution)["status"] == "SUCCEEDED"
    assert {node.state for node in store.nodes(run.run_name)} == {NodeState.READY}


def test_an_answer_that_could_not_be_sent_stays_parked_for_the_retry(handlers, cloud, resources, monkeypatch):
    """Step Functions out of reach (a closed port, no client retries): the invocation fails
    and the token is still parked; the retry of the same event answers the task."""
    import boto3
    from botocore.config import Config
    from conftest import free_port

    store, run, (first, second) = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token=token))
    completed = agent_event("TrainingCompleted", {"run_name": run.run_name, "attempt": 0, "instance_id": first,
                                                  "final_step": 10})
    working = handlers.common.aws()
    unreachable = boto3.client("stepfunctions", endpoint_url=f"http://127.0.0.1:{free_port()}",
                               config=Config(retries={"mode": "standard", "max_attempts": 1}))
    monkeypatch.setitem(working.__dict__, "sfn", unreachable)  # the function's client, made on first use
    with pytest.raises(Exception, match="Could not connect"):
        handlers.events.handler(completed, Context())
    assert store.run(run.run_name).waiting.token == token, "the token was dropped unanswered"

    del working.__dict__["sfn"]  # made afresh, reachable, on next use
    handlers.events.handler(completed, Context())
    assert finished(cloud, execution)["status"] == "SUCCEEDED"
    assert store.run(run.run_name).waiting is None


def test_of_many_handlers_racing_to_answer_exactly_one_does(handlers, cloud, resources):
    import threading

    store, run, _ = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token=token))
    answered, barrier = [], threading.Barrier(6)

    def handler(index: int) -> None:
        barrier.wait(timeout=10)
        answered.append(handlers.common.answer_task(run.run_name, "train", 0, output={"by": index}))

    threads = [threading.Thread(target=handler, args=(index,)) for index in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(answered) == [False] * 5 + [True]
    assert finished(cloud, execution)["status"] == "SUCCEEDED"
    assert store.run(run.run_name).waiting is None


def test_readiness_of_a_node_still_booting_when_the_run_moved_on_counts(handlers, cloud, resources):
    store, run, (survivor, booting) = recorded_run(cloud, resources)
    # Attempt 0 ended while `booting` was in preflight; the survivor was ready for attempt 0.
    store.modify_node(run.run_name, survivor, lambda node: node.model_copy(
        update={"state": NodeState.READY, "ready_attempt": 0}))
    store.modify_run(run.run_name, lambda current: current.model_copy(update={"attempt": 1}))
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="await_nodes", attempt=1, token=token))
    # The booting node's agent reports the attempt it read before Recover moved the run on.
    late = agent_event("NodeReady", {"run_name": run.run_name, "attempt": 0, "instance_id": booting})
    assert handlers.events.handler(late, Context())["outcome"] == "node ready"
    assert store.node(run.run_name, booting).state is NodeState.READY
    assert store.run(run.run_name).waiting is not None, "the survivor has not confirmed attempt 1 yet"
    for instance_id in (survivor, booting):  # each agent confirms the attempt it sees the run in
        confirmation = agent_event("NodeReady", {"run_name": run.run_name, "attempt": 1, "instance_id": instance_id})
        outcome = handlers.events.handler(confirmation, Context())["outcome"]
    assert outcome == "node ready, world complete"
    assert finished(cloud, execution)["status"] == "SUCCEEDED"
    assert store.node(run.run_name, survivor).ready_attempt == 1


def test_a_duplicate_event_acts_once(handlers, cloud, resources):
    store, run, (lost, _) = recorded_run(cloud, resources)
    event = state_change(lost, "shutting-down")
    first = handlers.events.handler(event, Context())
    version = store.node(run.run_name, lost).version
    assert handlers.events.handler(event, Context()) == first
    assert store.node(run.run_name, lost).version == version, "the redelivery changed the record"
    record = cloud.client("dynamodb").scan(TableName=resources["idempotency_table"])["Items"]
    assert any(item["status"]["S"] == "COMPLETED" for item in record)


def test_a_lost_worker_fails_the_train_task_with_a_failure_report(handlers, cloud, resources):
    store, run, (lost, survivor) = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token=token))
    outcome = handlers.events.handler(state_change(lost, "shutting-down"), Context())["outcome"]
    assert outcome == "INSTANCE_LOST: task failed"
    result = finished(cloud, execution)
    assert result["status"] == "FAILED" and result["error"] == FAILURE_ERROR
    report = json.loads(result["cause"])
    assert report["failure_class"] == FailureClass.INSTANCE_LOST.value and report["instance_ids"] == [lost]
    assert store.node(run.run_name, lost).state is NodeState.UNHEALTHY
    assert store.node(run.run_name, survivor).state is NodeState.REGISTERED
    # The 'terminated' that follows is news about a node already retired.
    later = handlers.events.handler(state_change(lost, "terminated"), Context())["outcome"]
    assert later == "node terminated" and store.node(run.run_name, lost).state is NodeState.TERMINATED


def fleet_checked(run_name: str, reporter: str, passed: bool, slow: list[str]) -> dict:
    figures = {"attempt": 0, "passed": passed, "busbw_gbytes_per_s": 30.0 if passed else 4.0,
               "floor_gbytes_per_s": 25.0, "slowest_link_gbytes_per_s": 2.0, "slowest_link": [reporter, *slow][:2],
               "slow_instance_ids": slow, "seconds": 3.5}
    return agent_event("FleetChecked", {"run_name": run_name, "attempt": 0, "instance_id": reporter,
                                        "figures": figures})


def test_a_world_below_the_fleet_check_floor_fails_before_training_blaming_the_slow_node(handlers, cloud,
                                                                                           resources):
    store, run, (host, slow) = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token=token))

    outcome = handlers.events.handler(fleet_checked(run.run_name, host, False, [slow]), Context())["outcome"]

    assert outcome == "SLOW_NETWORK: task failed"
    report = json.loads(finished(cloud, execution)["cause"])
    assert report["failure_class"] == "SLOW_NETWORK" and report["instance_ids"] == [slow]
    assert "fleet all-reduce 4.000 GB/s, floor 25.000 GB/s" in report["message"]
    assert store.node(run.run_name, slow).state is NodeState.UNHEALTHY
    assert store.node(run.run_name, host).state is not NodeState.UNHEALTHY
    assert store.run(run.run_name).fleet_check.slow_instance_ids == [slow]


def test_a_world_that_passed_the_fleet_check_trains_on_with_its_figures_recorded(handlers, cloud, resources):
    store, run, (host, _) = recorded_run(cloud, resources)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token="token-of-a-live-task"))
    outcome = handlers.events.handler(fleet_checked(run.run_name, host, True, []), Context())["outcome"]
    assert outcome.startswith("fleet check passed: fleet all-reduce 30.000 GB/s")
    recorded = store.run(run.run_name)
    assert recorded.waiting is not None and recorded.fleet_check.passed and recorded.fleet_check.seconds == 3.5


def test_where_the_state_came_from_is_recorded(handlers, cloud, resources):
    store, run, (host, _) = recorded_run(cloud, resources)
    figures = {"attempt": 0, "step": 13, "source": "memory", "shards": 6, "own_memory": 4, "peers": 2,
               "peer_bytes": 3 * 2**20, "seconds": 0.8, "fallback": None}
    outcome = handlers.events.handler(agent_event("StateRestored", {"run_name": run.run_name, "attempt": 0,
                                                                    "instance_id": host, "figures": figures}),
                                      Context())["outcome"]
    assert outcome == ("state restored: step 13 from host memory: 4 of 6 shards on their own node, 2 from a buddy "
                       "(3.0 MiB), 0.8 s")
    assert store.run(run.run_name).restored.peers == 2
    # The failure that led to the attempt says where it resumed (the report and live view show it).
    store.modify_run(run.run_name, lambda current: current.model_copy(update={"failures": [FailureRecord(
        failure_class=FailureClass.INSTANCE_LOST, resume_step=10, at=current.updated_at, attempt=0)]}))
    handlers.events.handler(agent_event("StateRestored", {"run_name": run.run_name, "attempt": 0, "instance_id": host,
                                                          "figures": figures | {"attempt": 1}}), Context())
    assert store.run(run.run_name).failures[0].restored.step == 13


def test_time_kept_for_a_restore_from_memory_is_taken_back_when_the_state_came_from_s3(handlers, cloud, resources):
    store, run, (host, _) = recorded_run(cloud, resources)
    store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "ledger": GoodputLedger(productive_seconds=600.0), "failures": [FailureRecord(
            failure_class=FailureClass.INSTANCE_LOST, resume_step=10, at=current.updated_at, attempt=0,
            kept_on_memory_seconds=45.0)]}))
    fallback = {"attempt": 1, "step": 10, "source": "s3", "shards": 2, "seconds": 1.0,
                "fallback": "shards [1] have no in-memory copy (a node and its buddy were lost)"}
    event = agent_event("StateRestored", {"run_name": run.run_name, "attempt": 1, "instance_id": host,
                                          "figures": fallback})
    for _ in range(2):  # a redelivered event takes nothing back twice
        handlers.events.handler(event, Context())
    recorded = store.run(run.run_name)
    assert recorded.ledger.productive_seconds == 555.0
    assert recorded.ledger.lost_by_cause == {"redone:INSTANCE_LOST": 45.0}
    assert recorded.failures[0].kept_on_memory_seconds == 0 and recorded.failures[0].restored.source == "s3"


def scaling_checked(run_name: str, reporter: str, passed: bool) -> dict:
    figures = {"attempt": 0, "passed": passed, "efficiency": 0.85 if passed else 0.12, "efficiency_floor": 0.7,
               "step_seconds": 2.0, "expected_step_seconds": 1.7 if passed else 0.24, "tokens_per_second": 4096,
               "expected_tokens_per_second": 4800 if passed else 34000, "steps": 5, "slowest_stages": [1],
               "slowest_stage_seconds": 0.16, "slowest_stage_instance_ids": [reporter], "slowest_rank": 1,
               "slowest_rank_instance_id": reporter, "slowest_rank_seconds": 0.17}
    return agent_event("ScalingChecked", {"run_name": run_name, "attempt": 0, "instance_id": reporter,
                                          "figures": figures})


def test_a_world_that_does_not_scale_fails_the_attempt_blaming_no_node(handlers, cloud, resources):
    store, run, (host, other) = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token=token))

    outcome = handlers.events.handler(scaling_checked(run.run_name, host, False), Context())["outcome"]

    assert outcome == "POOR_SCALING: task failed"
    report = json.loads(finished(cloud, execution)["cause"])
    assert report["failure_class"] == "POOR_SCALING" and report["instance_ids"] == []
    assert report["observed_at"].startswith("2026-01-01T00:00:00"), "the first sign is the event's time"
    assert "scaling efficiency 0.12 (floor 0.70)" in report["message"] and "slowest stage 1" in report["message"]
    assert {store.node(run.run_name, node).state for node in (host, other)} == {NodeState.REGISTERED}
    assert not store.run(run.run_name).scaling_check.passed


def test_a_world_that_scales_trains_on_and_the_check_is_not_due_again(handlers, cloud, resources):
    store, run, (host, _) = recorded_run(cloud, resources)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token="token-of-a-live-task"))
    outcome = handlers.events.handler(scaling_checked(run.run_name, host, True), Context())["outcome"]
    assert outcome.startswith("scaling check passed: scaling efficiency 0.85")
    recorded = store.run(run.run_name)
    assert recorded.waiting is not None and recorded.scaling_check.passed


def test_the_steps_a_progress_event_carries_are_kept_for_the_report(handlers, cloud, resources):
    store, run, (host, _) = recorded_run(cloud, resources)
    samples = [{"step": step, "loss": 4.0 - step / 10 if step != 3 else "NaN", "tokens_per_second": 900.0 + step,
                "step_seconds": 0.5, "at": f"2026-01-01T00:00:{step:02d}Z"} for step in range(1, 6)]
    detail = {"run_name": run.run_name, "attempt": 0, "instance_id": host, "step": 5, "loss": 3.5,
              "tokens_per_second": 905.0, "step_seconds": 0.5, "samples": samples}
    event = agent_event("TrainingProgress", detail)
    assert handlers.events.handler(event, Context())["outcome"] == "progress at step 5"
    later = agent_event("TrainingProgress", detail | {"step": 7, "samples": [samples[-1] | {"step": 7}]})
    handlers.events.handler(later, Context())
    handlers.events.handler(event | {"id": str(uuid.uuid4())}, Context())  # the same steps again
    kept = list(store.progress(run.run_name))
    assert [(attempt, sample.step) for attempt, sample in kept] == [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 7)]
    assert math.isnan(kept[2][1].loss) and kept[4][1].tokens_per_second == 905.0
    assert store.latest_progress(run.run_name)[1].step == 7
    assert {report.reporter for report in store.progress_reports(run.run_name)} == {host}, "who reported them"


def test_a_lost_spare_is_recorded_without_failing_training(handlers, cloud, resources):
    store, run, (_, _, spare) = recorded_run(cloud, resources, spares=1)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token="token-of-a-live-task"))
    outcome = handlers.events.handler(state_change(spare, "terminated"), Context())["outcome"]
    assert outcome == "INSTANCE_LOST recorded"
    assert store.run(run.run_name).waiting is not None, "training must go on"
    assert store.node(run.run_name, spare).state is NodeState.TERMINATED


def test_an_unhealthy_spare_is_terminated_at_once_and_training_goes_on(handlers, cloud, resources):
    """No recovery runs for a spare's failure: it was recorded and kept running, billed for
    nothing. Its instance now ends at once; the world trains on."""
    store, run, _ = recorded_run(cloud, resources)
    tags = [{"Key": TAG_RUN, "Value": run.run_name}, {"Key": TAG_STACK, "Value": STACK}]
    spare = cloud.client("ec2").run_instances(
        ImageId="ami-0123456789abcdef0", InstanceType="c5.large", MinCount=1, MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0]["InstanceId"]
    store.add_node(NodeRecord(run_name=run.run_name, instance_id=spare, role=NodeRole.SPARE))
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token="token-of-a-live-task"))
    unhealthy = agent_event("NodeUnhealthy", {"run_name": run.run_name, "attempt": 0, "instance_id": spare,
                                              "reason": "gpu_count: 7 of 8"})
    assert handlers.events.handler(unhealthy, Context())["outcome"] == "NODE_UNHEALTHY: spare(s) terminated"
    assert store.run(run.run_name).waiting is not None, "training must go on"
    assert store.node(run.run_name, spare).state is NodeState.TERMINATING
    assert instance_states(cloud, [spare])[spare] in ("shutting-down", "terminated")


def test_an_event_about_an_instance_launched_but_not_yet_recorded_is_tried_again(handlers, cloud, resources):
    """EC2's news of an instance this stack launched can come before Allocate or Recover records
    it: the invocation fails (Lambda tries the event again) rather than drop it as another
    account's instance, which stays ignored."""
    ec2 = cloud.client("ec2")

    def launched(tags: list[dict]) -> str:
        return ec2.run_instances(ImageId="ami-0123456789abcdef0", InstanceType="c5.large", MinCount=1, MaxCount=1,
                                 TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])["Instances"][0][
            "InstanceId"]
    ours = launched([{"Key": TAG_RUN, "Value": "not-recorded-yet"}, {"Key": TAG_STACK, "Value": STACK}])
    foreign = launched([{"Key": "team", "Value": "someone-else"}])
    with pytest.raises(handlers.errors.NodeNotRecordedYet, match=f"{ours}: launched by this stack"):
        handlers.events.handler(state_change(ours, "terminated"), Context())
    assert handlers.events.handler(state_change(foreign, "terminated"), Context())["outcome"] == \
        "ignored: no instance of a run"
    ec2.terminate_instances(InstanceIds=[ours, foreign])


def test_an_agent_event_of_a_replaced_attempt_changes_nothing(handlers, cloud, resources):
    store, run, (worker, _) = recorded_run(cloud, resources)
    store.modify_run(run.run_name, lambda current: current.model_copy(update={"attempt": 1}))
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=1, token="token-of-attempt-1"))
    failed = agent_event("TrainerFailed", {"run_name": run.run_name, "attempt": 0, "instance_id": worker,
                                           "kind": "crash", "message": "peer gone"})
    assert handlers.events.handler(failed, Context())["outcome"] == "ignored: attempt 0 was replaced by 1"
    assert store.run(run.run_name).waiting.token == "token-of-attempt-1"
    # The steps it trained before it was left still belong to the run's history, and only they.
    steps = [{"step": step, "loss": 3.0, "tokens_per_second": 10.0, "step_seconds": 1.0,
              "at": f"2026-01-01T00:00:{step:02d}Z"} for step in (11, 12)]
    progress = agent_event("TrainingProgress", {"run_name": run.run_name, "attempt": 0, "instance_id": worker,
                                                "step": 12, "loss": 3.0, "tokens_per_second": 10.0,
                                                "step_seconds": 1.0, "samples": steps})
    before = store.run(run.run_name)
    assert handlers.events.handler(progress, Context())["outcome"] == "steps of attempt 0 recorded; it was replaced by 1"
    assert [(attempt, sample.step) for attempt, sample in store.progress(run.run_name)] == [(0, 11), (0, 12)]
    assert store.run(run.run_name) == before


def test_an_instance_of_no_run_is_ignored(handlers):
    outcome = handlers.events.handler(state_change("i-0123456789abcdef0", "terminated"), Context())["outcome"]
    assert outcome == "ignored: no instance of a run"


def test_a_checkpoint_claim_is_checked_against_s3(handlers, cloud, resources):
    store, run, (worker, _) = recorded_run(cloud, resources)
    claim = agent_event("CheckpointCommitted", {
        "run_name": run.run_name, "attempt": 0, "instance_id": worker, "step": 100,
        "uri": f"{run.spec.checkpoint.s3_uri}/step-000000100"})
    assert handlers.events.handler(claim, Context())["outcome"] == "ignored: checkpoint not whole"
    assert store.run(run.run_name).latest_checkpoint is None


def test_the_last_step_is_never_below_the_newest_commit_and_a_claim_of_a_pruned_step_is_no_warning(
        handlers, cloud, resources):
    """Progress goes out every few seconds, commits as soon as an agent looks: `run status` must
    not say step 10 beside checkpoint step 60. A step keep_last pruned after the agent listed it
    is no failed save."""
    from test_adapters_checkpoints import save
    store, run, (worker, _) = recorded_run(cloud, resources)
    every, uri = run.spec.checkpoint.interval_steps, run.spec.checkpoint.s3_uri
    save(cloud.client("s3"), uri, 2 * every)

    def claim(step: int) -> dict:
        return agent_event("CheckpointCommitted", {"run_name": run.run_name, "attempt": 0, "instance_id": worker,
                                                   "step": step, "uri": f"{uri}/step-{step:09d}"})

    assert handlers.events.handler(claim(2 * every), Context())["outcome"].startswith(f"checkpoint step {2 * every}")
    assert store.run(run.run_name).last_step == 2 * every
    sample = {"step": 3, "loss": 4.0, "tokens_per_second": 900.0, "step_seconds": 0.5, "at": "2026-01-01T00:00:03Z"}
    progress = agent_event("TrainingProgress", {"run_name": run.run_name, "attempt": 0, "instance_id": worker,
                                                "step": 3, "loss": 4.0, "tokens_per_second": 900.0,
                                                "step_seconds": 0.5, "samples": [sample]})
    handlers.events.handler(progress, Context())
    assert store.run(run.run_name).last_step == 2 * every
    heard = Heard()
    functions_log = logging.getLogger(handlers.common.logger.service)  # Powertools' logger, by its service
    functions_log.addHandler(heard)
    try:
        outcome = handlers.events.handler(claim(every), Context())["outcome"]
    finally:
        functions_log.removeHandler(heard)
    assert outcome == f"ignored: step {every} pruned since, step {2 * every} recorded"
    assert heard.levels == ["INFO", "INFO"], heard.levels  # the claim's line and the event's


class Heard(logging.Handler):
    def __init__(self):
        super().__init__()
        self.levels: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.levels.append(record.levelname)


@pytest.mark.parametrize("sample, failure_class", [
    ("aws-health-ec2-instance-retirement.json", FailureClass.HEALTH_EVENT),
])  # announced departures first wait for the emergency checkpoint: tests/test_handlers_spot_goodput.py
def test_an_ongoing_health_issue_about_a_worker_fails_the_train_task(handlers, cloud, resources, sample,
                                                                      failure_class):
    store, run, (worker, _) = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token=token))
    event = json.loads((REPO / "events" / "aws" / sample).read_text())
    event["id"] = str(uuid.uuid4())
    event["detail"]["eventTypeCategory"] = "issue"  # degraded now, not a retirement to come
    # The documented samples name i-1234567890abcdef0: point them at this run's worker, and
    # keep a second, foreign instance in the Health event (it must be ignored).
    if "affectedEntities" in event["detail"]:
        event["detail"]["affectedEntities"] = [{"entityValue": worker}, {"entityValue": "i-0fedcba9876543210"}]
    else:
        event["detail"]["instance-id"] = worker
    assert handlers.events.handler(event, Context())["outcome"] == f"{failure_class.value}: task failed"
    report = json.loads(finished(cloud, execution)["cause"])
    assert report["failure_class"] == failure_class.value and report["instance_ids"] == [worker]


def spent_budget(current: RunRecord) -> dict:
    """The update that leaves a run no restart: Recover only books the failure and gives up."""
    return {"spec": current.spec.model_copy(update={"recovery": current.spec.recovery.model_copy(
        update={"max_restarts": 0})})}


def lost(run: RunRecord, worker: str) -> dict:
    """Recover's input for the loss of `worker` in attempt 0."""
    report = {"failure_class": "INSTANCE_LOST", "attempt": 0, "instance_ids": [worker], "message": "lost"}
    return {"run": {"run_name": run.run_name, "attempt": 0},
            "timeouts": {"boot_seconds": 60, "late_worker_seconds": 60, "heartbeat_seconds": 60},
            "failure": {"Error": FAILURE_ERROR, "Cause": json.dumps(report)}}


def test_recover_gives_up_when_the_restart_budget_is_spent(handlers, cloud, resources):
    store, run, (worker, _) = recorded_run(cloud, resources)
    store.modify_run(run.run_name, lambda current: current.model_copy(update=spent_budget(current)))
    with pytest.raises(handlers.errors.RecoveryGaveUp, match=r"restart budget spent \(0 of 0 in 24 h\)"):
        handlers.recover.handler(lost(run, worker), Context())
    after = store.run(run.run_name)
    assert after.error.startswith("restart budget spent") and [f.failure_class for f in after.failures] == [
        FailureClass.INSTANCE_LOST]


def test_recover_books_the_newest_commit_in_s3_even_one_no_agent_announced(handlers, cloud, resources):
    from test_adapters_checkpoints import save
    store, run, (worker, _) = recorded_run(cloud, resources)
    every = run.spec.checkpoint.interval_steps
    for step in (every, 2 * every):  # the node is lost before its agent announced the second
        save(cloud.client("s3"), run.spec.checkpoint.s3_uri, step)
    # The record knows the first; the restart budget is spent, so Recover only books the failure.
    store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "latest_checkpoint": CheckpointRef(step=every, uri=f"{run.spec.checkpoint.s3_uri}/step-{every:09d}",
                                           committed_at=current.created_at), **spent_budget(current)}))
    with pytest.raises(handlers.errors.RecoveryGaveUp):
        handlers.recover.handler(lost(run, worker), Context())
    after = store.run(run.run_name)
    assert after.latest_checkpoint.step == 2 * every
    assert [(f.failure_class, f.resume_step) for f in after.failures] == [(FailureClass.INSTANCE_LOST, 2 * every)]


def test_a_retried_recover_books_the_failure_once_and_keeps_the_replacements(handlers, cloud, resources, monkeypatch):
    payload = validated_run(handlers, cloud, resources, monkeypatch)
    name = payload["run"]["run_name"]
    store = RunStore(cloud.client("dynamodb"), resources["run_table"])
    handlers.allocate.handler(payload, Context())
    handlers.await_nodes.handler({"run": payload, "task_token": "token-of-await-nodes"}, Context())
    slow, booted = sorted(node.instance_id for node in store.nodes(name))
    store.transition_node(name, booted, NodeState.REGISTERED)
    store.transition_node(name, booted, NodeState.READY, ready_attempt=0)  # its agent confirmed attempt 0
    # The boot timeout sends AwaitNodes' input to Recover; its Retry sends the same again when an
    # invocation that had acted lost its answer (Lambda.ServiceException).
    caught = {**payload, "failure": {"Error": "States.Timeout", "Cause": "AwaitNodes timed out"}}
    first = handlers.recover.handler(caught, Context())
    replacements = [node.instance_id for node in store.nodes(name) if node.attempt == 1]
    second = handlers.recover.handler(caught, Context())

    run = store.run(name)
    assert (run.attempt, run.restarts, len(run.failures)) == (1, 1, 1), "the failure was booked twice"
    assert first["run"] == second["run"] == {"run_name": name, "attempt": 1}
    assert len(replacements) == 1 and store.node(name, replacements[0]).state is NodeState.LAUNCHED
    assert instance_states(cloud, replacements)[replacements[0]] in ("pending", "running")
    assert store.node(name, slow).state is NodeState.TERMINATING
    cloud.client("ec2").terminate_instances(InstanceIds=run_instance_ids(cloud.client("ec2"), name, STACK))


def test_a_replacement_refused_for_the_vcpu_quota_is_waited_for_as_capacity(handlers, cloud, resources, monkeypatch):
    """The node just terminated still holds its vCPUs while it shuts down (minutes for p4d and
    p5): EC2 refuses the replacement with VcpuLimitExceeded, which Recover raises as
    CapacityUnavailable (retried with backoff, then decided as a shortfall), not as an error
    that ends the run."""
    payload = validated_run(handlers, cloud, resources, monkeypatch)
    name = payload["run"]["run_name"]
    store = RunStore(cloud.client("dynamodb"), resources["run_table"])
    handlers.allocate.handler(payload, Context())
    handlers.await_nodes.handler({"run": payload, "task_token": "token-of-await-nodes"}, Context())
    # One node registered, so the boot timeout is a slow node's, not the set-up's (SETUP_FAILED).
    store.transition_node(name, sorted(node.instance_id for node in store.nodes(name))[0], NodeState.REGISTERED)
    caught = {**payload, "failure": {"Error": "States.Timeout", "Cause": "AwaitNodes timed out"}}
    cloud.set_vcpu_quota(0)
    try:
        with pytest.raises(handlers.errors.CapacityUnavailable, match="VcpuLimitExceeded"):
            handlers.recover.handler(caught, Context())
    finally:
        cloud.set_vcpu_quota(None)
    assert store.run(name).attempt == 1 and not run_instance_ids(cloud.client("ec2"), name, STACK)


def test_a_recover_cut_off_while_recording_replacements_gets_the_same_fleet_on_retry(
        handlers, cloud, resources, monkeypatch):
    payload = validated_run(handlers, cloud, resources, monkeypatch, nodes=3)
    name = payload["run"]["run_name"]
    store = RunStore(cloud.client("dynamodb"), resources["run_table"])
    handlers.allocate.handler(payload, Context())
    handlers.await_nodes.handler({"run": payload, "task_token": "token-of-await-nodes"}, Context())
    booted, *slow = sorted(node.instance_id for node in store.nodes(name))
    store.transition_node(name, booted, NodeState.REGISTERED)
    store.transition_node(name, booted, NodeState.READY, ready_attempt=0)  # its agent confirmed attempt 0
    # The invocation ends (its time out, say) after recording the first of two replacements.
    recorded = []

    def cut_off(params, **kwargs):
        if params["Item"]["sk"]["S"].startswith("NODE#") and "attribute_not_exists" in params["ConditionExpression"]:
            recorded.append(params["Item"]["sk"]["S"])
            if len(recorded) == 2:
                raise TimeoutError("Task timed out")

    events = handlers.common.aws().dynamodb.meta.events
    events.register("before-parameter-build.dynamodb.PutItem", cut_off)
    caught = {**payload, "failure": {"Error": "States.Timeout", "Cause": "AwaitNodes timed out"}}
    try:
        with pytest.raises(TimeoutError):
            handlers.recover.handler(caught, Context())
    finally:
        events.unregister("before-parameter-build.dynamodb.PutItem", cut_off)
    assert len([node for node in store.nodes(name) if node.attempt == 1]) == 1

    # The retry asks EC2 exactly what the first try asked (the same ClientToken with another
    # request is refused: IdempotentParameterMismatch), so it gets the same two back.
    handlers.recover.handler(caught, Context())
    replacements = sorted(node.instance_id for node in store.nodes(name) if node.attempt == 1)
    assert len(replacements) == 2 and store.run(name).restarts == 1
    ec2 = cloud.client("ec2")
    assert run_instance_ids(ec2, name, STACK) == sorted([booted, *replacements])
    assert {store.node(name, instance_id).state for instance_id in slow} == {NodeState.TERMINATING}
    ec2.terminate_instances(InstanceIds=run_instance_ids(ec2, name, STACK))


def _lost_before_the_wait(handlers, cloud, resources, attempt: int) -> tuple[RunStore, RunRecord, str, dict]:
    """A run whose world was ready, one worker lost while no task token was parked; (store, run,
    the lost worker, the payload of the next wait's state)."""
    store, run, (lost, survivor) = recorded_run(cloud, resources)
    for instance_id in (lost, survivor):
        store.transition_node(run.run_name, instance_id, NodeState.READY)
    if attempt:  # as Recover leaves it
        store.transition_run(run.run_name, RunState.RECOVERING, attempt=attempt)
    handlers.events.handler(state_change(lost, "shutting-down"), Context())
    assert store.run(run.run_name).waiting is None
    payload = {"run": {"run_name": run.run_name, "attempt": attempt},
               "timeouts": {"boot_seconds": 60, "late_worker_seconds": 60, "heartbeat_seconds": 60}}
    return store, run, lost, payload


def _failed_with_the_loss(cloud, execution: str, lost: str, attempt: int) -> None:
    result = finished(cloud, execution)
    assert result["status"] == "FAILED" and result["error"] == FAILURE_ERROR
    report = json.loads(result["cause"])
    assert (report["failure_class"], report["instance_ids"], report["attempt"]) == (
        FailureClass.INSTANCE_LOST.value, [lost], attempt)


def test_a_worker_lost_between_recover_and_await_nodes_fails_the_wait_at_once(handlers, cloud, resources):
    store, run, lost, payload = _lost_before_the_wait(handlers, cloud, resources, attempt=1)
    execution, token = parked_token(cloud)
    handlers.await_nodes.handler({"run": payload, "task_token": token}, Context())
    _failed_with_the_loss(cloud, execution, lost, attempt=1)


def test_a_worker_lost_between_await_nodes_and_train_fails_train_at_once(handlers, cloud, resources):
    store, run, lost, payload = _lost_before_the_wait(handlers, cloud, resources, attempt=0)
    execution, token = parked_token(cloud)
    handlers.launch.handler({"run": payload, "task_token": token}, Context())
    _failed_with_the_loss(cloud, execution, lost, attempt=0)
    s3 = cloud.client("s3")
    assert s3.list_objects_v2(Bucket=resources["bucket"], Prefix=f"runs/{run.run_name}/launch-spec")["KeyCount"] == 0


def run_on_real_instances(cloud, resources, monkeypatch, count: int) -> tuple:
    """A recorded run whose own node records are retired, and `count` running local instances
    (idle: their boot sleeps) for the test to record as the run's nodes: (ec2, ids, store, run)."""
    monkeypatch.setattr(cloud.fleet, "boot", lambda instance: ["sleep", "120"])
    ec2 = cloud.client("ec2")
    ids = [instance["InstanceId"] for instance in ec2.run_instances(
        ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=count, MaxCount=count)["Instances"]]
    store, run, recorded = recorded_run(cloud, resources, workers=2)
    for instance_id in recorded:
        store.transition_node(run.run_name, instance_id, NodeState.TERMINATED)
    return ec2, ids, store, run


def test_recover_names_the_workers_that_failed_silently(handlers, cloud, resources, monkeypatch):
    """A crash no event pinned on a node: the worker whose agent stopped reporting and the one EC2
    reports impaired (frozen) are named, so Recover replaces them instead of restarting on them."""
    ec2, ids, store, run = run_on_real_instances(cloud, resources, monkeypatch, 3)
    for index, instance_id in enumerate(ids):
        store.add_node(NodeRecord(run_name=run.run_name, instance_id=instance_id, state=NodeState.READY,
                                  ready_attempt=0, private_ip=f"10.0.1.{index}"))
        cloud.fleet.wait_for_state(instance_id, "running")
    answering, silent, frozen = ids
    now = datetime.now(timezone.utc)
    for instance_id, seconds_ago in ((answering, 2), (silent, 300), (frozen, 3)):
        write_liveness(cloud.client("dynamodb"), resources["liveness_table"], run.run_name, arn(cloud, instance_id),
                       NodeLiveness(instance_id=instance_id, attempt=0, step=40,
                                    reported_at=now - timedelta(seconds=seconds_ago)))
    cloud.wait_until(lambda: cloud.fleet.get(frozen).process is not None, "the frozen node to boot")
    cloud.fleet.hang(frozen)
    crash = FailureReport(failure_class=FailureClass.PROCESS_CRASH, attempt=0, message="peer gone")
    named = handlers.recover.name_silent_workers(store.run(run.run_name), store.nodes(run.run_name), crash)
    assert named.instance_ids == sorted([silent, frozen]) and named.failure_class is FailureClass.PROCESS_CRASH
    assert f"{silent}: agent silent for 30" in named.message  # 300 s ago when written
    assert f"{frozen}: EC2 instance status impaired" in named.message
    cloud.fleet.resume(frozen)
    ec2.terminate_instances(InstanceIds=ids)


def test_recover_books_a_crash_as_the_loss_of_the_instance_ec2_retired_before_it_looked(
        handlers, cloud, resources, monkeypatch):
    """The survivors' crash report answered the attempt's wait first; EC2's state-change event came
    next and retired the lost node before Recover looked. EC2 still shows the instance leaving:
    the failure is its loss, not a crash of the world."""
    ec2, (answering, lost), store, run = run_on_real_instances(cloud, resources, monkeypatch, 2)
    now = datetime.now(timezone.utc)
    for index, instance_id in enumerate((answering, lost)):
        store.add_node(NodeRecord(run_name=run.run_name, instance_id=instance_id, state=NodeState.READY,
                                  ready_attempt=0, private_ip=f"10.0.1.{index}"))
        cloud.fleet.wait_for_state(instance_id, "running")
        write_liveness(cloud.client("dynamodb"), resources["liveness_table"], run.run_name, arn(cloud, instance_id),
                       NodeLiveness(instance_id=instance_id, attempt=0, step=40, reported_at=now))
    ec2.terminate_instances(InstanceIds=[lost])
    store.modify_node(run.run_name, lost, lambda node: node.model_copy(update={
        "state": NodeState.UNHEALTHY, "failure_class": FailureClass.INSTANCE_LOST,
        "reason": f"EC2 reports instance {lost} shutting-down"}))
    crash = FailureReport(failure_class=FailureClass.PROCESS_CRASH, attempt=0, message="peer gone")
    named = handlers.recover.name_silent_workers(store.run(run.run_name), store.nodes(run.run_name), crash)
    assert (named.failure_class, named.instance_ids) == (FailureClass.INSTANCE_LOST, [lost]), named.message
    assert f"{lost}: EC2 reports the instance " in named.message
    ec2.terminate_instances(InstanceIds=[answering])


@pytest.mark.parametrize("survivor_reported_s", [2, 3600])
def test_recover_repairs_the_world_in_place_and_confirms_the_survivors_whose_trainers_live(
        handlers, cloud, resources, monkeypatch, survivor_reported_s):
    """Node rank 1 lost mid-training, a READY spare: with node rank 0's trainer seen alive lately,
    Recover repairs the world in place and confirms node rank 0 and the spare (its idle agent
    reported lately) for the new attempt itself: it waits on no agent's look. Node rank 0 seen an
    hour ago, every trainer restarts, and each node confirms the attempt itself."""
    ec2, ids, store, run = run_on_real_instances(cloud, resources, monkeypatch, 3)
    survivor, victim, spare = ids
    for rank, instance_id in enumerate(ids):
        store.add_node(NodeRecord(run_name=run.run_name, instance_id=instance_id, state=NodeState.READY,
                                  ready_attempt=0, private_ip=f"10.0.2.{rank}", node_rank=rank if rank < 2 else None,
                                  role=NodeRole.WORKER if rank < 2 else NodeRole.SPARE))
        cloud.fleet.wait_for_state(instance_id, "running")
    now = datetime.now(timezone.utc)
    store.modify_run(run.run_name, lambda current: current.model_copy(update={"first_step_at": now, "last_step": 12}))
    write_liveness(cloud.client("dynamodb"), resources["liveness_table"], run.run_name, arn(cloud, survivor),
                   NodeLiveness(instance_id=survivor, attempt=0, step=12,
                                reported_at=now - timedelta(seconds=survivor_reported_s)))
    write_liveness(cloud.client("dynamodb"), resources["liveness_table"], run.run_name, arn(cloud, spare),
                   NodeLiveness(instance_id=spare, attempt=0, trainer_running=False, reported_at=now))

    handlers.recover.handler(lost(run, victim), Context())
    after, nodes = store.run(run.run_name), {node.instance_id: node for node in store.nodes(run.run_name)}
    (failure,) = after.failures
    assert after.attempt == 1 and nodes[spare].role is NodeRole.WORKER and nodes[victim].state is NodeState.TERMINATING
    if survivor_reported_s < 60:
        assert after.repair == WorldRepair(generation=1, launched_attempt=0, survivor_ids=[survivor])
        assert failure.recovery is RecoveryKind.REPAIRED and "repair the world in place" in failure.decision
        assert nodes[survivor].ready_attempt == nodes[spare].ready_attempt == 1
    else:
        assert after.repair is None and failure.recovery is RecoveryKind.RESTARTED
        assert f"no sign of life from the trainers of {survivor}" in failure.decision
        assert nodes[survivor].ready_attempt == nodes[spare].ready_attempt == 0
    ec2.terminate_instances(InstanceIds=ids)


def test_late_workers_swaps_ready_spares_in_keeps_the_booting_worker_as_a_spare_and_releases_the_silent_one(
        handlers, cloud, resources, monkeypatch):
    """AwaitNodes' late-worker deadline passed in attempt 1: one worker is still in preflight,
    the other passed preflight in attempt 0 and never confirmed attempt 1 (silent). Both READY
    spares step in; the world is complete, so the Choice after LateWorkers goes on to Train."""
    ec2, ids, store, run = run_on_real_instances(cloud, resources, monkeypatch, 4)
    booting, silent, *spares = ids
    nodes = {booting: dict(state=NodeState.REGISTERED), silent: dict(state=NodeState.READY, ready_attempt=0),
             **{spare: dict(state=NodeState.READY, ready_attempt=1, role=NodeRole.SPARE) for spare in spares}}
    for index, (instance_id, fields) in enumerate(nodes.items()):
        store.add_node(NodeRecord(run_name=run.run_name, instance_id=instance_id, private_ip=f"10.0.3.{index}",
                                  **fields))
    store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "attempt": 1, "attempt_started_at": datetime.now(timezone.utc)}))
    payload = {"run": {"run_name": run.run_name, "attempt": 1},
               "timeouts": {"boot_seconds": 60, "late_worker_seconds": 10, "heartbeat_seconds": 60}}

    assert handlers.late_workers.handler(payload, Context()) == {"world_complete": True, "boot_over": False}
    after = {node.instance_id: node for node in store.nodes(run.run_name)}
    assert {instance_id: (after[instance_id].role, after[instance_id].state) for instance_id in ids} == {
        booting: (NodeRole.SPARE, NodeState.REGISTERED), silent: (NodeRole.WORKER, NodeState.TERMINATING),
        **{spare: (NodeRole.WORKER, NodeState.READY) for spare in spares}}
    assert "did not confirm attempt 1" in after[silent].reason
    (state,) = [instance["State"]["Name"] for reservation in ec2.describe_instances(InstanceIds=[silent])[
        "Reservations"] for instance in reservation["Instances"]]
    assert state in ("shutting-down", "terminated")
    # A retry finds the swap recorded and swaps nothing more.
    assert handlers.late_workers.handler(payload, Context()) == {"world_complete": True, "boot_over": False}
    assert {node.instance_id: node.role for node in store.nodes(run.run_name)} == {
        node.instance_id: node.role for node in after.values()}
    ec2.terminate_instances(InstanceIds=ids)


def test_late_workers_without_a_spare_waits_another_round_until_the_boot_timeout_is_spent(
        handlers, cloud, resources):
    store, run, _ = recorded_run(cloud, resources, workers=2)  # both still REGISTERED, no spare
    payload = {"run": {"run_name": run.run_name, "attempt": 0},
               "timeouts": {"boot_seconds": 60, "late_worker_seconds": 20, "heartbeat_seconds": 60}}
    for waited, boot_over in ((30, False), (60, True)):
        store.modify_run(run.run_name, lambda current, waited=waited: current.model_copy(update={
            "attempt_started_at": datetime.now(timezone.utc) - timedelta(seconds=waited)}))
        assert handlers.late_workers.handler(payload, Context()) == {"world_complete": False, "boot_over": boot_over}
    # Attempt 0 began at Validate, an hour ago (Allocate's capacity retries); its fleet was
    # recorded 30 s ago: the boot timeout counts from there.
    store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "attempt_started_at": None, "created_at": datetime.now(timezone.utc) - timedelta(hours=1),
        "nodes_launched_at": datetime.now(timezone.utc) - timedelta(seconds=30)}))
    assert handlers.late_workers.handler(payload, Context()) == {"world_complete": False, "boot_over": False}


def test_a_crash_reported_before_ec2s_event_replaces_the_lost_worker_alone_and_books_one_restart(
        handlers, cloud, resources, monkeypatch):
    """A worker's instance is terminated; the survivor's agent reports its trainer's crash (its
    peer died) before EC2's state-change event arrives. Recover finds the instance leaving in
    EC2's instance states: the failure is that instance's loss, it alone is replaced, and the
    event that follows books nothing more."""
    payload = validated_run(handlers, cloud, resources, monkeypatch)
    name = payload["run"]["run_name"]
    store = RunStore(cloud.client("dynamodb"), resources["run_table"])
    handlers.allocate.handler(payload, Context())
    for index, instance_id in enumerate(sorted(node.instance_id for node in store.nodes(name))):
        store.transition_node(name, instance_id, NodeState.REGISTERED, private_ip=f"10.0.2.{index + 1}")
        store.transition_node(name, instance_id, NodeState.READY, ready_attempt=0)
    handlers.await_nodes.handler({"run": payload, "task_token": "token-of-await-nodes"}, Context())
    execution, token = parked_token(cloud)
    handlers.launch.handler({"run": payload, "task_token": token}, Context())
    ranks = {node.node_rank: node.instance_id for node in store.nodes(name)}
    survivor, lost = ranks[0], ranks[1]
    ec2 = cloud.client("ec2")
    ec2.terminate_instances(InstanceIds=[lost])
    crashed = {"run_name": name, "attempt": 0, "instance_id": survivor, "kind": "crash", "exit_code": 1,
               "message": "RuntimeError: Connection closed by peer"}
    assert handlers.events.handler(agent_event("TrainerFailed", crashed), Context())["outcome"] == \
        "PROCESS_CRASH: task failed"
    caught = {**payload, "failure": {"Error": FAILURE_ERROR, "Cause": finished(cloud, execution)["cause"]}}
    handlers.recover.handler(caught, Context())

    run = store.run(name)
    assert (run.attempt, run.restarts) == (1, 1)
    assert [failure.failure_class for failure in run.failures] == [FailureClass.INSTANCE_LOST]
    assert f"{lost}: EC2 reports the instance " in store.node(name, lost).reason
    assert store.node(name, lost).state is NodeState.TERMINATING
    assert store.node(name, lost).failure_class is FailureClass.INSTANCE_LOST
    assert not store.node(name, survivor).state.is_retired and store.node(name, survivor).failure_class is None
    assert len([node for node in store.nodes(name) if node.attempt == 1]) == 1, "the lost worker alone is replaced"
    outcome = handlers.events.handler(state_change(lost, "terminated"), Context())["outcome"]
    assert outcome == "node terminated"
    assert (store.run(name).restarts, len(store.run(name).failures)) == (1, 1)
    ec2.terminate_instances(InstanceIds=run_instance_ids(ec2, name, STACK))


def test_an_agent_event_counts_only_from_a_node_of_its_run_speaking_for_itself(handlers, cloud, resources):
    store, run, (worker, peer) = recorded_run(cloud, resources)
    _, _, (stranger, _) = recorded_run(cloud, resources)  # a node of another run of the stack
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token="token-of-a-live-task"))
    completed = {"run_name": run.run_name, "attempt": 0, "final_step": 10}
    unhealthy = {"run_name": run.run_name, "attempt": 0, "instance_id": worker, "reason": "8 of 8 GPUs"}
    forged = [(agent_event("TrainingCompleted", completed, sender=stranger),
               f"ignored: its sender {stranger} is no node of run {run.run_name!r}"),
              (agent_event("NodeUnhealthy", unhealthy, sender=stranger),
               f"ignored: its sender {stranger} is no node of run {run.run_name!r}"),
              (agent_event("NodeUnhealthy", unhealthy, sender=peer), f"ignored: its sender {peer} speaks for {worker}"),
              (agent_event("TrainingCompleted", completed), "ignored: it names no sending instance")]
    for event, outcome in forged:
        assert handlers.events.handler(event, Context())["outcome"] == outcome
    assert store.run(run.run_name).state is RunState.TRAINING and store.run(run.run_name).waiting is not None
    assert store.node(run.run_name, worker).state is NodeState.REGISTERED


def test_a_report_about_a_node_already_retired_changes_nothing(handlers, cloud, resources):
    store, run, (worker, _) = recorded_run(cloud, resources)
    store.transition_node(run.run_name, worker, NodeState.UNHEALTHY)  # as a first report left it
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token="token-of-a-live-task"))
    unhealthy = {"run_name": run.run_name, "attempt": 0, "instance_id": worker, "reason": "2 of 8 GPUs"}
    outcome = handlers.events.handler(agent_event("NodeUnhealthy", unhealthy), Context())["outcome"]
    assert outcome == "ignored: node already retired"
    assert store.run(run.run_name).waiting is not None


def test_a_ready_node_without_an_address_does_not_complete_the_world(handlers, cloud, resources):
    store, run, (first, second) = recorded_run(cloud, resources)
    store.modify_node(run.run_name, second, lambda node: node.model_copy(update={"private_ip": None}))
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="await_nodes", attempt=0, token=token))
    for instance_id in (first, second):  # NodeReady overtook the second node's NodeRegistered
        handlers.events.handler(agent_event("NodeReady", {"run_name": run.run_name, "attempt": 0,
                                                          "instance_id": instance_id}), Context())
    assert store.run(run.run_name).waiting is not None
    registered = agent_event("NodeRegistered", {"run_name": run.run_name, "attempt": 0,
                                                "instance_id": second, "private_ip": "10.0.0.9"})
    outcome = handlers.events.handler(registered, Context())["outcome"]
    assert outcome == "node address recorded, world complete"
    assert finished(cloud, execution)["status"] == "SUCCEEDED"


def test_a_registration_overtaken_by_node_ready_mid_handler_records_the_address(handlers, cloud, resources,
                                                                                monkeypatch):
    store, run, _ = recorded_run(cloud, resources)
    late = "i-0late0registration"
    store.add_node(NodeRecord(run_name=run.run_name, instance_id=late, role=NodeRole.SPARE))
    ready = agent_event("NodeReady", {"run_name": run.run_name, "attempt": 0, "instance_id": late})
    registered = agent_event("NodeRegistered", {"run_name": run.run_name, "attempt": 0,
                                                "instance_id": late, "private_ip": "10.0.0.9"})
    # The NodeReady handler runs right after the NodeRegistered handler first read the node:
    # an interleaving two concurrent invocations can take.
    handler_store = handlers.common.aws().store
    read_node = handler_store.node
    interleaved = []

    def node_then_ready(run_name, instance_id):
        record = read_node(run_name, instance_id)
        if not interleaved:
            interleaved.append(ready)
            interleaved.append(handlers.events.process_event(ready)["outcome"])
        return record

    monkeypatch.setattr(handler_store, "node", node_then_ready)
    outcome = handlers.events.handler(registered, Context())["outcome"]
    assert interleaved[1:] == ["node ready"]
    assert outcome == "node address recorded"
    node = store.node(run.run_name, late)
    assert (node.state, node.private_ip) == (NodeState.READY, "10.0.0.9")
