"""What /proc tells about a local process: the one reader of /proc/PID/stat."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["stat_fields", "cpu_seconds"]

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
