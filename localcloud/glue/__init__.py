"""Named patches to moto 5.2.5 for what it lacks; one module per service.

moto is pinned exactly because these modules reach into its internals. Each patch says which
moto behaviour it replaces and why. cloud.py applies them once per process (apply_glue) as it
assembles a LocalCloud; the glue imports nothing of the cloud. A patch whose behaviour needs a
running LocalCloud (where to deliver an event, which fleet owns an instance) looks it up with
`active_cloud()`, typed by what the glue needs of it (localcloud/parts.py), and falls back to
moto's own behaviour when none is running, so a plain moto server in the same process is
unaffected.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localcloud.parts import RunningCloud

_lock = threading.Lock()
_active: RunningCloud | None = None


def activate(cloud: RunningCloud) -> None:
    """Make `cloud` the one the patches serve; moto's state is per process, so only one."""
    global _active
    with _lock:
        if _active is not None and _active is not cloud:
            raise RuntimeError(f"a LocalCloud is already running in this process at "
                               f"{_active.endpoint}; stop it first (moto state is per process)")
        _active = cloud


def deactivate(cloud: RunningCloud) -> None:
    global _active
    with _lock:
        if _active is cloud:
            _active = None


def active_cloud() -> RunningCloud | None:
    return _active
