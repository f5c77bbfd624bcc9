"""Turn what happened (an event, a task error) into a FailureReport, or None when it is no failure;
and whether an agent event may count at all, from who sent it (sender_problem)."""

import json
from datetime import datetime, timedelta

from trainfleet.core.events import (BOOT_CHECK, LOST_STATES, AgentEvent, AnyDetail, Ec2InstanceStateChange,
                                    Ec2RebalanceRecommendation, Ec2SpotInterruptionWarning, FleetChecked, HealthEvent,
                                    NodeReady, NodeRegistered, NodeUnhealthy, ScalingChecked, TrainerFailed,
                                    TrainerHung)
from trainfleet.core.lifecycle.launch import silent_fleet, unready_workers
from trainfleet.core.records import (CAPACITY_ERROR, FAILURE_ERROR, FailureClass, FailureReport, NodeRecord, TaskWait,
                                     TrainerFailureKind)

# Health categories that announce trouble for the instance itself (accountNotification does not).
_HEALTH_CATEGORIES = {"issue", "scheduledChange", "investigation"}

_TRAINER_FAILURES = {
    TrainerFailureKind.CRASH: FailureClass.PROCESS_CRASH,
    TrainerFailureKind.NAN_LOSS: FailureClass.NUMERICAL,
    TrainerFailureKind.CONFIG: FailureClass.CONFIG_ERROR,
}

# Step Functions names a task that outlived its timeout States.Timeout, one whose heartbeat
# stopped States.HeartbeatTimeout (moto reports both as States.Timeout).
_TIMEOUT_ERRORS = {"States.Timeout", "States.HeartbeatTimeout"}


# What a node says about itself (booting, preflight, readiness) is judged by the node's record:
# a node still booting when Recover moved the run on is still one of the run's nodes.
NODE_LIFECYCLE_EVENTS = (NodeRegistered, NodeReady, NodeUnhealthy)


def sender_problem(detail: AgentEvent, sender: str | None, sender_is_runs_node: bool) -> str | None:
    """Why an agent event must not count, or None: it counts only from a node of the run it
    names, and says something of one instance only when that is its sender (the node role lets
    a node put events under its own instance ARN alone, so `sender` is who sent it)."""
    if sender is None:
        return "it names no sending instance"
    if not sender_is_runs_node:
        return f"its sender {sender} is no node of run {detail.run_name!r}"
    if detail.instance_id is not None and detail.instance_id != sender:
        return f"its sender {sender} speaks for {detail.instance_id}"
    return None


def is_stale(detail: AnyDetail, current_attempt: int) -> bool:
    """An agent event about an attempt before the current one: it must change nothing.
    Node-lifecycle events never are (NODE_LIFECYCLE_EVENTS)."""
    return (isinstance(detail, AgentEvent) and not isinstance(detail, NODE_LIFECYCLE_EVENTS)
            and detail.attempt < current_attempt)


def classify_event(detail: AnyDetail, attempt: int, observed_at: datetime | None = None) -> FailureReport | None:
    """The failure an event reports for the run's current `attempt`, or None if it reports none;
    `observed_at` is the event's time (the report's first sign of the failure).

    Whether an AWS event's instance belongs to the run is the caller's look-up; agent events of
    older attempts should be dropped with is_stale() first.
    """
    report = _event_report(detail, attempt)
    if report is None:
        return None
    if isinstance(detail, TrainerHung) and observed_at is not None:
        # The hang's first sign is the world's last sign of life, not the agent's telling of it.
        observed_at -= timedelta(seconds=detail.seconds_since_progress)
    return report.model_copy(update={"observed_at": observed_at})


