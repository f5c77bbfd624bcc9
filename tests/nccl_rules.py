"""NCCL's rules enforced on gloo: a CPU test fails where a GPU run would hang, and a failure goes
as NCCL's watchdog takes it, not as gloo raises it.

Progress. gloo progresses each operation on its own; torch's ProcessGroupNCCL does not:

- an unbatched `isend`/`irecv` (and `send`/`recv`, `send_object_list`, ...) between two ranks runs
  on a communicator of those two ranks alone, created lazily by the first such op of each rank,
  blocking its calling thread until the peer creates it too (ProcessGroupNCCL::pointToPoint);
- the ops of one communicator run in the order each rank issued them, on one stream: an op starts
  only once the ops issued before it on that communicator have completed, and a send completes
  only once its receive has started (and the receive once its send has);
- `batch_isend_irecv` (ncclGroupStart/End) and the collectives run on the group's own
  communicator, in issue order with each other: a batch's ops start together (within a batch the
  order of sends and receives does not matter); a collective completes once every rank of the
  group has started its own, and NCCL pairs a group's collectives by their order alone;
- ops match in issue order per pair of ranks and communicator, whatever their tags (NCCL has
  none): a send meets the receive of the same ordinal, which must be as large.

Failure (ProcessGroupNCCL's Watchdog::runLoop, WorkNCCL::wait, HeartbeatMonitor::runLoop). An op
whose peer's process is gone does not raise where it waits, as gloo's does once the connection
closes: the watchdog finds it failed (NCCL reports a lost peer within seconds; a group's timeout
passing is found the same way), sets the group's error (Backend.get_error: COMM_ERROR, TIMEOUT),
sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default), and then, by
TORCH_NCCL_ASYNC_ERROR_HANDLING: 0 does nothing (the wait goes on until the program aborts the
group); 1 aborts the group's communicators and ends the process (SIGABRT: its rethrow from the
watchdog thread); 2 aborts them and the process lives; 3, ProcessGroupNCCL's default, ends the
process without aborting (torchrun sets 1 for its workers unless the variable is set). Aborting a
group, by its watchdog or by the program (`_abort_process_group`, ncclCommAbort), lets its
kernels exit: a wait on it in progress returns normally, its buffers holding whatever had been
reduced or received; an op issued on it afterwards raises, and so does a `Work.wait()` begun
after its work's failure was found. With TORCH_NCCL_DUMP_ON_TIMEOUT and
TORCH_NCCL_ENABLE_MONITORING (both on by default) the first failure any rank's watchdog finds has
the heartbeat monitor of every rank's first world end its process
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC later (8 minutes) unless that world was aborted or destroyed by
then (its flight recorder's dump is left out here).

`install(distributed_c10d)` wraps c10d's point-to-point ops, its collectives (all_reduce,
broadcast, all_gather, barrier, and the tensor gather and reduce-scatter under the names that do
the work in the torch installed: the object collectives and the deprecated names call these),
new_group, init_process_group and _abort_process_group, so that every op on a group standing for
NCCL follows these rules while the real gloo op underneath moves the data. A group stands for NCCL unless it was made with the backend "gloo" by name (the
checkpoints' and the in-memory copies' own groups, gloo on a GPU node too): the world
init_process_group starts, and the groups made without a backend (DeviceMesh's). Each rank
publishes in the default group's store what it has issued on each communicator and what its
threads wait for; a rank that has to wait reads every rank's record, works out which ops have
started and completed, and waits for the next change. When what it waits for depends on a cycle
(each rank in it waiting for the next), NCCL would hang: it raises NcclDeadlock naming the ranks,
their ops and why.

Modelled as waits of the host: a rank waits where it calls `Work.wait()` or a collective without
async_op (as on gloo; NCCL would stall its stream there and the host at its next
synchronisation). Not modelled: the group communicators are taken as created (the trainer binds
NCCL to its device, which creates them eagerly); DTensor's functional collectives (tensor
parallel's), which go from C++ to the backend where these wrappers do not see them, keep gloo's
progress and errors; and once the store is gone with the rank that hosted it (torchrun's rank 0,
on any node), progress is no longer checked, while failures still go as the watchdog takes them.

tests/nccl_site/sitecustomize.py installs this in every process of a test session that imports
torch (ENABLE_VARIABLE, set by tests/conftest.py).
"""

from __future__ import annotations

import inspect
import itertools
import json
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

ENABLE_VARIABLE = "TRAINFLEET_TEST_NCCL_RULES"
"""Set (to 1) in a process's environment: its torch.distributed follows NCCL's rules."""
SITE = Path(__file__).resolve().parent / "nccl_site"
"""On the PYTHONPATH with ENABLE_VARIABLE: the folder whose sitecustomize installs the rules."""
PREFIX = "nccl_rules"

__all__ = ["install", "installed", "NcclDeadlock", "NcclMismatch", "NcclAborted", "Settings", "ENABLE_VARIABLE",
           "SITE"]


class NcclDeadlock(RuntimeError):
    """Ops that NCCL would never complete."""


class NcclMismatch(RuntimeError):
    """Ops NCCL would pair although they disagree (a send and its receive, or a group's collectives)."""


class NcclAborted(RuntimeError):
    """An op on communicators that were aborted, or a wait to create one ended by an abort."""


