"""The node agent: what runs on every instance of a run, between the control plane and torchrun.

    python -m node.agent
        environment: TRAINFLEET_RUN_NAME, TRAINFLEET_RUN_TABLE, TRAINFLEET_LIVENESS_TABLE, TRAINFLEET_BUCKET,
        TRAINFLEET_EVENT_BUS (the user data of trainfleet/adapters/ec2_fleet.py writes them);
        optional TRAINFLEET_SHUTDOWN_COMMAND (how the agent ends its instance, e.g.
        "systemctl poweroff"; unset, it just exits: locally that ends the instance) and
        TRAINFLEET_AGENT_LIFETIME_S (exit after that many seconds; local runs set it) and
        TRAINFLEET_STANDIN_STEP_S (run the stand-in trainer, node/standin.py, on a thread
        of the agent, with steps that many seconds long, in place of torchrun; the local
        cloud's large runs set it)

On EC2 the user data starts it under systemd; in the local cloud the fleet starts it as the
instance's process. It speaks to the control plane only through AWS:

1. identity from the instance metadata (IMDSv2): instance id, type, private IP, zone, region;
2. NodeRegistered once the run has recorded the node;
3. preflight (`python -m node.health`, a subprocess so the agent never imports torch), then
   NodeReady or NodeUnhealthy with the check results;
4. at each look at the control plane (every 5-10 s, drawn; less often in very large runs, so a
   run's read rate stays bounded, and more often with a hang timeout under about 35 s, so a
   silent agent is known silent before a hang is declared: lifecycle.poll_interval) it reads the
   run record: it confirms
   its readiness (NodeReady) for each attempt the run moves to, and once the run trains an
   attempt newer than its last it reads `s3://BUCKET/runs/RUN/launch-spec.json` and, if the spec
   names it, runs torchrun for it: nnodes = the plan's nodes, c10d rendezvous at node rank 0's
   private IP, the trainer config from the spec written to a YAML file, resume as the spec says,
   and in its environment what NCCL needs on this node's type (catalogue.nccl_environment: its error
   handling, and EFA as preflight proved NCCL selects it);
5. while torchrun runs it looks at the trainer's files twice a second (no AWS call), for a Spot
   notice in the metadata service every 5 s (TRAINFLEET_METADATA_LOOK_S), and at the control
   plane at the paced rate: it writes its liveness record (its
   trainer's last step, lifecycle.liveness), asks the trainer for a checkpoint now when the run
   record requests one (a worker's departure was announced) or the metadata service gives a Spot
   notice, and stops torchrun when the run moves to a newer attempt. The agent whose node holds
   global rank 0 (the only one whose trainer writes the metrics file) also heartbeats the Train
   task as steps advance, sends TrainingProgress (every step) and CheckpointCommitted for every
   checkpoint committed to S3 with the reason it was saved, and the fleet check's figures
   (FleetChecked: the trainer measures the world's network before its first step,
   trainer/fleet_check.py; a world below the floor does not train). Before the attempt's first step
   (rendezvous, NCCL set-up, checkpoint load) no trainer writes metrics yet, so the agent of
   node rank 0 heartbeats the start-up, for at most the run's startup timeout after torchrun
   started or after its trainer's last sign of life; a start that falls silent longer is
   declared hung a hang timeout later. Likewise the end: after the final step the agent that
   speaks for the world heartbeats while the trainer saves its final checkpoint and exits, as
   long. The heartbeat's pace is a quarter of the hang timeout, at most 5 s
   (trainfleet.core.pace.heartbeat_pace), and it beats on a thread of its own, judging progress by
   the metrics file's growth and the speaking trainer's signs of life in its progress file (a
   microbatch, a start-up phase: trainer/progress.py), so a slow step is not a hang, only a
   silent world is; and a call of the watch loop waiting out throttling or an outage (botocore
   retries, then the agent's backoff) never delays it, so seconds of a slow control plane are
   not taken for a hang of the world either;
   every agent also times its own trainer's steps, and once it knows the world's cadence it
   sends TrainerHung when its trainer has been silent for HANG_STEPS of the recent median step
   time (at least the run's stall floor: trainfleet.core.pace.hung_after), so a hung world fails
   the Train task seconds after it stopped, not a hang timeout later;
6. torchrun's exit: 0 -> TrainingCompleted; otherwise TrainerFailed with the kind read from its
   output (config error, NaN loss, crash), unless the run has moved on meanwhile: a peer's
   death reaches this node as a crash. EC2's event about a lost peer usually lands within a
   second, so the agent waits that long first and then stays quiet; when it is later, Recover
   still blames the lost instance from its EC2 state. Its liveness record says at once that the
   trainer ended: it cannot be ordered into a repaired world;
7. a world repaired in place (trainer/repair.py; Recover's WorldRepair): a trainer whose step
   failed waits for an order and says so (trainer/repair_order.py), which the agent reports as
   TrainerFailed (a second later, as above); when the run's next attempt repairs this node's
   world and names it a survivor, the agent keeps torchrun, confirms the attempt, and once its
   launch spec is written orders the trainer into it (the store on node rank 0 at the attempt's
   port) and follows that attempt with the same process. A node that joins a repaired world (a
   replacement, or one whose trainer ended) starts `torchrun --standalone` with the order.

A failed control-plane call (throttling, a 5xx answer, a connection error, a timeout) is logged
and tried again at a later look with backoff; it never stops torchrun. When the run is over, or
the control plane has been unreachable for UNREACHABLE_LIMIT_S while its trainer showed no
progress as long, the agent ends its instance (the launch template's shutdown behaviour is
terminate), so no instance outlives its run unwatched. A trainer that makes progress keeps its
node through any outage (a regional DynamoDB outage would otherwise end every node of every run
a quarter of an hour in); an instance its run left behind is the reaper's to end.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import re
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import boto3
import botocore.session
import yaml
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.utils import IMDSFetcher

from node import standin
from node.node_log import NodeLog
from trainer import checkpoint_catalog as catalog
from trainer.progress import NODE_NAME_ENV, NODE_RANK_ENV, PROGRESS_FILE_ENV, read_progress
from trainer.repair_order import REPAIR_ORDER_ENV, RepairOrder, read_failure, write_order
from trainfleet.adapters.liveness import write_liveness
from trainfleet.adapters.run_store import NodeNotFound, RunStore
from trainfleet.core.catalogue import instance_facts, nccl_environment
from trainfleet.core.events import (PROGRESS_SAMPLES_MAX, AgentEvent, CheckpointCommitted, CheckpointReason,
                                    FleetChecked, HealthCheckResult, NodeReady, NodeRegistered, NodeUnhealthy,
                                    ProgressSample, ScalingChecked, StateRestored, TrainerFailed, TrainerHung,
                                    TrainingCompleted, TrainingProgress, instance_arn, put_events_entry)
from trainfleet.core.lifecycle import checkpoint_request_answered, poll_interval
from trainfleet.core.node_access import node_log_stream
from trainfleet.core.pace import CADENCE_WINDOW, LAUNCH_SPEC_POLL_S, heartbeat_pace, hung_after, longest_look, stalled
from trainfleet.core.records import (FleetCheckFigures, LaunchSpec, NodeLiveness, NodeRecord, RunRecord, RunState,
                                     ScalingCheckFigures, StateRestoredFigures, TrainerFailureKind)
from trainfleet.core.runspec import HOST_MEMORY_DIR

LOOK_S = 0.5
"""How often the agent looks at what is on the node: the trainer's files."""
METADATA_LOOK_S = 5.0
"""How often the agent asks the metadata service for a Spot notice: every 5 s, as AWS recommends
(the notice comes two minutes ahead). TRAINFLEET_METADATA_LOOK_S sets another pace: the local
cloud's notices are as much shorter as its time is scaled."""
RETRY_MAX_S = 60.0
"""Longest wait before a failed control-plane call is tried again (backoff doubles up to it, or
up to the run's longest look, if that is shorter)."""
UNREACHABLE_LIMIT_S = 900.0
"""Control plane unreachable this long, and the node's trainer silent as long: nothing can tell
the agent its run is over, so it ends its instance rather than leave it running unwatched."""
CLIENT_RETRIES = {"max_attempts": 5, "mode": "standard"}
"""botocore's own quick retries of a throttled or failed call, before the agent's backoff."""
TRANSIENT_ERRORS = (ClientError, BotoCoreError)
"""What a control-plane call fails with once botocore's own retries are spent (throttling, 5xx,
connection errors, timeouts, a refused call): logged and tried again later, never fatal."""
PROGRESS_EVERY_S = 10.0
"""Least time between two reports of TrainingProgress (CloudWatch gets each as metrics)."""
PEER_LOSS_GRACE_S = 1.0
"""How long a failed trainer waits for the run to move on before it reports the failure: EC2's
event about a lost peer, on its way when the peer's death broke this world, usually moves it on
by then. Only noise is saved: Recover names a lost instance from its EC2 state either way."""
HEALTH_TIMEOUT_S = 300
"""Longest preflight; beyond it the node is unhealthy."""
RENDEZVOUS_JOIN_TIMEOUT_S = 300
"""How long torchrun waits for all nodes to join the rendezvous before it gives up."""
STOP_GRACE_S = 30.0
"""How long torchrun gets to stop its ranks after SIGTERM before it is killed."""
OUTPUT_TAIL_CHARS = 2000
"""How much of torchrun's output a TrainerFailed event carries (after the exceptions it raised
above that tail: failure_message)."""
RAISED_CHARS = 1000
"""How much of a TrainerFailed message the exceptions above its tail may take."""
EXCEPTION_LINE = re.compile(r"^(?:\[[^\]\n]*\]:?[ \t]*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)\b.*)$",
                            re.MULTILINE)
