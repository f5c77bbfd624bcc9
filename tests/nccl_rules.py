"""NCCL's rules of progress for point-to-point, enforced on gloo: a CPU test fails where a GPU run would hang.

gloo progresses each send and receive on its own; torch's ProcessGroupNCCL does not
(ProcessGroupNCCL::pointToPoint):

- an unbatched `isend`/`irecv` (and `send`/`recv`, `send_object_list`, ...) between two ranks runs
  on a communicator of those two ranks alone, created lazily by the first such op of each rank,
  blocking its calling thread until the peer creates it too;
- the ops of one communicator run in the order each rank issued them, on one stream: an op starts
  only once the ops issued before it on that communicator have completed, and a send completes
  only once its receive has started (and the receive once its send has);
- `batch_isend_irecv` (ncclGroupStart/End) runs on the group's own communicator, all its ops
  started together: within a batch the order of sends and receives does not matter;
- ops match in issue order per pair of ranks and communicator, whatever their tags (NCCL has
  none): a send meets the receive of the same ordinal, which must be as large.

`install(distributed_c10d)` wraps c10d's `isend`, `irecv` and `batch_isend_irecv` (`send`, `recv`
and the object lists call these; torch.distributed re-exports them, and the pipelining schedules
and stages call them through it) so that every op follows these rules before the real gloo op
underneath moves the data. Each rank publishes in the default group's store what it has issued
on each communicator and what its threads wait for; a rank that has to wait reads every rank's
record, works out which ops have started and completed, and waits for the next change. When
what it waits for depends on a cycle (each rank in it waiting for the next), NCCL would hang: it
raises NcclDeadlock naming the ranks, their ops and why. A peer that dies does not end a wait
(NCCL waits for ever; gloo raises once the connection closes): aborting the world's groups
(`_abort_process_group`, ncclCommAbort) does, with NcclAborted.

Modelled as waits of the host: a rank waits where it calls `Work.wait()` (as on gloo; NCCL
would stall its stream there and the host at its next synchronisation). Not modelled: the group
communicators are taken as created (the trainer binds NCCL to its device, which creates them
eagerly), and collectives, which FSDP2 and DTensor issue from C++ where these wrappers do not
see them, stay as gloo runs them; a batch shares its group's stream with the group's
collectives, an order this model cannot check.

tests/nccl_site/sitecustomize.py installs this in every process of a test session that imports
torch (ENABLE_VARIABLE, set by tests/conftest.py).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

ENABLE_VARIABLE = "TRAINFLEET_TEST_NCCL_RULES"
"""Set (to 1) in a process's environment: its torch.distributed follows NCCL's rules."""
SITE = Path(__file__).resolve().parent / "nccl_site"
"""On the PYTHONPATH with ENABLE_VARIABLE: the folder whose sitecustomize installs the rules."""
PREFIX = "nccl_rules"

__all__ = ["install", "installed", "NcclDeadlock", "NcclMismatch", "NcclAborted", "ENABLE_VARIABLE", "SITE"]


class NcclDeadlock(RuntimeError):
    """Point-to-point ops that NCCL would never complete."""


class NcclMismatch(RuntimeError):
    """A send and the receive NCCL would match it with disagree (size or tag)."""


class NcclAborted(RuntimeError):
    """A point-to-point op waited on communicators that were aborted."""


_c10d = None
"""torch.distributed.distributed_c10d once installed."""
_real: dict[str, object] = {}
"""c10d's own functions, which move the data."""
_RuledWork = None
"""_RuledWorkMixin over c10d's Work, once installed."""


def installed() -> bool:
    return _c10d is not None