_c10d = None
"""torch.distributed.distributed_c10d once installed."""
_real: dict[str, object] = {}
"""c10d's own functions, which move the data."""
_RuledWork = None
"""_RuledWorkMixin over c10d's Work, once installed."""
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "barrier")
"""c10d's collectives that the rules wrap, with those of _TENSOR_COLLECTIVES; the others of c10d
(object collectives, deprecated names) call these."""
_TENSOR_COLLECTIVES = {"all_gather_single": "all_gather_into_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}
"""The tensor gather and reduce-scatter by their names since torch 2.13, and by the names that did
the work before it (the trainer supports torch 2.11; since 2.13 the old names call the new)."""


def _collectives(c10d) -> list[str]:
    """The names of c10d's collectives that move the data in the torch installed."""
    return [*_COLLECTIVES, *(new if hasattr(c10d, new) else old for new, old in _TENSOR_COLLECTIVES.items())]


def installed() -> bool:
    return _c10d is not None


def install(c10d) -> None:
    """Wrap `c10d` (torch.distributed.distributed_c10d, just executed) so that its ops follow
    NCCL's rules. Called before torch.distributed re-exports its names."""
    global _c10d, _RuledWork
    if _c10d is not None:
        return
    _c10d = c10d
    wrappers = {"isend": isend, "irecv": irecv, "batch_isend_irecv": batch_isend_irecv,
                "init_process_group": init_process_group, "new_group": new_group,
                "_abort_process_group": _abort_process_group,
                **{name: _ruled_collective(name) for name in _collectives(c10d)}}
    for name, wrapper in wrappers.items():
        _real[name] = getattr(c10d, name)
        wrapper.__wrapped__ = _real[name]
        wrapper.__doc__ = _real[name].__doc__
        setattr(c10d, name, wrapper)
    _RuledWork = type("RuledWork", (_RuledWorkMixin, c10d.Work), {})
    # What ProcessGroupNCCL reports of its watchdog's findings; gloo's backends have no get_error.
    _native().Backend.get_error = _backend_error


def _native():
    """torch's C++ half of c10d (its Backend and ErrorType)."""
    from torch._C import _distributed_c10d
    return _distributed_c10d


def _torch_distributed():
    """torch.distributed, once it has re-exported c10d (its DistBackendError, DistNetworkError)."""
    import torch.distributed
    return torch.distributed


@dataclass(frozen=True)
class Settings:
    """ProcessGroupNCCL's error handling, read from the environment as its constructor reads it."""

    error_handling: int = 3
    """TORCH_NCCL_ASYNC_ERROR_HANDLING: 0 NoHandling, 1 TearDown, 2 CleanUpOnly, 3 SkipCleanUp."""
    dump_timeout_ms: int = 15_000
    """TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC: the watchdog sleeps 4 times this after a failure."""
    dump_on_timeout: bool = True
    """TORCH_NCCL_DUMP_ON_TIMEOUT."""
    monitoring: bool = True
    """TORCH_NCCL_ENABLE_MONITORING."""
    heartbeat_timeout_s: int = 480
    """TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC."""
    coord_check_ms: int = 1_000
    """TORCH_NCCL_COORD_CHECK_MILSEC: how often the heartbeat monitor looks for another rank's failure."""

    @classmethod
    def from_environment(cls, environ=os.environ) -> Settings:
        def number(name: str, default: int) -> int:
            return int(environ.get(name, default))

        def flag(name: str, default: bool) -> bool:
            return environ.get(name, str(int(default))).lower() not in ("0", "false", "no", "off")

        return cls(error_handling=number("TORCH_NCCL_ASYNC_ERROR_HANDLING", cls.error_handling),
                   dump_timeout_ms=number("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", cls.dump_timeout_ms),
                   dump_on_timeout=flag("TORCH_NCCL_DUMP_ON_TIMEOUT", cls.dump_on_timeout),
                   monitoring=flag("TORCH_NCCL_ENABLE_MONITORING", cls.monitoring),
                   heartbeat_timeout_s=number("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", cls.heartbeat_timeout_s),
                   coord_check_ms=number("TORCH_NCCL_COORD_CHECK_MILSEC", cls.coord_check_ms))

    @property
    def aborts(self) -> bool:
        """Whether the watchdog aborts a failed group's communicators (SHOULD_CLEAN_UP)."""
        return self.error_handling in (1, 2)

    @property
    def ends_process(self) -> bool:
        """Whether the watchdog ends the process after a failure (SHOULD_TEAR_DOWN)."""
        return self.error_handling in (1, 3)


# --- the rules as plain data: records and the progress they allow -------------------------------

SEND, RECV, COLLECTIVE = "send", "recv", "collective"


@dataclass(frozen=True)
class Op:
    kind: str
    """SEND, RECV or COLLECTIVE."""
    peer: int
    """The other rank (global); -1 for a collective."""
    tag: int
    nbytes: int
    name: str
    """As the error names it: "isend->1", "irecv<-0 in a batch", "all_reduce"."""
    members: tuple[int, ...] = ()
    """A collective's ranks (global), in the group's order."""

    def to_json(self) -> list:
        return [self.kind, self.peer, self.tag, self.nbytes, self.name, list(self.members)]

    @classmethod
    def from_json(cls, raw: list) -> Op:
        kind, peer, tag, nbytes, name, members = raw
        return cls(kind, peer, tag, nbytes, name, tuple(members))


@dataclass
class Queue:
    """What one rank issued on one communicator: its units (an op, or a batch's ops) in issue
    order, after those already known complete (dropped, counted per peer and kind for the matching)."""

    done: int = 0
    """Units dropped: complete on this rank."""
    sent: Counter = field(default_factory=Counter)
    """Sends per peer in the dropped units."""
    received: Counter = field(default_factory=Counter)
    collectives: int = 0
    """Collectives in the dropped units."""
    units: list[list[Op]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"done": self.done, "sent": dict(self.sent), "received": dict(self.received),
                "collectives": self.collectives, "units": [[op.to_json() for op in unit] for unit in self.units]}

    @classmethod
    def from_json(cls, raw: dict) -> Queue:
        return cls(raw["done"], Counter({int(k): v for k, v in raw["sent"].items()}),
                   Counter({int(k): v for k, v in raw["received"].items()}), raw["collectives"],
                   [[Op.from_json(op) for op in unit] for unit in raw["units"]])

    def drop_until(self, index: int) -> None:
        """Forget the units before absolute `index`, known complete."""
        while self.done < index and self.units:
            for op in self.units.pop(0):
                if op.kind == COLLECTIVE:
                    self.collectives += 1
                else:
                    (self.sent if op.kind == SEND else self.received)[op.peer] += 1
            self.done += 1

    def _dropped(self, kind: str, peer: int) -> int:
        if kind == COLLECTIVE:
            return self.collectives
        return (self.sent if kind == SEND else self.received)[peer]

    def locate(self, kind: str, peer: int, ordinal: int) -> tuple[int, Op | None] | None:
        """This rank's `ordinal`-th op of `kind` with `peer` (any peer for a collective) and the
        absolute index of its unit; (-1, None) when dropped (complete), None when not issued yet."""
        count = self._dropped(kind, peer)
        if ordinal < count:
            return -1, None
        for index, unit in enumerate(self.units):
            for op in unit:
                if op.kind == kind and op.peer == peer:
                    if count == ordinal:
                        return self.done + index, op
                    count += 1
        return None

    def ordinal(self, index: int, position: int) -> int:
        """Among this rank's ops of the same kind and peer, the ordinal of op `position` of unit
        `index` (absolute)."""
        target = self.units[index - self.done][position]
        counted = self._dropped(target.kind, target.peer)
        for unit in self.units[:index - self.done]:
            counted += sum(op.kind == target.kind and op.peer == target.peer for op in unit)
        unit = self.units[index - self.done]
        return counted + sum(op.kind == target.kind and op.peer == target.peer for op in unit[:position])


@dataclass(frozen=True)
class Wait:
    """What one thread of a rank waits for: unit `unit` of communicator `comm` to complete, or
    (unit None) the creation of pair communicator `comm` with `peer`."""

    comm: str
    unit: int | None
    peer: int | None
    what: str
    main: bool
    """Whether the waiting thread is the main one, the thread that issues the rank's ops."""
    number: int
    """Which of the rank's waits: each has its own."""


@dataclass
class Record:
    """All one rank publishes."""

    version: int = 0
    queues: dict[str, Queue] = field(default_factory=dict)
    created: set[str] = field(default_factory=set)
    """Pair communicators this rank has begun to create."""
    waits: list[Wait] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "queues": {c: q.to_json() for c, q in self.queues.items()},
                           "created": sorted(self.created), "waits": [vars(w) for w in self.waits]})

    @classmethod
    def from_json(cls, raw: bytes) -> Record:
        data = json.loads(raw)
        return cls(data["version"], {c: Queue.from_json(q) for c, q in data["queues"].items()},
                   set(data["created"]), [Wait(**w) for w in data["waits"]])


