"""The fleet-wide preflight: the network of the whole world, measured before the first step.

Each node checks itself before it reports ready (node/health.py); what no node can see alone
is the network between them. At the start of every attempt of a world of more than one node,
once torchrun has gathered it and before the model is built, every rank:

1. all-reduces a buffer of `fleet_check.size_mib`, `iterations` times after one untimed: the
   world's bus bandwidth, nccl-tests' busbw (bytes / seconds x 2(n-1)/n, what each link of a
   ring carries). The buffer is sized where NCCL reaches its bandwidth plateau (1 GiB on GPUs):
   a smaller message is latency-bound at scale and says nothing of the links;
2. exchanges the buffer both ways with the rank of the same local rank on another node, in
   rounds of disjoint node pairs (`pairings`: a round-robin, three rounds where the world has
   them, so each node meets two or three partners; the one pair of a world of two). Each
   exchange is one `batch_isend_irecv`: on NCCL an unbatched send waits for its receive and
   lazily creates a communicator per pair, so sends and receives posted one by one deadlock;
   a batch completes as one work, so what is timed is the exchange, both directions at once.
   Each node-to-node link carries the buffers of all local ranks at once, timed by both of its
   ends: the slowest time counts.

Global rank 0 judges (`verdict`), by this rule: a world whose every link is healthy passes.
A link is healthy when it reaches `busbw_floor_gbytes_per_s`, the two-node floor (half what a
healthy pair of the instance type carries, trainfleet/core/catalogue.py). A node is slow when all of
its links are below it while some other node keeps a good link: it is named, and the world
fails for it to be replaced (spares first). When every node is slow there is none to blame
(the fabric, the placement group, a world of two): the world fails naming none if its all-reduce
is below the floor for its size too. The all-reduce is judged against the two-node floor scaled
for the world's node count (`allreduce_floor`, from published nccl-tests figures); below it with
every link healthy, the world passes with a warning and the figure recorded: a large world's
all-reduce is slower than a pair's, and no replacement can make it faster.

Nodes are named by TRAINFLEET_NODE_NAME (the node agent gives its instance id; the host name
otherwise). Rank 0 writes the result to `result_file` and its node's agent reports it
(FleetChecked, node/attempt.py). A world that failed does not train: its ranks wait to be
stopped, while the control plane replaces the slow nodes (spares first) for a new attempt.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import FleetCheckConfig
from trainer.progress import NODE_NAME_ENV, write_whole
from trainer.world_failure import current_world, raise_if_failed

__all__ = ["Link", "FleetCheckResult", "verdict", "run_fleet_check", "bus_bandwidth", "allreduce_floor", "pairings",
           "gate"]

ROUNDS = 3
"""Rounds of pair exchanges: three partners for each node of an even world from four nodes on,
two at least in an odd one (a node sits out one round of an odd world's round-robin at most)."""


@dataclass(frozen=True)
class Link:
    """Two nodes and what their exchange carried each way at once (GB/s)."""

    source: str
    """One end: the node of the lower index in the world."""
    target: str
    """The other end."""
    gbytes_per_s: float


@dataclass(frozen=True)
class FleetCheckResult:
    passed: bool
    busbw_gbytes_per_s: float
    floor_gbytes_per_s: float
    """What the all-reduce had to reach: the two-node floor scaled for the world's node count."""
    link_floor_gbytes_per_s: float
    """What every node-to-node link had to reach: the two-node floor."""
    slowest_link: Link | None
    slow_nodes: list[str]
    """The nodes to replace; empty when the world passed or no node is to blame."""
    warning: str
    """Why a world that passed deserves a look (its all-reduce below its floor); empty if none."""
    seconds: float
    """The whole check, all-reduce and link exchanges."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def bus_bandwidth(size_bytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' busbw of an all-reduce, GB/s."""
    return size_bytes / seconds * 2 * (ranks - 1) / ranks / 1e9


# Published nccl-tests all_reduce_perf busbw at 1 GiB over EFA, by node count:
# - NVIDIA/nccl issue 527 ("Slow bus bandwidth w/ nccl 2.9.9 on EC2 instances"), p4dn.24xlarge:
#   57.2 GB/s on 2 nodes, 31.8 on 3, 29.6 on 4: past two nodes about half (a two-node all-reduce
#   runs as a tree whose busbw overstates the links, NVIDIA/nccl-tests issue 22).
# - NVIDIA/nccl issue 235 and aws/aws-ofi-nccl issue 19 ("optimizing NCCL performance for Deep
#   Learning workloads on AWS EFA network"), p3dn.24xlarge: about 10 GB/s on 2 nodes, 6-8 GB/s on
#   8 to 32; 70% of an InfiniBand cluster's figure on 8 nodes, 60% on 16: about 0.85 a doubling.
# No figure for 64 nodes or more was found published; the decline is carried on, and a large
# world whose every link is healthy passes whatever its all-reduce (the module docstring).
PAST_TWO_NODES = 0.5
"""The all-reduce floor of three and four nodes over that of two."""
PER_DOUBLING = 0.85
"""Its decline each doubling of the node count from four nodes on."""


def allreduce_floor(two_node_floor: float, nodes: int) -> float:
    """The all-reduce busbw a healthy world of `nodes` nodes reaches, from the two-node floor."""
    if nodes <= 2:
        return two_node_floor
    return two_node_floor * PAST_TWO_NODES * PER_DOUBLING ** max(0.0, math.log2(nodes / 4))


def pairings(nodes: int, rounds: int = ROUNDS) -> list[list[tuple[int, int]]]:
    """The first `rounds` rounds of a round-robin of `nodes` nodes (the circle method): each
    round pairs every node with a partner it has not met (an odd world's extra slot is a round
    off for the node drawn with it); pairs lower index first."""
    slots = nodes + nodes % 2
    circle = slots - 1  # slot `circle` stays put while the others turn
    schedule = []
    for turn in range(min(rounds, circle)):
        pairs = [(turn, circle)] + [((turn + step) % circle, (turn - step) % circle) for step in range(1, slots // 2)]
        schedule.append(sorted((min(pair), max(pair)) for pair in pairs if max(pair) < nodes))
    return schedule


def verdict(busbw: float, two_node_floor: float, links: list[Link], nodes: list[str],
            seconds: float) -> FleetCheckResult:
    """Pass or fail, and the nodes to blame (the rule of the module docstring)."""
    floor = allreduce_floor(two_node_floor, len(nodes))
    slowest = min(links, key=lambda link: link.gbytes_per_s, default=None)
    best = {node: max((link.gbytes_per_s for link in links if node in (link.source, link.target)), default=0.0)
            for node in nodes}
    slow = sorted(node for node, bandwidth in best.items() if bandwidth < two_node_floor)
    blamed = slow if len(slow) < len(nodes) else []
    links_healthy = slowest is None or slowest.gbytes_per_s >= two_node_floor
    passed = not blamed and (links_healthy or busbw >= floor)
    warning = ""
    if passed and busbw < floor:
        warning = (f"all-reduce {busbw:.3f} GB/s below the floor of {len(nodes)} nodes ({floor:.3f} GB/s) with every "
                   f"link healthy: passed, no node to replace")
    return FleetCheckResult(passed, busbw, floor, two_node_floor, slowest, blamed, warning, seconds)


def _timed_allreduce(buffer: torch.Tensor, iterations: int, device: torch.device, on_work: Callable[[], None]) -> float:
    dist.all_reduce(buffer)  # untimed: connections and buffers set up
    _synchronize(device)
    on_work()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(buffer)
        on_work()  # a call of a clock at most: beside a transfer of MiB, nothing
    _synchronize(device)
    return (time.perf_counter() - started) / iterations


def _exchange(buffer: torch.Tensor, inbox: torch.Tensor, peer: int | None, device: torch.device) -> float:
    """Seconds until this rank's exchange with `peer` completed both ways (every rank of the world
    calls this together; one without a peer this round only keeps the pace)."""
    dist.barrier()
    started = time.perf_counter()
    if peer is None:
        return 0.0
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, buffer, peer), dist.P2POp(dist.irecv, inbox, peer)]):
        work.wait()
    _synchronize(device)
    return time.perf_counter() - started


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_fleet_check(cfg: FleetCheckConfig, device: torch.device,
                    on_work: Callable[[], None] = lambda: None) -> FleetCheckResult:
    """Measure the world (every rank calls this); the result, the same on every rank. `on_work`
    is called after each transfer: a slow node makes the check slow, never silent
    (trainer/progress.py)."""
    started = time.perf_counter()
    rank, world, formed = dist.get_rank(), dist.get_world_size(), current_world()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = world // per_node
    size = int(cfg.size_mib * 2**20) // 4 * 4
    buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
    busbw = bus_bandwidth(size, _timed_allreduce(buffer, cfg.iterations, device, on_work), world)
    inbox = torch.empty_like(buffer)
    node, local_rank = divmod(rank, per_node)
    timed: list[tuple[int, int, float]] = []  # (node, node, seconds) as this rank saw its exchanges
    for pairs in pairings(nodes):
        partner = {a: b for pair in pairs for a, b in (pair, pair[::-1])}.get(node)
        peer = None if partner is None else partner * per_node + local_rank
        seconds = []
        for _ in range(cfg.iterations):
            seconds.append(_exchange(buffer, inbox, peer, device))
            on_work()
        if partner is not None:
            timed.append((min(node, partner), max(node, partner), statistics.median(seconds)))
    gathered: list[tuple[str, list[tuple[int, int, float]]] | None] = [None] * world
    dist.all_gather_object(gathered, (os.environ.get(NODE_NAME_ENV) or socket.gethostname(), timed))
    raise_if_failed(formed, "the fleet check's gather")
    names = [gathered[index * per_node][0] for index in range(nodes)]
    slowest_time: dict[tuple[int, int], float] = {}
    for a, b, seconds in (entry for _, entries in gathered for entry in entries):
        slowest_time[(a, b)] = max(seconds, slowest_time.get((a, b), 0.0))
    # Every local rank of a node exchanges with its peer on the other node at once: the link
    # carries all of their buffers each way in the time the slowest of them took.
    links = [Link(names[a], names[b], per_node * size / seconds / 1e9)
             for (a, b), seconds in sorted(slowest_time.items())]
    # Rank 0's timing of the all-reduce judges, so that every rank acts on the same verdict.
    judged = [verdict(busbw, cfg.busbw_floor_gbytes_per_s, links, names, time.perf_counter() - started)]
    dist.broadcast_object_list(judged, src=0)
    raise_if_failed(formed, "the fleet check's verdict")
    return judged[0]


def gate(cfg: FleetCheckConfig, device: torch.device, on_work: Callable[[], None]) -> None:
    """Check the world; return when it passed, else wait to be stopped (never return)."""
    result = run_fleet_check(cfg, device, on_work)
    if dist.get_rank() == 0:
        if cfg.result_file:
            write_whole(Path(cfg.result_file), result.to_json())
        slowest = result.slowest_link
        print(f"fleet check {'passed' if result.passed else 'FAILED'}: all-reduce busbw "
              f"{result.busbw_gbytes_per_s:.3f} GB/s (floor {result.floor_gbytes_per_s:.3f}), slowest link "
              + (f"{slowest.source} <-> {slowest.target} {slowest.gbytes_per_s:.3f} GB/s each way" if slowest else "none")
              + f" (floor {result.link_floor_gbytes_per_s:.3f})"
              + (f", slow nodes {result.slow_nodes}" if result.slow_nodes else "")
              + f", {result.seconds:.1f} s" + (f"; warning: {result.warning}" if result.warning else ""), flush=True)
    if not result.passed:
        threading.Event().wait()  # until torchrun stops the world: the control plane replaces nodes