"""A traceback's last line (a rank's prefix, such as "[rank1]:", allowed): the exception raised."""
METADATA_PATIENCE_S = 600.0
"""How long the agent keeps asking the metadata service for its identity at boot: right after
boot, or throttled, it may not answer at once (botocore's fetcher gives up after a few seconds)."""

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
    liveness_table: str
    """DynamoDB table the agent writes its liveness record to (TRAINFLEET_LIVENESS_TABLE)."""
    bucket: str
    """The stack's bucket: launch specs and checkpoints (TRAINFLEET_BUCKET)."""
    event_bus: str
    """The agents' EventBridge bus (TRAINFLEET_EVENT_BUS)."""
    workdir: Path
    """Where attempts keep their config, output and metrics (the working directory)."""
    lifetime_s: float | None
    """Exit after this many seconds (TRAINFLEET_AGENT_LIFETIME_S); None = run until terminated.
    Local runs set it so that no agent outlives its test or demo."""
    shutdown_command: tuple[str, ...] = ()
    """How the agent ends its instance when the run is over (TRAINFLEET_SHUTDOWN_COMMAND, e.g.
    "systemctl poweroff"); empty: the agent exits, which ends a local instance."""
    standin_step_s: float | None = None
    """Seconds a step of the stand-in trainer takes (TRAINFLEET_STANDIN_STEP_S); set, the agent
    runs node/standin.py instead of torchrun and a stand-in preflight: no torch on the node,
    the same signals to the control plane. None: the real trainer."""
    metadata_look_s: float = METADATA_LOOK_S
    """Seconds between two looks for a Spot notice (TRAINFLEET_METADATA_LOOK_S)."""
    unreachable_limit_s: float = UNREACHABLE_LIMIT_S
    """How long the control plane may be out of reach, with the trainer silent as long, before
    the agent ends its instance (TRAINFLEET_UNREACHABLE_LIMIT_S; bench/outage.py sets it lower)."""
    log_group: str | None = None
    """The CloudWatch Logs group the node's log goes to (TRAINFLEET_NODE_LOG_GROUP,
    node/node_log.py); None: the console alone."""
    host_memory_dir: Path = Path(HOST_MEMORY_DIR)
    """The node's host-memory folder, under the node's filesystem root (TRAINFLEET_ROOT, unset on
    EC2: a local instance's own folder): the trainer keeps its in-memory checkpoints under
    RUN_NAME in it (trainer/memory_checkpoint.py)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ, workdir: Path | None = None) -> AgentSettings:
        names = {"run_name": "TRAINFLEET_RUN_NAME", "run_table": "TRAINFLEET_RUN_TABLE",
                 "liveness_table": "TRAINFLEET_LIVENESS_TABLE", "bucket": "TRAINFLEET_BUCKET",
                 "event_bus": "TRAINFLEET_EVENT_BUS"}
        missing = [variable for variable in names.values() if not env.get(variable)]
        if missing:
            raise AgentError(f"missing environment variable(s): {', '.join(missing)}")
        return cls(**{field: env[variable] for field, variable in names.items()},
                   workdir=workdir or Path.cwd(), lifetime_s=_seconds(env, "TRAINFLEET_AGENT_LIFETIME_S"),
                   shutdown_command=tuple(shlex.split(env.get("TRAINFLEET_SHUTDOWN_COMMAND", ""))),
                   standin_step_s=_seconds(env, "TRAINFLEET_STANDIN_STEP_S"),
                   metadata_look_s=_seconds(env, "TRAINFLEET_METADATA_LOOK_S") or METADATA_LOOK_S,
                   unreachable_limit_s=_seconds(env, "TRAINFLEET_UNREACHABLE_LIMIT_S") or UNREACHABLE_LIMIT_S,
                   log_group=env.get("TRAINFLEET_NODE_LOG_GROUP") or None,
                   host_memory_dir=Path(env.get("TRAINFLEET_ROOT") or "/", HOST_MEMORY_DIR.lstrip("/")))


def _seconds(env: dict[str, str] | os._Environ, variable: str) -> float | None:
    """A positive number of seconds from the environment, None when unset."""
    raw = env.get(variable)
    try:
        seconds = float(raw) if raw else None
    except ValueError:
        seconds = -1.0
    if seconds is not None and seconds <= 0:
        raise AgentError(f"{variable} must be a positive number of seconds, got {raw!r}")
    return seconds


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
    account_id: str
    """dynamic/instance-identity/document's accountId."""
    partition: str = "aws"
    """meta-data/services/partition."""

    @property
    def arn(self) -> str:
        """The instance's ARN: the sender named in every event it sends (the node role lets it
        put events with that source alone)."""
        return instance_arn(self.partition, self.region, self.account_id, self.instance_id)


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
            try:
                response = self._get_request(f"latest/{path}", retry_func=lambda reply: reply.status_code >= 500,
                                             token=self._token)
            except self._RETRIES_EXCEEDED_ERROR_CLS:
                raise AgentError(f"instance metadata latest/{path}: no answer after retries") from None
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

        document = self.read("dynamic/instance-identity/document")
        if not document:
            raise AgentError("instance metadata has no dynamic/instance-identity/document")
        return Identity(instance_id=required("instance-id"), instance_type=required("instance-type"),
                        private_ip=required("local-ipv4"),
                        availability_zone=required("placement/availability-zone"),
                        region=required("placement/region"), account_id=json.loads(document)["accountId"],
                        partition=required("services/partition"))

    def spot_action(self) -> dict[str, Any] | None:
        """The Spot interruption notice, once EC2 has given one."""
        document = self.read("meta-data/spot/instance-action")
        return json.loads(document) if document else None


# --- the control plane, as the agent reaches it -------------------------------------------

class Unreachable(AgentError):
    """The control plane did not answer for UNREACHABLE_LIMIT_S."""


