"""EventBridge glue: deliver matched events to Lambda and Step Functions targets.

Replaces `moto.events.models.Rule.send_to_targets`, which raises NotImplementedError for
Lambda and Step Functions targets and ignores InputPath and Input. Now, as EventBridge does:

- a DISABLED rule delivers nothing; a rule matches only through its event pattern;
- each target gets the event (ISO time, no moto-internal fields) or its Input, InputPath or
  InputTransformer result (`localcloud.event_delivery`);
- Lambda targets get an asynchronous (Event) invocation, retried on a function error as
  Lambda retries those (`glue.awslambda.invoke_event`);
  Step Functions targets start an execution with a generated name; SQS targets and
  CloudWatch Logs targets get the payload as a message / log event (a message sent is counted
  in `LocalCloud.requests` as an SQS SendMessage: SQS bills it to the queue's owner);
- other targets (event buses, archives, API destinations) keep moto's own delivery.

moto also accepted a rule's ScheduleExpression and never fired it. A `rate(...)` rule now
sends its targets a "Scheduled Event" (source aws.events) every period, on the LocalCloud's
scaled time, while it is enabled; `cron(...)` schedules are not run here.

Delivery runs on the LocalCloud's worker threads, so PutEvents (and the EC2 call that emitted
a state-change event) returns before the targets run, as on AWS. A target that cannot be
reached is recorded in `LocalCloud.delivery_failures` and logged.

Delivery faults (`LocalCloud.duplicate_events`, `delay_events`, `reorder_events`) make
delivery as loose as EventBridge promises: at least once (a matching event goes to each of
its rule's targets twice), late (after a nominal delay, on the cloud's scaled time like every
nominal duration here), and in no particular order (matching events are held for a nominal
window and then delivered newest first). They apply to the targets delivered here (Lambda,
Step Functions, SQS, CloudWatch Logs), to every rule an event matches.

Each entry PutEvents takes is sized as EventBridge sizes it against its 256 KB limit (Time 14
bytes when given; Source, DetailType, Detail and each Resources entry as UTF-8), and the
largest is kept in `LocalCloud.largest_payloads["events"]`.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any

from moto.events.models import EventsBackend, Rule

from localcloud.event_delivery import DeliveryFailure, bus_event, target_input
from localcloud.glue import active_cloud

if TYPE_CHECKING:
    from localcloud.parts import EventFault, EventsCloud

log = logging.getLogger(__name__)

_moto_send_to_targets = Rule.send_to_targets
_moto_put_events = EventsBackend.put_events


def _arn_parts(arn: str) -> tuple[str, str, str, str]:
    """(service, region, account, resource) of an ARN."""
    parts = arn.split(":", 5)
    if len(parts) != 6 or parts[0] != "arn":
        raise ValueError(f"target Arn is not an ARN: {arn!r}")
    return parts[2], parts[3], parts[4], parts[5]


def _deliver_to_lambda(arn: str, payload: Any) -> None:
    from moto.awslambda.models import lambda_backends

    from localcloud.glue.awslambda import invoke_event

    _, region, account, resource = _arn_parts(arn)
    _, name, *qualifier = resource.split(":")
    function = lambda_backends[account][region].get_function(name, qualifier[0] if qualifier else None)
    invoke_event(function, payload)


def _deliver_to_state_machine(arn: str, payload: Any) -> None:
    from moto.stepfunctions.responses import get_backend

    _, region, account, _ = _arn_parts(arn)
    get_backend(account, region).start_execution(
        arn, name=f"events-{uuid.uuid4().hex}", execution_input=json.dumps(payload))


def _deliver_to_queue(arn: str, payload: Any, target: dict[str, Any]) -> None:
    from moto.sqs.models import sqs_backends

    _, region, account, queue_name = _arn_parts(arn)
    group_id = (target.get("SqsParameters") or {}).get("MessageGroupId")
    body = payload if isinstance(payload, str) else json.dumps(payload)
    sqs_backends[account][region].send_message(queue_name=queue_name, message_body=body,
                                               group_id=group_id)
    cloud = active_cloud()
    if cloud is not None:  # SQS bills the queue's owner for what EventBridge sends it
        cloud.count(cloud.requests, ("sqs", "SendMessage"))


def _deliver_to_log_group(arn: str, payload: Any) -> None:
    from moto.logs.models import logs_backends

    _, region, account, resource = _arn_parts(arn)
    group_name = resource.split(":", 1)[1].removesuffix(":*")
    backend = logs_backends[account][region]
    stream = str(uuid.uuid4())
    backend.create_log_stream(group_name, stream)
    message = payload if isinstance(payload, str) else json.dumps(payload)
    backend.put_log_events(group_name, stream, [{"timestamp": int(time.time() * 1000),
                                                 "message": message}])


def _deliver(rule: Rule, target: dict[str, Any], event: dict[str, Any]) -> None:
    cloud = active_cloud()
    arn = target["Arn"]
    try:
        payload = target_input(target, event, rule.name, rule.arn)
        service = _arn_parts(arn)[0]
        if service == "lambda":
            _deliver_to_lambda(arn, payload)
        elif service == "states":
            _deliver_to_state_machine(arn, payload)
        elif service == "sqs":
            _deliver_to_queue(arn, payload, target)
        elif service == "logs":
            _deliver_to_log_group(arn, payload)
        else:
            raise ValueError(f"no delivery to {service} targets here")
    except Exception as exc:
        log.warning("EventBridge rule %s could not deliver to %s: %s", rule.name, arn, exc)
        if cloud is not None:

            cloud.delivery_failures.append(DeliveryFailure(arn, f"{type(exc).__name__}: {exc}", event))


_DELIVERED_HERE = {"lambda", "states", "sqs", "logs"}


def _send_to_targets(self: Rule, original_event: dict[str, Any], transform_input: bool = True) -> None:
    cloud = active_cloud()
    if cloud is None:
        return _moto_send_to_targets(self, original_event, transform_input)
    if self.state != "ENABLED" or not self.event_pattern.get_pattern():
        return None
    if not self.event_pattern.matches_event(original_event):
        return None
    event = bus_event(original_event)
    fault = cloud.event_fault(event)
    for target in list(self.targets):
        service = target["Arn"].split(":")[2:3]
        if service and service[0] in _DELIVERED_HERE:
            if fault is None:
                cloud.submit(f"deliver {event.get('detail-type')} to {target['Arn']}",
                             lambda target=target: _deliver(self, target, event))
        else:
            single = copy.copy(self)
            single.targets = [target]
            _moto_send_to_targets(single, original_event, transform_input)
    if fault is not None:
        _deliver_with_fault(cloud, fault, self, event)
    return None


# --- delivery faults -----------------------------------------------------------------------

def _deliver_to_rule_targets(rule: Rule, event: dict[str, Any]) -> None:
    """Every target of the rule that is delivered here, one after the other."""
    for target in list(rule.targets):
        if target["Arn"].split(":")[2] in _DELIVERED_HERE:
            _deliver(rule, target, event)


def _deliver_with_fault(cloud: EventsCloud, fault: EventFault, rule: Rule, event: dict[str, Any]) -> None:
    """Deliver an event as the fault says: twice, late, or held and released in reverse."""
    what = f"{fault.kind} {event.get('detail-type')} of rule {rule.name}"
    if fault.kind == "duplicate":
        cloud.submit(what, lambda: [_deliver_to_rule_targets(rule, event) for _ in range(2)])
    elif fault.kind == "delay":
        cloud.submit_later(what, fault.seconds, lambda: _deliver_to_rule_targets(rule, event))
    else:  # reorder: the first held event starts the window; at its end all go, newest first
        with fault.lock:
            fault.held.append((rule, event))
            first = len(fault.held) == 1

        def release() -> None:
            with fault.lock:
                held, fault.held = fault.held, []
            for held_rule, held_event in reversed(held):
                _deliver_to_rule_targets(held_rule, held_event)

        if first:
            cloud.submit_later(what, fault.seconds, release)


# --- schedules ---------------------------------------------------------------------------

_RATE = re.compile(r"^rate\((\d+) (minute|minutes|hour|hours|day|days)\)$")
_UNIT_SECONDS = {"minute": 60, "hour": 3600, "day": 86400}
_moto_put_rule = EventsBackend.put_rule
_clocks: dict[tuple[str, str, str], object] = {}
"""The running clock of each scheduled rule (account, region, name): a rule put again gets a
new clock and the old one stops at its next tick."""


def rate_seconds(expression: str | None) -> int | None:
    """The period of a `rate(N unit)` expression in seconds; None for anything else."""
    match = _RATE.match(expression or "")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2).rstrip("s")] if match else None


def scheduled_event(rule: Rule) -> dict[str, Any]:
    return {"version": "0", "id": str(uuid.uuid4()), "detail-type": "Scheduled Event", "source": "aws.events",
            "account": rule.account_id, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "region": rule.region_name, "resources": [rule.arn], "detail": {}}


def _put_rule(self: EventsBackend, name: str, *args: Any, **kwargs: Any) -> Rule:
    rule = _moto_put_rule(self, name, *args, **kwargs)
    cloud, period = active_cloud(), rate_seconds(rule.scheduled_expression)
    if cloud is None or period is None:
        return rule
    key, clock = (self.account_id, self.region_name, name), object()
    _clocks[key] = clock

    def tick() -> None:
        current = self.event_buses["default"].rules.get(name)
        if _clocks.get(key) is not clock or current is None or active_cloud() is not cloud:
            return  # put again, deleted, or another cloud's
        if current.state == "ENABLED":
            event = scheduled_event(current)
            for target in list(current.targets):
                if target["Arn"].split(":")[2] in _DELIVERED_HERE:
                    cloud.submit(f"deliver Scheduled Event to {target['Arn']}",
                                 lambda target=target: _deliver(current, target, event))
        cloud.submit_later(f"schedule {name}", period, tick)

    cloud.submit_later(f"schedule {name}", period, tick)
    return rule


def entry_size(entry: dict[str, Any]) -> int:
    """A PutEvents entry's size as EventBridge calculates it (Calculating PutEvents event entry size)."""
    texts = [entry.get("Source", ""), entry.get("DetailType", ""), entry.get("Detail") or "",
             *(resource for resource in entry.get("Resources") or [] if resource)]
    return (14 if entry.get("Time") is not None else 0) + sum(len(text.encode()) for text in texts)


def _put_events_sized(self: EventsBackend, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    cloud = active_cloud()
    if cloud is not None:
        for entry in events:
            cloud.note_payload("events", entry_size(entry), f"{entry.get('Source')} {entry.get('DetailType')}")
    return _moto_put_events(self, events)


def apply() -> None:
    Rule.send_to_targets = _send_to_targets
    EventsBackend.put_events = _put_events_sized
    EventsBackend.put_rule = _put_rule
