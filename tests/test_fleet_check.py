"""The fleet-wide network check (trainer/fleet_check.py): the verdict over plain figures, and a
real gloo world of three nodes where one node is made slow."""

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from conftest import free_port, spawn_ranks
from trainer import fleet_check
from trainer.config import FleetCheckConfig
from trainer.fleet_check import Link, bus_bandwidth, verdict
from trainer.progress import NODE_NAME_ENV

FAST, SLOW, FLOOR = 5.0, 0.1, 1.0


def name(node: int) -> str:
    return f"node-{node}"


def ring_links(nodes: int, slow: set[int]) -> list[Link]:
    """Links at shifts 1 and 2, slow where they touch a slow node."""
    return [Link(name(source), name((source + k) % nodes), SLOW if {source, (source + k) % nodes} & slow else FAST)
            for k in (1, 2) for source in range(nodes)]


def names(nodes: int) -> list[str]:
    return [name(node) for node in range(nodes)]


def test_bus_bandwidth_is_nccl_tests_busbw():
    # 1 GB in 0.1 s over 8 ranks: algbw 10 GB/s, busbw 10 x 2 x 7 / 8.
    assert bus_bandwidth(10**9, 0.1, 8) == pytest.approx(17.5)


def test_a_world_at_the_floor_passes_and_names_no_one():
    result = verdict(FLOOR, FLOOR, ring_links(4, slow={2}), names(4), 1.0)
    assert result.passed and result.slow_nodes == []
    assert result.slowest_link.gbytes_per_s == SLOW


@pytest.mark.parametrize("nodes, slow", [(3, {1}), (4, {2}), (8, {0, 5})])
def test_below_the_floor_the_nodes_without_a_good_link_are_named(nodes, slow):
    result = verdict(0.5, FLOOR, ring_links(nodes, slow), names(nodes), 1.0)
    assert not result.passed and result.slow_nodes == [name(node) for node in sorted(slow)]


@pytest.mark.parametrize("nodes", [2, 3, 5])
def test_when_every_node_is_slow_none_is_to_blame(nodes):
    result = verdict(0.5, FLOOR, ring_links(nodes, slow=set(range(nodes))), names(nodes), 1.0)
    assert not result.passed and result.slow_nodes == []


DELAY_S = 0.2


def _slowed(rank: int) -> None:
    """This rank's every transfer waits DELAY_S first, both ways: a node with a bad network."""
    send, receive, all_reduce = dist.isend, dist.irecv, dist.all_reduce

    class LateReceive:
        def __init__(self, work):
            self.work = work

        def wait(self):
            time.sleep(DELAY_S)
            return self.work.wait()

    def slow_send(tensor, peer):
        time.sleep(DELAY_S)
        return send(tensor, peer)

    def slow_all_reduce(tensor):
        time.sleep(DELAY_S)
        return all_reduce(tensor)

    fleet_check.dist.isend = slow_send
    fleet_check.dist.irecv = lambda tensor, peer: LateReceive(receive(tensor, peer))
    fleet_check.dist.all_reduce = slow_all_reduce


def _world(rank, port, slow_rank, floor, results, world=3, per_node=1, works=None):
    os.environ.update({NODE_NAME_ENV: name(rank // per_node), "LOCAL_WORLD_SIZE": str(per_node)})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        if rank == slow_rank:
            _slowed(rank)
        config = FleetCheckConfig(enabled=True, size_mib=1, iterations=3, busbw_floor_gbytes_per_s=floor)
        done = []
        results[rank] = fleet_check.run_fleet_check(config, torch.device("cpu"), lambda: done.append(1))
        if works is not None:
            works[rank] = len(done)
    finally:
        dist.destroy_process_group()


def three_nodes(slow_rank: int | None, floor: float) -> list:
    with torch_mp.Manager() as manager:
        results = manager.dict()
        spawn_ranks(_world, (free_port(), slow_rank, floor, results), nprocs=3)
        return [results[rank] for rank in range(3)]


@pytest.mark.slow
def test_a_slow_node_of_three_is_named_by_every_rank():
    # 1 MiB in 0.2 s is 5 MB/s at most on the slow node's links; loopback carries hundreds of MB/s.
    results = three_nodes(slow_rank=1, floor=0.05)
    assert all(result == results[0] for result in results)
    (result,) = {result.to_json() for result in results}
    assert not results[0].passed and results[0].slow_nodes == ["node-1"], result
    slowest = results[0].slowest_link
    assert slowest.gbytes_per_s < 0.05 and "node-1" in (slowest.source, slowest.target)


@pytest.mark.slow
def test_a_healthy_world_passes_its_floor_and_every_transfer_is_a_sign_of_life():
    with torch_mp.Manager() as manager:
        results, works = manager.dict(), manager.dict()
        spawn_ranks(_world, (free_port(), None, 0.001, results, 3, 1, works), nprocs=3)
        result, works = results[0], dict(works)
    assert result.passed and result.busbw_gbytes_per_s > 0.001 and result.slow_nodes == []
    # the untimed all-reduce, 3 timed ones, 3 exchanges with the next node and 3 with the one after
    assert works == {rank: 1 + 3 + 3 + 3 for rank in range(3)}


@pytest.mark.slow
def test_links_join_nodes_and_carry_every_local_rank(tmp_path):
    with torch_mp.Manager() as manager:
        results = manager.dict()
        spawn_ranks(_world, (free_port(), None, 0.001, results, 4, 2), nprocs=4)
        result = results[0]
    assert result.passed
    assert {(link.source, link.target) for link in [result.slowest_link]} <= {("node-0", "node-1"),
                                                                               ("node-1", "node-0")}
