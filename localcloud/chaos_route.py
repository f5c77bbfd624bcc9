"""The chaos control route: fault injection into a running local cloud from another process.

`trainfleet chaos FAULT RUN TARGET` (localcloud/commands.py) POSTs a fault request, a JSON object
{"fault", "run", "target", "seconds"}, to CHAOS_PATH on the cloud's endpoint; the endpoint's WSGI
wrapper (glue/faults.py) hands it to `inject` and answers 200 with what was done, or 400 with
{"error": ...}. The endpoint binds loopback only.

Faults on an instance of the run (TARGET an instance id tagged trainfleet:run=RUN):
kill (the instance dies), freeze (every process stopped: a wedged host), hang (one trainer
rank stopped), crash (one trainer rank SIGKILLed), spot (the two-minute Spot warning, then the
interruption), rebalance (a rebalance recommendation), health (an AWS Health retirement
event). Faults on a service (TARGET dynamodb, s3, events, lambda, ec2 or states): throttle
and error, for `seconds`; they hit every caller of the service, as an outage does, whatever
the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localcloud.parts import ChaosTarget

__all__ = ["CHAOS_PATH", "INSTANCE_FAULTS", "SERVICE_FAULTS", "ChaosError", "inject", "on_instance"]

CHAOS_PATH = "/_localcloud/chaos"
"""The control route (moto's own control routes live under /moto-api/)."""
INSTANCE_FAULTS = ("kill", "freeze", "hang", "crash", "spot", "rebalance", "health")
"""Faults on one instance of a run: kill (it dies), freeze (all its processes stop), hang and
crash (one trainer rank stops / is killed), spot, rebalance, health (the EC2 notice or AWS
Health event for it)."""
SERVICE_FAULTS = ("throttle", "error")
"""Faults on a service (dynamodb, s3, events, lambda, ec2, states) for some seconds: every
request answers its throttling error / its internal error."""

_ANSWER_NAMES = {"throttle": "throttling error", "error": "internal error"}


class ChaosError(ValueError):
    """A fault that cannot be injected as asked; the message says why."""


def inject(cloud: ChaosTarget, request: dict[str, Any]) -> dict[str, Any]:
    """Carry out one fault request; what was done, as JSON-ready data."""
    fault, run, target = (request.get(name) for name in ("fault", "run", "target"))
    if not isinstance(run, str) or not run or not isinstance(target, str) or not target:
        raise ChaosError("the request needs a run and a target")
    if fault in SERVICE_FAULTS:
        seconds = request.get("seconds")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
            raise ChaosError(f"{fault} needs seconds > 0, got {seconds!r}")
        try:
            cloud.fail_requests(target, float(seconds), fault)  # its answers are named so
        except ValueError as error:
            raise ChaosError(f"{fault} {target}: {error}") from error
        return {"fault": fault, "run": run, "service": target, "seconds": seconds,
                "done": f"every request to {target} answers its {_ANSWER_NAMES[fault]} for {seconds:g} s"}
    if fault not in INSTANCE_FAULTS:
        raise ChaosError(f"fault must be one of {[*INSTANCE_FAULTS, *SERVICE_FAULTS]}, got {fault!r}")
    _check_instance_of_run(cloud, run, target)
    try:
        done = on_instance(cloud, fault, target)
    except (RuntimeError, KeyError) as error:
        raise ChaosError(f"{fault} {target} of run {run}: {error}") from error
    return {"fault": fault, "run": run, "instance": target, **done}


def _check_instance_of_run(cloud: ChaosTarget, run: str, instance_id: str) -> None:
    from moto.ec2.exceptions import InvalidInstanceIdError

    from localcloud.glue.ec2 import ec2_backend
    from trainfleet.adapters.ec2_fleet import TAG_RUN

    try:
        cloud.fleet.get(instance_id)
        instance = ec2_backend(cloud).get_instance(instance_id)
    except (KeyError, InvalidInstanceIdError) as error:
        raise ChaosError(f"run {run} has no instance {instance_id}: no such instance in the "
                         f"local fleet") from error
    tags = {tag["key"]: tag["value"] for tag in instance.get_tags()}
    if tags.get(TAG_RUN) != run:
        raise ChaosError(f"instance {instance_id} is not one of run {run}: its {TAG_RUN} tag is "
                         f"{tags.get(TAG_RUN)!r}")


def on_instance(cloud: ChaosTarget, fault: str, instance_id: str, role: str = "trainer") -> dict[str, Any]:
    """Inject an instance fault; `role` is the process hang and crash hit: a trainer rank, or the
    node agent alone (before a trainer exists)."""
    fleet = cloud.fleet
    if fault == "kill":
        fleet.kill(instance_id)
        return {"done": "SIGKILL to every process of the instance: it terminates"}
    if fault == "freeze":
        fleet.hang(instance_id)
        return {"done": "SIGSTOP to every process of the instance: it stays running, frozen"}
    if fault == "hang":
        pid = fleet.hang_process(instance_id, role)
        return {"pid": pid, "done": f"SIGSTOP to {role} process {pid}"}
    if fault == "crash":
        pid = fleet.crash_process(instance_id, role)
        return {"pid": pid, "done": f"SIGKILL to {role} process {pid}"}
    if fault == "spot":
        event_id = cloud.inject_spot_interruption(instance_id)
        return {"event_id": event_id, "done": "EC2 Spot Instance Interruption Warning sent; the "
                f"instance is interrupted in {cloud.config.spot_notice_seconds:g} nominal s"}
    if fault == "rebalance":
        event_id = cloud.inject_rebalance(instance_id)
        return {"event_id": event_id, "done": "EC2 Instance Rebalance Recommendation sent"}
    event_id = cloud.inject_health_event([instance_id])
    return {"event_id": event_id, "done": "AWS Health Event AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED sent"}
