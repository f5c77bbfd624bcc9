"""The node agent: what runs on every instance of a run, between the control plane and torchrun.

    python -m trainer.agent
        environment: TRAINFLEET_RUN_NAME, TRAINFLEET_RUN_TABLE, TRAINFLEET_BUCKET,
        TRAINFLEET_EVENT_BUS (the user data of trainfleet/adapters/ec2_fleet.py writes them);
        optional TRAINFLEET_AGENT_LIFETIME_S (exit after that many seconds; local runs set it)

On EC2 the user data starts it under systemd; in the local cloud the fleet starts it as the
instance's process. It speaks to the control plane only through AWS:

1. identity from the instance metadata (IMDSv2): instance id, type, private IP, zone, region;
2. NodeRegistered once the run has recorded the node (its launch attempt comes from there);
3. preflight (`python -m trainer.health`, a subprocess so the agent never imports torch), then
   NodeReady or NodeUnhealthy with the check results;
4. wait for `s3://BUCKET/runs/RUN/launch-spec.json` naming this node in a newer attempt, then
   run torchrun for it: nnodes = the plan's nodes, c10d rendezvous at node rank 0's private IP
   (node rank 0 hosts the store), the trainer config from the spec written to a YAML file,
   resume as the spec says;
5. while it runs: the agent whose node holds global rank 0 (the only one whose trainer writes
   the metrics file) heartbeats the Train task as steps advance, sends sampled TrainingProgress
   and CheckpointCommitted for every checkpoint committed to S3 with the reason it was saved
   (the commit marker is the truth, read with trainer.checkpoint_catalog); every agent watches
   for a Spot interruption notice (asks the trainer to checkpoint now through its request file)
   and for the run moving to a newer attempt (stops torchrun, goes back to 4);
6. torchrun's exit: 0 -> TrainingCompleted; otherwise TrainerFailed with the kind read from its
   output (config error, NaN loss, crash), unless the run has moved on meanwhile: a peer's
   death reaches this node as a crash, and EC2's report of the lost instance must be what
   blames the failure, so the agent waits a few seconds for it first.

Then it waits for the next launch spec, until the instance is terminated.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import boto3
import botocore.session
import yaml
from botocore.config import Config
from botocore.utils import IMDSFetcher

from trainer import checkpoint_catalog as catalog
from trainfleet.adapters.run_store import NodeNotFound, RunStore
from trainfleet.contracts import (AgentEvent, CheckpointCommitted, CheckpointReason, HealthCheckResult,
                                  LaunchSpec, NodeReady, NodeRegistered, NodeUnhealthy, TrainerFailed,
                                  TrainerFailureKind, TrainingCompleted, TrainingProgress,
                                  put_events_entry)

POLL_S = 0.5
"""How often the agent looks at the trainer, the run record and the metadata service."""
HEARTBEAT_EVERY_S = 5.0
"""Least time between two SendTaskHeartbeat calls (a step may take milliseconds)."""
PROGRESS_EVERY_S = 10.0
"""Least time between two TrainingProgress events (sampled; CloudWatch gets them as metrics)."""
PEER_LOSS_GRACE_S = 5.0
"""How long a failed trainer waits for the run to move on before it reports the failure."""
HEALTH_TIMEOUT_S = 300
"""Longest preflight; beyond it the node is unhealthy."""
RENDEZVOUS_JOIN_TIMEOUT_S = 300
"""How long torchrun waits for all nodes to join the rendezvous before it gives up."""
STOP_GRACE_S = 30.0
"""How long torchrun gets to stop its ranks after SIGTERM before it is killed."""
OUTPUT_TAIL_CHARS = 2000
"""How much of torchrun's output a TrainerFailed event carries."""

T = TypeVar("T")


class AgentError(RuntimeError):
    """The agent cannot go on (a missing setting, an unreachable metadata service)."""