GROUP_COMM = "group"
"""The suffix of a group's own communicator (`<group name>/group`): its batches and collectives."""


def group_of(comm: str) -> str:
    """The process group a communicator belongs to."""
    return comm.rsplit("/", 1)[0]


def describe_comm(comm: str) -> str:
    group, ranks = comm.rsplit("/", 1)
    if ranks == GROUP_COMM:
        return f"the communicator of process group {group}"
    low, high = ranks.split(",")
    return f"the communicator of ranks {low} and {high} (process group {group})"


Located = tuple[int, "Op | None"] | None
"""Queue.locate's answer: an op's unit index and the op, (-1, None) when complete, None when not issued."""


def partners(queues: dict[int, Queue], rank: int, op: Op, ordinal: int) -> list[tuple[int, Located]]:
    """The ops NCCL pairs with `op` of `rank` (its `ordinal`-th of its kind and peer), each as
    (their rank, `locate`'s answer): a send's receive, a receive's send, a collective's
    counterparts on the group's other ranks."""
    if op.kind == COLLECTIVE:
        return [(member, queues[member].locate(COLLECTIVE, -1, ordinal) if member in queues else None)
                for member in op.members if member != rank]
    other = queues.get(op.peer)
    return [(op.peer, other.locate(RECV if op.kind == SEND else SEND, rank, ordinal) if other else None)]


def heads(records: dict[int, Record], comm: str) -> dict[int, int]:
    """For each rank with ops on `comm`, the absolute index of its first incomplete unit: the
    units before it have completed, it has started. A unit completes once each of its ops has
    met its partners' ops of the same ordinal, started too. Raises NcclMismatch for ops that NCCL
    would pair wrongly."""
    queues = {rank: record.queues[comm] for rank, record in records.items() if comm in record.queues}
    head = {rank: queue.done for rank, queue in queues.items()}

    def met(rank: int, position: int) -> bool:
        queue = queues[rank]
        op = queue.units[head[rank] - queue.done][position]
        for peer, found in partners(queues, rank, op, queue.ordinal(head[rank], position)):
            if found is None or found[0] > head[peer]:
                return False
            if found[1] is not None:
                check_match(comm, rank, op, peer, found[1])
        return True

    moved = True
    while moved:
        moved = False
        for rank, queue in queues.items():
            while head[rank] - queue.done < len(queue.units) and all(
                    met(rank, position) for position in range(len(queue.units[head[rank] - queue.done]))):
                head[rank] += 1
                moved = True
    return head


