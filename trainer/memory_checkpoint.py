"""In-memory checkpoints: every rank's shard of the training state in its node's host memory and
in the host memory of a buddy node, so that a lost node costs a step or two and no S3 read.

Every `memory_interval` steps each rank copies its shard to CPU memory (on a thread, overlapping
the next forward and backward like the S3 save's staging; the wait is at the next optimizer
step), serialises it once, writes it to its node's host-memory folder and sends it to its buddy:
the same local rank on the next node (by the control plane's node ranks), which writes it into
its own node's folder. On a node the folder is /dev/shm: it outlives the trainer's processes (a
restart finds it) but not the instance.

Copies start only when every rank's last one is done, which each rank's vote on the step's
all-reduce says (as the S3 save's votes do): a copy slower than a step makes the next ones skip a
step or more on every rank alike, rather than hold training up. So the last copy is whole on every
node when the next starts, and only then are older ones dropped: a node holds its own ranks'
shards and its previous node's at two steps, the last whole one and the one being written, four
times its share of the state (memory_plan.host_memory_per_node), and the world always has a step
whose copies all exist.

    memory = MemoryCheckpoints(cfg.checkpoint, key=..., ranks_per_node=8, node_rank=3)
    found = memory.newest_whole()             # or None: some shard has no copy; resume from S3
    restored = memory.restore(state, found)
    for step in ...:
        ...train one step; its all-reduce also sums memory.vote() over the ranks: agreed...
        memory.maybe_copy(step, state, agreed)
    memory.close()

The copies go over a gloo group of their own (host memory to host memory, also on GPU nodes),
from the copying thread, its connections made lazily: a rank talks to its buddy and its ward (and
its neighbours in the group's ring collectives), and an eager group would connect each rank to
every other, 4,095 connections a rank at 4,096 ranks, anew in every repaired world. A rank's copy
is serialised straight into its node's tmpfs and streamed from there to its buddy, which writes it
into its own tmpfs as it arrives, CHUNK_BYTES at a time: the copy needs no buffer of a shard's size
beside the staged state, and a copy a repair abandons holds two chunks until its exchange ends.
At most one copy is in flight, and every rank copies the same steps in the same order, which is
what pairs each send with its receive.

`newest_whole` and `restore` are collective: every rank says which copies its node holds of its own shard, of its
ward's (the rank whose buddy it is) and of any other shard its node held last time, all agree on the newest step that every shard of the world
has somewhere, and each rank loads its shard from its own node's memory or receives it from the
rank holding it. A world with some shard at no step gets None and resumes from S3.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainer.checkpoint import host_stager
from trainer.parallelize import local_part

__all__ = ["MemoryCheckpoints", "MemoryCheckpointError", "Found", "Restored", "buddy_of"]

log = logging.getLogger(__name__)


class MemoryCheckpointError(RuntimeError):
    """An in-memory checkpoint could not be copied or loaded."""


def buddy_of(rank: int, node_ranks: list[int], ranks_per_node: int) -> int:
    """The rank whose node holds the second copy of `rank`'s shard: the same local rank on the
    next node in the control plane's node ranks (`node_ranks[r]`: rank r's node; the world's nodes
    in a ring), never a rank of the same node; itself alone on one node. So a lost node's shards
    are all on one other node, and only a node lost together with the node after it loses copies.
    Node ranks, not the order torchrun's rendezvous gave the nodes: that order follows their
    addresses, which the control plane neither chooses nor keeps across attempts."""
    nodes = len(node_ranks) // ranks_per_node
    wanted = (node_ranks[rank] + 1) % nodes
    return next(other for other, node in enumerate(node_ranks)
                if node == wanted and other % ranks_per_node == rank % ranks_per_node)


@dataclass(frozen=True)
class Found:
    """A step every shard has in some node's memory (`newest_whole`)."""

    step: int
    sources: dict[int, int]
    """Shard -> the rank that gives it: the shard's own where it holds it, else the lowest holder."""


@dataclass(frozen=True)
class Restored:
    """What `restore` loaded: the step, and where the world's shards came from."""

    step: int
    own_memory: int
    """Shards loaded from their own node's memory."""
    peers: int
    """Shards received from the node holding their copy (a replaced node's)."""
    peer_bytes: int
    """Bytes those shards took on the network."""


