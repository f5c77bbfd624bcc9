"""A failed world's values are never used: the check after each host synchronisation.

Under NCCL a collective that fails does not raise where the host waits on it. With the error
handling a repairable world runs with (TORCH_NCCL_ASYNC_ERROR_HANDLING=2,
trainfleet.core.catalogue.NCCL_ERROR_HANDLING) the group's watchdog sets the group's error
(Backend.get_error), aborts its communicators, and the host's synchronisation on the result
returns normally with whatever had been reduced: a peer lost during the step's loss all-reduce
would leave a partial loss and gradient norm, which the step would clip with, log and report. An
abort of every group (the repair order's, trainer/repair.py) does the same. The next call on an
aborted group raises, but by then the values are in use.

So wherever the trainer reads a collective's result on the host (`.tolist()`, an object
collective) it calls `raise_if_failed` after: a step of a failed world raises WorldFailed
instead, and the world is repaired or restarted with nothing of that step kept. Gloo's groups
(the checkpoints', the in-memory copies') raise where they fail; they need no check.
"""

from __future__ import annotations

import torch.distributed as dist
from torch._C._distributed_c10d import ErrorType

__all__ = ["WorldFailed", "current_world", "failure", "raise_if_failed"]


class WorldFailed(RuntimeError):
    """A collective of this rank's world failed or was aborted: what it returned is not to be used."""


def failure(world: dist.ProcessGroup | None) -> str | None:
    """Why the world whose default group is `world` failed since it formed, or None while it is
    whole (and for None: one process, no world)."""
    if world is None:
        return None
    if dist.distributed_c10d.GroupMember.WORLD is not world:
        return "its process groups were aborted (a repair was ordered) or destroyed"
    for group in list(dist.distributed_c10d._world.pg_map):
        backends = {id(backend): backend for backend in map(group._get_backend, group._device_types)}
        for backend in backends.values():
            # Bound by builds with NCCL (ProcessGroupNCCL's watchdog sets it); gloo's has none.
            get_error = getattr(backend, "get_error", None)
            if get_error is not None and (error := get_error()) != ErrorType.SUCCESS:
                return (f"process group {group.group_name} reports {error.name} (NCCL's watchdog found an op of "
                        "it failed)")
    return None


def raise_if_failed(world: dist.ProcessGroup | None, after: str) -> None:
    """WorldFailed if `world` failed: call it after each host synchronisation on a collective of it
    (`after` names that collective)."""
    if (why := failure(world)) is not None:
        raise WorldFailed(f"the world failed by the end of {after}: {why}; its values are not used")


def current_world() -> dist.ProcessGroup | None:
    """This process's world as it is now (None without one): what `failure` compares against later."""
    return dist.distributed_c10d.GroupMember.WORLD if dist.is_available() and dist.is_initialized() else None
