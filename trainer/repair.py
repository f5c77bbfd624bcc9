"""The world repaired in place: when a node is lost, the ranks of the nodes left keep their
processes (their interpreter, imports, CUDA context and model) and form the next world with the
lost node's replacement, instead of every node restarting its trainer.

A repair is ordered by the node's agent (the control plane chose it: `parallel.repair_file`
names where the order comes). On a rank whose process lives through the loss:

1. The step fails. Under gloo a collective with a lost peer raises once the peer's connection
   closes, and a rank that leaves its groups closes its own, so the error reaches every rank.
   Under NCCL (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) the group's watchdog aborts a collective whose
   peer is lost, a few seconds after NCCL reports it, or past the collective timeout; the watcher
   thread, seeing the order arrive, aborts every group. Either way what the main thread waits on
   returns with partial values, which the check after every host synchronisation refuses
   (trainer/world_failure.py), and the next call on an aborted group raises.
2. The rank abandons the step: FSDP's state of the iteration is reset (FSDPModule.reset_iter_state)
   and every process group aborted. Copies and saves still in flight are abandoned by their
   owners (train.py): they end on the dead groups' errors.
3. It says that the step failed (trainer/repair_order.py: the agent reports it to the control
   plane) and waits for the order (a generation newer than its own), then forms the world the order names:
   its store, met at by every rank of the surviving nodes and of the replacement.
4. It creates the process groups again, in the order a fresh process creates them. torch names a
   group by a counter that destroying the world resets, so every group gets the name it had: the
   model's DeviceMesh, its DTensors and the functional collectives resolve groups by name and
   need nothing; FSDP's mesh info and the pipeline's stages hold the group objects and are
   pointed at the new ones (`rebind`).
5. The world restores the newest step every shard has in host memory (the replacement receives
   its shards from its buddy, trainer/memory_checkpoint.py) and trains on.

The replacement's trainer starts with the order already there and joins its generation
(`join_order`) instead of torchrun's world: torchrun on that node only supervises its processes.
The order and the failure file are trainer/repair_order.py's.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from trainer.repair_order import RepairOrder, read_order

__all__ = ["RepairError", "order_store", "join_order", "OrderWatcher", "abandon_step", "await_order", "rebind"]

log = logging.getLogger(__name__)

ORDER_POLL_S = 0.05
"""How often a rank waiting for its order looks at the order file (a local file)."""
WATCH_EVERY_S = 0.5
"""How often a training rank's watcher looks for an order."""


class RepairError(RuntimeError):
    """The world could not be repaired in place."""


def order_store(order: RepairOrder, rank: int, ranks_per_node: int, timeout: timedelta) -> dist.Store:
    """The generation's store: served by the host node's first rank, reached by the others."""
    return dist.TCPStore(order.store_host, order.store_port, order.world_size(ranks_per_node),
                         is_master=rank == order.host_node_rank * ranks_per_node, timeout=timeout, multi_tenant=True)


def join_order(order: RepairOrder, rank: int, ranks_per_node: int, backend: str, timeout: timedelta,
               **options) -> None:
    """Start this process's default group as `rank` of the world `order` names, with collectives
    timing out after `timeout`. The others are waited for twice as long: under gloo a rank leaving
    the failed world waits for a collective it had in flight there (its group's end joins the
    thread running it) until that collective's timeout, when the peer it waits on is leaving too."""
    world_size = order.world_size(ranks_per_node)
    dist.init_process_group(backend, store=order_store(order, rank, ranks_per_node, 2 * timeout), rank=rank,
                            world_size=world_size, timeout=timeout, **options)
    log.info("joined generation %d of the world as rank %d of %d", order.generation, rank, world_size)


class OrderWatcher:
    """Aborts every process group when an order newer than `generation` arrives: a main thread
    waiting on a lost peer under NCCL (which waits for ever) raises, and under gloo (whose abort
    does not end a wait in progress: the lost peer's closed connection does) the next collective
    of a rank that was computing raises at once instead of waiting on a rank that left."""

    def __init__(self, path: Path, generation: int):
        self.path, self.generation = path, generation
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="repair-order-watcher", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_EVERY_S):
            order = read_order(self.path)
            if order is not None and order.generation > self.generation:
                log.warning("repair order %d arrived: aborting the process groups", order.generation)
                dist.distributed_c10d._abort_process_group()
                return

    def stop(self) -> None:
        """Stop watching (before this thread touches the groups itself)."""
        self._stop.set()
        self._thread.join()


