"""What every handler shares: Powertools, the settings and AWS clients, the state payloads.

Logger, Tracer and Metrics are module-level, as Powertools recommends. The settings and the
clients are built by `aws()` on a function's first invocation and kept for the life of the
execution environment, so a missing setting fails that cold start with the variable's name.
They are not built at import because the local cloud runs every function of a deployment, and
its tests several deployments, in one process: `aws.cache_clear()` starts over.

The payload models are the shapes statemachine/training_run.asl.json passes between states:
references only (the run's name and attempt), never the fleet.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import cache, cached_property
from typing import Any, Literal, TypeVar

import boto3
from aws_lambda_powertools import Logger, Metrics, Tracer
from botocore.config import Config
from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
from aws_lambda_powertools.metrics import MetricUnit
from pydantic import BaseModel, ConfigDict

from functions.errors import CapacityUnavailable, TransientError
from trainfleet.adapters.ec2_fleet import CAPACITY_ERROR_CODES, Allocation
from trainfleet.adapters.run_store import RunStore
from trainfleet.core.events import instance_arn
from trainfleet.core.lifecycle import may_start, new_node_records
from trainfleet.core.records import (FAILURE_ERROR, FailureReport, NodeRecord, NodeRole, NodeState, RecoveryAction,
                                     RunRecord, RunRef, TaskWait)
from trainfleet.core.runspec import RunSpec
from trainfleet.core.settings import MissingSetting, Settings

__all__ = ["logger", "tracer", "metrics", "Aws", "aws", "answer_task", "fail_attempt", "park_task", "addressed",
           "answer_if_world_complete", "fleet_token_prefix", "capacity_unavailable", "is_transient",
           "transient_errors_named", "mark_terminating", "Timeouts", "CaughtError", "RecoveryStep", "LateWorkersStep",
           "RunPayload", "TaskPayload", "launch_spec_key", "report_prefix"]

IDEMPOTENCY_TABLE_VARIABLE = "TRAINFLEET_IDEMPOTENCY_TABLE"

logger = Logger()
tracer = Tracer()
metrics = Metrics()


def _client(service: str) -> cached_property:
    """A client of `service`, made on the first use of the attribute and kept."""
    return cached_property(lambda _: boto3.client(service, config=_CLIENT_CONFIG))


@dataclass(frozen=True)
class Aws:
    """The settings and one client per service, shared by every invocation. A client is made on
    first use: most functions call one or two of the services, and making one is most of a cold
    start's work after the imports."""

    settings: Settings
    idempotency_table: str
    """DynamoDB table of the event handler's idempotency records (TRAINFLEET_IDEMPOTENCY_TABLE)."""
    dynamodb: Any

    @cached_property
    def store(self) -> RunStore:
        return RunStore(self.dynamodb, self.settings.run_table)

    ec2 = _client("ec2")
    s3 = _client("s3")
    iam = _client("iam")
    sfn = _client("stepfunctions")
    sts = _client("sts")

    @cached_property
    def _instance_arn_parts(self) -> tuple[str, str, str]:
        """(partition, region, account) of this function's instances: GetCallerIdentity needs no
        permission and names the partition and account in the function's own ARN."""
        _, partition, _, _, account = self.sts.get_caller_identity()["Arn"].split(":", 5)[:5]
        return partition, self.ec2.meta.region_name, account

    def instance_arn(self, instance_id: str) -> str:
        """The ARN of an instance of this stack: ec2:SourceInstanceARN of its requests."""
        return instance_arn(*self._instance_arn_parts, instance_id)


# Throttling and 5xx answers of EC2, DynamoDB, S3 and Step Functions are retried in the client
# with backoff ("standard" mode); what outlasts that fails the invocation, where the state
# machine's Retry and Catch take over.
_CLIENT_CONFIG = Config(retries={"mode": "standard", "max_attempts": 8})


