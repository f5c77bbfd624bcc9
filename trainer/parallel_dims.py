"""The parallel layout as plain data: which schedule, which stages on which rank, which layers per stage.

Everything here is a pure function over ints and names, so tests can check placements without
starting processes. The schedules' rules, the layer split and the stage placement live in
trainer/schedules.py, which the config and the control plane check without torch; this module adds
the installed torch's classes.

Ranks form a (pp, dp, tp) grid, outermost first, rank = (pp_index * dp + dp_index) * tp + tp_index
(torchtitan's order): torchrun numbers a node's GPUs consecutively, so tensor parallel, which talks
twice per layer, stays inside a node on NVLink, data parallel comes next, and pipeline stages,
which only hand activations on, are spread across nodes. (dp splits further into dp_replicate x
dp_shard for FSDP; trainer/train.py builds that mesh.)
"""

from dataclasses import dataclass

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from trainer.config import ConfigError
from trainer.schedules import SCHEDULE_CLASSES
from trainer.schedules import SCHEDULES as KNOWN_SCHEDULES
from trainer.schedules import Placement, ScheduleRule, schedule_problem, split_layers, stage_ids

__all__ = ["SCHEDULES", "KNOWN_SCHEDULES", "ScheduleRule", "Placement", "schedule_class", "schedule_problem",
           "stage_ids", "split_layers", "layer_ranges", "RankPosition"]

# Only what the installed torch really offers can run.
SCHEDULES: dict[str, ScheduleRule] = {
    name: rule for name, rule in KNOWN_SCHEDULES.items() if hasattr(torch_schedules, SCHEDULE_CLASSES[name])
}


def schedule_class(name: str) -> type:
    """The installed torch's class of a known schedule; ConfigError when this torch lacks it."""
    if name not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={name!r} needs torch.distributed.pipelining."
                          f"{SCHEDULE_CLASSES[name]}, which the installed torch {torch.__version__} lacks")
    return getattr(torch_schedules, SCHEDULE_CLASSES[name])


def layer_ranges(layers_per_stage: list[int]) -> list[range]:
    """Contiguous global layer index ranges, one per stage."""
    ranges, start = [], 0
    for count in layers_per_stage:
        ranges.append(range(start, start + count))
        start += count
    return ranges


@dataclass(frozen=True)
class RankPosition:
    """Where one global rank sits in the (pp, dp, tp) grid."""

    pp_index: int
    dp_index: int
    tp_index: int

    @classmethod
    def of(cls, rank: int, dp: int, tp: int) -> "RankPosition":
        return cls(pp_index=rank // (dp * tp), dp_index=rank // tp % dp, tp_index=rank % tp)
