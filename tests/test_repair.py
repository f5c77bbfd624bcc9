"""The repair order's plain parts (trainer/repair.py); the repair itself runs in
tests/checkpoint/test_memory_checkpoint.py."""

import json
from datetime import timedelta

import pytest

from trainer.repair import RepairError, RepairOrder, await_order, read_order

ORDER = {"generation": 2, "store_host": "10.0.3.7", "store_port": 29611, "host_node_rank": 1, "nodes": 4}


def test_an_order_is_read_once_it_is_there(tmp_path):
    path = tmp_path / "repair.json"
    assert read_order(path) is None
    path.write_text(json.dumps(ORDER))
    order = read_order(path)
    assert order == RepairOrder(**ORDER) and order.world_size(8) == 32


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