def _event_report(detail: AnyDetail, attempt: int) -> FailureReport | None:
    match detail:
        case Ec2InstanceStateChange(state=state) if state in LOST_STATES:
            return _report(FailureClass.INSTANCE_LOST, attempt, [detail.instance_id],
                           f"EC2 reports instance {detail.instance_id} {state}")
        case Ec2SpotInterruptionWarning():
            return _report(FailureClass.SPOT_INTERRUPTION, attempt, [detail.instance_id],
                           f"Spot interruption warning ({detail.instance_action}) for {detail.instance_id}")
        case Ec2RebalanceRecommendation():
            return _report(FailureClass.SPOT_REBALANCE, attempt, [detail.instance_id],
                           f"rebalance recommendation for {detail.instance_id}")
        case HealthEvent() if (detail.service == "EC2" and detail.instance_ids
                               and detail.event_type_category in _HEALTH_CATEGORIES):
            return _report(FailureClass.HEALTH_EVENT, attempt, detail.instance_ids,
                           f"AWS Health {detail.event_type_code}")
        case NodeUnhealthy(checks=checks) if any(check.name == BOOT_CHECK and not check.passed for check in checks):
            failed = next(check for check in checks if check.name == BOOT_CHECK)
            return _report(FailureClass.BOOT_FAILED, attempt, [detail.instance_id],
                           f"{detail.instance_id}: {detail.reason}: {failed.detail}")
        case NodeUnhealthy():
            return _report(FailureClass.NODE_UNHEALTHY, attempt, [detail.instance_id], detail.reason)
        case TrainerFailed():
            # A crashed trainer does not blame its node: a sick node reports NodeUnhealthy.
            return _report(_TRAINER_FAILURES[detail.kind], attempt, [],
                           f"trainer {detail.kind.value} on {detail.instance_id or 'the world'}: {detail.message}")
        case FleetChecked(figures=figures) if not figures.passed:
            return _report(FailureClass.SLOW_NETWORK, attempt, figures.slow_instance_ids, figures.describe())
        case ScalingChecked(figures=figures) if not figures.passed:
            return _report(FailureClass.POOR_SCALING, attempt, figures.slow_instance_ids, figures.describe())
        case TrainerHung():
            return _report(FailureClass.HANG, attempt, [],
                           f"no progress for {detail.seconds_since_progress:.0f} s after step {detail.last_step}")
    return None


def classify_task_error(error: str, cause: str | None, waiting: TaskWait,
                        nodes: list[NodeRecord] = ()) -> FailureReport:
    """The failure behind a failed task (its Catch gives error and cause); `nodes`: the run's
    node records, which a boot timeout blames.

    A boot timeout blames the workers not ready for the attempt; one after which not a node the
    attempt waited for ever reported (lifecycle.silent_fleet) is the run's set-up failing, which no
    replacement can cure: a fleet that cannot reach AWS is billed silent until every timeout.
    """
    if error == FAILURE_ERROR and cause:
        return FailureReport.model_validate_json(cause)
    if error == CAPACITY_ERROR:
        return (_capacity_report(cause)
                or _report(FailureClass.CAPACITY, waiting.attempt, [], cause or "not enough instances"))
    if error in _TIMEOUT_ERRORS and waiting.purpose == "train":
        return _report(FailureClass.HANG, waiting.attempt, [], f"{error}: no heartbeat from training")
    if error in _TIMEOUT_ERRORS and (silent := silent_fleet(nodes)):
        subnets = sorted({node.subnet_id for node in silent if node.subnet_id})
        return _report(FailureClass.SETUP_FAILED, waiting.attempt, [],
                       f"{error}: not one of the {len(silent)} nodes of attempt {waiting.attempt} reported within "
                       f"the boot timeout (no agent registered, no bootstrap step failed): they could not reach "
                       f"the control plane (EventBridge, S3, DynamoDB, Step Functions, CloudWatch Logs) from "
                       f"{', '.join(subnets) or 'their subnets'}, or never ran their user data. The run's network "
                       "or image is at fault, not its nodes (their console output shows how far they got)")
    if error in _TIMEOUT_ERRORS:
        return _report(FailureClass.NODE_UNHEALTHY, waiting.attempt, unready_workers(nodes, waiting.attempt),
                       f"{error}: nodes not ready within the boot timeout")
    return _report(FailureClass.UNKNOWN, waiting.attempt, [], f"{error}: {cause or 'no cause given'}")


def _capacity_report(cause: str | None) -> FailureReport | None:
    """The FailureReport a handler raised as CapacityUnavailable's message, or None.

    A Lambda error reaches a Catch with the runtime's error document as its cause
    ({"errorMessage", "errorType", ...}). Recover puts a report in the message because only it
    knows which attempt came up short: a retry of the same input must find that attempt
    already decided, not blame the next one.
    """
    try:
        return FailureReport.model_validate_json(json.loads(cause or "")["errorMessage"])
    except (ValueError, TypeError, KeyError):
        return None


def _report(failure_class: FailureClass, attempt: int, instance_ids: list[str], message: str) -> FailureReport:
    return FailureReport(failure_class=failure_class, attempt=attempt, instance_ids=instance_ids,
                         message=message)
