"""Waiting by progress, never by the clock alone: how local runs, the chaos cells and the tests wait.

A healthy run on a loaded machine takes several times as long as on an idle one, so a deadline
for a whole run fails it for nothing, and one long enough for the worst machine hides a stuck
run for as long. `until` waits for `done` as long as `progress` (a snapshot of what shows the
work advancing: states entered, instance states, steps, bytes written) keeps changing, and gives
up only once it stood still for `stall_s`, naming what it waited for and the last change it saw.
`run_captured` does the same for a child process, whose output and files are its progress.

    watch = stack.watch(run)
    until(stack.ended(run), watch.progress, what=f"the end of {run.run_name}")
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["STALL_S", "Stalled", "Progress", "until", "run_captured", "wait_for_exit", "sizes"]

T = TypeVar("T")

STALL_S = 600.0
"""How long a local run may show nothing new before it counts as stuck. Longer than any bound a
local RunSpec gives the product (boot, start-up and hang timeouts: 300 s at most), by which the
product itself must act and so show something new, with room for a starved machine's slow
reaction."""


class Stalled(TimeoutError):
    """Nothing advanced for the stall limit while waiting."""


LOOK_EVERY_S = 2.0
"""How often a snapshot is taken: one may cost several reads of the local cloud."""


class Progress:
    """Whether something still advances: `check()` takes a new snapshot from `snapshot` (at most
    every LOOK_EVERY_S) and raises Stalled once the snapshots stood the same for `stall_s` seconds."""

    def __init__(self, snapshot: Callable[[], Hashable], *, what: str, stall_s: float = STALL_S):
        self.snapshot, self.what, self.stall_s = snapshot, what, stall_s
        self.seen, self.changed = snapshot(), time.monotonic()
        self.looked = self.changed

    def check(self) -> None:
        now = time.monotonic()
        if now - self.looked < LOOK_EVERY_S:
            return
        self.looked, snapshot = now, self.snapshot()
        if snapshot != self.seen:
            self.seen, self.changed = snapshot, now
        elif now - self.changed > self.stall_s:
            raise Stalled(f"nothing advanced for {self.stall_s:.0f} s while waiting for {self.what}; "
                          f"last seen: {self.seen}")


def until(done: Callable[[], T], progress: Callable[[], Hashable], *, what: str, stall_s: float = STALL_S,
          poll_s: float = 0.5) -> T:
    """Poll `done` until it gives something truthy, and return that; Stalled once `progress()`
    gave the same snapshot for `stall_s` seconds."""
    advancing = Progress(progress, what=what, stall_s=stall_s)
    while not (found := done()):
        time.sleep(poll_s)
        advancing.check()
    return found


def tail(path: Path, most: int = 20_000) -> str:
    """The end of a text file, at most `most` characters."""
    return path.read_text(errors="replace")[-most:]


def sizes(paths: Sequence[Path]) -> tuple[int, ...]:
    """The sizes of files (0 for one not there yet): a snapshot of what is being written to them."""
    found = []
    for path in paths:
        try:
            found.append(path.stat().st_size)
        except FileNotFoundError:
            found.append(0)
    return tuple(found)


def run_captured(command: Sequence[str], *, what: str, also_watch: Sequence[Path] = (), stall_s: float = STALL_S,
                 **popen: Any) -> subprocess.CompletedProcess[str]:
    """Run `command` until it exits, its stdout and stderr captured; Stalled (the process killed,
    the ends of its stdout and stderr in the message) once neither of them nor the files of
    `also_watch` grew for `stall_s`."""
    with tempfile.TemporaryDirectory(prefix="captured-") as folder:
        stdout, stderr = Path(folder, "stdout"), Path(folder, "stderr")
        with stdout.open("wb") as out, stderr.open("wb") as err, \
                subprocess.Popen(command, stdout=out, stderr=err, **popen) as process:
            try:
                wait_for_exit(process, [stdout, stderr, *also_watch], what=what, stall_s=stall_s)
            except Stalled as stalled:
                process.wait()
                raise Stalled(f"{stalled}\n--- the end of its stdout:\n{tail(stdout)}\n--- the end of its "
                              f"stderr:\n{tail(stderr)}") from None
        return subprocess.CompletedProcess(process.args, process.returncode, stdout.read_text(errors="replace"),
                                           stderr.read_text(errors="replace"))


DUMP_SIGNAL = signal.SIGUSR1
"""Asks a stalled process for its threads' stacks before it is killed: a local cloud's process
writes them to stderr on it (LocalCloud.start registers faulthandler); another one dies of it."""
DUMP_WAIT_S = 5.0


def wait_for_exit(process: Any, watched: Sequence[Path], *, what: str, stall_s: float = STALL_S) -> int:
    """Wait until `process` (a Popen, or anything with its poll() and kill()) exits; its exit status.
    Stalled (the process killed) once none of the files of `watched` grew for `stall_s`; a Popen
    is first sent DUMP_SIGNAL, and given DUMP_WAIT_S to write where it stood."""
    try:
        until(lambda: process.poll() is not None, lambda: sizes(watched), what=what, stall_s=stall_s, poll_s=0.2)
    except Stalled:
        if isinstance(process, subprocess.Popen) and process.poll() is None:
            process.send_signal(DUMP_SIGNAL)
            try:
                process.wait(DUMP_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        process.kill()
        raise
    return process.poll()