def install(c10d) -> None:
    """Wrap `c10d` (torch.distributed.distributed_c10d, just executed) so that its point-to-point
    ops follow NCCL's rules. Called before torch.distributed re-exports its names."""
    global _c10d
    if _c10d is not None:
        return
    _c10d = c10d
    for name, wrapper in (("isend", isend), ("irecv", irecv), ("batch_isend_irecv", batch_isend_irecv),
                          ("init_process_group", init_process_group),
                          ("_abort_process_group", _abort_process_group)):
        _real[name] = getattr(c10d, name)
        wrapper.__wrapped__ = _real[name]
        wrapper.__doc__ = _real[name].__doc__
        setattr(c10d, name, wrapper)
    global _RuledWork
    _RuledWork = type("RuledWork", (_RuledWorkMixin, c10d.Work), {})


# --- the rules as plain data: records and the progress they allow -------------------------------

SEND, RECV = "send", "recv"


@dataclass(frozen=True)
class Op:
    kind: str
    """SEND or RECV."""
    peer: int
    """The other rank (global)."""
    tag: int
    nbytes: int
    name: str
    """As the error names it: "isend->1", "irecv<-0 in a batch"."""

    def to_json(self) -> list:
        return [self.kind, self.peer, self.tag, self.nbytes, self.name]

    @classmethod
    def from_json(cls, raw: list) -> Op:
        return cls(*raw)


@dataclass
class Queue:
    """What one rank issued on one communicator: its units (an op, or a batch's ops) in issue
    order, after those already known complete (dropped, counted per peer for the matching)."""

    done: int = 0
    """Units dropped: complete on this rank."""
    sent: Counter = field(default_factory=Counter)
    """Sends per peer in the dropped units."""
    received: Counter = field(default_factory=Counter)
    units: list[list[Op]] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"done": self.done, "sent": dict(self.sent), "received": dict(self.received),
                "units": [[op.to_json() for op in unit] for unit in self.units]}

    @classmethod
    def from_json(cls, raw: dict) -> Queue:
        return cls(raw["done"], Counter({int(k): v for k, v in raw["sent"].items()}),
                   Counter({int(k): v for k, v in raw["received"].items()}),
                   [[Op.from_json(op) for op in unit] for unit in raw["units"]])

    def drop_until(self, index: int) -> None:
        """Forget the units before absolute `index`, known complete."""
        while self.done < index and self.units:
            for op in self.units.pop(0):
                (self.sent if op.kind == SEND else self.received)[op.peer] += 1
            self.done += 1

    def locate(self, kind: str, peer: int, ordinal: int) -> tuple[int, Op | None] | None:
        """This rank's `ordinal`-th op of `kind` with `peer` and the absolute index of its unit;
        (-1, None) when dropped (complete), None when not issued yet."""
        count = (self.sent if kind == SEND else self.received)[peer]
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
        counted = (self.sent if target.kind == SEND else self.received)[target.peer]
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


def describe_comm(comm: str) -> str:
    group, ranks = comm.rsplit("/", 1)
    if ranks == "batch":
        return f"the communicator of process group {group}"
    low, high = ranks.split(",")
    return f"the communicator of ranks {low} and {high} (process group {group})"


def heads(records: dict[int, Record], comm: str) -> dict[int, int]:
    """For each rank with ops on `comm`, the absolute index of its first incomplete unit: the
    units before it have completed, it has started. A unit completes once each of its ops has
    met its peer's op of the same ordinal, started too. Raises NcclMismatch for a pair that NCCL
    would match wrongly."""
    queues = {rank: record.queues[comm] for rank, record in records.items() if comm in record.queues}
    head = {rank: queue.done for rank, queue in queues.items()}

    def met(rank: int, position: int) -> bool:
        queue = queues[rank]
        op = queue.units[head[rank] - queue.done][position]
        found = partner_of(queues.get(op.peer), rank, op, queue.ordinal(head[rank], position))
        if found is None or found[0] > head[op.peer]:
            return False
        if found[1] is not None:
            check_match(comm, rank, op, found[1])
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


def partner_of(other: Queue | None, rank: int, op: Op, ordinal: int) -> tuple[int, Op | None] | None:
    """The op of `other` (the peer's queue) that NCCL matches with `op` of `rank`, as `locate`."""
    return other.locate(RECV if op.kind == SEND else SEND, rank, ordinal) if other else None