def check_match(comm: str, rank: int, op: Op, peer: int, partner: Op) -> None:
    if op.kind == COLLECTIVE:
        if (partner.name, partner.nbytes) != (op.name, op.nbytes):
            raise NcclMismatch(
                f"on {describe_comm(comm)} NCCL pairs rank {rank}'s {op.name} ({op.nbytes} bytes) with rank {peer}'s "
                f"{partner.name} ({partner.nbytes} bytes): a group's collectives are paired by their order alone")
        return
    if partner.nbytes == op.nbytes and partner.tag == op.tag:
        return
    (sender, send), (receiver, receive) = sorted([(rank, op), (peer, partner)], key=lambda side: side[1].kind)[::-1]
    raise NcclMismatch(
        f"on {describe_comm(comm)} NCCL matches rank {sender}'s {send.name} ({send.nbytes} bytes, tag {send.tag}) with "
        f"rank {receiver}'s {receive.name} ({receive.nbytes} bytes, tag {receive.tag}): NCCL matches a pair's ops in "
        "issue order and has no tags, where gloo matches them by tag")


# --- the wait-for graph -------------------------------------------------------------------------

def find_cycle(records: dict[int, Record], start: tuple) -> list[tuple] | None:
    """A cycle of waits reachable from node `start`, as its edges (node, next node, why); None
    when every wait may still end. Nodes: ("unit", rank, comm), the first incomplete unit of a
    rank on a communicator, which waits for each of its ops' partners (AND); ("host", rank), the
    rank's main thread, which waits for what its record says it waits for, or for nothing;
    ("create", rank, comm), a rank creating a pair communicator, which waits for the peer."""
    cache: dict[str, dict[int, int]] = {}

    def head_of(comm: str) -> dict[int, int]:
        if comm not in cache:
            cache[comm] = heads(records, comm)
        return cache[comm]

    def edges(node: tuple) -> list[tuple[tuple, str]]:
        if node[0] == "host":
            rank = node[1]
            main = next((w for w in records[rank].waits if w.main), None)
            if main is None:
                return []
            if main.unit is None:
                return [(("create", rank, main.comm), f"rank {rank} is blocked creating {describe_comm(main.comm)} "
                                                      f"for its {main.what}")]
            return [(("unit", rank, main.comm), f"rank {rank} is blocked waiting for its {main.what}")]
        if node[0] == "create":
            _, rank, comm = node
            wait = next(w for w in records[rank].waits if w.comm == comm and w.unit is None)
            if comm in records[wait.peer].created:
                return []
            return [(("host", wait.peer), f"rank {rank} creating {describe_comm(comm)} (for its {wait.what}) waits "
                                          f"for rank {wait.peer} to create it too")]
        _, rank, comm = node
        queues = {r: record.queues[comm] for r, record in records.items() if comm in record.queues}
        queue = queues[rank]
        head = head_of(comm)[rank]
        if head - queue.done >= len(queue.units):
            return []
        found = []
        for position, op in enumerate(queue.units[head - queue.done]):
            for peer, partner in partners(queues, rank, op, queue.ordinal(head, position)):
                if partner is None:
                    verb = (f"issue its {op.name}" if op.kind == COLLECTIVE
                            else f"issue its receive from rank {rank}" if op.kind == SEND
                            else f"issue its send to rank {rank}")
                    found.append((("host", peer), f"rank {rank}'s {op.name} waits for rank {peer} to {verb}"))
                elif partner[0] > head_of(comm)[peer]:
                    other = queues[peer]
                    blocking = other.units[head_of(comm)[peer] - other.done]
                    found.append((("unit", peer, comm),
                                  f"rank {rank}'s {op.name} waits for rank {peer} to post its {partner[1].name}, "
                                  f"queued behind its own {', '.join(p.name for p in blocking)} on "
                                  f"{describe_comm(comm)} (ops on one NCCL communicator start in issue order)"))
        return found

    path: list[tuple] = []
    on_path: dict[tuple, int] = {}
    seen: set[tuple] = set()

    def visit(node: tuple) -> list[tuple] | None:
        on_path[node] = len(path)
        for target, why in edges(node):
            path.append((node, target, why))
            if target in on_path:
                return path[on_path[target]:]
            if target not in seen:
                cycle = visit(target)
                if cycle:
                    return cycle
            path.pop()
        del on_path[node]
        seen.add(node)
        return None

    return visit(start)


# --- this process's part ------------------------------------------------------------------------

