"""The node agent's parts: settings, the metadata client (against the local metadata service),
the trainer's config and command, its output read back, and stopping it. The whole agent runs
end to end in tests/test_agent_local_run.py."""

import json
import os
import random
import resource
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from types import SimpleNamespace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import boto3
import pytest
import torch.distributed as torch_store
import torch.distributed.run as torchrun
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN, _NUM_MEMBERS

from localcloud.imds import InstanceMetadata, InstanceMetadataServer
from localcloud.waiting import until
from node import agent, attempt as attempt_module, control_plane, metadata, node_log, preflight
from node import settings as node_settings
from node import trainer_files, trainer_process
from node.attempt import Attempt
from node.control_plane import ControlPlane
from node.metadata import Identity, MetadataClient
from node.settings import AgentError, AgentSettings
from node.trainer_files import AttemptFiles, MetricsFollower
from node.trainer_process import (OUTPUT_TAIL_CHARS, failure_kind, failure_message, torchrun_command, torchrun_env,
                                  trainer_config)
from trainer import checkpoint_catalog as catalog
from trainer.progress import NODE_RANK_ENV, PROGRESS_FILE_ENV, Progress, read_progress, write_whole
from trainer.repair_order import REPAIR_ORDER_ENV, RepairOrder, write_order
from trainfleet.adapters.liveness import read_liveness
from trainfleet.adapters.run_store import RunStore
from trainfleet.core.events import PROGRESS_SAMPLES_MAX, CheckpointReason
from trainfleet.core.records import (RENDEZVOUS_PORT, RENDEZVOUS_PORTS, CheckpointRef, FailureClass, FailureReport,
                                     LaunchSpec, NodeRecord, RunRecord, RunState, TrainerFailureKind, WorldRepair,
                                     rendezvous_port)
from trainfleet.core.runspec import RunSpec

from localcloud_helpers import table_from_template

BARRIER_MEMBERS, BARRIER_LAST = _TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, _TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN
"""The keys of torchrun's exit barrier in the rendezvous store."""

REPO = Path(__file__).resolve().parent.parent
SETTINGS_ENV = {"TRAINFLEET_RUN_NAME": "run-a", "TRAINFLEET_RUN_TABLE": "table",
                "TRAINFLEET_LIVENESS_TABLE": "liveness", "TRAINFLEET_BUCKET": "bucket", "TRAINFLEET_EVENT_BUS": "bus"}
IDENTITY = Identity(instance_id="i-0aaa", instance_type="c5.large", private_ip="127.77.0.11",
                    availability_zone="us-east-1a", region="us-east-1", account_id="123456789012")


def run_record(**fields) -> RunRecord:
    spec = json.loads((REPO / "events" / "example-run.json").read_text())
    return RunRecord(run_name="run-a", spec=RunSpec.model_validate(spec), attempt=1, **fields)


def launch_spec(attempt: int = 0, resume_step: int | None = None, ranks: dict[str, int] | None = None) -> LaunchSpec:
    ranks = ranks or {"i-0aaa": 0, "i-0bbb": 1}
    return LaunchSpec(run_name="run-a", attempt=attempt, node_ranks=ranks, rendezvous_host="127.77.0.11",
                      rendezvous_id=f"run-a-{attempt}",
                      plan={"nodes": 2, "ranks_per_node": 1, "pp": 2, "dp": 1},
                      trainer_config={"model": {"n_layers": 2}, "training": {"steps": 30},
                                      "checkpoint": {"uri": "s3://b/runs/run-a/checkpoints", "resume": "none"}},
                      resume_step=resume_step, hang_timeout_seconds=10, startup_timeout_seconds=60,
                      stall_floor_seconds=8)


def test_settings_name_every_missing_variable():
    with pytest.raises(AgentError, match="TRAINFLEET_BUCKET, TRAINFLEET_EVENT_BUS"):
        AgentSettings.from_env({"TRAINFLEET_RUN_NAME": "run-a", "TRAINFLEET_RUN_TABLE": "table"})
    with pytest.raises(AgentError, match="TRAINFLEET_AGENT_LIFETIME_S must be a positive number of seconds, got 'soon'"):
        AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_AGENT_LIFETIME_S": "soon"})
    settings = AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_AGENT_LIFETIME_S": "90"})
    assert (settings.run_name, settings.event_bus, settings.lifetime_s) == ("run-a", "bus", 90.0)
    assert AgentSettings.from_env(SETTINGS_ENV).lifetime_s is None
    with pytest.raises(AgentError, match="TRAINFLEET_STANDIN_STEP_S must be a positive number of seconds"):
        AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_STANDIN_STEP_S": "0"})
    assert AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_STANDIN_STEP_S": "0.5"}).standin_step_s == 0.5
    assert AgentSettings.from_env(SETTINGS_ENV).metadata_look_s == node_settings.METADATA_LOOK_S == 5.0
    assert AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_METADATA_LOOK_S": "0.5"}).metadata_look_s == 0.5
    assert AgentSettings.from_env(SETTINGS_ENV).unreachable_limit_s == node_settings.UNREACHABLE_LIMIT_S == 900.0
    assert AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_UNREACHABLE_LIMIT_S": "60"}).unreachable_limit_s == 60.0
    assert AgentSettings.from_env(SETTINGS_ENV).log_group is None
    assert AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_NODE_LOG_GROUP": "/trainfleet/s/nodes"}).log_group == (
        "/trainfleet/s/nodes")


def test_the_trainer_config_resumes_as_the_spec_says_and_logs_to_the_attempt(tmp_path):
    files = AttemptFiles(tmp_path / "attempt-1")
    spec = launch_spec(attempt=1, resume_step=20)
    config = trainer_config(spec, files, Path("/dev/shm/trainfleet"))
    assert config["checkpoint"] == {"uri": "s3://b/runs/run-a/checkpoints", "resume": "20",
                                    "memory_dir": "/dev/shm/trainfleet/run-a", "memory_resume": False,
                                    "result_file": str(files.check_result("checkpoint"))}
    assert config["training"] == {"steps": 30, "metrics_file": str(files.metrics)}
    assert spec.trainer_config["checkpoint"]["resume"] == "none", "the spec itself is left alone"
    # A fresh run refuses a location holding checkpoints; a later attempt takes the newest.
    assert trainer_config(launch_spec(attempt=0), files, Path("/dev/shm/trainfleet"))["checkpoint"]["resume"] == "none"
    assert trainer_config(launch_spec(attempt=2), files, Path("/dev/shm/trainfleet"))["checkpoint"]["resume"] == "latest"


def test_torchrun_joins_the_rendezvous_of_node_rank_0(tmp_path):
    files = AttemptFiles(tmp_path)
    host = torchrun_command(launch_spec(), 0, IDENTITY, files)
    peer = torchrun_command(launch_spec(), 1, IDENTITY, files)
    assert host[:3] == [sys.executable, "-m", "node.torchrun"]
    for command in (host, peer):
        assert "--nnodes=2" in command and "--nproc-per-node=1" in command and "--max-restarts=0" in command
        assert f"--rdzv-endpoint=127.77.0.11:{RENDEZVOUS_PORT}" in command and "--rdzv-id=run-a-0" in command
        assert "--local-addr=127.77.0.11" in command
        assert command[command.index("-m", 3):] == ["-m", "trainer.worker", "--config", str(files.config)]
    # As torchrun reads them: a peer waits for the host's store as long as for the whole join.
    for command, is_host in ((host, "true"), (peer, "false")):
        launch_config, _, _ = torchrun.config_from_args(torchrun.parse_args(command[3:]))
        found = launch_config.rdzv_configs
        assert (found["is_host"], found["join_timeout"], found["read_timeout"]) == (is_host, "300", "300")


