"""Whole training runs through the deployed state machine, on the local cloud, with simulated
agents (tests/handlers_sim_agent.py) as the instances' processes.

1. a good RunSpec on 2 nodes: allocate, nodes ready, train; once a checkpoint is committed,
   the node of rank 1 is killed (EC2 reports it terminated); only it is replaced, training
   resumes from the latest committed checkpoint, completes, and teardown ends every instance;
2. bad RunSpecs: the execution fails at Validate naming the field, no instance is created; so
   does a trainer section the trainer itself refuses (model.n_heads not dividing d_model);
3. a run stopped (StopExecution) while it trains: no Catch runs, and the reaper, invoked by
   the execution's status-change event, terminates every instance of the run and writes its
   report.
While 1 trains, a node of another run reaches for run 1's objects, records and events with its
own instance's credentials (`hostile`).

It runs in a process of its own (tests/test_handlers_local_run.py starts it) because the local
cloud imports the deployed handlers from their package: a test process that imported
`functions` itself would hold a second copy. It prints one JSON summary as its last line.

    python tests/handlers_local_run.py
"""

import contextlib
import json
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import boto3
from botocore.exceptions import ClientError

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The SAM roles attach AWS managed policies; moto knows them only when asked before it starts.
os.environ["MOTO_IAM_LOAD_MANAGED_POLICIES"] = "true"

from localcloud import LocalCloud  # noqa: E402
from localcloud.cloud import exit_after_local_cloud  # noqa: E402
from localcloud.deploy import DeployRequest, deploy  # noqa: E402
from localcloud.glue import active_cloud  # noqa: E402
from localcloud.imds import serve_fleet  # noqa: E402
from localcloud.node_boot import publish_artifacts  # noqa: E402
from localcloud.stack import TIMEOUT_FLOORS_S, states_entered  # noqa: E402
from localcloud.waiting import until  # noqa: E402
from trainer.checkpoint_catalog import committed_steps, open_store  # noqa: E402
from trainfleet.adapters.ec2_fleet import TAG_RUN  # noqa: E402
from trainfleet.adapters.liveness import liveness_key  # noqa: E402
from trainfleet.adapters.run_store import RunNotFound, RunStore  # noqa: E402
from trainfleet.core.events import NodeUnhealthy, TrainingCompleted, instance_arn, put_events_entry
from trainfleet.core.node_access import node_log_stream

AGENT = REPO / "tests" / "handlers_sim_agent.py"


def network(ec2, outputs: dict[str, str], zone: str = "us-east-1a") -> tuple[str, str]:
    """The stack's node subnet in `zone` and the nodes' group: the nodes reach AWS from there (its endpoints)."""
    subnets = ec2.describe_subnets(SubnetIds=outputs["NodeSubnetIds"].split(","))["Subnets"]
    return next(subnet["SubnetId"] for subnet in subnets if subnet["AvailabilityZone"] == zone), \
        outputs["NodeSecurityGroupIds"]


def run_spec(run_name: str, bucket: str, subnet: str, group: str) -> dict:
    return {
        "run_name": run_name,
        "instance_type": "c5.large",
        "node_count": 2,
        "capacity": {"kind": "on-demand", "subnet_ids": [subnet], "security_group_ids": [group]},
        "image_id": "ami-0123456789abcdef0",
        "trainer": {"model": {"n_layers": 2},
                    "parallel": {"pp": 2, "dp": 1, "schedule": "gpipe", "microbatches": 2},
                    "training": {"batch_size": 2}},
        "checkpoint": {"s3_uri": f"s3://{bucket}/runs/{run_name}/checkpoints", "interval_steps": 10},
        # The local floors: a node of a starved machine boots and falls silent for longer than
        # AWS's would, and these runs are all meant to be healthy.
        "recovery": {"backoff_base_seconds": 0, "backoff_max_seconds": 0,
                     "hang_timeout_seconds": TIMEOUT_FLOORS_S["recovery.hang_timeout_seconds"],
                     "boot_timeout_seconds": TIMEOUT_FLOORS_S["recovery.boot_timeout_seconds"]},
    }


def wait(what: str, probe):
    """What `probe` finds, waited for while the local cloud advances (localcloud.waiting)."""
    return until(probe, active_cloud().activity, what=what, poll_s=0.1)


def in_state(store: RunStore, run_name: str, state: str) -> bool:
    try:
        return store.run(run_name).state.value == state
    except RunNotFound:
        return False


def launch_spec_written(s3, bucket: str, run_name: str) -> bool:
    """Whether Launch wrote the run's launch spec: it records the run TRAINING first."""
    return bool(s3.list_objects_v2(Bucket=bucket, Prefix=f"runs/{run_name}/launch-spec.json").get("Contents"))