class ControlPlane:
    """The AWS calls the agent makes: events, launch specs, records, liveness, the Train task.

    Looks are paced (`take_look`, lifecycle.poll_interval); every call goes through `call`,
    which turns a failure into None, logs it and backs off, so no single error stops training.
    """

    def __init__(self, settings: AgentSettings, identity: Identity,
                 clock: Callable[[], float] = time.monotonic, draw: Callable[[], float] = random.random):
        self.settings, self.identity = settings, identity
        self.clock, self.draw = clock, draw
        config = Config(region_name=identity.region, retries=CLIENT_RETRIES, connect_timeout=5, read_timeout=30)
        self.events = boto3.client("events", config=config)
        self.s3 = boto3.client("s3", config=config)
        self.sfn = boto3.client("stepfunctions", config=config)
        self.store = RunStore(boto3.client("dynamodb", config=config), settings.run_table)
        self.run_nodes = 1
        """The run's node count (workers and spares): the pace of the looks depends on it."""
        self.hang_timeout_s = math.inf
        """The run's hang timeout, and so the pace of the looks, once a look read the run record
        (unknown before: the usual pace)."""
        self.stepping = False
        """Whether this node's trainer steps now (Attempt.follow): the looks are paced by the
        run's size then, and at the full rate otherwise (trainfleet.core.pace)."""
        self.next_look = 0.0
        self.next_spec_read = -math.inf
        """clock() when read_launch_spec_soon reads the launch spec next."""
        self.failures = 0
        self.failing_since: float | None = None
        self.trainer_alive_at = -math.inf
        """clock() when this node's trainer last showed progress (the attempt's heartbeat thread
        sets it): while it does, no outage ends the instance."""

    # --- pacing and failures ---

    def take_look(self) -> bool:
        """Whether a look at the control plane is due now; if so, the next one is paced."""
        if self.clock() < self.next_look:
            return False
        self.next_look = self.clock() + self.pace()
        return True

    def pace(self) -> float:
        return poll_interval(self.run_nodes, self.draw(), self.hang_timeout_s, stepping=self.stepping)

    def pace_for(self, stepping: bool) -> None:
        """Looks paced for a trainer that steps or not; one that stops stepping (stalled, ended)
        brings the next look forward to the full rate: the run may be moving on without it."""
        was, self.stepping = self.stepping, stepping
        if was and not stepping:
            self.next_look = min(self.next_look, self.clock() + self.pace())

    def call(self, what: str, action: Callable[[], T]) -> T | None:
        """`action()`, or None when it failed: the failure is logged, the next look backs off,
        and one that outlasts UNREACHABLE_LIMIT_S, with the trainer silent as long, raises
        Unreachable."""
        try:
            result = action()
        except TRANSIENT_ERRORS as exc:
            now = self.clock()
            self.failures += 1
            self.failing_since = self.failing_since if self.failing_since is not None else now
            # Never beyond the paced look: an agent silent for a few looks counts as lost
            # (lifecycle.liveness), and one look a pace is the load the pace allows anyway.
            longest = longest_look(self.run_nodes, self.hang_timeout_s)
            wait = min(RETRY_MAX_S, 2.0 ** min(self.failures, 8), longest) * (0.5 + self.draw() / 2)
            self.next_look = max(self.next_look, now + wait)
            say("control plane call failed; trying again later", call=what, error=str(exc),
                failures=self.failures, retry_in_s=round(wait, 1))
            if min(now - self.failing_since, now - self.trainer_alive_at) > self.settings.unreachable_limit_s:
                raise Unreachable(f"the control plane has not answered for {now - self.failing_since:.0f} s "
                                  "and this node's trainer made no progress as long") from exc
            return None
        self.failures, self.failing_since = 0, None
        return result

    def look_at_run(self) -> RunRecord | None:
        """The run record, when a look is due and it could be read; paces the next look."""
        if not self.take_look():
            return None
        run = self.call("read the run record", lambda: self.store.run(self.settings.run_name, consistent=False))
        if run is not None:
            self.run_nodes = run.spec.node_count + run.spec.spare_count
            self.hang_timeout_s = run.spec.recovery.hang_timeout_seconds
        return run

    # --- calls ---

    def send(self, detail: AgentEvent) -> bool:
        """Put the event on the agents' bus; False when it could not be sent (try again later)."""
        response = self.call(f"send {detail.DETAIL_TYPE.value}", lambda: self.events.put_events(
            Entries=[put_events_entry(detail, self.settings.event_bus, self.identity.arn)]))
        if response is None:
            return False
        if response["FailedEntryCount"]:
            say(f"PutEvents refused {detail.DETAIL_TYPE.value}; trying again later", entries=response["Entries"])
            return False
        say(f"sent {detail.DETAIL_TYPE.value}", **detail.model_dump(mode="json", exclude={"run_name"}))
        return True

    def until_done(self, what: str, attempt: Callable[[], T | None], deadline: float | None) -> T:
        """`attempt()` (which makes its calls through `call`) again at the pace `call` sets after
        a failure, until it gives something."""
        while (result := attempt()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise AgentError(f"gave up trying to {what}: the agent's lifetime is over")
            time.sleep(max(LOOK_S, self.next_look - self.clock()))
        return result

    def deliver(self, detail: AgentEvent, deadline: float | None) -> None:
        """Send an event that must arrive (a node's state, an attempt's end), however long it takes."""
        self.until_done(f"send {detail.DETAIL_TYPE.value}", lambda: self.send(detail) or None, deadline)

    def node(self) -> NodeRecord | None:
        """The run's record of this node, once Allocate or Recover wrote it."""
        def read() -> NodeRecord | None:
            try:
                return self.store.node(self.settings.run_name, self.identity.instance_id)
            except NodeNotFound:
                return None
        return self.call("read this node's record", read)

    def launch_spec_after(self, attempt: int) -> LaunchSpec | None:
        """The launch spec, if it is of a newer attempt than `attempt` and names this node."""
        key = f"runs/{self.settings.run_name}/launch-spec.json"

        def read() -> bytes | None:
            try:
                return self.s3.get_object(Bucket=self.settings.bucket, Key=key)["Body"].read()
            except self.s3.exceptions.NoSuchKey:
                return None
        raw = self.call("read the launch spec", read)
        if raw is None:
            return None
        spec = LaunchSpec.model_validate_json(raw)
        return spec if spec.attempt > attempt and self.identity.instance_id in spec.node_ranks else None

    def read_launch_spec_soon(self, attempt: int) -> LaunchSpec | None:
        """launch_spec_after(attempt), read between the looks at most every LAUNCH_SPEC_POLL_S: what
        the agents a world repaired in place waits for, and the idle agents of a training run, read
        so that the repair waits on none of their looks."""
        now = self.clock()
        if now < self.next_spec_read:
            return None
        self.next_spec_read = now + LAUNCH_SPEC_POLL_S
        return self.launch_spec_after(attempt)

    def report_liveness(self, record: NodeLiveness) -> None:
        self.call("write the liveness record", lambda: write_liveness(
            self.store.db, self.settings.liveness_table, self.settings.run_name, record))

    def heartbeat(self, token: str) -> None:
        """SendTaskHeartbeat, from the attempt's heartbeat thread. A failure is logged and the next
        beat tries again; it neither paces the looks nor counts toward UNREACHABLE_LIMIT_S, which
        the watch loop's own calls judge."""
        try:
            self.sfn.send_task_heartbeat(taskToken=token)
        except (self.sfn.exceptions.TaskTimedOut, self.sfn.exceptions.InvalidToken,
                self.sfn.exceptions.TaskDoesNotExist) as exc:
            # The task is over; the run record tells the attempt loop so at its next look.
            say("heartbeat refused", error=type(exc).__name__)
        except TRANSIENT_ERRORS as exc:
            say("heartbeat failed; beating again at the next pace", error=str(exc))


def say(message: str, /, **fields: Any) -> None:
    """One JSON line on stdout (the instance's console) and in the node's log: what the agent did."""
    line = json.dumps({"agent": message, **fields}, default=str)
    print(line, flush=True)
    if _shipping is not None:
        _shipping.log.add("agent", line)


@dataclass(frozen=True)
class Shipping:
    """The node's log and the thread that ships it (node/node_log.py)."""

    log: NodeLog
    stop: threading.Event
    thread: threading.Thread


_shipping: Shipping | None = None


def start_node_log(settings: AgentSettings, identity: Identity) -> None:
    """Ship what the agent says and its trainers print to the stack's node log group."""
    global _shipping
    if settings.log_group is None:
        return
    logs = boto3.client("logs", config=Config(region_name=identity.region, retries=CLIENT_RETRIES,
                                              connect_timeout=5, read_timeout=30))
    log = NodeLog(logs, settings.log_group, node_log_stream(settings.run_name, identity.instance_id))
    stop = threading.Event()
    thread = threading.Thread(target=log.run, args=(stop,), name="node-log", daemon=True)
    _shipping = Shipping(log, stop, thread)
    thread.start()


def stop_node_log() -> None:
    """Ship what is left, once: before the instance ends."""
    global _shipping
    shipping, _shipping = _shipping, None
    if shipping is not None:
        shipping.stop.set()
        shipping.thread.join(timeout=30.0)


def wait_for(what: str, probe: Callable[[], T | None], deadline: float | None, control: ControlPlane) -> T:
    """`probe()` at each look at the control plane until it finds something."""
    while deadline is None or time.monotonic() < deadline:
        if control.take_look():
            found = probe()
            if found is not None:
                return found
        time.sleep(LOOK_S)
    raise AgentError(f"gave up waiting for {what}: the agent's lifetime is over")


# --- preflight ----------------------------------------------------------------------------

def standin_preflight() -> tuple[list[HealthCheckResult], str | None]:
    """With the stand-in trainer nothing on the node is probed: one check, skipped, says so."""
    return [HealthCheckResult(name="preflight", passed=False, skipped=True,
                              detail="stand-in trainer (TRAINFLEET_STANDIN_STEP_S): the node's devices and "
                                     "network are not probed")], None


def run_preflight(instance_type: str) -> tuple[list[HealthCheckResult], str | None]:
    """The checks and, when the node must not train, why."""
    command = [sys.executable, "-m", "node.health", "--instance-type", instance_type]
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

    @property
    def progress(self) -> Path:
        return self.folder / "progress"

    @property
    def repair_order(self) -> Path:
        """Where the agent orders a running trainer into a repaired world (trainer/repair_order.py)."""
        return self.folder / "repair-order.json"

    def check_result(self, check: str) -> Path:
        """Where global rank 0 writes the result of one of WORLD_CHECKS."""
        return self.folder / f"{check.replace('_', '-')}.json"


def fleet_check_figures(result: dict[str, Any], attempt: int) -> FleetCheckFigures:
    """The figures of trainer/fleet_check.py's result file."""
    slowest = result["slowest_link"]
    return FleetCheckFigures(
        attempt=attempt, passed=result["passed"], busbw_gbytes_per_s=result["busbw_gbytes_per_s"],
        floor_gbytes_per_s=result["floor_gbytes_per_s"],
        slowest_link_gbytes_per_s=slowest["gbytes_per_s"] if slowest else None,
        slowest_link=[slowest["source"], slowest["target"]] if slowest else [],
        slow_instance_ids=result["slow_nodes"], seconds=result["seconds"])


def scaling_check_figures(result: dict[str, Any], attempt: int) -> ScalingCheckFigures:
    """The figures of trainer/scaling_check.py's result file."""
    return ScalingCheckFigures(
        attempt=attempt, passed=result["passed"], efficiency=result["efficiency"],
        efficiency_floor=result["efficiency_floor"], step_seconds=result["step_seconds"],
        expected_step_seconds=result["expected_step_seconds"], tokens_per_second=result["tokens_per_second"],
        expected_tokens_per_second=result["expected_tokens_per_second"], steps=result["steps"],
        slowest_stages=result["slowest_stages"], slowest_stage_seconds=result["slowest_stage_seconds"],
        slowest_stage_instance_ids=result["slowest_stage_nodes"], slowest_rank=result["slowest_rank"],
        slowest_rank_instance_id=result["slowest_rank_node"], slowest_rank_seconds=result["slowest_rank_seconds"],
        slow_instance_ids=result["slow_nodes"])


def restore_figures(result: dict[str, Any], attempt: int) -> StateRestoredFigures:
    """The figures of trainer/train.py restore's result file."""
    return StateRestoredFigures(attempt=attempt, **result)


WORLD_CHECKS: dict[str, tuple[Callable[[dict[str, Any], int], Any], type[AgentEvent]]] = {
    "fleet_check": (fleet_check_figures, FleetChecked),
    "scaling_check": (scaling_check_figures, ScalingChecked),
    "checkpoint": (restore_figures, StateRestored),
}
"""Results about the whole world that global rank 0 writes on its node, by their trainer config
section (whose result_file the agent sets): the world checks, and where the resumed state came
from; what the agent makes of the result, and the event that carries it."""


def progress_samples(records: list[dict[str, Any]]) -> list[ProgressSample]:
    """The steps of metrics records."""
    return [ProgressSample(step=record["step"], loss=record["loss"], tokens_per_second=record["tokens_per_s"],
                           step_seconds=record["step_time_s"], at=datetime.fromtimestamp(record["time"], timezone.utc))
            for record in records]


def trainer_config(spec: LaunchSpec, files: AttemptFiles, host_memory: Path) -> dict[str, Any]:
    """The spec's trainer config with this attempt's metrics file, the node's host-memory folder
    for the run's in-memory checkpoints, and the spec's resume point."""
    config = json.loads(json.dumps(spec.trainer_config))  # a deep copy
    config.setdefault("training", {})["metrics_file"] = str(files.metrics)
    for check in WORLD_CHECKS.keys() & config.keys():
        config[check]["result_file"] = str(files.check_result(check))
    checkpoint = config.setdefault("checkpoint", {})
    checkpoint["memory_dir"] = str(host_memory / spec.run_name)
    checkpoint["memory_resume"] = spec.restore_from_memory
    if spec.repairable:
        # The control plane ends a trainer it does not repair: the wait is as long as it gives a
        # world to form.
        config.setdefault("parallel", {}).update(repair_file=str(files.repair_order),
                                                 repair_wait_s=spec.startup_timeout_seconds)
    if spec.repair:
        # Where the survivors resume (trainer/train.py _repair): the newest step in memory or S3.
        checkpoint["resume"] = "latest"
    elif spec.resume_step is not None:
        checkpoint["resume"] = str(spec.resume_step)
    elif spec.attempt > 0:
        # A checkpoint may have committed after the control plane chose the resume point (its
        # event still on the way); "none" would refuse that location, "latest" takes it.
        checkpoint["resume"] = "latest"
    return config


def torchrun_command(spec: LaunchSpec, node_rank: int, identity: Identity, files: AttemptFiles) -> list[str]:
    plan = spec.plan
    if spec.repair:
        # A node joining a repaired world: its trainer meets the others at the order's store, and
        # torchrun only supervises this node's processes. (Joining the survivors' rendezvous would
        # restart their workers.)
        return [sys.executable, "-m", "node.torchrun", "--standalone", f"--nproc-per-node={plan.ranks_per_node}",
                "--max-restarts=0", "--monitor-interval=1", "-m", "trainer.worker", "--config", str(files.config)]
    # read_timeout bounds a peer's wait for the host's store to listen (torch's default: 60 s): a
    # host whose torchrun starts late (a replacement still booting its software, a loaded node)
    # must not crash its peers' launches, as late as the join itself may be.
    rendezvous = {"is_host": "true" if node_rank == 0 else "false", "join_timeout": RENDEZVOUS_JOIN_TIMEOUT_S,
                  "read_timeout": RENDEZVOUS_JOIN_TIMEOUT_S}
    return [sys.executable, "-m", "node.torchrun",
            f"--nnodes={plan.nodes}", f"--nproc-per-node={plan.ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rendezvous_host}:{spec.rendezvous_port}",
            f"--rdzv-id={spec.rendezvous_id}",
            "--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in rendezvous.items()),
            f"--local-addr={identity.private_ip}", "--max-restarts=0", "--monitor-interval=1",
            "-m", "trainer.worker", "--config", str(files.config)]


def standin_command(spec: LaunchSpec, node_rank: int, step_seconds: float, files: AttemptFiles) -> list[str]:
    """The stand-in trainer in torchrun's place (node/standin.py): a thread of the agent."""
    return [sys.executable, "-m", "node.standin", "--config", str(files.config), f"--node-rank={node_rank}",
            f"--nodes={spec.plan.nodes}", f"--step-seconds={step_seconds}",
            f"--rendezvous={spec.rendezvous_host}:{spec.rendezvous_port}",
            f"--join-timeout-s={RENDEZVOUS_JOIN_TIMEOUT_S}"]


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, for torchrun and its ranks
    to inherit; the soft limit now. A gloo group holds a socket to every other rank (4,095 in a
    world of 4,096) beside NCCL's, the data's and the uploads' files, where a service's soft limit
    is 1,024 by default. The node's unit sets both limits (ec2_fleet.node_user_data); started
    otherwise, the agent still takes all its hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_process(command: list[str], folder: Path, env: dict[str, str], output: BinaryIO) -> subprocess.Popen:
    # Same process group as the agent: whatever ends the instance ends torchrun too.
    return subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=output,
                            stderr=subprocess.STDOUT)


