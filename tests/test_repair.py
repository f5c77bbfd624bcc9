"""The repair order's plain parts (trainer/repair.py, trainer/repair_order.py); the repair itself
runs in tests/checkpoint/test_memory_checkpoint.py and, ordered by the agents, in
tests/test_spares_local_run.py."""

import json
from datetime import timedelta

import pytest

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