def checkpointed(store: RunStore, run_name: str) -> bool:
    try:
        run = store.run(run_name)
    except RunNotFound:
        return False
    return run.latest_checkpoint is not None and run.attempt == 0


def execute(sfn, machine: str, name: str, document: dict) -> dict:
    arn = sfn.start_execution(stateMachineArn=machine, name=name, input=json.dumps(document))["executionArn"]
    wait(f"execution {name}", lambda: sfn.describe_execution(executionArn=arn)["status"] != "RUNNING")
    return sfn.describe_execution(executionArn=arn)


def instances_of(ec2, run_name: str) -> dict[str, str]:
    reservations = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_RUN}", "Values": [run_name]}])
    return {instance["InstanceId"]: instance["State"]["Name"]
            for reservation in reservations["Reservations"] for instance in reservation["Instances"]}


def console_lines(cloud, instance_id: str) -> list[dict]:
    log = cloud.fleet.get(instance_id).console_log
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


def report_failure(cloud, sfn) -> None:
    """What a failed scenario leaves to read: every instance's console and each execution."""
    for instance in cloud.fleet.instances():
        log = instance.console_log.read_text()[-3000:] if instance.console_log.exists() else "(none)"
        print(f"--- {instance.instance_id} ({instance.state}) console:\n{log}", file=sys.stderr)
    for machine in sfn.list_state_machines()["stateMachines"]:
        for execution in sfn.list_executions(stateMachineArn=machine["stateMachineArn"])["executions"]:
            described = sfn.describe_execution(executionArn=execution["executionArn"])
            print(f"--- {execution['name']}: {execution['status']} "
                  f"{states_entered(sfn, execution['executionArn'])} {described.get('error')}: "
                  f"{str(described.get('cause'))[:1500]}", file=sys.stderr)


def main() -> None:
    stack_name = f"tf-{uuid.uuid4().hex[:8]}"
    with LocalCloud(time_scale=0.02) as cloud:
        try:
            scenarios(cloud, stack_name)
        except Exception:
            report_failure(cloud, cloud.client("stepfunctions"))
            raise


def deploy_with_agents(cloud, stack_name: str) -> dict[str, str]:
    """Deploy template.yaml; instances then boot simulated agents of the stack. The outputs."""
    outputs = deploy(DeployRequest(template=REPO / "template.yaml", endpoint=cloud.endpoint,
                                   stack_name=stack_name)).outputs
    publish_artifacts(cloud.client("s3"), outputs["CheckpointBucketName"])

    def agent_environment(instance) -> dict[str, str]:
        return {"PYTHONPATH": str(REPO), "TRAINFLEET_RUN_NAME": instance.tags[TAG_RUN],
                "TRAINFLEET_RUN_TABLE": outputs["RunTableName"],
                "TRAINFLEET_BUCKET": outputs["CheckpointBucketName"],
                "TRAINFLEET_EVENT_BUS": outputs["AgentEventBusName"]}

    # The instances' processes have no credentials but their role's, from the instance metadata.
    serve_fleet(cloud)
    cloud.fleet.boot = lambda instance: [sys.executable, "-m", "localcloud.node_boot", sys.executable, str(AGENT)]
    cloud.fleet.env_hooks.append(agent_environment)
    return outputs