class _World:
    """This rank's record in one default process group's lifetime, the store it is shared in, and
    what NCCL's watchdog has found and done to its groups."""

    def __init__(self, store, rank: int, world_size: int, generation: int, settings: Settings):
        self.main_store, self.rank, self.world_size = store, rank, world_size
        self.settings = settings
        self.thread_stores = threading.local()
        self.prefix = f"{PREFIX}/{generation}"
        self.record = Record()
        self.known_complete: dict[str, int] = {}
        self.waits = itertools.count()
        self.lock = threading.RLock()
        self.aborted = False
        """The program aborted every group (`_abort_process_group`)."""
        self.real_gloo: set[str] = set()
        """Groups made with the backend "gloo" by name: gloo on a GPU node too, not held to these rules."""
        self.errors: dict[str, str] = {}
        """Group -> the ErrorType name its watchdog set (COMM_ERROR, TIMEOUT)."""
        self.aborted_groups: set[str] = set()
        """Groups whose communicators the watchdog aborted."""
        self.waker = store.clone()
        """A connection for the threads that end waits (`wake`), made while the store is there."""
        self.waker_lock = threading.Lock()
        self.publish()

    @property
    def store(self):
        """The store, through a connection of this thread's own: a client of c10d's TCPStore
        serves one call at a time, and a thread waiting in it would hold up the others' calls."""
        if _is_main():
            return self.main_store
        if not hasattr(self.thread_stores, "store"):
            self.thread_stores.store = self.main_store.clone()
        return self.thread_stores.store

    def key(self, rank: int) -> str:
        return f"{self.prefix}/rank/{rank}"

    def ruled(self, group) -> bool:
        """Whether `group` stands for an NCCL group (not one of gloo by name)."""
        return group.group_name not in self.real_gloo

    def publish(self, store=None) -> None:
        """This rank's record, and a change for every rank's waits to look at (through `store`, a
        connection of the calling thread's own by default)."""
        store = store or self.store
        with self.lock:
            for comm, index in self.known_complete.items():
                self.record.queues[comm].drop_until(index)
            self.record.version += 1
            store.set(self.key(self.rank), self.record.to_json())
            change = store.add(f"{self.prefix}/changes", 1)
        store.set(f"{self.prefix}/change/{change}", "")

    def snapshot(self) -> dict[int, Record]:
        raws = self.store.multi_get([self.key(rank) for rank in range(self.world_size)])
        return {rank: Record.from_json(bytes(raw)) for rank, raw in enumerate(raws)}

    def issue(self, comm: str, ops: list[Op]) -> int:
        with self.lock:
            queue = self.record.queues.setdefault(comm, Queue())
            queue.units.append(ops)
            index = queue.done + len(queue.units) - 1
            try:
                self.publish()
            except _torch_distributed().DistNetworkError:
                pass  # the store is gone with its host: NCCL's ops do not need it (see complete)
        return index

    def create(self, comm: str, peer: int, what: str) -> None:
        """Create pair communicator `comm` with `peer` unless done: blocks until the peer has
        begun to create it too. An abort ends the wait with NcclAborted: the creation fails."""
        if comm in self.record.created:
            return
        with self.lock:
            self.record.created.add(comm)
        ended = self._wait(Wait(comm, None, peer, what, _is_main(), next(self.waits)),
                           lambda records: comm in records[peer].created)
        if ended:
            raise NcclAborted(f"rank {self.rank}'s {what}: creating {describe_comm(comm)} was ended by an abort")

    def complete(self, comm: str, unit: int, what: str, works: list) -> None:
        """Block until unit `unit` of `comm` has completed on this rank by NCCL's rules and its real
        ops (`works`, gloo's) are done. An abort of the communicator ends the wait normally (its
        kernels exit; the buffers hold what had arrived); a real op that failed waits for it."""
        def done(records: dict[int, Record]) -> bool:
            head = heads(records, comm)[self.rank]
            with self.lock:
                self.known_complete[comm] = max(self.known_complete.get(comm, 0), head)
            return unit < head
        for work in works:
            work.watch()
        try:
            if self._wait(Wait(comm, unit, None, what, _is_main(), next(self.waits)), done):
                return
        except _torch_distributed().DistNetworkError:
            # The store went with its host (torchrun's rank 0, on any node), which NCCL's ops do
            # not need: gloo's ops underneath say what the records no longer can.
            pass
        for work in works:
            while not work.finished.wait(SETTLE_POLL_S):
                if self.ended(comm):
                    return
            if work.failure is not None:
                self.until_ended(comm, what)
                return

    def until_ended(self, comm: str, what: str) -> None:
        """Wait, as a host synchronised on a failed op waits, until the watchdog or the program
        aborts the communicator (or the watchdog ends the process)."""
        give_up = time.monotonic() + self.main_store.timeout.total_seconds()
        while not self.ended(comm):
            if time.monotonic() > give_up:
                raise NcclDeadlock(f"rank {self.rank}'s {what} on {describe_comm(comm)} failed and no abort ended it "
                                   f"within the store's timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING="
                                   f"{self.settings.error_handling}): NCCL waits for ever")
            time.sleep(SETTLE_POLL_S)  # the aborts that end it are this process's own

    def abort(self) -> None:
        """The program aborts every group (ncclCommAbort): its waits end."""
        self.aborted = True
        self.wake()

    def wake(self) -> None:
        """A change, for this rank's threads blocked on the store to look again, through the
        connection made for it while the store was there: the store may be gone since with the
        rank that hosted it (torchrun's rank 0, on any node), and a new connection to it would
        wait out its timeout; on the one made, a call fails at once, and so do the waits."""
        with self.waker_lock:
            try:
                self.publish(self.waker)
            except _torch_distributed().DistNetworkError:
                pass

    def ended(self, comm: str) -> bool:
        """Whether waits on `comm` end because its communicators were aborted."""
        return self.aborted or group_of(comm) in self.aborted_groups

    def failed(self, group_name: str, error: BaseException) -> None:
        """A real op of the group failed (its peer's process gone, or its timeout passed): what
        NCCL's watchdog does, on a thread of its own (Watchdog::runLoop)."""
        with self.lock:
            if group_name in self.errors:
                return
            self.errors[group_name] = "TIMEOUT" if "timed out" in str(error).lower() else "COMM_ERROR"
        threading.Thread(target=self._watchdog, args=(group_name, error), name="nccl-rules-watchdog",
                         daemon=True).start()

    def _watchdog(self, group_name: str, error: BaseException) -> None:
        if self.settings.dump_on_timeout:  # every rank's monitor sees it; the store may be gone
            threading.Thread(target=self._signal_dump, name="nccl-rules-dump-signal", daemon=True).start()
        time.sleep(4 * self.settings.dump_timeout_ms / 1000)  # the flight recorders' time to dump
        if self.settings.ends_process:
            # Under 1 the watchdog's abort of the communicators and its rethrow come back to back on
            # its thread: no wait of the rank is let go in between to use the values (as one here,
            # released before this message was written, did on a busy machine).
            print(f"[rank {self.rank}] NCCL's watchdog found process group {group_name} failed ({error}); "
                  f"TORCH_NCCL_ASYNC_ERROR_HANDLING={self.settings.error_handling}: to avoid data inconsistency, the "
                  "entire process is taken down", file=sys.stderr, flush=True)
            os.abort()
        if self.settings.aborts:
            self.aborted_groups.add(group_name)
            self.wake()  # its waits end

    def _signal_dump(self) -> None:
        with self.waker_lock:
            try:
                self.waker.set(f"{self.prefix}/exception_dump", str(self.rank))
            except _torch_distributed().DistNetworkError:
                pass  # the store's host may be the rank that is gone

    def monitor(self) -> None:
        """The heartbeat monitor of this process's first world: once any rank's watchdog found a
        failure, it ends the process TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC later unless this world was
        aborted or destroyed by then."""
        key = f"{self.prefix}/exception_dump"
        while self.current():
            time.sleep(self.settings.coord_check_ms / 1000)
            try:
                signalled = self.store.check([key])
            except Exception:  # noqa: BLE001 (the store's host gone: torch logs it and goes on)
                continue
            if signalled:
                time.sleep(self.settings.heartbeat_timeout_s)
                if self.current():
                    print(f"[rank {self.rank}] NCCL's heartbeat monitor: a collective failed on rank "
                          f"{self.store.get(key).decode()}; terminating the process after "
                          f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={self.settings.heartbeat_timeout_s}",
                          file=sys.stderr, flush=True)
                    os.abort()
                return

    def current(self) -> bool:
        """Whether this is still the process's world, neither aborted nor destroyed."""
        return _world is self and not self.aborted and _c10d.GroupMember.WORLD is not None

    def _wait(self, wait: Wait, done) -> bool:
        """Block until `done(records)`; True if it ended because the communicator was aborted."""
        registered = False
        ended = False
        while True:
            if self.ended(wait.comm):
                ended = True
                break
            seen = self.store.add(f"{self.prefix}/changes", 0)
            records = self.snapshot()
            if done(records):
                break
            named = self._named_deadlock()
            if named is not None:
                self.store.set(self._named_key(self.rank, wait), "")
                raise NcclDeadlock(named)
            if not registered:
                with self.lock:
                    self.record.waits.append(wait)
                    self.publish()
                registered = True
                continue
            start = ("create", self.rank, wait.comm) if wait.unit is None else ("unit", self.rank, wait.comm)
            cycle = find_cycle(records, start)
            if cycle and self._unchanged(records):
                message = _explain(self.rank, wait, cycle)
                self._name_deadlock(message, wait, records)
                raise NcclDeadlock(message)
            try:
                self.store.wait([f"{self.prefix}/change/{seen + 1}"])
            except _c10d.DistStoreError as error:  # the store's timeout: the process group's
                raise NcclDeadlock(f"rank {self.rank}'s {wait.what} on {describe_comm(wait.comm)} saw no progress "
                                   f"of any rank within the store's timeout ({error})") from error
        # Only once it ended: after an error the store may be gone with the rank that hosted it,
        # and so it may be after a peer whose op completed with this one's went on and exited.
        if registered:
            with self.lock:
                self.record.waits.remove(wait)
            try:
                self.publish()
            except Exception:  # noqa: BLE001 (the op ended all the same)
                pass
        return ended

    def _named_deadlock(self) -> str | None:
        key = f"{self.prefix}/deadlock"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _named_key(self, rank: int, wait: Wait) -> str:
        return f"{self.prefix}/named/{rank}/{wait.number}"

    def _name_deadlock(self, message: str, wait: Wait, records: dict[int, Record]) -> None:
        """Tell the other ranks, and wait until each of their threads blocked here has read it:
        the first rank to raise may host the store, and its exit would leave the others a lost
        connection to report instead of the deadlock."""
        if self._named_deadlock() is None:
            self.store.set(f"{self.prefix}/deadlock", message)
        self.publish()  # a change: the blocked ranks wake
        self.store.set(self._named_key(self.rank, wait), "")
        blocked = [self._named_key(rank, other) for rank, record in records.items() for other in record.waits
                   if (rank, other) != (self.rank, wait)]
        try:
            self.store.wait(blocked)
        except RuntimeError:
            pass  # every rank may have read it, and the one hosting the store gone with it: raise all the same

    def _unchanged(self, records: dict[int, Record]) -> bool:
        # Each record is one rank's at one moment; read twice with the same versions, all of them
        # held at once in between: the cycle is real, not a mix of old and new records.
        again = self.snapshot()
        return all(again[rank].version == record.version for rank, record in records.items())