class MemoryCheckpoints:
    """One rank's in-memory checkpoints (module docstring); every rank constructs it alike and
    calls `restore` and `maybe_copy` alike."""

    def __init__(self, cfg: Any, *, key: str, ranks_per_node: int, node_rank: int,
                 timeout: timedelta = timedelta(minutes=10)):
        """
        cfg: the CheckpointConfig (memory_interval, memory_dir).
        key: names the layout and model the shards belong to; a copy under another key (another
            pp x dp x tp, another world size) is never loaded.
        ranks_per_node: how many ranks each node runs (its nodes are consecutive rank blocks).
        node_rank: this node's rank in the control plane's launch spec (buddy_of).
        Collective: the ranks' node ranks are gathered on the copies' own gloo group, made here.
        """
        self.interval = cfg.memory_interval
        self.folder = Path(cfg.memory_dir) / key
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.ranks_per_node = ranks_per_node
        self._group = _lazy_gloo_group(timeout) if self.world_size > 1 else None
        node_ranks = [node_rank]
        if self._group is not None:
            node_ranks = [0] * self.world_size
            dist.all_gather_object(node_ranks, node_rank, group=self._group)
        self.buddy = buddy_of(self.rank, node_ranks, ranks_per_node)
        self.ward = next(other for other in range(self.world_size)
                         if buddy_of(other, node_ranks, ranks_per_node) == self.rank)
        """The rank whose shard this rank's node keeps the second copy of."""
        self._stager = host_stager()
        self._staging: Future | None = None
        self._staging_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-checkpoint")
        self._in_flight: Future | None = None
        self._last_copied: int | None = None
        self.blocked_seconds = 0.0
        """Total time the training loop has waited on copies (staging, and a copy still going)."""
        self.copy_seconds = 0.0
        """Total time the copying thread spent on copies (serialise, write, exchange)."""
        self.copies = 0
        self.unavailable = ""
        """Why the last `restore` found nothing to load."""

    # ---- copy ---------------------------------------------------------------------------------

    def vote(self) -> torch.Tensor:
        """This rank's say in the next `maybe_copy`: [its last copy is done, it failed], as 0 or 1.
        Summed over all ranks (the step's all-reduce carries them), they are `maybe_copy`'s `agreed`."""
        done = self._in_flight is None or self._in_flight.done()
        failed = done and self._in_flight is not None and self._in_flight.exception() is not None
        return torch.tensor([float(done), float(failed)])

    def maybe_copy(self, step: int, state: Stateful, agreed: torch.Tensor) -> bool:
        """Start the in-memory copy of `step` if it is on the interval and every rank's last copy
        is done (`agreed`: the ranks' votes summed); True if one was started. A copy still going
        somewhere skips this step's on every rank alike (copies slower than steps take every few
        steps, never hold training up). Raises MemoryCheckpointError if a copy failed on any rank."""
        done, failed = (int(flag) for flag in agreed.tolist())
        if failed:
            self._wait()  # raises this rank's own error, if it has one
            raise MemoryCheckpointError(f"in-memory checkpoint of step {self._last_copied} failed on another rank")
        if step % self.interval or done < self.world_size:
            return False
        started = time.perf_counter()
        self._wait()
        if self._last_copied is not None:
            # Done on every rank: that copy is whole everywhere, older ones are no longer needed.
            last = self._last_copied
            self._drop(lambda saved: saved < last)
        staged = self._stager.stage(state.state_dict())
        self._staging = staged
        # In a box the thread empties: once serialised, nothing of the thread's holds the staged state.
        self._in_flight = self._copier.submit(self._copy, step, [staged], self._group)
        self._last_copied = step
        self.blocked_seconds += time.perf_counter() - started
        return True

    def _copy(self, step: int, staged_box: list[Future], group: dist.ProcessGroup | None) -> None:
        started = time.perf_counter()
        staged = staged_box.pop()
        own = self._copy_file(self.rank, step)
        with _written_whole(own) as out:
            torch.save(dict(_leaves(staged.result())), out)
        del staged
        if self.buddy != self.rank:
            _exchange_files({self.buddy: own}, {self.ward: self._copy_file(self.ward, step)}, group)
        self.copy_seconds += time.perf_counter() - started
        self.copies += 1

    def _copy_file(self, shard: int, step: int) -> Path:
        """Where this node keeps `shard`'s copy of `step`."""
        folder = self._shard_folder(shard)
        folder.mkdir(parents=True, exist_ok=True)
        return folder / _file_name(step)

    def _drop(self, unwanted: Callable[[int], bool]) -> None:
        """Delete this rank's share of the node's copies of the steps `unwanted` says."""
        for shard in self._shards_here():
            for saved in self._steps(shard):
                if unwanted(saved):
                    (self._shard_folder(shard) / _file_name(saved)).unlink(missing_ok=True)

    def _wait(self) -> None:
        """Block until the copy in flight is done; MemoryCheckpointError if it failed."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        try:
            in_flight.result()
        except Exception as exc:
            raise MemoryCheckpointError(f"in-memory checkpoint failed on rank {self.rank}: "
                                        f"{type(exc).__name__}: {exc}") from exc

    def _before_optimizer_step(self, *_: Any) -> None:
        # The optimizer step changes the state in place: the copy being staged must be complete.
        staging, self._staging = self._staging, None
        if staging is not None:
            started = time.perf_counter()
            staging.exception()  # waits; a failed copy is raised by the next maybe_copy, on this rank
            self.blocked_seconds += time.perf_counter() - started

    # ---- restore ------------------------------------------------------------------------------

    def newest_whole(self) -> Found | None:
        """The newest step that every shard of the world has in some node's memory, and which rank
        gives each shard (its own, where it holds it); None when there is none, `unavailable`
        saying why. Collective: every rank says what its node holds."""
        # Every shard on this node with this rank's local rank: the node may have held other
        # ranks in the last attempt (torchrun orders the nodes by address), its copies still count.
        held = {shard: self._steps(shard) for shard in self._shards_here()}
        everyone: list[dict[int, list[int]]] = [held]
        if self._group is not None:
            everyone = [{}] * self.world_size
            dist.all_gather_object(everyone, held, group=self._group)
        holders: dict[tuple[int, int], list[int]] = {}
        for rank, inventory in enumerate(everyone):
            for shard, steps in inventory.items():
                for step in steps:
                    holders.setdefault((shard, step), []).append(rank)
        common = set.intersection(*({step for (s, step) in holders if s == shard} for shard in range(self.world_size)))
        if not common:
            missing = [shard for shard in range(self.world_size) if not any(s == shard for s, _ in holders)]
            newest = {shard: max(step for s, step in holders if s == shard) for shard in range(self.world_size)
                      if shard not in missing}
            if len(missing) == self.world_size:
                self.unavailable = "no node holds an in-memory copy"
            elif missing:
                self.unavailable = (f"shards {missing} have no in-memory copy (a node and its buddy were lost, or "
                                    "never held one)")
            else:
                self.unavailable = f"no step has an in-memory copy of every shard (newest per shard: {newest})"
            log.info("%s", self.unavailable)
            return None
        step = max(common)
        return Found(step, {shard: shard if shard in holders[shard, step] else min(holders[shard, step])
                            for shard in range(self.world_size)})

    def restore(self, state: Stateful, found: Found) -> Restored:
        """Load `found`'s step into `state`: this rank's shard from its node's memory, or received
        from the rank `found` names into its node's memory first (its own copy again), while it
        sends the shards it gives (collective)."""
        step, source = found.step, found.sources
        sends = {shard: self._copy_file(shard, step) for shard, rank in source.items()
                 if rank == self.rank and shard != self.rank}
        own = self._copy_file(self.rank, step)
        received = source[self.rank] != self.rank
        peer_bytes = _exchange_files(sends, {source[self.rank]: own} if received else {}, self._group)
        self._apply(state, own)
        figures = torch.tensor([0 if received else 1, int(received), peer_bytes])
        if self._group is not None:
            dist.all_reduce(figures, group=self._group)
        own_memory, peers, peer_bytes = figures.tolist()
        log.info("restored step %d from host memory: %d shards from their own node, %d from a buddy (%d bytes)",
                 step, own_memory, peers, peer_bytes)
        return Restored(step, own_memory, peers, peer_bytes)

    def _apply(self, state: Stateful, copy: Path) -> None:
        saved = torch.load(copy, weights_only=True, mmap=True)  # the tmpfs's pages, not a second copy
        current = state.state_dict()
        for path, value in _leaves(current):
            if path not in saved:
                raise MemoryCheckpointError(f"the in-memory copy under {self.folder} lacks {'.'.join(map(str, path))}")
            if isinstance(value, torch.Tensor):
                target = local_part(value)
                if target.shape != saved[path].shape:
                    raise MemoryCheckpointError(
                        f"{'.'.join(map(str, path))}: in-memory copy has shape {tuple(saved[path].shape)}, "
                        f"this rank holds {tuple(target.shape)}")
                target.copy_(saved[path])
            else:
                _set(current, path, saved[path])
        state.load_state_dict(current)

    def forget_after(self, step: int | None) -> None:
        """Drop the copies on this node (this rank's share of them) other than `step`'s (all for
        None): the world resumed at `step`; newer copies belong to an abandoned timeline, older
        ones will not be needed."""
        self._drop(lambda saved: step is None or saved != step)

    # ---- the rest -----------------------------------------------------------------------------

    def _steps(self, shard: int) -> list[int]:
        """The steps of `shard` this node holds complete, oldest first."""
        folder = self._shard_folder(shard)
        names = os.listdir(folder) if folder.is_dir() else []
        return sorted(int(name[5:-3]) for name in names if name.startswith("step-") and name.endswith(".pt"))

    def _shard_folder(self, shard: int) -> Path:
        return self.folder / f"shard-{shard:05d}"

    def _shards_here(self) -> set[int]:
        """The shards this rank looks after in its node's memory: its own, its ward's, and any
        other left there with its local rank (ranks of a node share one folder)."""
        names = os.listdir(self.folder) if self.folder.is_dir() else []
        found = {int(name[6:]) for name in names if name.startswith("shard-")}
        return {self.rank, self.ward} | {shard for shard in found if shard % self.ranks_per_node
                                         == self.rank % self.ranks_per_node}

    def close(self) -> None:
        """Wait for the copy in flight and release resources; raises MemoryCheckpointError if it failed."""
        try:
            self._wait()
        finally:
            self._staging_hook.remove()
            self._copier.shutdown(wait=True)
            self._stager.close()

    def abandon(self) -> None:
        """Stop without waiting: the world failed and is being repaired. A copy in flight finishes
        on its own or fails on the dead group; one it completes is of the failed world's timeline,
        which the repaired world repeats exactly from its restored step. The staged state is
        released as soon as a staging in progress ends (its stager closes off the repair's path),
        and a copy's exchange holds two chunks until it ends."""
        self._staging_hook.remove()
        self._staging = None
        self._copier.shutdown(wait=False)
        threading.Thread(target=self._stager.close, name="memory-checkpoint-release", daemon=True).start()


def _file_name(step: int) -> str:
    return f"step-{step:09d}.pt"


def _leaves(tree: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) of a nested state dict; a tensor leaf as the part this rank holds, on the CPU."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path, local_part(tree) if isinstance(tree, torch.Tensor) else tree


def _set(tree: dict, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


CHUNK_BYTES = 64 * 2**20
"""What a copy moves between nodes at once: a shard's file is streamed this much at a time."""
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"


@contextlib.contextmanager
def _written_whole(path: Path) -> Iterator[BinaryIO]:
    """A file to write `path` into, renamed into place once whole: a rank never reads half of it."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with partial.open("wb") as out:
        yield out
    partial.replace(path)


def _exchange_files(sends: dict[int, Path], receives: dict[int, Path], group: dist.ProcessGroup | None) -> int:
    """Send each file of `sends` to its rank while receiving one file from each rank of `receives`
    into the path given: the sizes first, then CHUNK_BYTES of each file at a time, each round one
    batch (its sends and receives started together, in no order among the peers). The bytes received."""
    sizes = {rank: torch.zeros(1, dtype=torch.int64) for rank in receives}
    _batch([(dist.isend, torch.tensor([path.stat().st_size]), rank) for rank, path in sends.items()]
           + [(dist.irecv, size, rank) for rank, size in sizes.items()], group)
    incoming = {rank: int(size.item()) for rank, size in sizes.items()}
    outgoing = {rank: path.stat().st_size for rank, path in sends.items()}
    rounds = -(-max([*incoming.values(), *outgoing.values()], default=0) // CHUNK_BYTES)
    with contextlib.ExitStack() as files:
        readers = {rank: files.enter_context(path.open("rb")) for rank, path in sends.items()}
        writers = {rank: files.enter_context(_written_whole(path)) for rank, path in receives.items()}
        for index in range(rounds):
            leaving = {rank: _chunk(size, index) for rank, size in outgoing.items() if index * CHUNK_BYTES < size}
            for rank, chunk in leaving.items():
                readers[rank].readinto(memoryview(chunk.numpy()))
            arriving = {rank: _chunk(size, index) for rank, size in incoming.items() if index * CHUNK_BYTES < size}
            _batch([(dist.isend, chunk, rank) for rank, chunk in leaving.items()]
                   + [(dist.irecv, chunk, rank) for rank, chunk in arriving.items()], group)
            for rank, chunk in arriving.items():
                writers[rank].write(memoryview(chunk.numpy()))
    return sum(incoming.values())


def _chunk(size: int, index: int) -> torch.Tensor:
    """A buffer for chunk `index` of a file of `size` bytes."""
    return torch.empty(min(CHUNK_BYTES, size - index * CHUNK_BYTES), dtype=torch.uint8)


def _lazy_gloo_group(timeout: timedelta) -> dist.ProcessGroup:
    """A gloo group of the whole world whose pairs connect at their first message. torch makes a
    gloo group's device as it makes the group, lazily connecting where TORCH_GLOO_LAZY_INIT is
    set then (new_group takes no options for gloo): set for that call alone."""
    previous = os.environ.get(GLOO_LAZY_INIT)
    os.environ[GLOO_LAZY_INIT] = "1"
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    finally:
        if previous is None:
            del os.environ[GLOO_LAZY_INIT]
        else:
            os.environ[GLOO_LAZY_INIT] = previous


def _batch(ops: list[tuple], group: dist.ProcessGroup | None) -> None:
    if ops:
        for request in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group) for op, tensor, peer in ops]):
            request.wait()
