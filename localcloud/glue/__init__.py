"""Named patches to moto 5.2.5 for what it lacks; one module per service.

moto is pinned exactly because these modules reach into its internals. Each patch says which
moto behaviour it replaces and why. `apply_all()` applies them once per process; LocalCloud
calls it on start. A patch whose behaviour needs a running LocalCloud (where to deliver an
event, which fleet owns an instance) looks it up with `active_cloud()` and falls back to moto's
own behaviour when none is running, so a plain moto server in the same process is unaffected.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localcloud.cloud import LocalCloud

_lock = threading.Lock()
_applied = False
_active: LocalCloud | None = None


def apply_all() -> None:
    """Apply every service's patches, once per process."""
    global _applied
    with _lock:
        if _applied:
            return
        from localcloud.glue import (awslambda, capacity_reservations, cloudwatch, dispatch, dynamodb, ec2, events,
                                     faults, iam, s3, sqs_lambda, stepfunctions, stepfunctions_map, vpc)

        for service in (awslambda, sqs_lambda, stepfunctions, stepfunctions_map, events, ec2, capacity_reservations,
                        vpc, dynamodb, iam, s3, cloudwatch, faults, dispatch):
            service.apply()
        _applied = True


def activate(cloud: LocalCloud) -> None:
    """Make `cloud` the one the patches serve; moto's state is per process, so only one."""
    global _active
    with _lock:
        if _active is not None and _active is not cloud:
            raise RuntimeError(f"a LocalCloud is already running in this process at "
                               f"{_active.endpoint}; stop it first (moto state is per process)")
        _active = cloud


def deactivate(cloud: LocalCloud) -> None:
    global _active
    with _lock:
        if _active is cloud:
            _active = None


def active_cloud() -> LocalCloud | None:
    return _active
