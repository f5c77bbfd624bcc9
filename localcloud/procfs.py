"""What /proc tells about a local process: the one reader of /proc/PID/stat."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["stat_fields", "cpu_seconds", "descendants", "tree_cpu_seconds"]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def stat_fields(path: Path) -> list[str] | None:
    """The fields of a /proc/PID/stat after the process's name (state, parent, group, ...); None
    once the process is gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()  # the name may hold spaces and parentheses
    except (OSError, IndexError):
        return None  # ended while listed


def cpu_seconds(pid: int) -> float | None:
    """The CPU time the process used so far (user and system); None once it is gone."""
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    return None if fields is None else (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (its children, theirs, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if (fields := stat_fields(stat)) is not None:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def tree_cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) of `pid` and every process below it: each live one's own and
    that of the children it reaped. A test's end-to-end run lives in processes the test process
    never reaps (a fork server's ranks, a harness's instances), which its own rusage misses. Only
    a process that ended unreaped under a parent that ended too is lost."""
    total = 0.0
    for process in [pid, *descendants(pid)]:
        fields = stat_fields(Path(f"/proc/{process}/stat"))
        if fields is not None:
            total += sum(int(ticks) for ticks in fields[11:15]) / _TICKS_PER_S
    return total
