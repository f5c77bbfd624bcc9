"""The events AWS services put on the default bus, built with AWS's documented shapes.

Pure functions over plain data: the EC2 glue and the fault injectors build events here and
LocalCloud.put_event sends them. Field names and values follow the EC2 and AWS Health
event reference pages (EC2 Instance State-change Notification, EC2 Spot Instance
Interruption Warning, EC2 Instance Rebalance Recommendation, AWS Health Event, Step Functions
Execution Status Change).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

INSTANCE_STATES = ("pending", "running", "stopping", "stopped", "shutting-down", "terminated")
"""States an EC2 state-change notification reports (AWS does not send one for rebooting)."""

SPOT_ACTIONS = frozenset({"terminate", "stop", "hibernate"})
"""What a Spot interruption does to the instance."""


@dataclass(frozen=True)
class AwsEvent:
    """One event as a service emits it; the bus adds id, account, region and version."""

    source: str
    """"aws.ec2", "aws.health"."""
    detail_type: str
    """The event's detail-type."""
    detail: dict
    """The service-specific payload."""
    resources: tuple[str, ...] = ()
    """ARNs (EC2) or ids (Health) of the resources the event is about."""
    time: float = field(default_factory=time.time)
    """When it happened, seconds since the epoch."""


def iso_time(epoch_s: float) -> str:
    """AWS's event time format: UTC, second precision, trailing Z."""
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def instance_arn(region: str, account_id: str, instance_id: str) -> str:
    return f"arn:aws:ec2:{region}:{account_id}:instance/{instance_id}"


def instance_state_change(region: str, account_id: str, instance_id: str, state: str) -> AwsEvent:
    if state not in INSTANCE_STATES:
        raise ValueError(f"state must be one of {INSTANCE_STATES}, got {state!r}")
    return AwsEvent("aws.ec2", "EC2 Instance State-change Notification",
                    {"instance-id": instance_id, "state": state},
                    (instance_arn(region, account_id, instance_id),))


def spot_interruption_warning(region: str, account_id: str, instance_id: str,
                              action: str) -> AwsEvent:
    return AwsEvent("aws.ec2", "EC2 Spot Instance Interruption Warning",
                    {"instance-id": instance_id, "instance-action": action},
                    (instance_arn(region, account_id, instance_id),))


def spot_instance_action(action: str, notice_s: float, now: float | None = None) -> dict:
    """The instance metadata document spot/instance-action: what happens, and when."""
    at = (now if now is not None else time.time()) + notice_s
    return {"action": action, "time": iso_time(at)}


def rebalance_recommendation(region: str, account_id: str, instance_id: str) -> AwsEvent:
    return AwsEvent("aws.ec2", "EC2 Instance Rebalance Recommendation",
                    {"instance-id": instance_id},
                    (instance_arn(region, account_id, instance_id),))


def health_event(region: str, account_id: str, instance_ids: list[str], event_type_code: str,
                 category: str, description: str, event_id: str,
                 now: float | None = None) -> AwsEvent:
    """An EC2 Health event for these instances (scheduled retirement, degradation ...)."""
    if category not in {"issue", "accountNotification", "scheduledChange"}:
        raise ValueError(f"category must be issue, accountNotification or scheduledChange, "
                         f"got {category!r}")
    start = now if now is not None else time.time()
    rfc_time = datetime.fromtimestamp(start, timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")
    end = datetime.fromtimestamp(start, timezone.utc) + timedelta(days=14)
    detail = {
        "eventArn": f"arn:aws:health:{region}::event/EC2/{event_type_code}/{event_type_code}_{event_id}",
        "service": "EC2",
        "eventTypeCode": event_type_code,
        "eventTypeCategory": category,
        "eventScopeCode": "ACCOUNT_SPECIFIC",
        "communicationId": event_id,
        "startTime": rfc_time,
        "endTime": end.strftime("%a, %d %b %Y %H:%M:%S GMT"),
        "statusCode": "upcoming" if category == "scheduledChange" else "open",
        "eventRegion": region,
        "eventDescription": [{"language": "en_US", "latestDescription": description}],
        "affectedEntities": [{"entityValue": instance_id} for instance_id in instance_ids],
        "affectedAccount": account_id,
    }
    return AwsEvent("aws.health", "AWS Health Event", detail, tuple(instance_ids), start)


EXECUTION_STATUSES = ("RUNNING", "SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED")
"""Statuses a Step Functions Execution Status Change event reports."""


def execution_status_change(region: str, account_id: str, execution: dict) -> AwsEvent:
    """The event Step Functions sends for a Standard workflow's execution when its status
    changes. `execution` is what DescribeExecution returns (dates as datetimes); the event
    carries the dates as epoch milliseconds and absent fields as null."""
    status = str(getattr(execution["status"], "value", execution["status"]))
    if status not in EXECUTION_STATUSES:
        raise ValueError(f"status must be one of {EXECUTION_STATUSES}, got {status!r}")

    def epoch_ms(when: datetime | None) -> int | None:
        return int(when.timestamp() * 1000) if when is not None else None

    detail = {
        "executionArn": execution["executionArn"],
        "stateMachineArn": execution["stateMachineArn"],
        "name": execution["name"],
        "status": status,
        "startDate": epoch_ms(execution.get("startDate")),
        "stopDate": epoch_ms(execution.get("stopDate")),
        "input": execution.get("input"),
        "output": execution.get("output"),
        "inputDetails": {"included": True},
        "outputDetails": {"included": True} if execution.get("output") is not None else None,
        "error": execution.get("error"),
        "cause": execution.get("cause"),
    }
    return AwsEvent("aws.states", "Step Functions Execution Status Change", detail,
                    (execution["executionArn"],))