@dataclass(frozen=True)
class AgentSettings:
    """What the user data gives the agent."""

    run_name: str
    """The run this instance belongs to (TRAINFLEET_RUN_NAME)."""
    run_table: str
    """DynamoDB table of run and node records (TRAINFLEET_RUN_TABLE)."""
    bucket: str
    """The stack's bucket: launch specs and checkpoints (TRAINFLEET_BUCKET)."""
    event_bus: str
    """The agents' EventBridge bus (TRAINFLEET_EVENT_BUS)."""
    workdir: Path
    """Where attempts keep their config, output and metrics (the working directory)."""
    lifetime_s: float | None
    """Exit after this many seconds (TRAINFLEET_AGENT_LIFETIME_S); None = run until terminated.
    Local runs set it so that no agent outlives its test or demo."""

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ) -> AgentSettings:
        names = {"run_name": "TRAINFLEET_RUN_NAME", "run_table": "TRAINFLEET_RUN_TABLE",
                 "bucket": "TRAINFLEET_BUCKET", "event_bus": "TRAINFLEET_EVENT_BUS"}
        missing = [variable for variable in names.values() if not env.get(variable)]
        if missing:
            raise AgentError(f"missing environment variable(s): {', '.join(missing)}")
        lifetime = env.get("TRAINFLEET_AGENT_LIFETIME_S")
        try:
            lifetime_s = float(lifetime) if lifetime else None
        except ValueError:
            raise AgentError(f"TRAINFLEET_AGENT_LIFETIME_S must be a number of seconds, got {lifetime!r}") from None
        return cls(**{field: env[variable] for field, variable in names.items()},
                   workdir=Path.cwd(), lifetime_s=lifetime_s)


# --- instance metadata --------------------------------------------------------------------

@dataclass(frozen=True)
class Identity:
    """Who and where this instance is, from the instance metadata."""

    instance_id: str
    """meta-data/instance-id."""
    instance_type: str
    """meta-data/instance-type: what the preflight holds the node to."""
    private_ip: str
    """meta-data/local-ipv4: where node rank 0 hosts the rendezvous."""
    availability_zone: str
    """meta-data/placement/availability-zone."""
    region: str
    """meta-data/placement/region: where the agent's AWS clients go."""


class MetadataClient(IMDSFetcher):
    """IMDSv2 reads through botocore's fetcher (it honours AWS_EC2_METADATA_SERVICE_ENDPOINT)."""

    def __init__(self) -> None:
        endpoint = botocore.session.get_session().get_config_variable("ec2_metadata_service_endpoint")
        super().__init__(timeout=2, num_attempts=3,
                         config={"ec2_metadata_service_endpoint": endpoint} if endpoint else {})
        self._token: str | None = None

    def read(self, path: str) -> str | None:
        """The text at latest/<path>, or None where the service has nothing (404)."""
        for _ in range(2):  # a second time with a fresh token if the first one expired
            if self._token is None:
                self._token = self._fetch_metadata_token()
                if self._token is None:
                    raise AgentError(f"no IMDSv2 token from {self.get_base_url()}")
            response = self._get_request(f"latest/{path}", retry_func=lambda reply: reply.status_code >= 500,
                                         token=self._token)
            if response.status_code == 401:
                self._token = None
                continue
            if response.status_code == 404:
                return None
            if response.status_code != 200:
                raise AgentError(f"instance metadata latest/{path}: HTTP {response.status_code}")
            return response.text
        raise AgentError(f"instance metadata latest/{path}: token refused twice")

    def identity(self) -> Identity:
        def required(path: str) -> str:
            value = self.read(f"meta-data/{path}")
            if not value:
                raise AgentError(f"instance metadata has no meta-data/{path}")
            return value

        return Identity(instance_id=required("instance-id"), instance_type=required("instance-type"),
                        private_ip=required("local-ipv4"),
                        availability_zone=required("placement/availability-zone"),
                        region=required("placement/region"))

    def spot_action(self) -> dict[str, Any] | None:
        """The Spot interruption notice, once EC2 has given one."""
        document = self.read("meta-data/spot/instance-action")
        return json.loads(document) if document else None


# --- the control plane, as the agent reaches it -------------------------------------------

