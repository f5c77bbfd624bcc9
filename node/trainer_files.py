"""What an attempt's trainer reads and writes on this node, and what the agent makes of it: its
folder's files, the metrics it follows, the signs of life it judges, the world checks' results."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainfleet.core.events import AgentEvent, FleetChecked, ProgressSample, ScalingChecked, StateRestored
from trainfleet.core.records import FleetCheckFigures, ScalingCheckFigures, StateRestoredFigures

@dataclass(frozen=True)
class AttemptFiles:
    """Where one attempt's trainer reads and writes on this node."""

    folder: Path

    @property
    def config(self) -> Path:
        return self.folder / "trainer.yaml"

    @property
    def metrics(self) -> Path:
        return self.folder / "metrics.jsonl"

    @property
    def output(self) -> Path:
        return self.folder / "torchrun.log"

    @property
    def checkpoint_request(self) -> Path:
        return self.folder / "checkpoint-now"

    @property
    def progress(self) -> Path:
        return self.folder / "progress"

    @property
    def repair_order(self) -> Path:
        """Where the agent orders a running trainer into a repaired world (trainer/repair_order.py)."""
        return self.folder / "repair-order.json"

    def check_result(self, check: str) -> Path:
        """Where global rank 0 writes the result of one of WORLD_CHECKS."""
        return self.folder / f"{check.replace('_', '-')}.json"


def fleet_check_figures(result: dict[str, Any], attempt: int) -> FleetCheckFigures:
    """The figures of trainer/fleet_check.py's result file."""
    slowest = result["slowest_link"]
    return FleetCheckFigures(
        attempt=attempt, passed=result["passed"], busbw_gbytes_per_s=result["busbw_gbytes_per_s"],
        floor_gbytes_per_s=result["floor_gbytes_per_s"],
        slowest_link_gbytes_per_s=slowest["gbytes_per_s"] if slowest else None,
        slowest_link=[slowest["source"], slowest["target"]] if slowest else [],
        slow_instance_ids=result["slow_nodes"], seconds=result["seconds"])


def scaling_check_figures(result: dict[str, Any], attempt: int) -> ScalingCheckFigures:
    """The figures of trainer/scaling_check.py's result file."""
    return ScalingCheckFigures(
        attempt=attempt, passed=result["passed"], efficiency=result["efficiency"],
        efficiency_floor=result["efficiency_floor"], step_seconds=result["step_seconds"],
        expected_step_seconds=result["expected_step_seconds"], tokens_per_second=result["tokens_per_second"],
        expected_tokens_per_second=result["expected_tokens_per_second"], steps=result["steps"],
        slowest_stages=result["slowest_stages"], slowest_stage_seconds=result["slowest_stage_seconds"],
        slowest_stage_instance_ids=result["slowest_stage_nodes"], slowest_rank=result["slowest_rank"],
        slowest_rank_instance_id=result["slowest_rank_node"], slowest_rank_seconds=result["slowest_rank_seconds"],
        slow_instance_ids=result["slow_nodes"])


def restore_figures(result: dict[str, Any], attempt: int) -> StateRestoredFigures:
    """The figures of trainer/train.py restore's result file."""
    return StateRestoredFigures(attempt=attempt, **result)


WORLD_CHECKS: dict[str, tuple[Callable[[dict[str, Any], int], Any], type[AgentEvent]]] = {
    "fleet_check": (fleet_check_figures, FleetChecked),
    "scaling_check": (scaling_check_figures, ScalingChecked),
    "checkpoint": (restore_figures, StateRestored),
}
"""Results about the whole world that global rank 0 writes on its node, by their trainer config
section (whose result_file the agent sets): the world checks, and where the resumed state came
from; what the agent makes of the result, and the event that carries it."""


def progress_samples(records: list[dict[str, Any]]) -> list[ProgressSample]:
    """The steps of metrics records."""
    return [ProgressSample(step=record["step"], loss=record["loss"], tokens_per_second=record["tokens_per_s"],
                           step_seconds=record["step_time_s"], at=datetime.fromtimestamp(record["time"], timezone.utc))
            for record in records]


@dataclass(frozen=True)
class Life:
    """What a node's trainer files show of its life at one look: the metrics file's size (global
    rank 0 appends a record a step) and the progress file's identity (its local rank 0 replaces
    it whole at every sign of life)."""

    metrics_size: int = 0
    progress: tuple[int, int] | None = None

    @classmethod
    def of(cls, files: AttemptFiles) -> Life:
        try:
            metrics_size = files.metrics.stat().st_size
        except FileNotFoundError:
            metrics_size = 0
        try:
            written = files.progress.stat()
        except FileNotFoundError:
            return cls(metrics_size)
        return cls(metrics_size, (written.st_ino, written.st_mtime_ns))


class MetricsFollower:
    """New complete lines of the trainer's metrics JSONL (global rank 0 writes one per step)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def new_records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as metrics:
            metrics.seek(self.offset)
            chunk = metrics.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]