def torchrun_env(files: AttemptFiles, identity: Identity, node_rank: int) -> dict[str, str]:
    """The agent's environment, plus what NCCL needs on this node's type (its error handling; EFA
    as preflight proved NCCL selects it, but for NCCL's log: warnings only), the attempt's files,
    the node's name and its rank in the launch spec (where its in-memory checkpoints' buddy is:
    trainer/memory_checkpoint.py)."""
    return {**os.environ,
            **nccl_environment(instance_facts(identity.instance_type), os.environ),
            # The rendezvous store is not shared with the ranks' process group: with gloo, a
            # shared one made the first restart fail on stale peer addresses (DESIGN.md, 7).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            catalog.REQUEST_FILE_ENV: str(files.checkpoint_request),
            PROGRESS_FILE_ENV: str(files.progress),
            NODE_NAME_ENV: identity.instance_id,
            NODE_RANK_ENV: str(node_rank),
            REPAIR_ORDER_ENV: str(files.repair_order)}


def failure_message(output: str) -> str:
    """What a TrainerFailed event says of torchrun's output: its tail, led by the exceptions
    raised above it. The error that ends torchrun is the last of a chain whose first names the
    cause (the store that could not listen, the rank that crashed), often further up than a tail
    reaches."""
    tail = output[-OUTPUT_TAIL_CHARS:]
    raised = [line for line in dict.fromkeys(EXCEPTION_LINE.findall(output[:-OUTPUT_TAIL_CHARS]))
              if line not in tail]
    if not raised:
        return tail
    lead = "raised above: " + " | ".join(raised)
    if len(lead) > RAISED_CHARS:
        lead = lead[:RAISED_CHARS - 3] + "..."
    return f"{lead}\n...\n{tail}"