def test_torchrun_gets_what_nccl_needs_for_efa_on_this_node_type_and_keeps_the_library_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LD_LIBRARY_PATH", "/usr/local/cuda/lib64")
    monkeypatch.delenv("FI_PROVIDER", raising=False)
    files = AttemptFiles(tmp_path)
    p4d = torchrun_env(files, replace(IDENTITY, instance_type="p4d.24xlarge"), node_rank=1)
    assert (p4d["FI_PROVIDER"], p4d["FI_EFA_USE_DEVICE_RDMA"]) == ("efa", "1")
    # Warnings only: at INFO every rank of a large world logs its whole topology.
    assert (p4d["NCCL_DEBUG"], p4d["NCCL_DEBUG_SUBSYS"]) == ("WARN", "INIT,NET")
    libraries = p4d["LD_LIBRARY_PATH"].split(":")
    assert libraries[0] == "/opt/amazon/ofi-nccl/lib" and libraries[-1] == "/usr/local/cuda/lib64"
    assert p4d["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and p4d[PROGRESS_FILE_ENV] == str(files.progress)
    assert p4d[NODE_RANK_ENV] == "1"  # where its in-memory checkpoints' buddy is
    cpu = torchrun_env(files, IDENTITY, node_rank=1)  # c5.large: gloo, no EFA
    assert "FI_PROVIDER" not in cpu and "NCCL_DEBUG" not in cpu
    # On every type: a failed collective aborts its group and the rank lives on to be repaired
    # (torchrun would set 1 for its workers, which ends them).
    assert p4d["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == cpu["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert cpu["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64"


def test_torchrun_and_its_ranks_may_open_as_many_files_as_the_hard_limit_allows():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, hard // 2)  # a service's default soft limit sits far below its hard one
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        assert trainer_process.raise_open_files_limit() == hard
        child = subprocess.run([sys.executable, "-c", "import resource; print(*resource.getrlimit(resource.RLIMIT_NOFILE))"],
                               capture_output=True, text=True, check=True, timeout=30)
        assert child.stdout.split() == [str(hard), str(hard)], "torchrun inherits it"
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("output, kind", [
    ("config error: parallel.microbatches=3 must divide ...", TrainerFailureKind.CONFIG),
    ("trainer.train.NonFiniteLossError: step 7: loss is nan", TrainerFailureKind.NAN_LOSS),
    ("RuntimeError: Connection closed by peer", TrainerFailureKind.CRASH),
])
def test_the_failure_kind_comes_from_the_trainer_output(output, kind):
    assert failure_kind(output) is kind


def test_a_failure_message_names_the_exceptions_raised_above_its_tail():
    """torchrun's rendezvous failure, as it prints it: the cause (the store could not listen) is
    the first exception of the chain, thousands of characters above the error that ended it."""
    cause = ("torch.distributed.DistNetworkError: The server socket has failed to listen on any local network "
             "address. port: 29555, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    ended = ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d "
             "store has failed. See inner exception for details.")
    frames = "".join(f'  File "/x/torch/run.py", line {line}, in main\n    run(args)\n' for line in range(60))
    output = (f"Traceback (most recent call last):\n{frames}{cause}\n\nThe above exception was the direct cause "
              f"of the following exception:\n\nTraceback (most recent call last):\n{frames}{ended}\n")
    message = failure_message(output)
    assert message.startswith(f"raised above: {cause}\n") and message.endswith(output[-OUTPUT_TAIL_CHARS:])
    assert message.count(ended) == 1, "what the tail shows is not repeated"
    short = "[rank1]: RuntimeError: Connection closed by peer\n"
    assert failure_message(short) == short, "a short output is the message as it is"


def test_metrics_are_read_a_whole_line_at_a_time(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(metrics)
    assert follower.new_records() == []
    metrics.write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "lo')
    assert follower.new_records() == [{"step": 1, "loss": 5.0}]
    with metrics.open("a") as out:
        out.write('ss": 4.5}\n')
    assert follower.new_records() == [{"step": 2, "loss": 4.5}]
    assert follower.new_records() == []


IMDS_RECORD = InstanceMetadata(
    instance_id="i-0aaa", instance_type="c5.large", image_id="ami-0123456789abcdef0", local_ipv4="127.77.0.11",
    availability_zone="us-east-1a", region="us-east-1", account_id="123456789012",
    launch_time=datetime(2026, 11, 29, 20, 0, tzinfo=timezone.utc))


@pytest.fixture
def metadata_service(monkeypatch):
    """The local metadata service with one instance; `clock` moves token time on."""
    record = {"value": IMDS_RECORD}
    clock = {"now": 0.0}
    with InstanceMetadataServer(lambda instance_id: record["value"] if instance_id == "i-0aaa" else None,
                                clock=lambda: clock["now"]) as server:
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.endpoint_for("i-0aaa"))
        yield record, clock


def test_identity_and_spot_notice_come_from_imdsv2(metadata_service):
    record, clock = metadata_service
    client = MetadataClient()
    assert client.identity() == IDENTITY
    assert client.spot_action() is None
    notice = {"action": "terminate", "time": "2026-11-29T22:00:00Z"}
    record["value"] = replace(record["value"], spot_action=notice)
    clock["now"] += 30_000  # past the token's six hours: the client asks for a new one
    assert client.spot_action() == notice


def test_an_unreachable_metadata_service_is_an_agent_error(monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:9/i-0aaa")
    with pytest.raises(AgentError, match="no IMDSv2 token"):
        MetadataClient().identity()


class _LateMetadata:
    """Fails `failures` times, then answers."""

    def __init__(self, failures: int):
        self.failures = failures

    def identity(self):
        if self.failures:
            self.failures -= 1
            raise AgentError("no IMDSv2 token from the service")
        return IDENTITY


def test_boot_asks_a_slow_metadata_service_again_and_gives_up_only_after_its_patience(monkeypatch):
    monkeypatch.setattr(metadata.time, "sleep", lambda seconds: None)
    assert metadata.boot_identity(_LateMetadata(failures=3)) == IDENTITY
    now = iter(range(0, 10_000, 50))
    with pytest.raises(AgentError, match="no IMDSv2 token"):
        metadata.boot_identity(_LateMetadata(failures=10_000), clock=lambda: next(now))


def test_stop_ends_torchrun_and_kills_one_that_ignores_sigterm(monkeypatch):
    monkeypatch.setattr(trainer_process, "STOP_GRACE_S", 1.0)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True)\n"
                                 "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert stubborn.stdout.readline() == "ready\n"
    trainer_process.stop(polite)
    trainer_process.stop(stubborn)
    stubborn.stdout.close()
    assert polite.returncode == -signal.SIGTERM and stubborn.returncode == -signal.SIGKILL


def test_a_rank_dies_with_its_torchrun():
    # A stand-in for torchrun starts a rank in a session of its own (as torchrun does) and is
    # then killed outright; the rank must not outlive it.
    launcher = ("import subprocess, sys\n"
                "rank = subprocess.Popen([sys.executable, '-c', 'import time; from trainer.worker import "
                "die_with_parent; die_with_parent(); print(1, flush=True); time.sleep(60)'], "
                "stdout=subprocess.PIPE, start_new_session=True)\n"
                "rank.stdout.readline(); print(rank.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", "import time\n" + launcher], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    rank_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait(timeout=10)
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(rank_pid):
        time.sleep(0.05)
    assert not _alive(rank_pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- one attempt's watch over the trainer, against a moto server and the metadata service ---

def commit(store, step: int, reason: catalog.SaveReason = catalog.SaveReason.INTERVAL) -> None:
    """A checkpoint in the trainer's commit format: a shard, then the marker."""
    shard = b"shard of step %d" % step
    shards = f"{catalog.shard_folder(0)}/{catalog.step_dir_name(step)}"
    store.create(shards, "__0_0.distcp", shard)
    manifest = catalog.Manifest(step=step, layout={"pp": 2, "dp": 1},
                                files=(catalog.StoredFile(f"{shards}/__0_0.distcp", len(shard)),), reason=reason)
    store.create(catalog.step_dir_name(step), catalog.MARKER_NAME, manifest.to_json())


@pytest.fixture
def watched_attempt(moto_endpoint, metadata_service, tmp_path):
    """An Attempt of node rank 0 resumed from step 10, its agent's events copied to a queue."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    s3, events, sqs = (boto3.client(service, region_name="us-east-1") for service in ("s3", "events", "sqs"))
    s3.create_bucket(Bucket=name)
    events.create_event_bus(Name=name)
    queue_url = sqs.create_queue(QueueName=name)["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name=name, EventBusName=name, EventPattern=json.dumps({"source": [{"prefix": "trainfleet/"}]}))
    events.put_targets(Rule=name, EventBusName=name, Targets=[{"Id": "queue", "Arn": queue_arn}])
    liveness = table_from_template(boto3.client("dynamodb", region_name="us-east-1"), "LivenessTable")
    settings = AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_BUCKET": name, "TRAINFLEET_EVENT_BUS": name,
                                                      "TRAINFLEET_LIVENESS_TABLE": liveness})
    settings = replace(settings, workdir=tmp_path)
    control = ControlPlane(settings, IDENTITY)
    spec = launch_spec(attempt=1, resume_step=10)
    spec = spec.model_copy(update={"heartbeat_task_token": "token-of-train", "trainer_config": {
        **spec.trainer_config, "checkpoint": {"uri": f"s3://{name}/runs/run-a/checkpoints", "resume": "10"}}})
    store = catalog.open_store(spec.trainer_config["checkpoint"]["uri"], control.s3)
    commit(store, 10)  # the resume point: already announced by the attempt that saved it
    attempt = Attempt(control, MetadataClient(), spec, confirm=lambda attempt: False)
    attempt.files.folder.mkdir(parents=True)

    def sent() -> list[dict]:
        messages = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", [])
        return [json.loads(message["Body"]) for message in messages]

    yield attempt, store, sent


def test_steps_trained_before_a_repair_in_place_go_out_as_the_failed_attempts(watched_attempt):
    """A world repaired in place writes on into the same metrics file: each step is reported in
    an event of the attempt that trained it, the failed attempt's last ones before the new one's."""
    attempt, store, sent = watched_attempt
    bucket = store.bucket

    def trained(*steps: int) -> None:
        with attempt.files.metrics.open("a") as metrics:
            for step in steps:
                metrics.write(json.dumps({"step": step, "loss": 3.0, "tokens_per_s": 900.0, "step_time_s": 0.1,
                                          "time": time.time()}) + "\n")
        attempt.follow()

    trained(11)  # the first report goes at once
    trained(12, 13, 14)  # then every PROGRESS_EVERY_S: these wait
    repaired = launch_spec(attempt=2, resume_step=None).model_copy(update={
        "repairable": True, "repair": WorldRepair(generation=1, launched_attempt=1, survivor_ids=[IDENTITY.instance_id])})
    boto3.client("s3", region_name="us-east-1").put_object(
        Bucket=bucket, Key="runs/run-a/launch-spec.json", Body=repaired.model_dump_json().encode())
    attempt.repair_pending = 2
    assert attempt.take_repaired_spec() and attempt.spec.attempt == 2
    trained(15, 16)
    attempt.send_progress()
    events = sorted((event for event in sent() if event["detail-type"] == "TrainingProgress"),
                    key=lambda event: event["detail"]["step"])
    assert [(event["detail"]["attempt"], [sample["step"] for sample in event["detail"]["samples"]])
            for event in events] == [(1, [11]), (1, [12, 13, 14]), (2, [15, 16])]


def test_the_rank_0_node_announces_each_new_commit_once_with_progress(watched_attempt):
    attempt, store, sent = watched_attempt
    run = run_record()
    commit(store, 20)
    attempt.follow()
    attempt.look(run.control())
    assert sent() == [], "no metrics yet: this node does not hold global rank 0 (so far)"
    attempt.files.metrics.write_text(json.dumps({"step": 21, "loss": 3.5, "tokens_per_s": 900.0,
                                                 "step_time_s": 0.1, "time": time.time()}) + "\n")
    attempt.follow()
    attempt.look(run.control())
    commit(store, 30, reason=catalog.SaveReason.REQUESTED)
    attempt.follow()
    attempt.look(run.control())
    events = sorted(sent(), key=lambda event: (event["detail-type"], event["detail"].get("step", 0)))
    assert [(event["detail-type"], event["detail"]["step"], event["detail"].get("reason")) for event in events] == [
        ("CheckpointCommitted", 20, "interval"), ("CheckpointCommitted", 30, "requested"),
        ("TrainingProgress", 21, None)]
    assert events[0]["detail"]["uri"] == store.step_uri(catalog.step_dir_name(20))
    assert all(event["detail"]["attempt"] == 1 and event["source"] == f"trainfleet/{IDENTITY.arn}" for event in events)


def step_record(step: int) -> str:
    return json.dumps({"step": step, "loss": 3.5, "tokens_per_s": 900.0, "step_time_s": 0.1, "time": time.time()}) + "\n"


def repair_of(attempt, resume_step: int) -> LaunchSpec:
    """The launch spec of the run's next attempt, repairing `attempt`'s world around this node,
    written where the agent reads it."""
    spec = launch_spec(attempt=attempt.spec.attempt + 1, resume_step=resume_step).model_copy(update={
        "trainer_config": attempt.spec.trainer_config,
        "repair": WorldRepair(generation=1, launched_attempt=attempt.spec.attempt, survivor_ids=[IDENTITY.instance_id])})
    control = attempt.control
    control.s3.put_object(Bucket=control.settings.bucket, Key="runs/run-a/launch-spec.json",
                          Body=spec.model_dump_json().encode())
    return spec


def commits_sent(events: list[dict]) -> list[tuple[int, int]]:
    return sorted((event["detail"]["step"], event["detail"]["attempt"]) for event in events
                  if event["detail-type"] == "CheckpointCommitted")


def test_a_repaired_world_announces_again_what_its_agent_announced_for_the_attempt_the_run_left(watched_attempt):
    """A world trains on after its attempt failed (a Spot notice: until the leaving node is
    terminated), and its commits are announced under the attempt the run left, which the control
    plane drops as stale. The repaired attempt resumes from the commit Train found, older: the
    commits past it are the new attempt's to announce, or the run's last commit goes unrecorded."""
    attempt, store, sent = watched_attempt
    attempt.files.metrics.write_text(step_record(21))
    commit(store, 20)
    attempt.follow()
    attempt.look(run_record())
    assert commits_sent(sent()) == [(20, 1)]
    repair_of(attempt, resume_step=10)
    attempt.repair_pending = 2
    assert attempt.take_repaired_spec()
    attempt.look(run_record())
    assert commits_sent(sent()) == [(20, 2)]


def test_a_world_that_trained_its_last_step_before_the_repair_order_completes_the_repaired_attempt(watched_attempt):
    """Its trainer ended well at the run's last step while the control plane repaired its world
    (the step committed after Train listed S3): nothing is left to train, which the node that
    speaks for the world tells the repaired attempt, its last commit included; no crash."""
    attempt, store, sent = watched_attempt
    assert not attempt.trained_to_the_end
    attempt.files.metrics.write_text(step_record(30))
    write_whole(attempt.files.progress, "30")
    commit(store, 30, reason=catalog.SaveReason.FINAL)
    attempt.follow()
    attempt.returncode = 0
    assert attempt.trained_to_the_end
    attempt.complete(repair_of(attempt, resume_step=20))
    events = sent()
    assert commits_sent(events) == [(30, 2)]
    (completed,) = [event["detail"] for event in events if event["detail-type"] == "TrainingCompleted"]
    assert (completed["attempt"], completed["final_step"]) == (2, 30)
    assert completed["checkpoint_uri"] == store.step_uri(catalog.step_dir_name(30))


def test_a_commit_pruned_between_listing_and_reading_is_skipped_not_the_end_of_the_agent(watched_attempt, monkeypatch):
    """Retention (keep_last) deletes an old step's marker while the agent announces the steps it
    listed a moment before: the step is gone, a newer one is announced."""
    attempt, store, sent = watched_attempt
    commit(store, 30)
    listed = [30, 20, 10]  # step 20 was there when listed, pruned before it was read
    monkeypatch.setattr(catalog, "committed_steps", lambda checkpoints: listed)
    attempt.files.metrics.write_text(json.dumps({"step": 31, "loss": 3.5, "tokens_per_s": 900.0,
                                                 "step_time_s": 0.1, "time": time.time()}) + "\n")
    attempt.follow()
    attempt.look(run_record().control())
    assert sorted(event["detail"]["step"] for event in sent() if event["detail-type"] == "CheckpointCommitted") == [30]


def test_every_step_since_the_last_report_is_sent_in_events_of_at_most_the_most_steps(watched_attempt):
    """A fast trainer writes hundreds of steps between two reports: each one reaches the run's
    history, PROGRESS_SAMPLES_MAX an event."""
    attempt, _, sent = watched_attempt
    steps = range(11, 11 + 2 * PROGRESS_SAMPLES_MAX + 200)
    attempt.files.metrics.write_text("".join(json.dumps(metrics_record(step, step / 10)) + "\n" for step in steps))
    attempt.follow()
    events = []
    while batch := sent():
        events += batch
    carried = sorted((sample["step"] for event in events for sample in event["detail"]["samples"]))
    assert carried == list(steps)
    assert sorted(len(event["detail"]["samples"]) for event in events) == [200, PROGRESS_SAMPLES_MAX,
                                                                            PROGRESS_SAMPLES_MAX]


def test_a_commit_asked_for_is_announced_at_once_others_at_the_next_look(watched_attempt):
    """Between two looks the agent lists the commits only while a checkpoint it asked for (a Spot
    notice, a departure) is not announced yet: one S3 listing a look otherwise, not two a second."""
    attempt, store, sent = watched_attempt
    record = {"step": 21, "loss": 3.5, "tokens_per_s": 900.0, "step_time_s": 0.1, "time": time.time()}
    attempt.files.metrics.write_text(json.dumps(record) + "\n")
    attempt.follow()
    commit(store, 20)
    with attempt.files.metrics.open("a") as metrics:
        metrics.write(json.dumps(record | {"step": 22}) + "\n")
    attempt.follow()
    assert [event["detail-type"] for event in sent()] == ["TrainingProgress"], "the interval commit waits for a look"
    attempt.request_checkpoint("spot interruption notice")
    commit(store, 23, reason=catalog.SaveReason.REQUESTED)
    with attempt.files.metrics.open("a") as metrics:
        metrics.write(json.dumps(record | {"step": 23}) + "\n")
    attempt.follow()
    assert sorted(event["detail"]["step"] for event in sent()) == [20, 23]
    assert attempt.commit_awaited_after is None


def test_a_large_runs_agent_looks_at_the_full_rate_once_its_trainer_stalls(watched_attempt):
    """At 2,048 nodes a look while training comes every 40-80 s; a trainer that stops stepping (a
    lost peer blocks the world) brings the next look within 10 s: the run is moving on."""
    attempt, _, _ = watched_attempt
    clock = {"now": 1000.0}
    control = attempt.control
    control.clock, control.draw = (lambda: clock["now"]), (lambda: 0.999)
    control.run_nodes, control.hang_timeout_s = 2048, 600
    for step in range(10, 17):  # joined at its resume step, then a step every 2 s
        write_whole(attempt.files.progress, f"{step} {step}")
        attempt.follow()
        control.take_look()  # due at the start, full rate, and 10 s later, paced
        clock["now"] += 2.0
    assert control.stepping and control.next_look - clock["now"] > 60
    clock["now"] += 10.5  # no step for 12.5 s: more than 3 steps and 10 s
    attempt.follow()
    assert not control.stepping and control.next_look - clock["now"] < 10


def test_a_trainer_resumed_at_its_last_step_completes_the_run(watched_attempt):
    attempt, store, sent = watched_attempt
    # What trainer.train writes when the checkpoint it resumed from is already the last step.
    attempt.files.metrics.write_text(json.dumps({"step": 10, "finished": True}) + "\n")
    attempt.follow()
    attempt.report_exit(0)
    assert [(event["detail-type"], event["detail"]["final_step"], event["detail"]["checkpoint_uri"])
            for event in sent()] == [("TrainingCompleted", 10, store.step_uri(catalog.step_dir_name(10)))]


@pytest.fixture
def heartbeats(watched_attempt):
    """The watched attempt on a clock the test moves, its torchrun started at 0 s; every
    SendTaskHeartbeat it makes (to the moto server) is noted with the time."""
    attempt, _, _ = watched_attempt
    clock = {"now": 0.0}
    attempt.control.clock = lambda: clock["now"]
    beats: list[float] = []
    attempt.control.sfn.meta.events.register(
        "before-parameter-build.stepfunctions.SendTaskHeartbeat",
        lambda params, **_: beats.append(clock["now"]) if params["taskToken"] == "token-of-train" else None)
    attempt.torchrun_started = clock["now"]
    return attempt, clock, beats


def follow_until(attempt: Attempt, clock: dict, until: float) -> None:
    """The agent's watch and its heartbeat thread, every LOOK_S up to `until` seconds."""
    while clock["now"] < until:
        attempt.follow()
        attempt.beat_if_due()
        clock["now"] += node_settings.LOOK_S


def step(attempt: Attempt, number: int) -> None:
    """What global rank 0's trainer writes for a step."""
    with attempt.files.metrics.open("a") as metrics:
        metrics.write(json.dumps({"step": number, "loss": 3.0, "tokens_per_s": 900.0, "step_time_s": 0.1,
                                  "time": time.time()}) + "\n")


def test_node_rank_0_heartbeats_the_start_up_until_the_startup_timeout_then_lets_the_hang_be_declared(heartbeats):
    """No trainer writes metrics before the first step (rendezvous, NCCL set-up, checkpoint load):
    node rank 0's agent speaks for the world then, a beat every quarter of the hang timeout (10 s
    here) for the startup timeout (60 s), then falls silent so the Train task's heartbeat times out."""
    attempt, clock, beats = heartbeats
    attempt.files.progress.write_text("10")  # joined the world at its resume step: no step yet
    follow_until(attempt, clock, 80.0)
    assert beats == [2.5 * beat for beat in range(24)]  # 0 s ... 57.5 s
    beats.clear()
    for number in range(11, 31):  # a late first step, then a step every LOOK_S: steady heartbeats
        step(attempt, number)
        follow_until(attempt, clock, clock["now"] + node_settings.LOOK_S)
    assert beats == [80.0, 82.5, 85.0, 87.5]


def test_the_heartbeat_follows_the_trainer_while_the_watch_loop_waits_on_the_control_plane(heartbeats):
    """The watch loop may wait seconds in a throttled call (follow is not called here at all):
    the heartbeat thread judges progress by the metrics file alone, and stops when it does."""
    attempt, clock, beats = heartbeats
    clock["now"] = 100.0  # past the start-up: beats need steps
    for number in range(11, 21):
        step(attempt, number)
        attempt.beat_if_due()
        clock["now"] += node_settings.LOOK_S
    assert beats == [100.0, 102.5]
    for _ in range(20):  # the trainer hangs: one beat for the last steps, then silence
        attempt.beat_if_due()
        clock["now"] += node_settings.LOOK_S
    assert beats == [100.0, 102.5, 105.0]


def test_the_start_up_heartbeats_end_at_this_node_first_step(heartbeats):
    attempt, clock, beats = heartbeats
    attempt.files.progress.write_text("10")
    follow_until(attempt, clock, 5.0)
    attempt.files.progress.write_text("11")  # its trainer stepped; global rank 0 is on another node
    follow_until(attempt, clock, 20.0)
    assert beats == [0.0, 2.5]


def test_only_node_rank_0_heartbeats_the_start_up(heartbeats):
    attempt, clock, beats = heartbeats
    spec = attempt.spec.model_copy(update={"node_ranks": {"i-0bbb": 0, "i-0aaa": 1}})
    peer = Attempt(attempt.control, attempt.spot.metadata, spec, confirm=lambda attempt: False)
    peer.files.folder.mkdir(parents=True, exist_ok=True)
    peer.torchrun_started = clock["now"]
    for beat in range(8):  # its trainer's signs of life speak for this node alone
        sign_of_life(peer, None, beat)
        follow_until(peer, clock, clock["now"] + 2.5)
    assert beats == []


def sign_of_life(attempt: Attempt, step: int | None, beats: int) -> None:
    """What local rank 0's trainer writes after a start-up phase or a microbatch (trainer/progress.py)."""
    write_whole(attempt.files.progress, f"{'-' if step is None else step} {beats}")


def test_a_start_up_that_shows_life_is_heartbeaten_past_the_startup_timeout_until_it_falls_silent(heartbeats):
    """A start-up of several long phases (imports, the rendezvous, the fleet check, a checkpoint
    load: on a starved machine each takes long) is not a hang while each phase ends within the
    startup timeout (60 s here) of the one before: node rank 0 beats on until its trainer has
    been silent that long."""
    attempt, clock, beats = heartbeats
    for phase in range(4):  # a sign of life every 40 s: 160 s of start-up, past the 60 s bound
        sign_of_life(attempt, None, phase)
        follow_until(attempt, clock, 40.0 * (phase + 1))
    follow_until(attempt, clock, 300.0)
    assert beats == [2.5 * beat for beat in range(72)]  # the last sign at 120 s: beats until 177.5 s


def test_a_slow_step_that_shows_life_is_no_hang_and_a_silent_one_is(heartbeats):
    """Steps of 30 s with a hang timeout of 10 s: global rank 0's trainer gives a sign of life at
    every microbatch (every 2 s), so its agent beats on between the steps' metrics records; when
    the trainer falls silent mid-step, so does the heartbeat."""
    attempt, clock, beats = heartbeats
    clock["now"] = 100.0  # past the start-up
    step(attempt, 11)  # its trainer writes metrics: this node speaks for the world
    follow_until(attempt, clock, 101.0)
    for microbatch in range(15):  # 30 s of a step, a microbatch every 2 s
        sign_of_life(attempt, 11, microbatch)
        follow_until(attempt, clock, clock["now"] + 2.0)
    step(attempt, 12)
    for microbatch in range(15, 20):  # then 10 s of the next step, and silence
        sign_of_life(attempt, 12, microbatch)
        follow_until(attempt, clock, clock["now"] + 2.0)
    follow_until(attempt, clock, 200.0)
    assert all(0 < later - earlier <= 2.5 + node_settings.LOOK_S for earlier, later in zip(beats, beats[1:]))
    assert beats[0] == 100.0 and 140.0 <= beats[-1] <= 143.0, beats


def hung_events(sent) -> list[dict]:
    return [event["detail"] for event in sent() if event["detail-type"] == "TrainerHung"]


def steps_every(attempt: Attempt, clock: dict, first: int, last: int, seconds: float) -> None:
    """This node's trainer completes steps first..last, one every `seconds` (its progress file)."""
    for number in range(first, last + 1):
        follow_until(attempt, clock, clock["now"] + seconds)
        sign_of_life(attempt, number, number)


def test_a_trainer_blocked_in_a_save_gives_signs_of_life_until_the_block_ends(tmp_path):
    """trainer/progress.py's alive_during, as train.py wraps a checkpoint's save and close in it:
    the progress file keeps changing while the caller blocks, in each block."""
    progress = Progress(tmp_path / "progress")
    progress.reached(20)
    written = (tmp_path / "progress").read_text()
    with progress.alive_during():
        until(lambda: (tmp_path / "progress").read_text() != written, lambda: None, what="a beat while blocked",
              poll_s=0.05)
    beats_after = progress.beats
    with progress.alive_during():
        until(lambda: progress.beats > beats_after, lambda: None, what="a beat in a second block", poll_s=0.05)
    assert read_progress(tmp_path / "progress") == 20


def test_a_world_silent_past_its_cadence_is_declared_hung_once(heartbeats, watched_attempt):
    """Steps of 2 s: five of them (10 s) of silence is a hang (the stall floor is 8 s here), told
    with TrainerHung at once, while the Train task's heartbeat timeout would wait its own."""
    attempt, clock, _ = heartbeats
    _, _, sent = watched_attempt
    clock["now"] = 100.0
    sign_of_life(attempt, 10, 0)  # the world formed at the resume step
    steps_every(attempt, clock, 11, 20, seconds=2.0)
    silent_since = clock["now"]
    follow_until(attempt, clock, silent_since + 9.5)
    assert hung_events(sent) == []
    follow_until(attempt, clock, silent_since + 30.0)
    (hung,) = hung_events(sent)
    assert hung["instance_id"] == IDENTITY.instance_id and hung["attempt"] == 1 and hung["last_step"] == 20
    assert 10.0 < hung["seconds_since_progress"] <= 10.0 + 2 * node_settings.LOOK_S


def test_the_stall_floor_bounds_a_fast_worlds_silence(heartbeats, watched_attempt):
    attempt, clock, _ = heartbeats
    _, _, sent = watched_attempt
    clock["now"] = 100.0
    sign_of_life(attempt, 10, 0)
    steps_every(attempt, clock, 11, 29, seconds=node_settings.LOOK_S)  # steps far faster than the 8 s floor allows
    silent_since = clock["now"]
    follow_until(attempt, clock, silent_since + 7.5)
    assert hung_events(sent) == []
    follow_until(attempt, clock, silent_since + 10.0)
    assert [hung["last_step"] for hung in hung_events(sent)] == [29], "the final step is 30: the world still had one"


def test_a_silent_start_up_or_a_world_that_finished_is_not_judged_by_a_cadence(heartbeats, watched_attempt):
    """Before CADENCE_STEPS_KNOWN steps are timed the cadence is unknown (the startup timeout
    bounds a start-up); after the final step (30 here) the end is the startup timeout's too."""
    attempt, clock, _ = heartbeats
    _, _, sent = watched_attempt
    sign_of_life(attempt, 10, 0)
    steps_every(attempt, clock, 11, 12, seconds=2.0)  # two steps: one timing only
    follow_until(attempt, clock, clock["now"] + 100.0)
    assert hung_events(sent) == []
    steps_every(attempt, clock, 13, 30, seconds=2.0)
    follow_until(attempt, clock, clock["now"] + 100.0)
    assert hung_events(sent) == []


def test_a_hang_is_judged_by_the_watch_loop_whatever_the_heartbeat_thread_waits_on(heartbeats, watched_attempt):
    """The heartbeat thread may wait out a slow control plane's retries for minutes; the trainer's
    signs of life meanwhile still count."""
    attempt, clock, _ = heartbeats
    _, _, sent = watched_attempt
    sign_of_life(attempt, 10, 0)
    steps_every(attempt, clock, 11, 20, seconds=2.0)
    for microbatch in range(60):  # two minutes of a slow step; no beat_if_due: its thread is stuck
        sign_of_life(attempt, 20, 100 + microbatch)
        clock["now"] += 2.0
        attempt.follow()
    assert hung_events(sent) == []


def test_a_world_repaired_in_place_learns_its_cadence_anew(heartbeats, watched_attempt):
    """Forming a repaired world (its ranks meet, restore and rebuild their stages; minutes for
    thousands of ranks) is silent far past five of the failed world's steps: judged by them, its
    agents declared it hung as it formed."""
    attempt, clock, _ = heartbeats
    _, store, sent = watched_attempt
    sign_of_life(attempt, 10, 0)
    steps_every(attempt, clock, 11, 20, seconds=2.0)  # the failed world's cadence: 2 s
    repaired = attempt.spec.model_copy(update={
        "attempt": 2, "repair": WorldRepair(generation=1, launched_attempt=1, survivor_ids=[IDENTITY.instance_id])})
    attempt.control.s3.put_object(Bucket=attempt.control.settings.bucket, Key="runs/run-a/launch-spec.json",
                                  Body=repaired.model_dump_json().encode())
    attempt.repair_pending = 2
    assert attempt.take_repaired_spec() and attempt.spec.attempt == 2
    follow_until(attempt, clock, clock["now"] + 45.0)  # the repaired world forms
    assert hung_events(sent) == []
    sign_of_life(attempt, 20, 1)  # it restored step 20
    steps_every(attempt, clock, 21, 25, seconds=2.0)
    follow_until(attempt, clock, clock["now"] + 30.0)
    assert [hung["attempt"] for hung in hung_events(sent)] == [2], "its own cadence, known again, tells a hang"


def test_a_slow_step_that_shows_life_is_not_declared_hung(heartbeats, watched_attempt):
    attempt, clock, _ = heartbeats
    _, _, sent = watched_attempt
    sign_of_life(attempt, 10, 0)
    steps_every(attempt, clock, 11, 20, seconds=2.0)
    for microbatch in range(30):  # a step of 60 s, thirty times the cadence, with a sign every 2 s
        sign_of_life(attempt, 20, 100 + microbatch)
        follow_until(attempt, clock, clock["now"] + 2.0)
    sign_of_life(attempt, 21, 200)
    follow_until(attempt, clock, clock["now"] + 5.0)
    assert hung_events(sent) == []


def test_the_final_save_and_exit_are_heartbeaten_for_at_most_the_startup_timeout(heartbeats):
    """After its final step (training.steps = 30) the trainer saves its last checkpoint and tears
    the world down before torchrun exits and TrainingCompleted answers the task: no step shows
    for it, so the agent that speaks for the world beats on, bounded like the start-up."""
    attempt, clock, beats = heartbeats
    step(attempt, 29)
    follow_until(attempt, clock, 1.0)
    step(attempt, 30)
    follow_until(attempt, clock, 100.0)
    assert beats == [2.5 * beat for beat in range(25)]  # the final step at 1 s: beats until 61 s


def test_the_save_reasons_of_markers_and_events_are_the_same():
    assert [reason.value for reason in catalog.SaveReason] == [reason.value for reason in CheckpointReason]


def on_a_clock(attempt: Attempt) -> dict:
    """The attempt's clock, moved on by the test."""
    clock = {"now": 0.0}
    attempt.control.clock = lambda: clock["now"]
    return clock


def test_a_spot_notice_asks_the_trainer_for_a_checkpoint_now(watched_attempt, metadata_service):
    """The metadata service is asked every 5 s (AWS's advice for the Spot notice), not at every
    look at the node."""
    attempt, _, _ = watched_attempt
    record, _ = metadata_service
    clock = on_a_clock(attempt)
    attempt.follow()
    assert not attempt.files.checkpoint_request.exists()
    record["value"] = replace(record["value"], spot_action={"action": "terminate", "time": "2026-11-29T22:00:00Z"})
    clock["now"] += node_settings.LOOK_S
    attempt.follow()
    assert not attempt.files.checkpoint_request.exists(), "not asked again yet"
    clock["now"] += node_settings.METADATA_LOOK_S
    attempt.follow()
    assert attempt.files.checkpoint_request.exists()


def test_a_metadata_service_that_fails_is_asked_again_and_never_ends_the_agent(watched_attempt, metadata_service):
    attempt, _, _ = watched_attempt
    record, _ = metadata_service
    clock = on_a_clock(attempt)
    record["value"] = object()  # the service fails every request for this instance
    for _ in range(2):
        attempt.follow()
        clock["now"] += node_settings.METADATA_LOOK_S
    record["value"] = replace(IMDS_RECORD, spot_action={"action": "terminate", "time": "2026-11-29T22:00:00Z"})
    attempt.follow()
    assert attempt.files.checkpoint_request.exists()


def test_a_checkpoint_the_run_asks_for_is_requested_once_and_liveness_is_reported(watched_attempt):
    attempt, store, _ = watched_attempt
    attempt.files.progress.write_text("12")  # what local rank 0 of this node's trainer wrote
    attempt.follow()
    attempt.look(run_record().control())
    assert not attempt.files.checkpoint_request.exists()
    asked = run_record(checkpoint_requested_at=datetime(2026, 1, 1, tzinfo=timezone.utc))
    attempt.look(asked.control())
    assert attempt.files.checkpoint_request.exists()
    attempt.files.checkpoint_request.unlink()  # the trainer consumed it
    attempt.look(asked.control())
    assert not attempt.files.checkpoint_request.exists(), "one request, one checkpoint"
    (record,) = read_liveness(attempt.control.store.db, attempt.control.settings.liveness_table, "run-a",
                              [IDENTITY.arn])
    assert (record.instance_id, record.attempt, record.step) == ("i-0aaa", 1, 12)
    assert record.alive_at is not None and record.alive_at <= record.reported_at  # the progress file's change


def test_a_checkpoint_request_already_answered_starts_no_second_save(watched_attempt):
    attempt, _, _ = watched_attempt
    asked_at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    committed = CheckpointRef(step=330, uri="s3://b/runs/run-a/checkpoints/step-000000330",
                              committed_at=asked_at + timedelta(seconds=5))
    # The leaving node's own notice was served before this look saw the run's request.
    attempt.look(run_record(checkpoint_requested_at=asked_at, latest_checkpoint=committed).control())
    assert not attempt.files.checkpoint_request.exists()
    failed = FailureReport(failure_class=FailureClass.SPOT_INTERRUPTION, attempt=1, instance_ids=["i-0bbb"])
    attempt.look(run_record(checkpoint_requested_at=asked_at + timedelta(seconds=1),
                            attempt_failure=failed).control())
    assert not attempt.files.checkpoint_request.exists(), "the attempt is over: no save to wait for"


def test_an_event_with_a_message_field_is_logged_whole(capsys):
    node_log.say("sent TrainerFailed", kind="config", message="config error: model.n_heads=3 ...")
    assert json.loads(capsys.readouterr().out) == {"agent": "sent TrainerFailed", "kind": "config",
                                                   "message": "config error: model.n_heads=3 ..."}


def test_a_preflight_that_cannot_run_makes_the_node_unhealthy_saying_why():
    checks, problem = preflight.run_preflight("p9.huge")
    assert checks == [] and "preflight failed with exit code 2" in problem and "'p9.huge'" in problem


def test_each_attempt_rendezvouses_on_a_port_of_its_own():
    ports = {rendezvous_port(f"run-a-{attempt}") for attempt in range(20)}
    assert len(ports) > 15 and ports <= set(RENDEZVOUS_PORTS)
    assert rendezvous_port("run-a-3") == rendezvous_port("run-a-3"), "every agent of an attempt agrees"


def run_table(cloud) -> str:
    return table_from_template(cloud.client("dynamodb"), "RunTable")


THROTTLED_CALLS = {"dynamodb": {"read the run record", "write the liveness record"},
                   "events": {"send TrainingProgress"}, "s3": {"list the committed checkpoints"}}
"""What each throttled service's outage must have failed before it ends."""


def test_a_throttled_control_plane_never_stops_training(local_cloud, metadata_service, tmp_path, monkeypatch):
    """DynamoDB, S3 and EventBridge answer with their throttling errors while torchrun runs: each
    failed call is logged and tried again later with backoff, and the trainer runs to its end. Each
    outage lasts until the agent has logged the failure of the calls it answers (THROTTLED_CALLS),
    and the trainer until every outage is over and a call succeeded again: on a loaded machine
    the agent's calls come later, never in a fixed window."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    local_cloud.client("s3").create_bucket(Bucket=name)
    local_cloud.client("events").create_event_bus(Name=name)
    table = run_table(local_cloud)
    RunStore(local_cloud.client("dynamodb"), table).create_run(run_record())
    liveness = table_from_template(local_cloud.client("dynamodb"), "LivenessTable")
    settings = replace(AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_BUCKET": name, "TRAINFLEET_EVENT_BUS": name,
                                                              "TRAINFLEET_RUN_TABLE": table,
                                                              "TRAINFLEET_LIVENESS_TABLE": liveness}), workdir=tmp_path)
    # botocore's own quick retries out of the way: every throttled answer reaches the agent.
    monkeypatch.setattr(control_plane, "CLIENT_RETRIES", {"max_attempts": 1, "mode": "standard"})
    control = ControlPlane(settings, IDENTITY, draw=lambda: 0.0)  # the shortest backoff: 1, 2, 4 ... s
    spec = launch_spec(attempt=1)
    spec = spec.model_copy(update={"trainer_config": {**spec.trainer_config, "checkpoint": {
        "uri": f"s3://{name}/runs/run-a/checkpoints", "resume": "none"}}})
    attempt = Attempt(control, MetadataClient(), spec, confirm=lambda attempt: False)
    monkeypatch.setattr(control_plane, "poll_interval", lambda nodes, draw, hang_timeout_s, stepping: 0.2)  # many looks
    logged: list[dict] = []
    for speaker in (control_plane, attempt_module):  # the modules whose lines the test reads
        monkeypatch.setattr(speaker, "say", lambda message, /, **fields: (logged.append({"agent": message, **fields}),
                                                                          node_log.say(message, **fields)))
    # A trainer that writes one metrics record (so this node heartbeats and sends progress) and
    # trains on until told to end.
    end = tmp_path / "end"
    trainer = ("import json, os, sys, time; open(sys.argv[1], 'w').write(json.dumps({'step': 1, 'loss': 1.0, "
               "'tokens_per_s': 1.0, 'step_time_s': 0.1, 'time': time.time()}) + '\\n')\n"
               "while not os.path.exists(sys.argv[2]): time.sleep(0.1)")
    monkeypatch.setattr(attempt_module, "torchrun_command", lambda spec, rank, identity, files: [
        sys.executable, "-c", trainer, str(files.metrics), str(end)])
    # S3 outlasts DynamoDB: the listing of the commits comes at a look that read the run record.
    for service in THROTTLED_CALLS:
        local_cloud.throttle(service, 3600.0)
    failed_calls: set[str] = set()
    stalled: list[Exception] = []

    def outages() -> None:
        try:
            throttled = set(THROTTLED_CALLS)
            while throttled or control.failures:
                until(lambda: [line for line in logged if line["agent"].startswith("control plane call failed")
                               and line["call"] not in failed_calls] or (not throttled and not control.failures),
                      lambda: len(logged), what="the agent's next call failed or succeeded", poll_s=0.05)
                failed_calls.update(line["call"] for line in logged
                                    if line["agent"].startswith("control plane call failed"))
                for service in [service for service in throttled if THROTTLED_CALLS[service] <= failed_calls]:
                    local_cloud.stop_failing_requests(service)
                    throttled.discard(service)
        except Exception as error:  # raised by the test, after the attempt it ends
            stalled.append(error)
        finally:
            end.touch()

    watching = threading.Thread(target=outages)
    watching.start()
    try:
        assert attempt.run() is None, "the attempt ran to torchrun's exit"
    finally:
        end.touch()
        watching.join()
    if stalled:
        raise stalled[0]
    assert set().union(*THROTTLED_CALLS.values()) <= failed_calls
    assert not [line for line in logged if "stopping torchrun" in line["agent"]]
    assert all(local_cloud.failed_requests[(service, "throttle")] for service in THROTTLED_CALLS), dict(local_cloud.failed_requests)
    assert control.failures == 0, "calls succeed again once the throttling is over"


def test_the_agent_ends_its_instance_when_the_run_is_over(local_cloud, metadata_service, tmp_path, monkeypatch):
    name = f"agent-{uuid.uuid4().hex[:8]}"
    local_cloud.client("s3").create_bucket(Bucket=name)
    local_cloud.client("events").create_event_bus(Name=name)
    table = run_table(local_cloud)
    store = RunStore(local_cloud.client("dynamodb"), table)
    store.create_run(run_record(state=RunState.FAILED))  # stopped while this node booted
    store.add_node(NodeRecord(run_name="run-a", instance_id="i-0aaa"))
    ended = tmp_path / "ended"
    for variable, value in (SETTINGS_ENV | {"TRAINFLEET_BUCKET": name, "TRAINFLEET_EVENT_BUS": name,
                                            "TRAINFLEET_RUN_TABLE": table, "TRAINFLEET_AGENT_LIFETIME_S": "120",
                                            "TRAINFLEET_SHUTDOWN_COMMAND": f"touch {ended}"}).items():
        monkeypatch.setenv(variable, value)
    monkeypatch.chdir(tmp_path)
    assert agent.main() == 0
    assert ended.exists(), "the shutdown command ran"


def test_the_looks_quicken_with_the_run_hang_timeout_once_the_run_record_is_read(local_cloud, tmp_path):
    """A 10 s hang timeout: three looks must fit in 7.5 s, so an agent looks every 1.25-2.5 s."""
    table = run_table(local_cloud)
    record = run_record()
    record = record.model_copy(update={"spec": record.spec.model_copy(update={
        "recovery": record.spec.recovery.model_copy(update={"hang_timeout_seconds": 10})})})
    RunStore(local_cloud.client("dynamodb"), table).create_run(record)
    clock = {"now": 0.0}
    control = ControlPlane(replace(AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_RUN_TABLE": table}),
                                   workdir=tmp_path), IDENTITY, clock=lambda: clock["now"], draw=lambda: 0.999)
    assert control.look_at_run().attempt == 1
    assert control.next_look == pytest.approx(10.0, abs=0.01), "the run's pace was not known at the first look"
    clock["now"] = control.next_look
    assert control.look_at_run() is not None
    assert control.next_look - clock["now"] == pytest.approx(2.5, abs=0.01)


def test_the_backoff_after_failed_calls_never_outlasts_the_runs_longest_look(tmp_path):
    """Looks skipped by the backoff would make a healthy agent silent (lifecycle.liveness) once a
    throttle outlasts a few of them."""
    from botocore.exceptions import EndpointConnectionError
    clock = {"now": 0.0}
    control = ControlPlane(replace(AgentSettings.from_env(SETTINGS_ENV), workdir=tmp_path), IDENTITY,
                           clock=lambda: clock["now"], draw=lambda: 0.999)
    control.run_nodes, control.hang_timeout_s = 2, 20  # looks at most 5 s apart

    def unreachable():
        raise EndpointConnectionError(endpoint_url="http://dynamodb")

    for _ in range(6):  # 1, 2, 4, 8, 16, 32 s uncapped
        assert control.call("read the run record", unreachable) is None
        assert control.next_look - clock["now"] <= 5.0
        clock["now"] = control.next_look


def control_on_a_clock(local_cloud, tmp_path, monkeypatch) -> tuple[ControlPlane, dict[str, float]]:
    """A control plane over a recorded run (botocore tries each call once), its clock to set."""
    table = run_table(local_cloud)
    RunStore(local_cloud.client("dynamodb"), table).create_run(run_record())
    monkeypatch.setattr(control_plane, "CLIENT_RETRIES", {"max_attempts": 1, "mode": "standard"})
    clock = {"now": 0.0}
    control = ControlPlane(replace(AgentSettings.from_env(SETTINGS_ENV | {"TRAINFLEET_RUN_TABLE": table}),
                                   workdir=tmp_path), IDENTITY, clock=lambda: clock["now"])
    return control, clock


def test_a_node_cut_off_from_every_service_ends_its_instance_after_the_limit(tmp_path):
    """No answer at all (every connection fails) for the limit, with the trainer silent as long:
    nothing can tell the agent its run is over. A trainer that makes progress keeps its node."""
    from botocore.exceptions import EndpointConnectionError
    clock = {"now": 0.0}
    control = ControlPlane(replace(AgentSettings.from_env(SETTINGS_ENV), workdir=tmp_path), IDENTITY,
                           clock=lambda: clock["now"])

    def cut_off():
        raise EndpointConnectionError(endpoint_url="https://dynamodb.us-east-1.amazonaws.com")

    control.trainer_alive_at = 0.0
    clock["now"] = node_settings.UNREACHABLE_LIMIT_S
    assert control.call("read the run record", cut_off) is None
    clock["now"] += 1
    control.trainer_alive_at = clock["now"]  # still training: kept
    assert control.call("read the run record", cut_off) is None
    clock["now"] += node_settings.UNREACHABLE_LIMIT_S + 1
    with pytest.raises(control_plane.Unreachable, match="no AWS service has answered for [0-9]+ s and this node's trainer made no progress"):
        control.call("read the run record", cut_off)


def test_an_outage_of_hours_ends_no_node_even_with_its_trainer_silent(local_cloud, tmp_path, monkeypatch):
    """A regional DynamoDB outage of hours (us-east-1 had one): DynamoDB answers, with errors. A
    node lost inside it leaves its peers' trainers waiting on it, silent; had their agents ended
    their instances a quarter of an hour in, the run the state machine keeps through the outage
    would have come back to no fleet."""
    control, clock = control_on_a_clock(local_cloud, tmp_path, monkeypatch)
    local_cloud.fail_requests("dynamodb", 600.0, "error")  # real seconds: far longer than the test
    control.trainer_alive_at = 0.0  # the trainer fell silent as the outage began
    while clock["now"] < 2 * 3600:
        assert control.call("read the run record", lambda: control.store.run("run-a")) is None
        clock["now"] += 300
    local_cloud.stop_failing_requests()
    assert control.look_at_run().attempt == 1 and control.failures == 0


def test_an_idle_agent_ends_its_instance_once_its_stack_is_gone(local_cloud, tmp_path, monkeypatch):
    """A deleted stack keeps its bucket (retained), so the launch spec still reads; the run table
    and the bus answer that they are gone. Judged by what each service answers, not by whether
    some call succeeded, the agent ends its instance after the limit."""
    control, clock = control_on_a_clock(local_cloud, tmp_path, monkeypatch)
    bucket = f"agent-{uuid.uuid4().hex[:8]}"
    s3 = local_cloud.client("s3")
    s3.create_bucket(Bucket=bucket)
    control.settings = replace(control.settings, bucket=bucket)
    s3.put_object(Bucket=bucket, Key="runs/run-a/launch-spec.json", Body=b"{}")
    assert control.look_at_run() is not None
    local_cloud.client("dynamodb").delete_table(TableName=control.settings.run_table)
    read_spec = lambda: s3.get_object(Bucket=bucket, Key="runs/run-a/launch-spec.json")  # noqa: E731
    while clock["now"] <= node_settings.UNREACHABLE_LIMIT_S:
        control.trainer_alive_at = clock["now"]  # even a trainer that steps: no one will read its work
        assert control.call("read the launch spec", read_spec) is not None
        assert control.call("read the run record", lambda: control.store.run("run-a")) is None
        clock["now"] += 60
    with pytest.raises(control_plane.Unreachable, match="the stack's resources have been gone for 9[0-9][0-9] s"):
        control.call("read the run record", lambda: control.store.run("run-a"))


@pytest.mark.parametrize("nodes, hang_timeout_s, looks_per_s", [
    (2, 600, 0.27), (512, 600, 34.1), (4096, 600, 34.1),
    (512, 65, 34.1),  # the shortest hang timeout 512 nodes may have (trainfleet.core.pace.least_hang_timeout)
])
def test_a_runs_agents_read_at_a_bounded_rate_whatever_its_node_count(nodes, hang_timeout_s, looks_per_s):
    """One agent's own pacing over simulated hours, scaled to the run's agents: each look is one
    read of the run record (bench/control_plane_load.py prints the partition's load)."""
    clock = {"now": 0.0}
    control = ControlPlane(replace(AgentSettings.from_env(SETTINGS_ENV), workdir=Path(".")), IDENTITY,
                           clock=lambda: clock["now"], draw=random.Random(7).random)
    control.run_nodes, control.hang_timeout_s, control.stepping = nodes, hang_timeout_s, True  # a trainer steps
    looks, seconds = 0, 3600 * max(1, nodes // 256)  # about the same number of looks each time
    while clock["now"] < seconds:
        looks += control.take_look()
        clock["now"] += node_settings.LOOK_S
    assert nodes * looks / seconds == pytest.approx(looks_per_s, rel=0.05)


def metrics_record(step: int, seconds: float) -> dict:
    return {"step": step, "loss": 5.0 - step / 100, "tokens_per_s": 1000.0 + step, "step_time_s": 0.25,
            "time": 1_800_000_000 + seconds}


def test_progress_carries_every_step_since_the_last():
    few = trainer_files.progress_samples([metrics_record(step, step / 4) for step in range(1, 11)])
    assert [sample.step for sample in few] == list(range(1, 11))
    assert few[0].at == datetime.fromtimestamp(1_800_000_000.25, timezone.utc) and few[0].tokens_per_second == 1001


def test_a_world_checks_result_file_becomes_its_event():
    files = AttemptFiles(Path("/attempt-3"))
    assert files.check_result("scaling_check") == Path("/attempt-3/scaling-check.json")
    result = {"passed": False, "efficiency": 0.2, "efficiency_floor": 0.7, "step_seconds": 1.0,
              "expected_step_seconds": 0.2, "tokens_per_second": 10.0, "expected_tokens_per_second": 50.0, "steps": 5,
              "slowest_stages": [1], "slowest_stage_seconds": 0.2, "slowest_stage_nodes": ["i-2"], "slowest_rank": 1,
              "slowest_rank_node": "i-2", "slowest_rank_seconds": 0.21, "slow_nodes": ["i-2"]}
    figures_of, event = trainer_files.WORLD_CHECKS["scaling_check"]
    figures = figures_of(result, 3)
    assert (figures.attempt, figures.slowest_stage_instance_ids, figures.slowest_rank_instance_id) == (3, ["i-2"], "i-2")
    assert figures.slow_instance_ids == ["i-2"]
    assert event.__name__ == "ScalingChecked"
    spec = launch_spec(attempt=3, resume_step=None)
    spec = spec.model_copy(update={"trainer_config": spec.trainer_config | {
        "scaling_check": {"enabled": True}, "fleet_check": {"enabled": True}}})
    config = trainer_config(spec, files, Path("/dev/shm/trainfleet"))
    assert config["scaling_check"]["result_file"] == "/attempt-3/scaling-check.json"
    assert config["fleet_check"]["result_file"] == "/attempt-3/fleet-check.json"


def test_torchrun_names_a_rendezvous_event_s_method_as_torch_does_without_inspecting_the_stack():
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import get_method_name

    from node.torchrun import caller_name

    def record(name_of) -> str:  # as torch's _record: the name of the method that called it
        return name_of()

    def keep_alive(name_of) -> str:
        return record(name_of)

    assert keep_alive(caller_name) == keep_alive(get_method_name) == "keep_alive"
    assert caller_name(depth=10_000) == get_method_name(depth=10_000) == "no_method_name"


def _barrier_agent(store, nodes: int, timeout_s: float) -> SimpleNamespace:
    """What torch's exit barrier reads of its elastic agent."""
    return SimpleNamespace(_store=store, _worker_group=SimpleNamespace(group_world_size=nodes, state="SUCCEEDED"),
                           _exit_barrier_timeout=timeout_s, _in_exit_barrier=False)


def test_torchrun_s_exit_barrier_waits_for_every_node_of_its_world(monkeypatch, tmp_path):
    from node.torchrun import exit_barrier

    monkeypatch.setenv(REPAIR_ORDER_ENV, str(tmp_path / "no-order"))
    host = torch_store.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    peer, observer = (torch_store.TCPStore("127.0.0.1", host.port, 2, False, timedelta(seconds=60)) for _ in range(2))
    arrived = threading.Thread(target=exit_barrier, args=(_barrier_agent(host, 2, 600),))
    arrived.start()
    until(lambda: observer.add(BARRIER_MEMBERS, 0) == 1, lambda: 0, what="the host at the barrier", poll_s=0.05)
    assert arrived.is_alive(), "one of two nodes at the barrier: it waits"
    exit_barrier(_barrier_agent(peer, 2, 600))
    arrived.join()
    assert observer.check([BARRIER_LAST])


def test_torchrun_s_exit_barrier_counts_the_nodes_an_order_written_while_it_waits_says_are_gone(monkeypatch, tmp_path):
    """A world that trained its last step while the control plane repaired it (a Spot notice near
    the end) reached the barrier before its agent wrote the order: it must not wait out the
    barrier's timeout for the node that left."""
    from node.torchrun import exit_barrier

    order = tmp_path / "repair-order.json"
    monkeypatch.setenv(REPAIR_ORDER_ENV, str(order))
    host = torch_store.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    observer = torch_store.TCPStore("127.0.0.1", host.port, 2, False, timedelta(seconds=60))
    waiting = threading.Thread(target=exit_barrier, args=(_barrier_agent(host, 2, 60),))
    waiting.start()
    until(lambda: observer.add(BARRIER_MEMBERS, 0) == 1, lambda: 0, what="the host at the barrier", poll_s=0.05)
    write_order(order, RepairOrder(generation=1, store_host="127.0.0.1", store_port=1, host_node_rank=0, nodes=2,
                                   launch_nodes_gone=1))
    waiting.join()
    assert observer.check([BARRIER_LAST]), "made whole by the nodes still there, not given up at its timeout"