@cache
def aws() -> Aws:
    settings = Settings.from_environ()
    idempotency_table = os.environ.get(IDEMPOTENCY_TABLE_VARIABLE, "").strip()
    if not idempotency_table:
        raise MissingSetting(f"environment variable {IDEMPOTENCY_TABLE_VARIABLE} is not set")
    return Aws(settings=settings, idempotency_table=idempotency_table,
               dynamodb=boto3.client("dynamodb", config=_CLIENT_CONFIG))


# Throttling and transient faults (botocore's standard retry mode retries the same codes, and
# AWS's internal-error codes): one that outlasted the client's retries is still worth retrying
# later, with the state machine's backoff.
_TRANSIENT_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottledException",
    "TooManyRequestsException", "ProvisionedThroughputExceededException", "TransactionInProgressException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "RequestThrottled", "SlowDown",
    "PriorRequestNotComplete", "EC2ThrottledException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "InternalFailure", "ServiceUnavailable", "Unavailable",
})
_TRANSIENT_STATUS = frozenset({500, 502, 503, 504})


def is_transient(exc: BaseException) -> bool:
    """True for an AWS error that may well not happen again: throttling, a 5xx, a timeout, an
    endpoint that could not be reached. EC2's capacity errors are 5xx too, but they are
    capacity, not chance: CapacityUnavailable and Recover deal with them."""
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code not in CAPACITY_ERROR_CODES and (code in _TRANSIENT_CODES or status in _TRANSIENT_STATUS)
    return isinstance(exc, (ConnectionError, HTTPClientError))


_Handler = TypeVar("_Handler", bound=Callable[..., Any])


def transient_errors_named(handler: _Handler) -> _Handler:
    """Let a transient AWS error leave the handler as TransientError, the one name the state
    machine retries with backoff; every other error keeps its own name (Catch decides)."""
    @functools.wraps(handler)
    def named(event: Any, context: Any) -> Any:
        try:
            return handler(event, context)
        except Exception as exc:
            if is_transient(exc):
                raise TransientError(f"{type(exc).__name__}: {exc}") from exc
            raise
    return named  # type: ignore[return-value]


def answer_task(run_name: str, purpose: Literal["await_nodes", "train"], attempt: int, *,
                output: dict[str, Any] | None = None, failure: FailureReport | None = None) -> bool:
    """Answer the task token parked for (purpose, attempt): success with `output`, or failure
    with `failure` as the cause. True if this call's answer is the one Step Functions took.

    The token is sent first and cleared after: an answer that fails to send (throttled, a 5xx,
    a timeout) fails this invocation with the token still parked, and the invocation's retry
    sends it. Of many handlers racing on duplicate or concurrent events, all may send; Step
    Functions takes the first answer and refuses the others (TaskTimedOut), so exactly one of
    them returns True.
    """
    cloud = aws()
    token = cloud.store.parked_token(run_name, purpose, attempt)
    if token is None:
        return False
    try:
        if failure is None:
            cloud.sfn.send_task_success(taskToken=token, output=json.dumps(output or {}))
        else:
            cloud.sfn.send_task_failure(taskToken=token, error=FAILURE_ERROR, cause=failure.model_dump_json())
    except (cloud.sfn.exceptions.TaskTimedOut, cloud.sfn.exceptions.InvalidToken,
            cloud.sfn.exceptions.TaskDoesNotExist) as exc:
        # Answered by another handler first, or the task ended on its own (its timeout).
        logger.info("task token no longer answerable", run_name=run_name, purpose=purpose, error=str(exc))
        cloud.store.clear_task_token(run_name, token)
        return False
    cloud.store.clear_task_token(run_name, token)
    metrics.add_metric(name="TaskTokensAnswered", unit=MetricUnit.Count, value=1)
    logger.info("task answered", run_name=run_name, purpose=purpose, attempt=attempt,
                failed=failure is not None)
    return True