def _explain(rank: int, wait: Wait, cycle: list[tuple]) -> str:
    ranks = sorted({node[1] for node, _, _ in cycle})
    return (f"NCCL would deadlock here (rank {rank}, waiting for its {wait.what}): ranks {ranks} wait for each "
            "other: " + "; ".join(why for _, _, why in cycle) + ". Exchange through dist.batch_isend_irecv, whose "
            "ops NCCL starts together, or order each rank's ops so that every op meets its partners already posted.")


def _is_main() -> bool:
    return threading.current_thread() is threading.main_thread()


SETTLE_POLL_S = 0.05
"""How often a rank whose op completed by the rules, while gloo's op underneath has not yet,
looks whether its communicator was aborted meanwhile."""

_world: _World | None = None
_monitored = False
"""Whether this process's first world has its heartbeat monitor (ProcessGroupNCCL's of uid 0:
later worlds' default groups get other uids)."""


def init_process_group(*args, **kwargs):
    """c10d's, then this rank's record in a store prefix of its own: ranks that start a new
    default group on a store an older one used (a restart) count from a fresh generation."""
    global _world, _monitored
    _real["init_process_group"](*args, **kwargs)
    store = _c10d._get_default_store()
    rank, size = _c10d.get_rank(), _c10d.get_world_size()
    generation = (store.add(f"{PREFIX}/joined", 1) - 1) // size
    _world = _World(store, rank, size, generation, Settings.from_environment())
    if not _monitored and _world.settings.dump_on_timeout and _world.settings.monitoring:
        _monitored = True
        threading.Thread(target=_world.monitor, name="nccl-rules-heartbeat-monitor", daemon=True).start()


