"""The trainer's progress file: how a node's agent sees its own node's trainer advance.

Only global rank 0 writes the metrics file, so without this an agent on any other node cannot
tell whether its trainer joined the rendezvous or still advances. Local rank 0 of every node
writes to the file named by TRAINFLEET_PROGRESS_FILE, replacing it whole, two things:
- the step it completed (the resume step first, once the world is up), which the agent reports
  in its liveness record (trainfleet.core.records.NodeLiveness);
- how many signs of life it gave: each phase of its start-up (the world formed, the fleet
  checked, the model built), each transfer of the fleet check (a slow node's take seconds
  each), each microbatch's forward or backward, and every half second of a checkpoint save
  that blocks it (alive_during). A step of a large model
  takes seconds to minutes, and on a starved machine any step can: the agent that speaks for
  the world takes any change of this file as the world being alive, so that a hang is declared
  only when the world is silent, not when it is slow (node/attempt.py, beat_if_due).
The agent also names its node to the trainer (TRAINFLEET_NODE_NAME, its instance id): the
fleet check reports slow nodes by that name. Torch-free: the agent imports it.
"""

import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PROGRESS_FILE_ENV", "NODE_NAME_ENV", "NODE_RANK_ENV", "BEAT_WRITE_EVERY_S", "Progress", "progress_file",
           "write_whole", "read_progress"]

PROGRESS_FILE_ENV = "TRAINFLEET_PROGRESS_FILE"
"""Environment variable naming the file; unset, nothing is written."""
NODE_NAME_ENV = "TRAINFLEET_NODE_NAME"
"""Environment variable naming the node (trainer/fleet_check.py)."""
NODE_RANK_ENV = "TRAINFLEET_NODE_RANK"
"""Environment variable with the node's rank in the launch spec, which the node agent sets
(trainer/memory_checkpoint.py's buddies follow it); unset, the node's place in torchrun's order."""
BEAT_WRITE_EVERY_S = 0.5
"""Signs of life are written at most this often (a microbatch may take a millisecond); a step is
written at once."""


def progress_file() -> Path | None:
    """This process's progress file: only local rank 0 of a node writes one."""
    path = os.environ.get(PROGRESS_FILE_ENV)
    return Path(path) if path and os.environ.get("LOCAL_RANK", "0") == "0" else None


def write_whole(path: Path, text: str) -> None:
    """Replace the file at once: the agent reading it never sees half of what was written."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


class Progress:
    """This process's progress file, or nothing where it writes none (`path` None)."""

    def __init__(self, path: Path | None):
        self.path = path
        self.step: int | None = None
        """The last step completed; None before the trainer joined the world."""
        self.beats = 0
        self._written_at = -math.inf
        self._lock = threading.Lock()  # alive_during's thread beats too
        self._blocked = threading.Event()
        self._beater: threading.Thread | None = None

    @classmethod
    def of_this_process(cls) -> "Progress":
        return cls(progress_file())

    def beat(self) -> None:
        """A unit of work done (a start-up phase, a microbatch's forward or backward)."""
        with self._lock:
            self.beats += 1
            if time.monotonic() - self._written_at >= BEAT_WRITE_EVERY_S:
                self._write()

    @contextlib.contextmanager
    def alive_during(self) -> Iterator[None]:
        """Signs of life while the caller blocks in work that gives none of its own (a save that
        waits for the upload before it, or, asked for, returns once committed): the agents judge
        a world that was stepping hung after a few of its step times of silence
        (trainfleet.core.pace.hung_after), and a save may take longer. One thread of this
        process beats while any such block runs. A world stuck inside one (a peer lost during a
        save's collectives) is ended by the checkpoint's own timeout instead."""
        if self.path is None:
            yield
            return
        if self._beater is None:
            self._beater = threading.Thread(target=self._beat_while_blocked, name="progress", daemon=True)
            self._beater.start()
        self._blocked.set()
        try:
            yield
        finally:
            self._blocked.clear()

    def _beat_while_blocked(self) -> None:
        while self._blocked.wait():
            time.sleep(BEAT_WRITE_EVERY_S)
            if self._blocked.is_set():
                self.beat()

    def reached(self, step: int) -> None:
        """The world completed `step` (the first call: it joined the world at that step)."""
        with self._lock:
            self.step = step
            self.beats += 1
            self._write()

    def _write(self) -> None:
        if self.path is not None:
            write_whole(self.path, f"{'-' if self.step is None else self.step} {self.beats}")
        self._written_at = time.monotonic()


def read_progress(path: Path) -> int | None:
    """The last step written, or None before the trainer joined the world."""
    try:
        step = path.read_text().split()[0]
    except (FileNotFoundError, IndexError):
        return None
    return None if step == "-" else int(step)