def abandon_step(model_parts: list[torch.nn.Module], mesh: DeviceMesh, failure: BaseException) -> None:
    """Leave the failed step and the world: the model's FSDP state made a new model's, every
    process group destroyed, and every reference to one dropped: a gloo group closes its
    connections only once its last reference goes, and until then a peer still waiting in one of
    its collectives (gloo's abort does not end that wait, NCCL's does) waits out its timeout
    instead of raising and coming to the repair. (The pipeline's stages hold one too: train.py
    drops them.)"""
    log.warning("step failed (%s: %s): leaving the world to repair it", type(failure).__name__, failure)
    _reset_fsdp(model_parts)
    if dist.is_initialized():
        # Aborted, not destroyed: destroying a group waits for its communicators' kernels to end
        # (ProcessGroupNCCL::shutdown), and those waiting on a lost peer never do.
        dist.distributed_c10d._abort_process_group()
    mesh._pg_registry = {}
    for info in _fsdp_mesh_infos(model_parts):
        for name in _FSDP_GROUPS:
            if hasattr(info, name):
                setattr(info, name, None)
    cause: BaseException | None = failure
    while cause is not None:  # the failed step's frames hold groups and works in their locals
        traceback.clear_frames(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    gc.collect()


def _reset_fsdp(model_parts: list[torch.nn.Module]) -> None:
    """FSDP's state as a new model has it, wherever each rank was in the failed step: the next
    step must issue the same collectives on every rank (the new stages' metadata inference runs a
    backward before it)."""
    _settle_all_gathers(model_parts)
    for part in model_parts:
        # A part that never ran forward in this process (a replacement's) has no iteration to reset.
        if isinstance(part, FSDPModule) and part._get_fsdp_state()._is_root is not None:
            try:
                part.reset_iter_state()
            except Exception as exc:
                raise RepairError(f"FSDP's state of the failed step could not be reset ({type(exc).__name__}: "
                                  f"{exc}): the ranks of a stage could issue different collectives in the next "
                                  "world, so it restarts instead") from exc
            # The pipeline turns these off for every microbatch's backward but the last.
            part.set_is_last_backward(True)
            part.set_reshard_after_backward(True)
            part.set_requires_gradient_sync(True)
            part.set_requires_all_reduce(True)
        for parameter in part.parameters():
            parameter.grad = None
    # FSDP reduces the gradients its unsharded parameters hold: a rank that failed after a
    # backward left some there, which the next backward would reduce where others have none.
    for group in _fsdp_param_groups(model_parts):
        for fsdp_param in group.fsdp_params:
            fsdp_param.unsharded_accumulated_grad = None
            if hasattr(fsdp_param, "_unsharded_param"):
                fsdp_param._unsharded_param.grad = None


def _settle_all_gathers(model_parts: list[torch.nn.Module]) -> None:
    """Wait out the all-gathers the failed step left in flight, which FSDP's reset waits on too: a
    collective of the world being left fails with it (its error is that world's failure, already
    known), and the reset must not stop at it halfway."""
    for group in _fsdp_param_groups(model_parts):
        result = group._all_gather_result
        if result is None or not isinstance(result.all_gather_work, dist.distributed_c10d.Work):
            continue
        try:
            result.all_gather_work.wait()
        except Exception as exc:  # noqa: BLE001 (the failed world's own error)
            log.info("an all-gather of the failed step failed with it: %s", exc)
        group._all_gather_result = result._replace(all_gather_work=None)


_FSDP_GROUPS = ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group")
"""The groups an FSDPMeshInfo holds."""


def _fsdp_param_groups(model_parts: list[torch.nn.Module]) -> Iterator[Any]:
    """Every FSDPParamGroup of the parts' FSDP modules."""
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                yield from module._get_fsdp_state()._fsdp_param_groups


def _fsdp_mesh_infos(model_parts: list[torch.nn.Module]) -> Iterator[Any]:
    """Every FSDPMeshInfo of the parts' FSDP modules, once each."""
    seen: set[int] = set()
    for group in _fsdp_param_groups(model_parts):
        for info in (group.mesh_info, group.post_forward_mesh_info):
            if info is not None and id(info) not in seen:
                seen.add(id(info))
                yield info


def await_order(path: Path, generation: int, timeout: timedelta, alive: Callable[[], None],
                failure: BaseException) -> RepairOrder:
    """Wait for an order newer than `generation`, calling `alive` meanwhile; `failure` is raised
    again if none comes within `timeout` (no repair was ordered: the step failed for another
    reason, and the control plane restarts the world)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while (order := read_order(path)) is None or order.generation <= generation:
        if time.monotonic() > deadline:
            raise RepairError(f"no repair order came in {timeout.total_seconds():.0f} s after the step failed "
                              f"({type(failure).__name__}: {failure})") from failure
        alive()
        time.sleep(ORDER_POLL_S)
    return order


def rebind(mesh: DeviceMesh, fresh: DeviceMesh, model_parts: list[torch.nn.Module]) -> None:
    """Point what holds the old world's groups at the new ones. `fresh` is the mesh built over the
    new world the way the first was; the model keeps `mesh`, whose groups are found by name. (The
    pipeline's stages are made anew: Pipeline.restage.)"""
    if fresh._dim_group_names != mesh._dim_group_names:  # noqa: SLF001 (the names are the contract)
        raise RepairError(f"the repaired world's mesh groups are named {fresh._dim_group_names}, the model's "
                          f"{mesh._dim_group_names}: the groups were created in another order")
    mesh._pg_registry = fresh._pg_registry  # what compiled code looks groups up in
    for info in _fsdp_mesh_infos(model_parts):
        info.__post_init__()  # resolves its groups from its mesh, by name
