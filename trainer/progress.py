"""The trainer's progress file: how a node's agent sees its own node's trainer advance.

Only global rank 0 writes the metrics file, so without this an agent on any other node cannot
tell whether its trainer joined the rendezvous or still advances. Local rank 0 of every node
writes the step it completed (the resume step first, once the world is up) to the file named by
TRAINFLEET_PROGRESS_FILE, replacing it whole; the agent reads it at each look and reports it in
its liveness record (trainfleet.contracts.NodeLiveness). The agent also names its node to the
trainer (TRAINFLEET_NODE_NAME, its instance id): the fleet check reports slow nodes by that name.
Torch-free: the agent imports it.
"""

import os
from pathlib import Path

__all__ = ["PROGRESS_FILE_ENV", "NODE_NAME_ENV", "progress_file", "write_whole", "write_progress", "read_progress"]

PROGRESS_FILE_ENV = "TRAINFLEET_PROGRESS_FILE"
"""Environment variable naming the file; unset, nothing is written."""
NODE_NAME_ENV = "TRAINFLEET_NODE_NAME"
"""Environment variable naming the node (trainer/fleet_check.py)."""


def progress_file() -> Path | None:
    """This process's progress file: only local rank 0 of a node writes one."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    return Path(path) if path and os.environ.get("LOCAL_RANK", "0") == "0" else None


def write_whole(path: Path, text: str) -> None:
    """Replace the file at once: the agent reading it never sees half of what was written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_progress(path: Path, step: int) -> None:
    write_whole(path, str(step))


def read_progress(path: Path) -> int | None:
    """The last step written, or None before the trainer joined the rendezvous."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return None
