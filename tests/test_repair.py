"""The repair order's plain parts (trainer/repair.py, trainer/repair_order.py) and leaving a failed
step's FSDP state; the repair itself runs in tests/checkpoint/test_memory_checkpoint.py and,
ordered by the agents, in tests/test_spares_local_run.py."""

import json
from datetime import timedelta
from pathlib import Path

import pytest

from conftest import free_port, spawn_ranks

from trainer.repair import RepairError, await_order
from trainer.repair_order import RepairOrder, read_failure, read_order, say_failed, write_order

ORDER = {"generation": 2, "store_host": "10.0.3.7", "store_port": 29611, "host_node_rank": 1, "nodes": 4,
         "launch_nodes_gone": 1}


def test_an_order_is_read_once_it_is_there(tmp_path):
    path = tmp_path / "repair.json"
    assert read_order(path) is None
    write_order(path, RepairOrder(**ORDER))
    assert json.loads(path.read_text()) == ORDER
    order = read_order(path)
    assert order == RepairOrder(**ORDER) and order.world_size(8) == 32


def test_the_failure_is_said_once_per_node_for_the_agent(tmp_path, monkeypatch):
    path = tmp_path / "repair.json"
    assert read_failure(path) is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    say_failed(path, 0, "RuntimeError: Connection closed by peer")
    assert read_failure(path) is None, "only local rank 0 writes it"
    monkeypatch.setenv("LOCAL_RANK", "0")
    say_failed(path, 3, "RuntimeError: " + "x" * 5000)
    said = read_failure(path)
    assert said["generation"] == 3 and said["error"].startswith("RuntimeError: x") and len(said["error"]) == 2000


def test_a_rank_waits_only_for_an_order_newer_than_its_world(tmp_path):
    path = tmp_path / "repair.json"
    path.write_text(json.dumps(ORDER))
    beats = []
    assert await_order(path, 1, timedelta(seconds=60), lambda: beats.append(1), ValueError()).generation == 2
    failure = RuntimeError("Connection closed by peer")
    with pytest.raises(RepairError, match=r"no repair order came in 0 s after the step failed "
                                          r"\(RuntimeError: Connection closed by peer\)") as raised:
        await_order(path, 2, timedelta(seconds=0.2), lambda: beats.append(1), failure)
    assert raised.value.__cause__ is failure and beats, "the rank says it is alive while it waits"


def _abandoning_rank(rank: int, out: str) -> None:
    """A one-rank world with an FSDP model that ran a forward, whose reset then fails."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.repair import abandon_step

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    fresh, used = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    for part in (fresh, used):
        fully_shard(part, mesh=mesh)
    used(torch.ones(2, 4)).sum().backward()
    outcome = {}
    abandon_step([fresh], mesh, RuntimeError("lost peer"))  # never ran: nothing to reset
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def fails() -> None:
        raise RuntimeError("waiting on an all-gather of the dead world")
    used.reset_iter_state = fails
    try:
        abandon_step([used], mesh, RuntimeError("lost peer"))
    except RepairError as error:
        outcome["error"] = str(error)
    Path(out).write_text(json.dumps(outcome))


def test_a_failed_reset_of_fsdps_state_is_a_repair_error_not_a_log_line(tmp_path):
    """A rank whose FSDP state of the failed step cannot be reset would issue other collectives
    than its peers in the next world: the repair gives up (the control plane restarts the world)."""
    out = tmp_path / "outcome.json"
    spawn_ranks(_abandoning_rank, (str(out),), 1)
    assert json.loads(out.read_text())["error"] == (
        "FSDP's state of the failed step could not be reset (RuntimeError: waiting on an all-gather of the dead "
        "world): the ranks of a stage could issue different collectives in the next world, so it restarts instead")


def _restored_rank(rank: int, port: int, steps: list[int], out: str) -> None:
    """Two ranks that restored `steps[rank]` check that they agree."""
    import os
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from trainer.train import StepsDisagree, _agree_on_step
    from trainer.world_failure import current_world

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    run = SimpleNamespace(env=SimpleNamespace(world_size=2, device=torch.device("cpu"), world=current_world()),
                          state=SimpleNamespace(step=steps[rank]))
    try:
        _agree_on_step(run)
        outcome = "agreed"
    except StepsDisagree as error:
        outcome = str(error)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


@pytest.mark.parametrize("steps, disagree", [([13, 13], False), ([13, 0], True)])
def test_after_a_restore_the_world_agrees_on_its_step_or_stops(tmp_path, steps, disagree):
    """The highest and the lowest step, from one all-reduce: a world whose ranks restored different
    steps would train different batches and wait for each other at the end for ever."""
    spawn_ranks(_restored_rank, (free_port(), steps, str(tmp_path)), 2)
    outcomes = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    if disagree:
        assert outcomes == [f"after the restore the world's ranks hold steps 0 to 13 (this rank {step}): they would "
                            "train different batches; the world restarts" for step in steps]
    else:
        assert outcomes == ["agreed", "agreed"]
