"""The fleet-wide preflight: the network of the whole world, measured before the first step.

Each node checks itself before it reports ready (trainer/health.py); what no node can see alone
is the network between them. At the start of every attempt of a world of more than one node,
once torchrun has gathered it and before the model is built, every rank:

1. all-reduces a buffer of `fleet_check.size_mib`, `iterations` times after one untimed: the
   world's bus bandwidth, nccl-tests' busbw (bytes / seconds x 2(n-1)/n, what each link of a
   ring carries, comparable across world sizes);
2. sends the buffer to the rank of its local rank `k` nodes on while it receives from the one
   `k` nodes back (k = 1, and 2 from three nodes on: every node gets two different partners
   each way), timing its send and its receive apart: each node-to-node link carries the
   buffers of all local ranks at once, timed by both of its ends, the slowest time counts.

Global rank 0 judges (`verdict`): the world passes when its busbw reaches the floor. Below it,
the slow nodes are those whose best link is below the floor: all the links of a slow node are
slow, while each of its partners keeps a good link to another node. When every node is slow
there is none to blame (the fabric, the placement group, a world of two): none is named.

Nodes are named by TRAINFLEET_NODE_NAME (the node agent gives its instance id; the host name
otherwise). Rank 0 writes the result to `result_file` and its node's agent reports it
(FleetChecked, trainer/agent.py). A world that failed does not train: its ranks wait to be
stopped, while the control plane replaces the slow nodes (spares first) for a new attempt.
"""

from __future__ import annotations

import json
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

__all__ = ["Link", "FleetCheckResult", "verdict", "run_fleet_check", "bus_bandwidth", "gate"]


@dataclass(frozen=True)
class Link:
    """One direction between two nodes and the bandwidth it carried (GB/s)."""

    source: str
    """The node that sent."""
    target: str
    """The node that received."""
    gbytes_per_s: float


@dataclass(frozen=True)
class FleetCheckResult:
    passed: bool
    busbw_gbytes_per_s: float
    floor_gbytes_per_s: float
    slowest_link: Link | None
    slow_nodes: list[str]
    """The nodes to replace; empty when the world passed or no node is to blame."""
    seconds: float
    """The whole check, all-reduce and link exchanges."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def bus_bandwidth(size_bytes: int, seconds: float, ranks: int) -> float:
    """nccl-tests' busbw of an all-reduce, GB/s."""
    return size_bytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def verdict(busbw: float, floor: float, links: list[Link], nodes: list[str], seconds: float) -> FleetCheckResult:
    """Pass or fail, and the nodes to blame (see the module docstring)."""
    slowest = min(links, key=lambda link: link.gbytes_per_s, default=None)
    if busbw >= floor:
        return FleetCheckResult(True, busbw, floor, slowest, [], seconds)
    best = {node: max((link.gbytes_per_s for link in links if node in (link.source, link.target)), default=0.0)
            for node in nodes}
    slow = sorted(node for node, bandwidth in best.items() if bandwidth < floor)
    return FleetCheckResult(False, busbw, floor, slowest, slow if len(slow) < len(nodes) else [], seconds)


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


def _exchange(buffer: torch.Tensor, inbox: torch.Tensor, send_to: int, receive_from: int,
              device: torch.device) -> tuple[float, float]:
    """Seconds until this rank's send and its receive completed, started together."""
    dist.barrier()
    started = time.perf_counter()
    sending, receiving = dist.isend(buffer, send_to), dist.irecv(inbox, receive_from)
    done: dict[str, float] = {}

    def wait(name: str, request: dist.Work) -> None:
        request.wait()
        _synchronize(device)
        done[name] = time.perf_counter() - started

    waiter = threading.Thread(target=wait, args=("send", sending))
    waiter.start()
    wait("receive", receiving)
    waiter.join()
    return done["send"], done["receive"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_fleet_check(cfg: FleetCheckConfig, device: torch.device,
                    on_work: Callable[[], None] = lambda: None) -> FleetCheckResult:
    """Measure the world (every rank calls this); the result, the same on every rank. `on_work`
    is called after each transfer: a slow node makes the check slow, never silent
    (trainer/progress.py)."""
    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = world // per_node
    size = int(cfg.size_mib * 2**20) // 4 * 4
    buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
    busbw = bus_bandwidth(size, _timed_allreduce(buffer, cfg.iterations, device, on_work), world)
    inbox = torch.empty_like(buffer)
    node = rank // per_node
    timed: list[tuple[int, int, float]] = []  # (source node, target node, seconds) as this rank saw them
    for k in (1, 2) if nodes >= 3 else (1,):
        shift = k * per_node
        seconds = []
        for _ in range(cfg.iterations):
            seconds.append(_exchange(buffer, inbox, (rank + shift) % world, (rank - shift) % world, device))
            on_work()
        send_s, receive_s = (statistics.median(times) for times in zip(*seconds))
        timed += [(node, (node + k) % nodes, send_s), ((node - k) % nodes, node, receive_s)]
    gathered: list[tuple[str, list[tuple[int, int, float]]] | None] = [None] * world
    dist.all_gather_object(gathered, (os.environ.get(NODE_NAME_ENV) or socket.gethostname(), timed))
    names = [gathered[index * per_node][0] for index in range(nodes)]
    slowest_time: dict[tuple[int, int], float] = {}
    for source, target, seconds in (entry for _, entries in gathered for entry in entries):
        slowest_time[(source, target)] = max(seconds, slowest_time.get((source, target), 0.0))
    # Every local rank of a node sends to its peer on the other node at once: the link carries
    # all of their buffers in the time the slowest of them took.
    links = [Link(names[source], names[target], per_node * size / seconds / 1e9)
             for (source, target), seconds in sorted(slowest_time.items())]
    # Rank 0's timing of the all-reduce judges, so that every rank acts on the same verdict.
    judged = [verdict(busbw, cfg.busbw_floor_gbytes_per_s, links, names, time.perf_counter() - started)]
    dist.broadcast_object_list(judged, src=0)
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
              + (f"node {slowest.source} -> {slowest.target} {slowest.gbytes_per_s:.3f} GB/s" if slowest else "none")
              + (f", slow nodes {result.slow_nodes}" if result.slow_nodes else "")
              + f", {result.seconds:.1f} s", flush=True)
    if not result.passed:
        threading.Event().wait()  # until torchrun stops the world: the control plane replaces nodes