def failure_kind(output: str) -> TrainerFailureKind:
    """Why the trainer failed, from its output (torchrun's own exit code is 1 for all of them)."""
    if "config error:" in output:
        return TrainerFailureKind.CONFIG
    if "NonFiniteLossError" in output:
        return TrainerFailureKind.NAN_LOSS
    return TrainerFailureKind.CRASH


@dataclass(frozen=True)
class Life:
    """What a node's trainer files show of its life at one look: the metrics file's size (global
    rank 0 appends a record a step) and the progress file's identity (its local rank 0 replaces
    it whole at every sign of life)."""

    metrics_size: int = 0
    progress: tuple[int, int] | None = None

    @classmethod
    def of(cls, files: AttemptFiles) -> Life:
        try:
            metrics_size = files.metrics.stat().st_size
        except FileNotFoundError:
            metrics_size = 0
        try:
            written = files.progress.stat()
        except FileNotFoundError:
            return cls(metrics_size)
        return cls(metrics_size, (written.st_ino, written.st_mtime_ns))


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
    """torchrun for one launch spec on this node, and what the agent reports about it; the
    attempts after it whose worlds repair its world in place, which its trainer joins with the
    processes it has (trainer/repair.py)."""

    def __init__(self, control: ControlPlane, metadata: MetadataClient, spec: LaunchSpec,
                 confirm: Callable[[int], bool], deadline: float | None = None):
        """`confirm(attempt)` confirms this node for a newer attempt (NodeReady), and says whether it is."""
        self.control, self.metadata, self.spec, self.confirm, self.deadline = control, metadata, spec, confirm, deadline
        self.identity = control.identity
        self.world = spec.repair.launched_attempt if spec.repair else spec.attempt
        """The attempt whose launch formed the world this node's trainer is in (a repair keeps it)."""
        self.launched_with = frozenset(spec.node_ranks)
        """The nodes whose torchrun this node's torchrun met (its rendezvous)."""
        self.generation = spec.repair.generation if spec.repair else 0
        """The repairs of that world this node's trainer was ordered into."""
        self.failure_said = -1
        """The last generation whose failed step the agent reported."""
        self.failure_seen_at: float | None = None
        self.failed_step: dict[str, Any] | None = None
        """What this node's trainer said of its world's failed step (trainer/repair_order.py), while it waits."""
        self.trainer_pid: int | None = None
        """torchrun's process (the stand-in's: the agent's own)."""
        self.repair_pending: int | None = None
        """The attempt that repairs this node's world and keeps its trainer, until its launch spec is read."""
        self.run_seen: RunRecord | None = None
        """The run record at the last look."""
        self.node_rank = spec.node_ranks[self.identity.instance_id]
        self.files = AttemptFiles(control.settings.workdir / f"attempt-{spec.attempt}")
        self.metrics = MetricsFollower(self.files.metrics)
        self.checkpoints = catalog.open_store(spec.trainer_config["checkpoint"]["uri"], control.s3)
        committed = control.until_done("list the committed checkpoints", lambda: control.call(
            "list the committed checkpoints", lambda: catalog.committed_steps(self.checkpoints)), deadline)
        self.announced = announced_before(spec, committed)
        self.last_step: int | None = None
        self.speaks_for_world = False  # set once this node's trainer writes metrics (global rank 0)
        self.heartbeat_every = heartbeat_pace(spec.hang_timeout_seconds)
        self.torchrun_started: float | None = None  # control.clock() when torchrun was started
        self.stepped = False  # whether this node saw a step of this attempt (metrics or its progress)
        self.final_step = spec.trainer_config.get("training", {}).get("steps")
        self.finished: float | None = None  # control.clock() when the metrics showed the final step
        self.last_heartbeat = self.last_progress = -math.inf
        self.unsent_steps: list[tuple[int, dict[str, Any]]] = []
        """Metrics records of steps no TrainingProgress carried yet, each with the attempt that
        trained it: a world repaired in place goes on writing the same file in the next attempt."""
        self.beaten = Life()
        """What the trainer's files showed at the last heartbeat."""
        self.seen = Life()
        """What they showed at the heartbeat thread's last look."""
        self.alive_at = -math.inf
        """control.clock() when the heartbeat thread last saw them change: the trainer's last sign of life."""
        self.watched = Life()
        self.watched_alive_at = -math.inf
        """The same, as the watch loop sees them at its looks: what a hang is judged by. The heartbeat
        thread's view stalls while a heartbeat call waits out a slow control plane."""
        self.watched_alive_wall: datetime | None = None
        """That moment in wall-clock time, for the liveness record (NodeLiveness.alive_at)."""
        self.spot_notice_seen = False
        self.next_metadata_look = -math.inf
        self.commit_awaited_after: int | None = None
        """The last step when a checkpoint was asked for, until a later commit is announced."""
        self.metadata_failing = False
        self.checkpoint_request_seen: datetime | None = None
        self.node_step: int | None = None  # this node's trainer's last step (its progress file)
        self.node_step_at: datetime | None = None
        self.progress_changes = 0  # how often its progress file changed
        self.node_stepped_at = -math.inf  # control.clock() when it changed last
        self.node_step_s: float | None = None  # the time a step took, from the last two changes
        self.step_seconds: deque[float] = deque(maxlen=CADENCE_WINDOW)
        """node_step_s at each look that saw steps, oldest first: the world's cadence (pace.hung_after)."""
        self.hang_declared = False
        self.checks_reported: set[str] = set()
        """WORLD_CHECKS whose result the control plane took."""

    def run(self) -> RunRecord | None:
        """Run torchrun until it exits or the run leaves this attempt; the run record that showed
        the run had left it, if that is what ended it."""
        self.files.folder.mkdir(parents=True, exist_ok=True)
        self.files.config.write_text(yaml.safe_dump(
            trainer_config(self.spec, self.files, self.control.settings.host_memory_dir), sort_keys=False))
        if self.spec.repair:  # this node joins a repaired world (a replacement, or its trainer ended): with the order
            write_order(self.files.repair_order, repair_order(self.spec))
        step_seconds = self.control.settings.standin_step_s
        command = (standin_command(self.spec, self.node_rank, step_seconds, self.files) if step_seconds
                   else torchrun_command(self.spec, self.node_rank, self.identity, self.files))
        # Reported before torchrun starts: a peer's trainer can train only once this node's torchrun
        # joined, so a node without a report while its peers trained has an agent that went silent.
        self.report_liveness()
        self.torchrun_started = self.control.clock()
        launch = standin.start_thread if step_seconds else start_process
        if _shipping is not None:
            _shipping.log.follow("trainer", self.files.output)
        with self.files.output.open("ab") as output:
            process = launch(command, self.files.folder, torchrun_env(self.files, self.identity, self.node_rank),
                             output)
        self.trainer_pid = process.pid
        say("starting torchrun", attempt=self.spec.attempt, node_rank=self.node_rank,
            resume_step=self.spec.resume_step, command=" ".join(command[1:]), pid=process.pid)
        stop_beating = threading.Event()
        threading.Thread(target=self.beat_until, args=(stop_beating,), name="heartbeat", daemon=True).start()
        try:
            while process.poll() is None:
                time.sleep(LOOK_S)
                self.follow()
                self.report_failed_step()
                run = self.control.look_at_run()
                self.run_seen = run or self.run_seen
                if run is not None and self.left_behind(run) and not self.awaits_repair(run):
                    say("attempt superseded: stopping torchrun", attempt=self.spec.attempt)
                    return run
                if run is not None and not self.left_behind(run):
                    self.look(run)
                if self.repair_pending is not None and not self.take_repaired_spec():
                    say("attempt superseded, not repaired in place: stopping torchrun", attempt=self.spec.attempt)
                    return self.run_seen
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise AgentError("the agent's lifetime is over: stopping torchrun")
        finally:
            self.control.pace_for(stepping=False)
            stop_beating.set()
            stop(process)
            self.follow()
            # The steps since the last TrainingProgress belong to the run's history, also those
            # of an attempt the run has left.
            self.send_progress()
        self.report_exit(process.returncode)
        return None

    def left_behind(self, run: RunRecord) -> bool:
        """Whether the run has left this attempt (a failure moved it on, or it finished)."""
        return run.attempt > self.spec.attempt or run.state.is_final

    def awaits_repair(self, run: RunRecord) -> bool:
        """Whether the run, having left this attempt, repairs this node's world in place and keeps
        its trainer (Recover's WorldRepair): the node confirms the new attempt and reads its
        launch spec as soon as it is written (take_repaired_spec). False when the trainer is to stop."""
        repair = run.repair
        if (run.state.is_final or repair is None or repair.launched_attempt != self.world
                or repair.generation <= self.generation or self.identity.instance_id not in repair.survivor_ids
                or not self.confirm(run.attempt)):
            return False
        self.repair_pending = run.attempt
        return True

    def take_repaired_spec(self) -> bool:
        """Read the pending repair's launch spec (ControlPlane.read_launch_spec_soon) and, once it
        is there, order the trainer into the repaired world and follow that attempt. False when the
        spec turned out not to repair this node's world: the trainer is to stop."""
        spec = self.control.read_launch_spec_soon(self.spec.attempt)
        if spec is None or spec.attempt != self.repair_pending:
            return True  # not written yet (a newer attempt is the run record's to tell)
        if spec.repair is None or self.identity.instance_id not in spec.repair.survivor_ids:
            return False
        say("repairing the world in place: the trainer keeps its processes", attempt=spec.attempt,
            generation=spec.repair.generation, node_rank=spec.node_ranks[self.identity.instance_id],
            pid=self.trainer_pid)
        for check in WORLD_CHECKS:  # the repaired world writes its own (its restore)
            self.files.check_result(check).unlink(missing_ok=True)
        self.checks_reported.clear()
        self.send_progress()  # the failed attempt's last steps, ahead of the new one's
        self.spec, self.generation = spec, spec.repair.generation
        self.announced |= announced_before(spec, self.control.call(
            "list the committed checkpoints", lambda: catalog.committed_steps(self.checkpoints)) or ())
        write_order(self.files.repair_order,
                    repair_order(spec, launch_nodes_gone=len(self.launched_with - set(spec.repair.survivor_ids))))
        self.report_liveness()
        self.repair_pending = None
        return True

    def report_failed_step(self) -> None:
        """TrainerFailed once for a failed step of this node's world whose ranks wait for a repair
        order (trainer/repair_order.py): the trainer does not exit, so its exit cannot report it.
        As with an exit, after PEER_LOSS_GRACE_S: EC2's event about a lost peer usually moves the
        run on first, and then this attempt's failure is already known (the control plane drops
        the report as stale)."""
        failed = self.failed_step
        if failed is None or failed["generation"] <= self.failure_said:
            return
        now = self.control.clock()
        self.failure_seen_at = self.failure_seen_at or now
        if now - self.failure_seen_at < PEER_LOSS_GRACE_S:
            return
        say("the trainer's step failed: it waits to be repaired", attempt=self.spec.attempt, error=failed["error"])
        if self.control.send(TrainerFailed(
                run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
                kind=TrainerFailureKind.CRASH, message=failed["error"], last_step=self.last_step)):
            self.failure_said, self.failure_seen_at = failed["generation"], None

    def beat_until(self, stopped: threading.Event) -> None:
        """The heartbeat thread: beat_if_due every LOOK_S until `stopped`."""
        while not stopped.wait(LOOK_S):
            self.beat_if_due()

    def beat_if_due(self) -> None:
        """Heartbeat the Train task when a beat is due (heartbeat_every since the last) and the
        world showed life since: the metrics file grew (global rank 0 appends a record a step), or
        the trainer of the node that speaks for the world gave a sign of life in its progress file
        (a microbatch, a start-up phase: trainer/progress.py), or the world starts up or winds
        down and its last sign of life is recent enough. So a world whose steps are slow (a large
        model, a starved machine) is never taken for a hung one: only a silent one is."""
        token, now = self.spec.heartbeat_task_token, self.control.clock()
        life = Life.of(self.files)
        if life != self.seen:
            self.seen, self.alive_at = life, now
            self.control.trainer_alive_at = now
        if token is None or now - self.last_heartbeat < self.heartbeat_every:
            return
        spoke = life.progress != self.beaten.progress and (self.speaks_for_world or self.speaks_for_start())
        if life.metrics_size > self.beaten.metrics_size or spoke or self.starting_up(now) or self.winding_down(now):
            self.control.heartbeat(token)
            self.last_heartbeat, self.beaten = now, life

    def follow(self) -> None:
        """What the node shows since the last look: metrics, this node's progress, a Spot notice.
        Only the node that speaks for the world calls the control plane here (progress,
        new commits); the heartbeat has a thread of its own (beat_if_due)."""
        records = self.metrics.new_records()
        # A `finished` record (no loss) is what a trainer resumed at its last step writes instead
        # of step records: it speaks for the world all the same.
        steps = [record for record in records if not record.get("finished")]
        now = self.control.clock()
        life = Life.of(self.files)
        if life != self.watched:
            self.watched, self.watched_alive_at, self.watched_alive_wall = life, now, datetime.now(timezone.utc)
        step = read_progress(self.files.progress)
        if step is not None and step != self.node_step:
            # The first step written is where the trainer joined the world, the next its first
            # step; each later one times the steps since the one before.
            self.progress_changes += 1
            if self.progress_changes > 2:
                self.node_step_s = (now - self.node_stepped_at) / max(1, step - self.node_step)
                self.step_seconds.append(self.node_step_s)
            self.stepped = self.stepped or self.progress_changes > 1
            self.node_step, self.node_step_at, self.node_stepped_at = step, datetime.now(timezone.utc), now
        failed = read_failure(self.files.repair_order) if self.spec.repairable else None
        self.failed_step = failed if failed is not None and failed["generation"] == self.generation else None
        # A trainer whose step failed waits for the control plane: looks at the full rate at once.
        self.control.pace_for(stepping=self.progress_changes > 1 and self.failed_step is None
                              and not stalled(now - self.node_stepped_at, self.node_step_s))
        self.stepped = self.stepped or bool(steps)
        if records:
            self.speaks_for_world = True
            self.last_step = records[-1]["step"]
            if self.finished is None and self.last_step == self.final_step:
                self.finished = now
        self.unsent_steps += [(self.spec.attempt, step) for step in steps]
        # The final step goes out at once: the history and the run record end where training did.
        if self.unsent_steps and (now - self.last_progress >= PROGRESS_EVERY_S or self.finished is not None):
            self.send_progress()
            self.last_progress = now
        if records and self.commit_awaited_after is not None:
            # A checkpoint asked for now (a Spot notice, a departure) is announced as soon as it
            # commits, not at the next look: the Spot wait ends on it, and the next attempt
            # resumes from the newest announced. Other commits wait for the look (one S3 listing
            # a look, not two a second).
            self.announce_commits()
        for check in WORLD_CHECKS.keys() - self.checks_reported:
            if self.files.check_result(check).exists():
                self.report_check(check)
        if not self.spot_notice_seen and now >= self.next_metadata_look:
            self.next_metadata_look = now + self.control.settings.metadata_look_s
            if self.spot_notice() is not None:
                self.spot_notice_seen = True
                self.request_checkpoint("spot interruption notice")
        self.declare_if_hung(now)

    def declare_if_hung(self, now: float) -> None:
        """TrainerHung, once, when this node's trainer was stepping and has been silent for longer
        than the world's cadence allows (pace.hung_after): no step, no microbatch, no start-up
        phase, no sign from a save. A rank that stopped stops the whole world at its next
        collective, so every node's trainer falls silent and the first agent to tell fails the
        Train task at once, not a hang timeout later. A world that finished its steps is judged
        no more: its end (the final save, the exit) is the startup timeout's to bound."""
        limit = hung_after(self.step_seconds, self.spec.stall_floor_seconds)
        silent = now - self.watched_alive_at
        if self.hang_declared or limit is None or silent <= limit or self.node_step == self.final_step:
            return
        say("the trainer is silent past the world's cadence: declaring it hung", attempt=self.spec.attempt,
            last_step=self.node_step, silent_s=round(silent, 1), limit_s=round(limit, 1))
        self.hang_declared = self.control.send(TrainerHung(
            run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
            last_step=self.node_step, seconds_since_progress=silent))

    def spot_notice(self) -> dict[str, Any] | None:
        """The Spot notice, if the metadata service shows one; a service that does not answer
        (it throttles too) is asked again at the next look, never the end of the agent."""
        try:
            notice = self.metadata.spot_action()
        except AgentError as error:
            if not self.metadata_failing:
                say("instance metadata unavailable: looking for a Spot notice again at the next look",
                    error=str(error))
            self.metadata_failing = True
            return None
        self.metadata_failing = False
        return notice

    def speaks_for_start(self) -> bool:
        """Whether this node speaks for the attempt's start-up: before the first step no trainer
        writes metrics, so the agent of node rank 0 (the launch spec's choice, known to every
        agent) speaks for the world until a step (its trainer's, or one in the metrics file)."""
        return (self.node_rank == 0 and not self.stepped and self.seen.metrics_size == 0
                and self.torchrun_started is not None)

    def starting_up(self, now: float) -> bool:
        """Whether this node heartbeats the attempt's start-up whatever its trainer shows: the
        phases of a start-up (a rendezvous, NCCL set-up, a checkpoint load from S3) are long and
        show no step, so node rank 0 beats on until the startup timeout has passed since torchrun
        started or since its trainer's last sign of life, whichever is later."""
        return (self.speaks_for_start()
                and now - max(self.torchrun_started, self.alive_at) < self.spec.startup_timeout_seconds)

    def winding_down(self, now: float) -> bool:
        """Whether this node heartbeats the end of a trainer that reached its final step: the final
        checkpoint is saved and the world torn down before torchrun exits (and TrainingCompleted
        answers the task), with no step to show for it. Bounded like the start-up, which it
        mirrors (a checkpoint saved instead of loaded)."""
        return (self.finished is not None
                and now - max(self.finished, self.alive_at) < self.spec.startup_timeout_seconds)

    def look(self, run: RunRecord) -> None:
        """At each look at the control plane: this node's liveness, a checkpoint the run asks for,
        and (the rank-0 node) the checkpoints committed since the last look."""
        self.report_liveness()
        requested = run.checkpoint_requested_at
        if requested is not None and requested != self.checkpoint_request_seen:
            self.checkpoint_request_seen = requested
            if not checkpoint_request_answered(run, self.spec.attempt):
                self.request_checkpoint("the run asks for a checkpoint (a worker is leaving)")
        # Commits that land after the trainer's last record (an asynchronous save). Only after the
        # first record: by then the trainer has deleted the folders of an abandoned timeline (steps
        # newer than its resume point), which must not be announced as this attempt's commits.
        if self.speaks_for_world:
            self.announce_commits()

    def request_checkpoint(self, why: str) -> None:
        self.files.checkpoint_request.touch()
        self.commit_awaited_after = self.last_step if self.last_step is not None else -1
        say(f"{why}: asked the trainer to checkpoint now", attempt=self.spec.attempt)

    def report_liveness(self, trainer_running: bool = True) -> None:
        self.control.report_liveness(NodeLiveness(
            instance_id=self.identity.instance_id, attempt=self.spec.attempt, step=self.node_step,
            step_at=self.node_step_at, alive_at=self.watched_alive_wall, trainer_running=trainer_running,
            reported_at=datetime.now(timezone.utc)))

    def report_check(self, check: str) -> None:
        """A world check's result, which global rank 0 wrote on this node; sent again at the
        next look if the bus does not take it now."""
        figures_of, event = WORLD_CHECKS[check]
        figures = figures_of(json.loads(self.files.check_result(check).read_text()), self.spec.attempt)
        verdict = "restored" if isinstance(figures, StateRestoredFigures) else "passed" if figures.passed else "failed"
        say(f"{check.replace('_', ' ')} {verdict}", attempt=self.spec.attempt, figures=figures.describe())
        if self.control.send(event(run_name=self.spec.run_name, attempt=self.spec.attempt,
                                   instance_id=self.identity.instance_id, figures=figures)):
            self.checks_reported.add(check)

    def send_progress(self) -> None:
        """Every step since the last TrainingProgress, PROGRESS_SAMPLES_MAX an event, each in an
        event of the attempt that trained it: the run's history holds each one. What could not be
        sent goes at the next try."""
        while self.unsent_steps:
            attempt = self.unsent_steps[0][0]
            records = list(itertools.takewhile(lambda unsent: unsent[0] == attempt,
                                               self.unsent_steps[:PROGRESS_SAMPLES_MAX]))
            latest = records[-1][1]
            if not self.control.send(TrainingProgress(
                    run_name=self.spec.run_name, attempt=attempt, instance_id=self.identity.instance_id,
                    step=latest["step"], loss=latest["loss"], tokens_per_second=latest["tokens_per_s"],
                    step_seconds=latest["step_time_s"], samples=progress_samples([record for _, record in records]))):
                return
            del self.unsent_steps[:len(records)]

    def announce_commits(self) -> None:
        committed = self.control.call("list the committed checkpoints",
                                      lambda: catalog.committed_steps(self.checkpoints))
        for step in sorted(committed or ()):
            if step in self.announced:
                continue
            try:
                manifest = self.control.call("read a commit marker",
                                             lambda: catalog.read_manifest(self.checkpoints, step))
            except catalog.CheckpointInvalid as error:
                # Listed a moment ago and pruned since by the trainer's retention (a newer commit
                # is listed too), or no commit after all: nothing to announce. It ended the agent,
                # and so its instance, before.
                say("a listed checkpoint is gone: not announced", attempt=self.spec.attempt, error=str(error))
                self.announced.add(step)
                continue
            if manifest is None or not self.control.send(CheckpointCommitted(
                    run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
                    step=step, uri=self.checkpoints.step_uri(catalog.step_dir_name(step)),
                    reason=CheckpointReason(manifest.reason))):
                return  # announced at a later look
            self.announced.add(step)
            if self.commit_awaited_after is not None and step > self.commit_awaited_after:
                self.commit_awaited_after = None

    def report_exit(self, returncode: int) -> None:
        base = {"run_name": self.spec.run_name, "attempt": self.spec.attempt,
                "instance_id": self.identity.instance_id}
        if returncode == 0:
            say("torchrun finished", attempt=self.spec.attempt, last_step=self.last_step)
            if self.speaks_for_world:
                self.announce_commits()
                latest = max(self.announced, default=None)
                self.control.deliver(TrainingCompleted(
                    **base, final_step=self.last_step,
                    checkpoint_uri=self.checkpoints.step_uri(catalog.step_dir_name(latest)) if latest else None),
                    self.deadline)
            return
        # At once: Recover, deciding on the failure that the peers report a grace later, must not
        # order this node's ended trainer into a repaired world.
        self.report_liveness(trainer_running=False)
        time.sleep(PEER_LOSS_GRACE_S)
        run = self.control.call("read the run record",
                                lambda: self.control.store.run(self.spec.run_name, consistent=False))
        if run is not None and self.left_behind(run):
            say("torchrun failed after the run moved on; not reported", attempt=self.spec.attempt,
                exit_code=returncode)
            return
        output = self.files.output.read_text(errors="replace")[-20 * OUTPUT_TAIL_CHARS:]
        self.control.deliver(TrainerFailed(**base, kind=failure_kind(output), exit_code=returncode,
                                           message=failure_message(output), last_step=self.last_step),
                             self.deadline)