def new_group(*args, **kwargs):
    """c10d's; a group made with the backend "gloo" by name is gloo on a GPU node too."""
    group = _real["new_group"](*args, **kwargs)
    backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
    if _world is not None and backend is not None and "gloo" in str(backend).lower() \
            and group is not _c10d.GroupMember.NON_GROUP_MEMBER:
        _world.real_gloo.add(group.group_name)
    return group


def _abort_process_group(group=None):
    """c10d's; aborting the world's groups also ends this rank's waits, which return normally."""
    _real["_abort_process_group"](group)
    if group is None and _world is not None:
        _world.abort()


def _backend_error(backend):
    """Backend.get_error as ProcessGroupNCCL answers it: what its watchdog found."""
    found = _world.errors.get(backend.options.group_name, "SUCCESS") if _world is not None else "SUCCESS"
    return _native().ErrorType.__members__[found]


def _ruled_world(group, what: str) -> _World | None:
    """The world whose rules `group` (resolved: never None) follows, None when it follows none
    (gloo by name, or this rank not in it). An op on a group of a world destroyed or aborted since
    (a thread left behind by a repair), or on one whose communicators the watchdog aborted, raises,
    as NCCL fails an op on a communicator that is gone."""
    if _c10d._rank_not_in_group(group):
        return None
    if _world is None or _c10d.GroupMember.WORLD is None:
        raise RuntimeError(f"NCCL rules: {what} before init_process_group")
    if group not in _c10d._world.pg_map:
        raise NcclAborted(f"{what} on process group {group.group_name}, of a world destroyed or aborted since")
    if not _world.ruled(group):
        return None
    if group.group_name in _world.aborted_groups:
        raise NcclAborted(f"{what} on process group {group.group_name}, whose communicators NCCL's watchdog aborted "
                          f"after an op failed ({_world.errors[group.group_name]})")
    return _world


def _peer(group, peer: int | None, group_peer: int | None) -> int:
    return _c10d.get_global_rank(group, _c10d._canonicalize_group_rank(group, peer, group_peer))


def _pair_comm(group, rank: int, peer: int) -> str:
    low, high = sorted((rank, peer))
    return f"{group.group_name}/{low},{high}"


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _unbatched(SEND, "isend", tensor, dst, group, tag, group_dst)


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if src is None and group_src is None:
        raise NcclMismatch("irecv from any source: NCCL receives only from a named rank")
    return _unbatched(RECV, "irecv", tensor, src, group, tag, group_src)


def _unbatched(kind: str, name: str, tensor, peer, group, tag, group_peer):
    group_ = _c10d._group_or_default_group(group)
    real = _real[name]
    world = _ruled_world(group_, name)
    if world is None:
        return real(tensor, peer, group, tag, group_peer)
    other = _peer(group_, peer, group_peer)
    if other == world.rank:
        return real(tensor, peer, group, tag, group_peer)
    op = Op(kind, other, tag, _nbytes(tensor), f"{name}->{other}" if kind == SEND else f"{name}<-{other}")
    comm = _pair_comm(group_, world.rank, other)
    world.create(comm, other, op.name)
    unit = world.issue(comm, [op])
    return _RuledWork(real(tensor, peer, group, tag, group_peer), world, comm, unit, op.name)


def _p2p_kind(op) -> str:
    """SEND or RECV for a P2POp's function: these rules' own or torch's. Another function means
    something wrapped torch's after these rules did (an import hook out of order): named, not
    guessed, since a send read as a receive shows as a deadlock that is not there."""
    if op in (isend, _real["isend"]):
        return SEND
    if op in (irecv, _real["irecv"]):
        return RECV
    raise TypeError(f"a P2POp of {getattr(op, '__qualname__', op)!r}, neither isend nor irecv as these rules or "
                    "torch define them: something wrapped them after the rules were installed")


