"""The pipeline schedules the trainer knows and the layouts each can run, without torch.

The config checks these before any process group exists; they import no torch, so the control
plane runs the trainer's own checks on a RunSpec (functions/validate.py) before it pays for a
fleet. trainer/parallel_dims.py maps each name to the installed torch's class.
"""

from dataclasses import dataclass
from typing import Literal

Placement = Literal["single", "loop", "v"]


@dataclass(frozen=True)
class ScheduleSpec:
    class_name: str
    """Class in torch.distributed.pipelining.schedules (older torch releases lack some)."""
    placement: Placement
    """single: one stage per rank; loop: stage s on rank s % pp; v: rank r holds r and 2pp-1-r."""
    stages_per_rank: int
    """Default number of stages per rank (virtual stages)."""
    needs_microbatches_ge_stages: bool
    """The schedule runs out of work in its warm-up with fewer microbatches than stages."""
    needs_whole_rounds: bool
    """Looped schedules run microbatches in rounds of pp; more than one round must divide evenly."""


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "single", 1, False, False),
    "1f1b": ScheduleSpec("Schedule1F1B", "single", 1, True, False),
    "interleaved-1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "loop", 2, False, True),
    "looped-bfs": ScheduleSpec("ScheduleLoopedBFS", "loop", 2, False, False),
    "interleaved-zero-bubble": ScheduleSpec("ScheduleInterleavedZeroBubble", "loop", 2, False, True),
    "zbv-zero-bubble": ScheduleSpec("ScheduleZBVZeroBubble", "v", 2, True, False),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", "v", 2, True, False),
}


def schedule_problem(name: str, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why this schedule cannot run this layout, or None when it can."""
    spec = SCHEDULES[name]
    n_stages = pp * stages_per_rank
    if spec.placement == "single" and stages_per_rank != 1:
        return f"schedule {name!r} runs exactly one stage per rank, got parallel.stages_per_rank={stages_per_rank}"
    if spec.placement == "v" and stages_per_rank != 2:
        return f"schedule {name!r} needs exactly two stages per rank (a V), got parallel.stages_per_rank={stages_per_rank}"
    if spec.needs_microbatches_ge_stages and microbatches < n_stages:
        return (f"schedule {name!r} needs parallel.microbatches >= number of stages ({n_stages}), "
                f"got {microbatches}")
    rounds = max(1, microbatches // pp)
    if spec.needs_whole_rounds and microbatches % rounds != 0:
        return (f"schedule {name!r} runs microbatches in rounds of parallel.pp={pp}: "
                f"parallel.microbatches={microbatches} must be below pp or a multiple of it")
    return None