def fail_attempt(run_name: str, report: FailureReport) -> bool:
    """Fail the wait parked for the report's attempt, with the report as cause. The report is
    recorded on the run first (`attempt_failure`, the attempt's first one), so that when no
    token is parked the next wait of that attempt fails with it as it parks (park_task). True if
    a task was answered here.

    Either this write or the parking write comes second, and the second one sees the other's
    change: a failure and a wait racing each other always meet."""
    run = aws().store.modify_run(run_name, lambda current: current.model_copy(update={"attempt_failure": report})
                                 if current.attempt == report.attempt and current.attempt_failure is None
                                 else current)
    if run.waiting is None:
        return False
    return answer_task(run_name, run.waiting.purpose, report.attempt, failure=report)


def park_task(run_name: str, wait: TaskWait) -> bool:
    """Park the wait's token on the run; if its attempt has already failed (fail_attempt with no
    token parked), fail the wait at once with that report. True if it failed here."""
    run = aws().store.park_task(run_name, wait)
    failure = run.attempt_failure
    if failure is None or failure.attempt != wait.attempt:
        return False
    return answer_task(run_name, wait.purpose, wait.attempt, failure=failure)


def addressed(nodes: list[NodeRecord]) -> list[NodeRecord]:
    """Nodes whose private IP is known. NodeReady can overtake NodeRegistered (EventBridge keeps
    no order), and a node without an address cannot host the rendezvous."""
    return [node for node in nodes if node.private_ip]


def answer_if_world_complete(run_name: str) -> bool:
    """Succeed AwaitNodes once enough addressed workers passed preflight and confirmed they are
    ready for the run's current attempt. Two reads, whatever the fleet's size: the run and the
    count of its workers ready for the attempt (RunStore.ready_workers), which the store keeps
    exact as node records change."""
    store = aws().store
    run = store.run(run_name)
    ready = store.ready_workers(run_name, run.attempt)
    if not may_start(run, ready):
        return False
    return answer_task(run_name, "await_nodes", run.attempt, output={"ready_workers": ready})


_ENDING = frozenset({NodeState.TERMINATING, NodeState.TERMINATED})


def mark_terminating(run_name: str, instance_id: str, **changes: Any) -> None:
    """Move a node to TERMINATING (recorded before the TerminateInstances call), unless EC2 has
    already reported it gone: an instance lost outright is often recorded TERMINATED by the
    event handler meanwhile."""
    aws().store.modify_node(run_name, instance_id, lambda node: node if node.state in _ENDING
                            else node.model_copy(update={"state": NodeState.TERMINATING, **changes}))


def confirm_ready(run_name: str, instance_id: str, attempt: int) -> NodeRecord:
    """The node confirmed READY for `attempt` (what its NodeReady says); confirmations may arrive
    out of order, so the newest attempt confirmed stays, and a retired node stays retired."""
    def confirm(current: NodeRecord) -> NodeRecord:
        if current.state.is_retired:
            return current
        newest = max(attempt, current.ready_attempt if current.ready_attempt is not None else -1)
        return current.model_copy(update={"state": NodeState.READY, "ready_attempt": newest,
                                          "ready_at": current.ready_at or datetime.now(timezone.utc)})

    return aws().store.modify_node(run_name, instance_id, confirm)


def swap_roles(run_name: str, promote_spare_ids: Iterable[str], demote_worker_ids: Iterable[str]) -> None:
    """Record a swap of roles: promoted spares become workers, demoted workers spares."""
    roles = {**dict.fromkeys(promote_spare_ids, NodeRole.WORKER), **dict.fromkeys(demote_worker_ids, NodeRole.SPARE)}
    for instance_id, role in roles.items():
        aws().store.modify_node(run_name, instance_id, lambda node, role=role: node.model_copy(update={"role": role}))


def record_nodes(spec: RunSpec, attempt: int, allocation: Allocation, workers: int) -> None:
    """Record the instances an allocation launched (lifecycle.new_node_records: the first
    `workers` are workers, the rest spares); a node recorded before (a retry that EC2 answered
    with the same fleet) is left as it is."""
    for record in new_node_records(spec, attempt, allocation.instance_ids, workers, allocation.availability_zone,
                                   allocation.subnet_id):
        aws().store.add_node(record)