def batch_isend_irecv(p2p_op_list):
    _c10d._check_p2p_op_list(p2p_op_list)
    group = _c10d._group_or_default_group(p2p_op_list[0].group)
    world = _ruled_world(group, "batch_isend_irecv")
    if world is None:
        return _real["batch_isend_irecv"](p2p_op_list)
    ops = []
    for p2p in p2p_op_list:
        kind = _p2p_kind(p2p.op)
        if p2p.peer != world.rank:
            arrow = f"isend->{p2p.peer}" if kind == SEND else f"irecv<-{p2p.peer}"
            ops.append(Op(kind, p2p.peer, p2p.tag, _nbytes(p2p.tensor), f"{arrow} in a batch"))
    comm = f"{group.group_name}/{GROUP_COMM}"
    unit = world.issue(comm, ops) if ops else None
    what = "batch of " + ", ".join(op.name.removesuffix(" in a batch") for op in ops)
    works = []
    for p2p in p2p_op_list:
        real = _real["isend" if _p2p_kind(p2p.op) == SEND else "irecv"]
        peer_kwarg = {"group_dst" if real is _real["isend"] else "group_src": p2p.group_peer}
        work = real(p2p.tensor, group=p2p.group, tag=p2p.tag, **peer_kwarg)
        works.append(work if unit is None else _RuledWork(work, world, comm, unit, what))
    return works


_SIZED = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather": "tensor", "barrier": None,
          **dict.fromkeys(("all_gather_single", "all_gather_into_tensor"), "input_tensor"),
          **dict.fromkeys(("reduce_scatter_single", "reduce_scatter_tensor"), "output")}
"""Which argument's bytes each collective's ranks must agree on: the tensor reduced, broadcast or
given, or the shard received (a barrier moves nothing of the caller's)."""


def _ruled_collective(name: str):
    """c10d's collective `name`, issued on a group standing for NCCL as a unit of the group's
    communicator: without async_op its caller waits there, else at its Work's wait()."""
    sized = _SIZED[name]

    def collective(*args, **kwargs):
        real = _real[name]
        call = inspect.signature(real).bind(*args, **kwargs)
        call.apply_defaults()
        arguments = call.arguments
        group = _c10d._group_or_default_group(arguments["group"])
        world = _ruled_world(group, name)
        if world is None or group in _c10d._world.pg_coalesce_state:
            return real(*args, **kwargs)
        nbytes = _nbytes(arguments[sized]) if sized else 0
        comm = f"{group.group_name}/{GROUP_COMM}"
        unit = world.issue(comm, [Op(COLLECTIVE, -1, 0, nbytes, name, tuple(_c10d.get_process_group_ranks(group)))])
        work = _RuledWork(real(**{**arguments, "async_op": True}), world, comm, unit, name)
        if arguments["async_op"]:
            return work
        work.wait_in_progress()  # the caller's host waits from the call on, as at NCCL's next synchronisation
        return None

    collective.__name__ = name
    return collective


class _RuledWorkMixin:
    """A gloo Work whose wait first waits, by NCCL's rules, for its op (or batch, or collective)
    to complete, and whose failure NCCL's watchdog takes (_World.failed)."""

    def __init__(self, work, world: _World, comm: str, unit: int, what: str):
        super().__init__()
        self._work, self._world, self._comm, self._unit, self._what = work, world, comm, unit, what
        self.finished = threading.Event()
        """Set once the real op is done, failed or not."""
        self.failure: BaseException | None = None
        try:
            work.get_future().add_done_callback(self._future_done)
            self._watched = True
        except RuntimeError:  # gloo's point-to-point works have no future: watched once waited on
            self._watched = False

    def _future_done(self, future) -> None:
        try:
            future.value()
            self._finish(None)
        except Exception as error:  # noqa: BLE001 (gloo's: a peer gone, or the group's timeout)
            self._finish(error)

    def _finish(self, failure: BaseException | None) -> None:
        self.failure = failure
        if failure is not None:
            self._world.failed(group_of(self._comm), failure)
        self.finished.set()

    def watch(self) -> None:
        """Have the real op's end noticed, as NCCL's watchdog notices every op's: gloo's
        point-to-point ops end only in a wait, so a thread waits on one for its waiter."""
        if self._watched:
            return
        self._watched = True

        def wait_real() -> None:
            try:
                self._work.wait()
                self._finish(None)
            except Exception as error:  # noqa: BLE001
                self._finish(error)
        threading.Thread(target=wait_real, name="nccl-rules-op", daemon=True).start()

    def wait(self, timeout: timedelta | None = None) -> bool:
        group = group_of(self._comm)
        if self.failure is not None and group in self._world.errors:
            # WorkNCCL::wait: the watchdog has found this work failed; it raises in the caller.
            raise _torch_distributed().DistBackendError(f"NCCL error in {self._what} on process group {group} "
                                         f"({self._world.errors[group]}): {self.failure}")
        self.wait_in_progress()
        return True

    def wait_in_progress(self) -> None:
        """Wait for the op to complete by NCCL's rules; an abort of its group ends the wait normally."""
        self._world.complete(self._comm, self._unit, self._what, [self])

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def result(self):
        return self._work.result()

    def get_future(self):
        return self._work.get_future()

    def synchronize(self) -> None:
        self.wait()