def scenarios(cloud, stack_name: str) -> None:
    clients = {name: cloud.client(name) for name in ("ec2", "stepfunctions", "s3", "dynamodb")}
    ec2, sfn, s3 = clients["ec2"], clients["stepfunctions"], clients["s3"]
    outputs = deploy_with_agents(cloud, stack_name)
    store = RunStore(clients["dynamodb"], outputs["RunTableName"])
    subnet, group = network(ec2, outputs)
    machine = outputs["StateMachineArn"]

    # 1. A run with one node lost mid-training; a node of another run tries to end it, read it
    # and overwrite it meanwhile.
    run_name, attacker = f"run-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    arn, attacker_arn = (sfn.start_execution(stateMachineArn=machine, name=name, input=json.dumps(
        run_spec(name, outputs["CheckpointBucketName"], subnet, group)))["executionArn"] for name in (run_name, attacker))
    wait("both runs' launch specs", lambda: all(launch_spec_written(s3, outputs["CheckpointBucketName"], name)
                                                for name in (run_name, attacker)))
    hostile = hostile_node(cloud, outputs, store, attacker=attacker, victim=run_name)
    wait("the first committed checkpoint", lambda: checkpointed(store, run_name))
    first_nodes = {node.instance_id: node.node_rank for node in store.nodes(run_name)}
    killed = next(instance_id for instance_id, rank in first_nodes.items() if rank == 1)
    survivor = next(instance_id for instance_id, rank in first_nodes.items() if rank == 0)
    cloud.fleet.kill(killed)
    wait("the run to end", lambda: sfn.describe_execution(executionArn=arn)["status"] != "RUNNING")
    execution = sfn.describe_execution(executionArn=arn)
    run = store.run(run_name)
    report = json.loads(s3.get_object(Bucket=outputs["CheckpointBucketName"],
                                      Key=f"runs/{run_name}/report.json")["Body"].read())
    committed = sorted(committed_steps(open_store(f"s3://{outputs['CheckpointBucketName']}/runs/{run_name}/checkpoints",
                                                  s3)))
    recovered = {
        "status": execution["status"],
        "states": states_entered(sfn, arn),
        "first_nodes": first_nodes,
        "killed": killed,
        "survivor": survivor,
        "nodes": {node.instance_id: {"state": node.state.value, "attempt": node.attempt,
                                     "rank": node.node_rank, "failure": node.failure_class}
                  for node in store.nodes(run_name)},
        "instances": instances_of(ec2, run_name),
        "survivor_launches": [line for line in console_lines(cloud, survivor) if "node_rank" in line],
        "survivor_commits": [line for line in console_lines(cloud, survivor) if "committed_step" in line],
        "run": {"state": run.state.value, "attempt": run.attempt, "restarts": run.restarts,
                "latest_checkpoint": run.latest_checkpoint.step if run.latest_checkpoint else None},
        "committed_steps": committed,
        "report": {"state": report["state"], "restarts": report["restarts"],
                   "lost_by_cause": report["ledger"]["lost_by_cause"],
                   "unaccounted_seconds": report["unaccounted_seconds"]},
    }

    wait("the other run to end", lambda: sfn.describe_execution(executionArn=attacker_arn)["status"] != "RUNNING")
    hostile["attacker_status"] = sfn.describe_execution(executionArn=attacker_arn)["status"]

    # 2. A bad RunSpec.
    bad_name = f"bad-{uuid.uuid4().hex[:6]}"
    bad_spec = run_spec(bad_name, outputs["CheckpointBucketName"], subnet, group)
    bad_spec["node_count"] = 3  # pp x dp = 2 ranks cannot fill 3 nodes
    before = len(instances_of(ec2, bad_name))
    rejected = execute(sfn, machine, bad_name, bad_spec)
    invalid = {"status": rejected["status"], "error": rejected.get("error"), "cause": rejected.get("cause"),
               "states": states_entered(sfn, rejected["executionArn"]),
               "instances_before": before, "instances_after": len(instances_of(ec2, bad_name))}
    refused_name = f"refused-{uuid.uuid4().hex[:6]}"
    refused_spec = run_spec(refused_name, outputs["CheckpointBucketName"], subnet, group)
    refused_spec["trainer"]["model"].update(d_model=64, n_heads=3)
    refused = execute(sfn, machine, refused_name, refused_spec)
    refused_by_trainer = {"status": refused["status"], "error": refused.get("error"), "cause": refused.get("cause"),
                          "states": states_entered(sfn, refused["executionArn"]),
                          "instances": len(instances_of(ec2, refused_name))}

    # 3. A run stopped while it trains.
    stopped_name = f"stop-{uuid.uuid4().hex[:6]}"
    stopped_spec = run_spec(stopped_name, outputs["CheckpointBucketName"], subnet, group)
    stopped_arn = sfn.start_execution(stateMachineArn=machine, name=stopped_name,
                                      input=json.dumps(stopped_spec))["executionArn"]
    wait("the run to train", lambda: in_state(store, stopped_name, "TRAINING"))
    launched = instances_of(ec2, stopped_name)
    stop_requested = time.monotonic()
    sfn.stop_execution(executionArn=stopped_arn, error="Operator", cause="stopped from the console")
    wait("every instance of the stopped run to terminate",
         lambda: set(instances_of(ec2, stopped_name).values()) == {"terminated"})
    stop_to_terminated_s = round(time.monotonic() - stop_requested, 2)
    wait("the stopped run's outcome", lambda: store.run(stopped_name).state.is_final)
    stopped_report = wait("the stopped run's report", lambda: s3.list_objects_v2(
        Bucket=outputs["CheckpointBucketName"], Prefix=f"runs/{stopped_name}/report.json").get("Contents"))
    stopped_run = store.run(stopped_name)
    stopped = {"name": stopped_name, "status": sfn.describe_execution(executionArn=stopped_arn)["status"],
               "stop_to_terminated_s": stop_to_terminated_s,
               "launched": len(launched), "instances": instances_of(ec2, stopped_name),
               "run": {"state": stopped_run.state.value, "error": stopped_run.error},
               "report": [entry["Key"] for entry in stopped_report]}
    print(json.dumps({"recovered": recovered, "invalid": invalid, "refused_by_trainer": refused_by_trainer,
                      "stopped": stopped, "hostile": hostile}, default=str))