class ControlPlane:
    """The AWS calls the agent makes: events, launch specs, records, the Train task."""

    def __init__(self, settings: AgentSettings, identity: Identity):
        self.settings, self.identity = settings, identity
        config = Config(region_name=identity.region, retries={"max_attempts": 5, "mode": "standard"},
                        connect_timeout=5, read_timeout=30)
        self.events = boto3.client("events", config=config)
        self.s3 = boto3.client("s3", config=config)
        self.sfn = boto3.client("stepfunctions", config=config)
        self.store = RunStore(boto3.client("dynamodb", config=config), settings.run_table)

    def send(self, detail: AgentEvent) -> None:
        response = self.events.put_events(Entries=[put_events_entry(detail, self.settings.event_bus)])
        if response["FailedEntryCount"]:
            raise AgentError(f"PutEvents refused {detail.DETAIL_TYPE.value}: {response['Entries']}")
        say(f"sent {detail.DETAIL_TYPE.value}", **detail.model_dump(mode="json", exclude={"run_name"}))

    def node_attempt(self) -> int | None:
        """The attempt the run launched this node in, once the node is recorded."""
        try:
            return self.store.node(self.settings.run_name, self.identity.instance_id).attempt
        except NodeNotFound:
            return None

    def launch_spec_after(self, attempt: int) -> LaunchSpec | None:
        """The launch spec, if it is of a newer attempt than `attempt` and names this node."""
        key = f"runs/{self.settings.run_name}/launch-spec.json"
        try:
            raw = self.s3.get_object(Bucket=self.settings.bucket, Key=key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None
        spec = LaunchSpec.model_validate_json(raw)
        return spec if spec.attempt > attempt and self.identity.instance_id in spec.node_ranks else None

    def superseded(self, attempt: int) -> bool:
        """Whether the run has left `attempt` (a failure moved it on, or it finished)."""
        run = self.store.run(self.settings.run_name)
        return run.attempt > attempt or run.state.is_final

    def heartbeat(self, token: str) -> None:
        try:
            self.sfn.send_task_heartbeat(taskToken=token)
        except (self.sfn.exceptions.TaskTimedOut, self.sfn.exceptions.InvalidToken,
                self.sfn.exceptions.TaskDoesNotExist) as exc:
            # The task is over; the run record tells the attempt loop so at its next look.
            say("heartbeat refused", error=type(exc).__name__)


def say(message: str, /, **fields: Any) -> None:
    """One JSON line on stdout (the instance's console): what the agent did."""
    print(json.dumps({"agent": message, **fields}, default=str), flush=True)


def wait_for(what: str, probe: Callable[[], T | None], deadline: float | None) -> T:
    while deadline is None or time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        time.sleep(POLL_S)
    raise AgentError(f"gave up waiting for {what}: the agent's lifetime is over")


# --- preflight ----------------------------------------------------------------------------

def run_preflight(instance_type: str) -> tuple[list[HealthCheckResult], str | None]:
    """The checks and, when the node must not train, why."""
    command = [sys.executable, "-m", "trainer.health", "--instance-type", instance_type]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=HEALTH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [], f"preflight did not finish within {HEALTH_TIMEOUT_S} s"
    if done.returncode != 0:
        return [], f"preflight failed with exit code {done.returncode}: {done.stderr[-OUTPUT_TAIL_CHARS:]}"
    checks = [HealthCheckResult.model_validate(item) for item in json.loads(done.stdout)]
    failed = [check for check in checks if check.failed]
    return checks, "; ".join(f"{check.name}: {check.detail}" for check in failed) or None


# --- one attempt: torchrun and what it tells ----------------------------------------------

@dataclass(frozen=True)
class AttemptFiles:
    """Where one attempt's trainer reads and writes on this node."""

    folder: Path

    @property
    def config(self) -> Path:
        return self.folder / "trainer.yaml"

    @property
    def metrics(self) -> Path:
        return self.folder / "metrics.jsonl"

    @property
    def output(self) -> Path:
        return self.folder / "torchrun.log"

    @property
    def checkpoint_request(self) -> Path:
        return self.folder / "checkpoint-now"


def trainer_config(spec: LaunchSpec, files: AttemptFiles) -> dict[str, Any]:
    """The spec's trainer config with this attempt's metrics file and the spec's resume point."""
    config = json.loads(json.dumps(spec.trainer_config))  # a deep copy
    config.setdefault("training", {})["metrics_file"] = str(files.metrics)
    checkpoint = config.setdefault("checkpoint", {})
    if spec.resume_step is not None:
        checkpoint["resume"] = str(spec.resume_step)
    elif spec.attempt > 0:
        # A checkpoint may have committed after the control plane chose the resume point (its
        # event still on the way); "none" would refuse that location, "latest" takes it.
        checkpoint["resume"] = "latest"
    return config


def torchrun_command(spec: LaunchSpec, node_rank: int, identity: Identity, files: AttemptFiles) -> list[str]:
    plan = spec.plan
    rendezvous = {"is_host": "true" if node_rank == 0 else "false", "join_timeout": RENDEZVOUS_JOIN_TIMEOUT_S}
    return [sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={plan.nodes}", f"--nproc-per-node={plan.ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rendezvous_host}:{spec.rendezvous_port}",
            f"--rdzv-id={spec.rendezvous_id}",
            "--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in rendezvous.items()),
            f"--local-addr={identity.private_ip}", "--max-restarts=0", "--monitor-interval=1",
            "-m", "trainer.worker", "--config", str(files.config)]


def torchrun_env(files: AttemptFiles) -> dict[str, str]:
    return {**os.environ,
            # The rendezvous store is not shared with the ranks' process group: with gloo, a
            # shared one made the first restart fail on stale peer addresses (DESIGN.md, 7).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            catalog.REQUEST_FILE_ENV: str(files.checkpoint_request)}


def failure_kind(output: str) -> TrainerFailureKind:
    """Why the trainer failed, from its output (torchrun's own exit code is 1 for all of them)."""
    if "config error:" in output:
        return TrainerFailureKind.CONFIG
    if "NonFiniteLossError" in output:
        return TrainerFailureKind.NAN_LOSS
    return TrainerFailureKind.CRASH


class MetricsFollower:
    """New complete lines of the trainer's metrics JSONL (global rank 0 writes one per step)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as metrics:
            metrics.seek(self.offset)
            chunk = metrics.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


class Attempt:
    """torchrun for one launch spec on this node, and what the agent reports about it."""

    def __init__(self, control: ControlPlane, metadata: MetadataClient, spec: LaunchSpec):
        self.control, self.metadata, self.spec = control, metadata, spec
        self.identity = control.identity
        self.node_rank = spec.node_ranks[self.identity.instance_id]
        self.files = AttemptFiles(control.settings.workdir / f"attempt-{spec.attempt}")
        self.metrics = MetricsFollower(self.files.metrics)
        self.checkpoints = catalog.open_store(spec.trainer_config["checkpoint"]["uri"], control.s3)
        self.announced = {step for step in catalog.committed_steps(self.checkpoints)
                          if spec.resume_step is None or step <= spec.resume_step}
        self.last_step: int | None = None
        self.speaks_for_world = False  # set once this node's trainer writes metrics (global rank 0)
        self.last_heartbeat = self.last_progress = 0.0
        self.spot_notice_seen = False

    def run(self, deadline: float | None) -> None:
        self.files.folder.mkdir(parents=True, exist_ok=True)
        self.files.config.write_text(yaml.safe_dump(trainer_config(self.spec, self.files), sort_keys=False))
        command = torchrun_command(self.spec, self.node_rank, self.identity, self.files)
        say("starting torchrun", attempt=self.spec.attempt, node_rank=self.node_rank,
            resume_step=self.spec.resume_step, command=" ".join(command[1:]))
        with self.files.output.open("ab") as output:
            # Same process group as the agent: whatever ends the instance ends torchrun too.
            process = subprocess.Popen(command, cwd=self.files.folder, env=torchrun_env(self.files),
                                       stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
        try:
            while process.poll() is None:
                time.sleep(POLL_S)
                self.follow()
                if self.control.superseded(self.spec.attempt):
                    say("attempt superseded: stopping torchrun", attempt=self.spec.attempt)
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise AgentError("the agent's lifetime is over: stopping torchrun")
        finally:
            stop(process)
        self.follow()
        self.report_exit(process.returncode)

    def follow(self) -> None:
        """Heartbeat, progress, commits and Spot notices since the last look."""
        records = self.metrics.new_records()
        # A `finished` record (no loss) is what a trainer resumed at its last step writes instead
        # of step records: it speaks for the world all the same.
        steps = [record for record in records if not record.get("finished")]
        now = time.monotonic()
        if records:
            self.speaks_for_world = True
            self.last_step = records[-1]["step"]
        if steps:
            if self.spec.heartbeat_task_token and now - self.last_heartbeat >= HEARTBEAT_EVERY_S:
                self.control.heartbeat(self.spec.heartbeat_task_token)
                self.last_heartbeat = now
            if now - self.last_progress >= PROGRESS_EVERY_S:
                self.send_progress(steps[-1])
                self.last_progress = now
        # Only after the first record: by then the trainer has deleted the folders of an abandoned
        # timeline (steps newer than its resume point), which must not be announced as this
        # attempt's commits.
        if self.speaks_for_world:
            self.announce_commits()
        if not self.spot_notice_seen and self.metadata.spot_action() is not None:
            self.spot_notice_seen = True
            self.files.checkpoint_request.touch()
            say("spot interruption notice: asked the trainer to checkpoint now", attempt=self.spec.attempt)

    def send_progress(self, record: dict[str, Any]) -> None:
        self.control.send(TrainingProgress(
            run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
            step=record["step"], loss=record["loss"], tokens_per_second=record["tokens_per_s"],
            step_seconds=record["step_time_s"]))

    def announce_commits(self) -> None:
        for step in sorted(catalog.committed_steps(self.checkpoints)):
            if step in self.announced:
                continue
            reason = catalog.read_manifest(self.checkpoints, step).reason
            self.control.send(CheckpointCommitted(
                run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
                step=step, uri=self.checkpoints.step_uri(catalog.step_dir_name(step)),
                reason=CheckpointReason(reason)))
            self.announced.add(step)

    def report_exit(self, returncode: int) -> None:
        base = {"run_name": self.spec.run_name, "attempt": self.spec.attempt,
                "instance_id": self.identity.instance_id}
        if returncode == 0:
            say("torchrun finished", attempt=self.spec.attempt, last_step=self.last_step)
            if self.speaks_for_world:
                latest = max(self.announced, default=None)
                self.control.send(TrainingCompleted(
                    **base, final_step=self.last_step,
                    checkpoint_uri=self.checkpoints.step_uri(catalog.step_dir_name(latest)) if latest else None))
            return
        deadline = time.monotonic() + PEER_LOSS_GRACE_S
        while time.monotonic() < deadline:
            if self.control.superseded(self.spec.attempt):
                say("torchrun failed after the run moved on; not reported", attempt=self.spec.attempt,
                    exit_code=returncode)
                return
            time.sleep(POLL_S)
        output = self.files.output.read_text(errors="replace")[-20 * OUTPUT_TAIL_CHARS:]
        self.control.send(TrainerFailed(**base, kind=failure_kind(output), exit_code=returncode,
                                        message=output[-OUTPUT_TAIL_CHARS:], last_step=self.last_step))


def stop(process: subprocess.Popen) -> None:
    """End torchrun: SIGTERM (it stops its ranks), then SIGKILL (its ranks die with it)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_GRACE_S)


# --- the agent ----------------------------------------------------------------------------

def serve(settings: AgentSettings) -> None:
    deadline = time.monotonic() + settings.lifetime_s if settings.lifetime_s else None
    metadata = MetadataClient()
    identity = metadata.identity()
    control = ControlPlane(settings, identity)
    say("agent up", instance_id=identity.instance_id, instance_type=identity.instance_type,
        private_ip=identity.private_ip, run_name=settings.run_name)
    attempt = wait_for("the run's record of this node", control.node_attempt, deadline)
    control.send(NodeRegistered(run_name=settings.run_name, attempt=attempt, instance_id=identity.instance_id,
                                private_ip=identity.private_ip, availability_zone=identity.availability_zone))
    checks, problem = run_preflight(identity.instance_type)
    if problem:
        control.send(NodeUnhealthy(run_name=settings.run_name, attempt=attempt, instance_id=identity.instance_id,
                                   reason=problem, checks=checks))
    else:
        control.send(NodeReady(run_name=settings.run_name, attempt=attempt, instance_id=identity.instance_id,
                               checks=checks))
    ran = -1
    while True:  # an unhealthy node is never named, and waits here to be terminated
        spec = wait_for("a launch spec naming this node", lambda: control.launch_spec_after(ran), deadline)
        ran = spec.attempt
        Attempt(control, metadata, spec).run(deadline)


def main() -> int:
    try:
        serve(AgentSettings.from_env())
    except AgentError as exc:
        say("agent stopped", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