def announced_before(spec: LaunchSpec, committed: Iterable[int]) -> set[int]:
    """The commits the attempts before `spec`'s announced (or could have): those up to its resume
    point. Its own are announced as they come."""
    return {step for step in committed if spec.resume_step is None or step <= spec.resume_step}


def repair_order(spec: LaunchSpec, launch_nodes_gone: int = 0) -> RepairOrder:
    """The order into the world `spec` repairs: its store on node rank 0, at the attempt's port;
    `launch_nodes_gone`: RepairOrder's (a joining node's torchrun met no other)."""
    return RepairOrder(generation=spec.repair.generation, store_host=spec.rendezvous_host,
                       store_port=spec.rendezvous_port, host_node_rank=0, nodes=spec.plan.nodes,
                       launch_nodes_gone=launch_nodes_gone)


def stop(process: Any) -> None:
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
    """Boot, preflight, then each attempt that names this node, until the run is over (returns)."""
    deadline = time.monotonic() + settings.lifetime_s if settings.lifetime_s else None
    metadata = MetadataClient()
    identity = boot_identity(metadata)
    control = ControlPlane(settings, identity)
    start_node_log(settings, identity)
    say("agent up", instance_id=identity.instance_id, instance_type=identity.instance_type,
        private_ip=identity.private_ip, run_name=settings.run_name, open_files_limit=raise_open_files_limit())
    node = wait_for("the run's record of this node", control.node, deadline, control)
    ids = {"run_name": settings.run_name, "attempt": node.attempt, "instance_id": identity.instance_id}
    control.deliver(NodeRegistered(**ids, private_ip=identity.private_ip,
                                   availability_zone=identity.availability_zone), deadline)
    checks, problem = standin_preflight() if settings.standin_step_s else run_preflight(identity.instance_type)
    if problem:  # never named in a launch spec: it waits to be terminated
        control.deliver(NodeUnhealthy(**ids, reason=problem, checks=checks), deadline)
    else:
        control.deliver(NodeReady(**ids, checks=checks), deadline)
    confirmed, ran = node.attempt, -1

    def confirm(attempt: int) -> bool:
        nonlocal confirmed
        if attempt > confirmed and control.send(NodeReady(**{**ids, "attempt": attempt}, checks=checks)):
            confirmed = attempt  # this node answers: it may join that attempt's world
        return confirmed >= attempt

    run = latest = None
    while True:
        spec = None
        if run is not None:
            latest = run
            if run.state.is_final:
                return
            if not problem:
                confirm(run.attempt)
                if run.state is RunState.TRAINING:
                    # Idle while the run trains (a READY spare): Recover confirms a spare seen alive
                    # for a world repaired around it, which then waits on no look of its agent.
                    control.report_liveness(NodeLiveness(instance_id=identity.instance_id, attempt=confirmed,
                                                         trainer_running=False, reported_at=datetime.now(timezone.utc)))
            if not problem and run.state is RunState.TRAINING and run.attempt > ran:
                spec = control.launch_spec_after(ran)
                spec = spec if spec is not None and spec.attempt == run.attempt else None
        elif not problem and latest is not None and latest.state is RunState.TRAINING:
            # An idle agent of a training run (a READY spare, a node whose trainer ended) reads the
            # launch spec between its looks too: a world repaired around it waits on no look.
            spec = control.read_launch_spec_soon(ran)
        if spec is not None:
            ran = spec.attempt
            if spec.repair and identity.instance_id in spec.repair.survivor_ids:
                # Its trainer ended before the order came: the control plane restarts the world.
                control.deliver(TrainerFailed(**{**ids, "attempt": spec.attempt}, kind=TrainerFailureKind.CRASH,
                                              message="no trainer left on this node to repair the world with"),
                                deadline)
                continue
            attempt = Attempt(control, metadata, spec, confirm, deadline)
            run = attempt.run()
            ran = attempt.spec.attempt
            continue
        if deadline is not None and time.monotonic() > deadline:
            raise AgentError("the agent's lifetime is over")
        time.sleep(LOOK_S)
        run = control.look_at_run()


