"""The files between a node's agent and its trainer when the world is repaired in place
(trainer/repair.py), torch-free: the agent imports it.

- The order (`parallel.repair_file`): the agent writes it, whole, when the control plane repairs
  the world; every rank of the node waits for one newer than its world's generation.
- The failure file beside it: local rank 0 writes it when its world's step failed and the node's
  ranks wait for an order. The agent reports that failure at once, as it reports a trainer's exit
  when no repair can follow.

    {"generation": 1, "store_host": "10.0.3.7", "store_port": 29611, "host_node_rank": 0, "nodes": 4,
     "launch_nodes_gone": 1}
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.progress import write_whole

__all__ = ["REPAIR_ORDER_ENV", "RepairOrder", "read_order", "write_order", "failure_file", "say_failed", "read_failure"]

REPAIR_ORDER_ENV = "TRAINFLEET_REPAIR_ORDER"
"""Environment variable naming the order file for torchrun (node/torchrun.py); the trainer has it
in its config (parallel.repair_file)."""

FAILURE_TEXT_CHARS = 2000
"""How much of the failed step's error the failure file keeps."""


@dataclass(frozen=True)
class RepairOrder:
    """The next world, as the node's agent writes it."""

    generation: int
    """Counts the repairs of this launch: the world torchrun formed is generation 0."""
    store_host: str
    store_port: int
    """Where the generation's ranks meet: a store that the host node's local rank 0 serves."""
    host_node_rank: int
    nodes: int
    """Nodes in the repaired world (the same as before: a replacement takes a lost node's rank)."""
    launch_nodes_gone: int = 0
    """Nodes of the world torchrun launched whose torchrun is gone (lost since): the survivors'
    torchrun waits at its exit for the others only (node/torchrun.py). The trainer ignores it."""

    def world_size(self, ranks_per_node: int) -> int:
        return self.nodes * ranks_per_node


def read_order(path: Path) -> RepairOrder | None:
    """The order in `path`, or None while there is none."""
    try:
        return RepairOrder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None


def write_order(path: Path, order: RepairOrder) -> None:
    """Put the order in place whole: a rank never reads half of it."""
    write_whole(path, json.dumps(asdict(order)))


def failure_file(order_file: Path) -> Path:
    return order_file.with_name(order_file.name + ".failed")


def say_failed(order_file: Path, generation: int, error: str) -> None:
    """Say that generation `generation`'s step failed with `error` (local rank 0 of the node: one writer)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        write_whole(failure_file(order_file), json.dumps({"generation": generation,
                                                          "error": error[:FAILURE_TEXT_CHARS]}))


def read_failure(order_file: Path) -> dict[str, Any] | None:
    """What the failure file says ({"generation": ..., "error": ...}), or None while there is none."""
    try:
        return json.loads(failure_file(order_file).read_text())
    except FileNotFoundError:
        return None
