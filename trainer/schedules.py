"""The pipeline schedules the trainer knows, without torch.

Their layout rules are the control plane's own (trainfleet.contracts.SCHEDULES and
schedule_problem), so the trainer's config and the control plane's Validate and re-planning
refuse exactly the same layouts; this module adds the torch class that runs each.
trainer/parallel_dims.py maps them to the installed torch's classes.
"""

from trainfleet.contracts import SCHEDULES, Placement, ScheduleRule, schedule_problem

__all__ = ["SCHEDULES", "SCHEDULE_CLASSES", "Placement", "ScheduleRule", "schedule_problem"]

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