def check_match(comm: str, rank: int, op: Op, partner: Op) -> None:
    if partner.nbytes == op.nbytes and partner.tag == op.tag:
        return
    (sender, send), (receiver, receive) = sorted([(rank, op), (op.peer, partner)], key=lambda side: side[1].kind)[::-1]
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
        queue = records[rank].queues[comm]
        head = head_of(comm)[rank]
        if head - queue.done >= len(queue.units):
            return []
        found = []
        for position, op in enumerate(queue.units[head - queue.done]):
            partner = partner_of(records[op.peer].queues.get(comm), rank, op, queue.ordinal(head, position))
            if partner is None:
                verb = "issue its receive from" if op.kind == SEND else "issue its send to"
                found.append((("host", op.peer), f"rank {rank}'s {op.name} waits for rank {op.peer} to {verb} "
                                                 f"rank {rank}"))
            elif partner[0] > head_of(comm)[op.peer]:
                other = records[op.peer].queues[comm]
                blocking = other.units[head_of(comm)[op.peer] - other.done]
                found.append((("unit", op.peer, comm),
                              f"rank {rank}'s {op.name} waits for rank {op.peer} to post its {partner[1].name}, "
                              f"queued behind its own {', '.join(p.name for p in blocking)} on {describe_comm(comm)} "
                              "(ops on one NCCL communicator start in issue order)"))
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
    """This rank's record in one default process group's lifetime, and the store it is shared in."""

    def __init__(self, store, rank: int, world_size: int, generation: int):
        self.main_store, self.rank, self.world_size = store, rank, world_size
        self.thread_stores = threading.local()
        self.prefix = f"{PREFIX}/{generation}"
        self.record = Record()
        self.known_complete: dict[str, int] = {}
        self.waits = itertools.count()
        self.lock = threading.RLock()
        self.aborted = False
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

    def publish(self) -> None:
        with self.lock:
            for comm, index in self.known_complete.items():
                self.record.queues[comm].drop_until(index)
            self.record.version += 1
            self.store.set(self.key(self.rank), self.record.to_json())
            change = self.store.add(f"{self.prefix}/changes", 1)
        self.store.set(f"{self.prefix}/change/{change}", "")

    def snapshot(self) -> dict[int, Record]:
        raws = self.store.multi_get([self.key(rank) for rank in range(self.world_size)])
        return {rank: Record.from_json(bytes(raw)) for rank, raw in enumerate(raws)}

    def issue(self, comm: str, ops: list[Op]) -> int:
        with self.lock:
            queue = self.record.queues.setdefault(comm, Queue())
            queue.units.append(ops)
            index = queue.done + len(queue.units) - 1
            self.publish()
        return index

    def create(self, comm: str, peer: int, what: str) -> None:
        """Create pair communicator `comm` with `peer` unless done: blocks until the peer has
        begun to create it too."""
        if comm in self.record.created:
            return
        with self.lock:
            self.record.created.add(comm)
        self._wait(Wait(comm, None, peer, what, _is_main(), next(self.waits)),
                   lambda records: comm in records[peer].created)

    def complete(self, comm: str, unit: int, what: str) -> None:
        """Block until unit `unit` of `comm` has completed on this rank."""
        def done(records: dict[int, Record]) -> bool:
            head = heads(records, comm)[self.rank]
            with self.lock:
                self.known_complete[comm] = max(self.known_complete.get(comm, 0), head)
            return unit < head
        self._wait(Wait(comm, unit, None, what, _is_main(), next(self.waits)), done)

    def abort(self) -> None:
        """End this rank's waits, as ncclCommAbort ends what its communicators run."""
        self.aborted = True
        self.publish()  # a change: its blocked threads wake

    def _wait(self, wait: Wait, done) -> None:
        registered = False
        while True:
            if self.aborted:
                raise NcclAborted(f"rank {self.rank}'s {wait.what} on {describe_comm(wait.comm)}: its communicators "
                                  "were aborted")
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
        # Only once it ended: after an error the store may be gone with the rank that hosted it.
        if registered:
            with self.lock:
                self.record.waits.remove(wait)
                self.publish()

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
            "ops NCCL starts together, or order each pair's ops so that a send meets a receive already posted.")


