"""The pipeline schedules the trainer knows and the layouts each can run, without torch: the one
copy of these rules. The trainer's config (trainer/config.py) checks itself with them and
trainer/parallel_dims.py maps each name to the installed torch's class; the control plane's
Validate, re-planning and memory plan (trainfleet/core) refuse and plan exactly the same layouts.

    SCHEDULES, ScheduleRule, Placement, schedule_problem   each schedule's placement and rules
    SCHEDULE_CLASSES                     the torch class that runs each
    split_layers, stage_ids              the layers of each stage and the stages of each rank
    bubble_seconds                       the idle time of each schedule's fill and drain
"""

import functools
from typing import Literal, NamedTuple

Placement = Literal["single", "loop", "v"]


class ScheduleRule(NamedTuple):
    placement: Placement
    """single: one stage per rank; loop: stage s on rank s % pp; v: rank r holds r and 2pp-1-r."""
    stages_per_rank: int
    """Stages per rank when the config leaves parallel.stages_per_rank at 0."""
    needs_microbatches_ge_stages: bool
    """Fewer microbatches than stages starve the warm-up."""
    needs_whole_rounds: bool
    """Looped schedules run microbatches in rounds of pp."""


SCHEDULES: dict[str, ScheduleRule] = {
    "gpipe": ScheduleRule("single", 1, False, False),
    "1f1b": ScheduleRule("single", 1, True, False),
    "interleaved-1f1b": ScheduleRule("loop", 2, False, True),
    "looped-bfs": ScheduleRule("loop", 2, False, False),
    "interleaved-zero-bubble": ScheduleRule("loop", 2, False, True),
    "zbv-zero-bubble": ScheduleRule("v", 2, True, False),
    "dualpipev": ScheduleRule("v", 2, True, False),
}


def schedule_problem(name: str, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why `name` cannot run pp ranks x stages_per_rank (0 = the schedule's default), else None."""
    rule = SCHEDULES[name]
    per_rank = stages_per_rank or rule.stages_per_rank
    stages = pp * per_rank
    if rule.placement == "single" and per_rank != 1:
        return f"schedule {name!r} runs exactly one stage per rank, got parallel.stages_per_rank={per_rank}"
    if rule.placement == "v" and per_rank != 2:
        return (f"schedule {name!r} needs exactly two stages per rank (a V), "
                f"got parallel.stages_per_rank={per_rank}")
    if rule.needs_microbatches_ge_stages and microbatches < stages:
        return (f"schedule {name!r} needs parallel.microbatches >= number of stages ({stages}), "
                f"got {microbatches}")
    rounds = max(1, microbatches // pp)
    if rule.needs_whole_rounds and microbatches % rounds != 0:
        return (f"schedule {name!r} runs microbatches in rounds of parallel.pp={pp}: "
                f"parallel.microbatches={microbatches} must be below pp or a multiple of it")
    return None


SCHEDULE_CLASSES: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv-zero-bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""Class in torch.distributed.pipelining.schedules of each schedule (older torch releases lack some)."""


def split_layers(layer_params: int, n_layers: int, first_extra: int, last_extra: int,
                 n_stages: int) -> list[int]:
    """Layers per stage so that each stage holds about the same number of parameters (see
    _split_layers; remembered, as the planners ask for the same splits of thousands of layouts)."""
    return list(_split_layers(layer_params, n_layers, first_extra, last_extra, n_stages))


@functools.lru_cache(maxsize=4096)
def _split_layers(layer_params: int, n_layers: int, first_extra: int, last_extra: int,
                  n_stages: int) -> tuple[int, ...]:
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
    return tuple(edges[i + 1] - edges[i] for i in range(n_stages))


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, placement: Placement) -> list[int]:
    """The global stage indices this pipeline rank builds, in increasing order."""
    if placement == "v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def bubble_seconds(name: str, pp: int, stages_per_rank: int, microbatches: int, forward: float, backward: float,
                   weight: float) -> float:
    """Seconds a pipeline rank of schedule `name` idles in a step (fill and drain), for `pp` ranks
    holding `stages_per_rank` stages each and `microbatches` a step.

    `forward`, `backward` and `weight` are one microbatch's times on one stage: its forward, its
    backward for the inputs' gradients (recomputation included) and its backward for the weights'
    gradients. The zero-bubble schedules run the last apart; for the others only the sum of the two
    backwards matters. A rank's step is its own microbatches' work plus this. Each formula replays
    torch's own pipeline order with these times (tests/test_schedule_bubbles.py), F + B + W = S:

    gpipe, 1f1b                 (pp - 1) S
    interleaved-1f1b,           (pp - 1) S, and (v - 1)(pp - m) S more with fewer microbatches m than
    looped-bfs                  ranks (each round of v stages then runs with pp - m ranks idle): a
                                stage is 1/v of a rank's layers, which is how interleaving helps
    interleaved-zero-bubble     (pp - 1) max(F, B, F + B - W) from pp microbatches on; with fewer,
                                at most interleaved-1f1b's
    zbv-zero-bubble             (pp - 1) max(F, B, 2(B - W))
    dualpipev                   (pp - 1)(2F + B - W) + (pp - 2) min(B - F, F), within 3 % of the
                                step: torch runs a forward and a backward it pairs one after the
                                other unless the model overlaps them itself

    The zero-bubble and V formulas hold where a backward takes at least its forward (B >= F), as
    a transformer's does.
    """
    if pp == 1:
        return 0.0
    whole = forward + backward + weight
    few = max(0, pp - microbatches) * (stages_per_rank - 1) * whole   # rounds of loop schedules left part idle
    if name in ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs"):
        return (pp - 1) * whole + few
    if name == "interleaved-zero-bubble":
        if microbatches < pp:
            return (pp - 1) * whole + few
        return (pp - 1) * max(forward, backward, forward + backward - weight)
    if name == "zbv-zero-bubble":
        return (pp - 1) * max(forward, backward, 2 * (backward - weight))
    if name == "dualpipev":
        return (pp - 1) * (2 * forward + backward - weight) + (pp - 2) * min(max(backward - forward, 0.0), forward)
    raise ValueError(f"schedule {name!r} is unknown; choose one of {sorted(SCHEDULES)}")
