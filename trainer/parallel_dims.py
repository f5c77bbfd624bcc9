"""The parallel layout as plain data: which schedule, which stages on which rank, which layers per stage.

Everything here is a pure function over ints and names, so the config can check a layout before
any process group exists, and tests can check placements without starting processes.

Ranks form a (dp, pp) grid, rank = dp_index * pp + pp_index: pipeline neighbours have adjacent
ranks, which torchrun places on the same node first.
"""

from dataclasses import dataclass
from typing import Literal

from torch.distributed.pipelining import schedules as torch_schedules

Placement = Literal["single", "loop", "v"]


@dataclass(frozen=True)
class ScheduleSpec:
    class_name: str
    """Class in torch.distributed.pipelining.schedules."""
    placement: Placement
    """single: one stage per rank; loop: stage s on rank s % pp; v: rank r holds r and 2pp-1-r."""
    stages_per_rank: int
    """Default number of stages per rank (virtual stages)."""
    needs_microbatches_ge_stages: bool
    """The schedule runs out of work in its warm-up with fewer microbatches than stages."""
    needs_whole_rounds: bool
    """Looped schedules run microbatches in rounds of pp; more than one round must divide evenly."""


_ALL_SCHEDULES = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "single", 1, False, False),
    "1f1b": ScheduleSpec("Schedule1F1B", "single", 1, True, False),
    "interleaved-1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "loop", 2, False, True),
    "looped-bfs": ScheduleSpec("ScheduleLoopedBFS", "loop", 2, False, False),
    "interleaved-zero-bubble": ScheduleSpec("ScheduleInterleavedZeroBubble", "loop", 2, False, True),
    "zbv-zero-bubble": ScheduleSpec("ScheduleZBVZeroBubble", "v", 2, True, False),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", "v", 2, True, False),
}

# Only what the installed torch really offers can be configured.
SCHEDULES: dict[str, ScheduleSpec] = {
    name: spec for name, spec in _ALL_SCHEDULES.items() if hasattr(torch_schedules, spec.class_name)
}


def schedule_class(name: str) -> type:
    return getattr(torch_schedules, SCHEDULES[name].class_name)


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


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, placement: Placement) -> list[int]:
    """The global stage indices this pipeline rank builds, in increasing order."""
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_layers(layer_params: int, n_layers: int, first_extra: int, last_extra: int,
                 n_stages: int) -> list[int]:
    """Layers per stage so that each stage holds about the same number of parameters.

    Every layer has `layer_params` parameters; the first stage also holds `first_extra` (embeddings)
    and the last `last_extra` (final norm and head). Greedy over the cumulative count: stage s ends
    where the running total is nearest to (s + 1) / n_stages of the whole, and every stage keeps at
    least one layer.
    """
    total = first_extra + n_layers * layer_params + last_extra
    boundaries = []
    start = 0
    for stage in range(n_stages - 1):
        target = total * (stage + 1) / n_stages
        stages_after = n_stages - stage - 1
        candidates = range(start + 1, n_layers - stages_after + 1)
        end = min(candidates, key=lambda e: abs(first_extra + e * layer_params - target))
        boundaries.append(end)
        start = end
    edges = [0, *boundaries, n_layers]
    return [edges[i + 1] - edges[i] for i in range(n_stages)]


def layer_ranges(layers_per_stage: list[int]) -> list[range]:
    """Contiguous global layer index ranges, one per stage."""
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


@dataclass(frozen=True)
class RankPosition:
    """Where one global rank sits in the (dp, pp) grid."""

    dp_index: int
    pp_index: int

    @classmethod
    def of(cls, rank: int, pp: int) -> "RankPosition":
        return cls(dp_index=rank // pp, pp_index=rank % pp)