def _is_main() -> bool:
    return threading.current_thread() is threading.main_thread()


_world: _World | None = None


def init_process_group(*args, **kwargs):
    """c10d's, then this rank's record in a store prefix of its own: ranks that start a new
    default group on a store an older one used (a restart) count from a fresh generation."""
    global _world
    _real["init_process_group"](*args, **kwargs)
    store = _c10d._get_default_store()
    rank, size = _c10d.get_rank(), _c10d.get_world_size()
    generation = (store.add(f"{PREFIX}/joined", 1) - 1) // size
    _world = _World(store, rank, size, generation)


def _abort_process_group(group=None):
    """c10d's; aborting the world's groups also ends this rank's waits (NcclAborted)."""
    if group is None and _world is not None:
        _world.abort()
    _real["_abort_process_group"](group)


def _current_world(group) -> _World:
    """The world `group` (resolved: never None) belongs to, which must be the current one: an
    op on a group of a world destroyed or aborted since (a thread left behind by a repair) fails,
    as NCCL fails an op on a communicator that is gone."""
    if _world is None or _c10d.GroupMember.WORLD is None:
        raise RuntimeError("NCCL rules: point-to-point before init_process_group")
    if group not in _c10d._world.pg_map:
        raise NcclAborted(f"point-to-point on process group {group.group_name}, of a world destroyed or aborted since")
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
    if _c10d._rank_not_in_group(group_):
        return real(tensor, peer, group, tag, group_peer)
    world = _current_world(group_)
    other = _peer(group_, peer, group_peer)
    if other == world.rank:
        return real(tensor, peer, group, tag, group_peer)
    op = Op(kind, other, tag, _nbytes(tensor), f"{name}->{other}" if kind == SEND else f"{name}<-{other}")
    comm = _pair_comm(group_, world.rank, other)
    world.create(comm, other, op.name)
    unit = world.issue(comm, [op])
    return _RuledWork(real(tensor, peer, group, tag, group_peer), world, comm, unit, op.name)


def batch_isend_irecv(p2p_op_list):
    _c10d._check_p2p_op_list(p2p_op_list)
    group = _c10d._group_or_default_group(p2p_op_list[0].group)
    world = _current_world(group)
    ops = []
    for p2p in p2p_op_list:
        kind = SEND if p2p.op in (isend, _real["isend"]) else RECV
        if p2p.peer != world.rank:
            arrow = f"isend->{p2p.peer}" if kind == SEND else f"irecv<-{p2p.peer}"
            ops.append(Op(kind, p2p.peer, p2p.tag, _nbytes(p2p.tensor), f"{arrow} in a batch"))
    comm = f"{group.group_name}/batch"
    unit = world.issue(comm, ops) if ops else None
    what = "batch of " + ", ".join(op.name.removesuffix(" in a batch") for op in ops)
    works = []
    for p2p in p2p_op_list:
        real = _real["isend" if p2p.op in (isend, _real["isend"]) else "irecv"]
        peer_kwarg = {"group_dst" if real is _real["isend"] else "group_src": p2p.group_peer}
        work = real(p2p.tensor, group=p2p.group, tag=p2p.tag, **peer_kwarg)
        works.append(work if unit is None else _RuledWork(work, world, comm, unit, what))
    return works


class _RuledWorkMixin:
    """A gloo Work whose wait first waits, by NCCL's rules, for its op (or batch) to complete."""

    def __init__(self, work, world: _World, comm: str, unit: int, what: str):
        super().__init__()
        self._work, self._world, self._comm, self._unit, self._what = work, world, comm, unit, what

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._world.complete(self._comm, self._unit, self._what)
        return self._work.wait() if timeout is None else self._work.wait(timeout)

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