def hostile_node(cloud, outputs: dict[str, str], store: RunStore, attacker: str, victim: str) -> dict[str, str]:
    """What a node of run `attacker`, with its instance's own credentials (as its metadata
    service hands them out), gets when it reaches for run `victim`: each attempt -> "refused"
    (AccessDenied, AccessDeniedException) or "accepted"; and the same on its own run, which it may."""
    from localcloud.imds import fleet_records, role_session_of

    mine, theirs = (min(node.instance_id for node in store.nodes(run)) for run in (attacker, victim))
    credentials = role_session_of(cloud)(fleet_records(cloud)(mine), timedelta(hours=1))
    s3, dynamodb, events, logs = (boto3.client(
        service, endpoint_url=cloud.endpoint, region_name=cloud.region, aws_access_key_id=credentials.access_key_id,
        aws_secret_access_key=credentials.secret_access_key, aws_session_token=credentials.token)
        for service in ("s3", "dynamodb", "events", "logs"))
    bucket, table, bus = outputs["CheckpointBucketName"], outputs["RunTableName"], outputs["AgentEventBusName"]
    liveness, node_logs = outputs["LivenessTableName"], outputs["NodeLogGroupName"]
    sender = instance_arn("aws", cloud.region, cloud.account_id, mine)

    def write_node_log(run: str) -> None:
        # The group lets any node make a stream (CloudWatch Logs authorizes CreateLogStream on
        # the group); only its own run's streams take its events.
        stream = node_log_stream(run, mine if run == attacker else theirs)
        with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):
            logs.create_log_stream(logGroupName=node_logs, logStreamName=stream)
        logs.put_log_events(logGroupName=node_logs, logStreamName=stream,
                            logEvents=[{"timestamp": int(time.time() * 1000), "message": "forged"}])

    def event(detail, as_instance: str = mine) -> dict:
        return put_events_entry(detail, bus, instance_arn("aws", cloud.region, cloud.account_id, as_instance))

    def run_record_key(run: str) -> dict:
        return {"pk": {"S": f"RUN#{run}"}, "sk": {"S": "RUN"}}

    attempts = {
        "read its launch spec": lambda run: s3.get_object(Bucket=bucket, Key=f"runs/{run}/launch-spec.json"),
        "write a checkpoint": lambda run: s3.put_object(Bucket=bucket, Key=f"runs/{run}/checkpoints/x", Body=b"x"),
        "delete its launch spec": lambda run: s3.delete_object(Bucket=bucket, Key=f"runs/{run}/launch-spec.json-x"),
        "list its objects": lambda run: s3.list_objects_v2(Bucket=bucket, Prefix=f"runs/{run}/"),
        "read its record and task tokens": lambda run: dynamodb.get_item(TableName=table, Key=run_record_key(run)),
        "list its nodes": lambda run: dynamodb.query(
            TableName=table, KeyConditionExpression="pk = :pk", ExpressionAttributeValues={":pk": {"S": f"RUN#{run}"}}),
        "write a liveness record": lambda run: dynamodb.put_item(TableName=liveness, Item={
            **liveness_key(run, sender), "record": {"S": "{}"}}),
        "write into its node log": write_node_log,
    }
    outcomes = {}
    for what, attempt in attempts.items():
        for whose, run in (("own", attacker), ("other", victim)):
            try:
                attempt(run)
                outcomes[f"{whose}: {what}"] = "accepted"
            except ClientError as refused:
                outcomes[f"{whose}: {what}"] = refused.response["Error"]["Code"]
    forged = {
        "send as the other run's node": event(NodeUnhealthy(run_name=victim, attempt=0, instance_id=theirs,
                                                            reason="forged"), as_instance=theirs),
        "end the other run": event(TrainingCompleted(run_name=victim, attempt=0, final_step=60, instance_id=mine)),
        "blame the other run's node": event(NodeUnhealthy(run_name=victim, attempt=0, instance_id=theirs,
                                                          reason="forged")),
    }
    for what, entry in forged.items():
        try:
            answer = events.put_events(Entries=[entry])
            outcomes[f"other: {what}"] = "accepted" if answer["FailedEntryCount"] == 0 else "failed"
        except ClientError as refused:
            outcomes[f"other: {what}"] = refused.response["Error"]["Code"]
    # A peer of its own run: its liveness record, forged, could get the peer blamed and terminated.
    peer = max(node.instance_id for node in store.nodes(attacker))
    try:
        dynamodb.put_item(TableName=liveness, Item={
            **liveness_key(attacker, instance_arn("aws", cloud.region, cloud.account_id, peer)), "record": {"S": "{}"}})
        outcomes["peer: write a liveness record"] = "accepted"
    except ClientError as refused:
        outcomes["peer: write a liveness record"] = refused.response["Error"]["Code"]
    outcomes["sender"] = sender
    return outcomes


if __name__ == "__main__":
    main()
    exit_after_local_cloud(0)