def fleet_token_prefix(run: RunRecord) -> str:
    """What the fleet adapter's CreateFleet ClientTokens are made of: the same for every retry
    of a launch (EC2 returns the fleet it launched), new after each round that came up short."""
    return f"{run.run_name}/{run.attempt}/{run.fleet_requests_unfilled}"


def count_unfilled_request(run_name: str) -> None:
    """Count a fleet request that came up short (or was refused) on the run, so that the state
    machine's retry asks EC2 anew (fleet_token_prefix): EC2 answers a repeated ClientToken with
    its first answer."""
    aws().store.modify_run(run_name, lambda run: run.model_copy(
        update={"fleet_requests_unfilled": run.fleet_requests_unfilled + 1}))


def capacity_unavailable(run_name: str, message: str) -> CapacityUnavailable:
    """The error to raise when a fleet request came up short, counted on the run first."""
    count_unfilled_request(run_name)
    return CapacityUnavailable(message)


def launch_spec_key(run_name: str) -> str:
    """S3 key (in the stack's bucket) of the run's current launch spec; agents poll it and act
    on an attempt newer than the one they run."""
    return f"runs/{run_name}/launch-spec.json"


def report_prefix(run_name: str) -> str:
    """Where the run report's files go in the stack's bucket (trainfleet.report.files's names follow)."""
    return f"runs/{run_name}/"


class _Payload(BaseModel):
    # A field the state machine does not send is a drift between the ASL and the code.
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_state(self) -> dict[str, Any]:
        """As JSON for the next state. Absent fields are left out, never null: the Outcome
        state tests `$.failure` with IsPresent."""
        return self.model_dump(mode="json", exclude_none=True)


class Timeouts(_Payload):
    """Task timeouts the state machine reads by path (TimeoutSecondsPath, HeartbeatSecondsPath)."""

    boot_seconds: int
    """The bound of the whole wait for the nodes: RunSpec.recovery.boot_timeout_seconds."""
    late_worker_seconds: int
    """AwaitNodes' timeout, after which LateWorkers swaps READY spares in for late workers:
    RunSpec.recovery.late_worker_seconds with spares; without, the boot bound (nothing to swap)."""
    heartbeat_seconds: int
    """Train's HeartbeatSeconds: RunSpec.recovery.hang_timeout_seconds."""

    @classmethod
    def of(cls, spec: RunSpec) -> Timeouts:
        recovery = spec.recovery
        return cls(boot_seconds=recovery.boot_timeout_seconds,
                   late_worker_seconds=recovery.late_worker_deadline if spec.spare_count
                   else recovery.boot_timeout_seconds,
                   heartbeat_seconds=recovery.hang_timeout_seconds)


class CaughtError(BaseModel):
    """What a Catch with ResultPath $.failure adds: Step Functions' own field names."""

    model_config = ConfigDict(frozen=True)

    Error: str
    Cause: str | None = None


class RecoveryStep(_Payload):
    """What Recover decided, for the execution history and the backoff Wait state."""

    action: RecoveryAction | None = None
    """None when this invocation carried on a recovery an interrupted one had decided."""
    reason: str
    backoff_seconds: int
    """The RecoveryBackoff state's SecondsPath (whole seconds)."""


class LateWorkersStep(_Payload):
    """What LateWorkers found, for the Choice after it."""

    world_complete: bool
    """Enough workers confirmed (spares swapped in included): the attempt trains now."""
    boot_over: bool
    """The world is not complete and the attempt has waited boot_seconds: Recover takes over."""


class RunPayload(_Payload):
    """The state every task after Validate receives and (unless its ResultPath is null) returns."""

    run: RunRef
    timeouts: Timeouts
    failure: CaughtError | None = None
    """Set by a Catch; its presence makes the run end as failed."""
    recovery: RecoveryStep | None = None
    """Set by Recover for the backoff that follows it."""
    late_workers: LateWorkersStep | None = None
    """Set by LateWorkers for the Choice that follows it."""


class TaskPayload(_Payload):
    """Input of the .waitForTaskToken tasks (AwaitNodes, Train)."""

    run: RunPayload
    task_token: str