def boot_identity(metadata: MetadataClient, clock: Callable[[], float] = time.monotonic) -> Identity:
    """The instance's identity, asked again for METADATA_PATIENCE_S while the service fails."""
    give_up = clock() + METADATA_PATIENCE_S
    while True:
        try:
            return metadata.identity()
        except AgentError as error:
            if clock() > give_up:
                raise
            say("instance metadata unavailable at boot; asking again", error=str(error))
            time.sleep(2.0)


def end_instance(settings: AgentSettings, why: str) -> None:
    """End this instance: its shutdown behaviour is terminate (launch template). Without a
    shutdown command the agent's exit is what ends it (a local instance)."""
    say(f"{why}: ending this instance", command=" ".join(settings.shutdown_command) or None)
    stop_node_log()
    if settings.shutdown_command:
        subprocess.run(settings.shutdown_command, check=False)


def main() -> int:
    """The agent's life on its instance; its exit status."""
    try:
        settings = AgentSettings.from_env()
    except AgentError as exc:
        say("agent stopped", error=str(exc))
        return 1
    try:
        serve(settings)
    except Unreachable as exc:
        end_instance(settings, str(exc))
        return 0
    except AgentError as exc:
        say("agent stopped", error=str(exc))
        stop_node_log()
        return 1
    end_instance(settings, "the run is over")
    return 0


if __name__ == "__main__":
    sys.exit(main())
