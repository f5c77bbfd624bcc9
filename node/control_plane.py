"""The control plane as the node sees it: the AWS calls the agent makes (events, launch specs,
records, liveness, the Train task), how often it looks (lifecycle.poll_interval), and how long
it waits out a control plane out of reach before it ends its instance (UNREACHABLE_LIMIT_S)."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import TypeVar

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from node.metadata import Identity
from node.node_log import say
from node.settings import LOOK_S, AgentError, AgentSettings
from trainfleet.adapters.liveness import write_liveness
from trainfleet.adapters.run_store import NodeNotFound, RunStore
from trainfleet.core.events import AgentEvent, put_events_entry
from trainfleet.core.lifecycle import poll_interval
from trainfleet.core.pace import LAUNCH_SPEC_POLL_S, longest_look
from trainfleet.core.records import LaunchSpec, NodeLiveness, NodeRecord, RunControl

RETRY_MAX_S = 60.0
"""Longest wait before a failed control-plane call is tried again (backoff doubles up to it, or
up to the run's longest look, if that is shorter)."""
GONE_CODES = frozenset({"ResourceNotFoundException", "NoSuchBucket"})
"""What AWS answers once the stack's table, bus or bucket is deleted: the run is gone, not out of reach."""
CLIENT_RETRIES = {"max_attempts": 5, "mode": "standard"}
"""botocore's own quick retries of a throttled or failed call, before the agent's backoff."""
TRANSIENT_ERRORS = (ClientError, BotoCoreError)
"""What a control-plane call fails with once botocore's own retries are spent (throttling, 5xx,
connection errors, timeouts, a refused call): logged and tried again later, never fatal."""

T = TypeVar("T")


class Unreachable(AgentError):
    """The control plane is gone or out of reach (UNREACHABLE_LIMIT_S)."""


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
        """The run's hang timeout, and so the pace of the looks, once a look read the run
        (unknown before: the usual pace)."""
        self.stepping = False
        """Whether this node's trainer steps now (Attempt.follow): the looks are paced by the
        run's size then, and at the full rate otherwise (trainfleet.core.pace)."""
        self.next_look = 0.0
        self.next_spec_read = -math.inf
        """clock() when read_launch_spec_soon reads the launch spec next."""
        self.failures = 0
        self.answered_at = clock()
        """clock() when an AWS service last answered, with a result or an error: throttling and
        5xx answers (an outage) are answers, a connection that fails or times out is none."""
        self.gone_since: float | None = None
        """clock() of the first answer since the run was last read that the stack's table,
        bus or bucket no longer exists (GONE_CODES): whatever else still answers (the bucket is
        retained), the run is over."""
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
        """`action()`, or None when it failed: the failure is logged and the next look backs off.
        Unreachable when the stack's resources have been gone, or no service has answered with
        the trainer silent, for UNREACHABLE_LIMIT_S. An outage (throttling, 5xx answers) of any
        length ends no instance: the control plane waits it out too, and then needs the fleet."""
        now = self.clock()
        try:
            result = action()
        except TRANSIENT_ERRORS as exc:
            self.failures += 1
            if isinstance(exc, ClientError):
                self.answered_at = now
                if exc.response.get("Error", {}).get("Code") in GONE_CODES and self.gone_since is None:
                    self.gone_since = now
            # Never beyond the paced look: an agent silent for a few looks counts as lost
            # (lifecycle.liveness), and one look a pace is the load the pace allows anyway.
            longest = longest_look(self.run_nodes, self.hang_timeout_s)
            wait = min(RETRY_MAX_S, 2.0 ** min(self.failures, 8), longest) * (0.5 + self.draw() / 2)
            self.next_look = max(self.next_look, now + wait)
            say("control plane call failed; trying again later", call=what, error=str(exc),
                failures=self.failures, retry_in_s=round(wait, 1))
            limit = self.settings.unreachable_limit_s
            if self.gone_since is not None and now - self.gone_since > limit:
                raise Unreachable(f"the stack's resources have been gone for {now - self.gone_since:.0f} s "
                                  f"({exc})") from exc
            if min(now - self.answered_at, now - self.trainer_alive_at) > limit:
                raise Unreachable(f"no AWS service has answered for {now - self.answered_at:.0f} s "
                                  "and this node's trainer made no progress as long") from exc
            return None
        self.failures, self.answered_at = 0, now
        return result

    def look_at_run(self) -> RunControl | None:
        """The run's control item, when a look is due and it could be read; paces the next look."""
        if not self.take_look():
            return None
        run = self.read_run()
        if run is not None:
            self.gone_since = None
            self.run_nodes, self.hang_timeout_s = run.nodes, run.hang_timeout_seconds
        return run

    def read_run(self) -> RunControl | None:
        """The run as its agents see it (RunStore.run_control), or None when it could not be read."""
        return self.call("read the run record", lambda: self.store.run_control(self.settings.run_name))

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
            self.store.db, self.settings.liveness_table, self.settings.run_name, self.identity.arn, record))

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


def wait_for(what: str, probe: Callable[[], T | None], deadline: float | None, control: ControlPlane) -> T:
    """`probe()` at each look at the control plane until it finds something."""
    while deadline is None or time.monotonic() < deadline:
        if control.take_look():
            found = probe()
            if found is not None:
                return found
        time.sleep(LOOK_S)
    raise AgentError(f"gave up waiting for {what}: the agent's lifetime is over")
