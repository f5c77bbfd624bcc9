"""CloudWatch metrics as embedded metric format (EMF): one JSON log line per data point set.

In Lambda, a line printed to stdout reaches CloudWatch Logs, which extracts the metrics; no
PutMetricData call, no extra latency. The event handler turns agent events into metrics:

    emit(progress_metrics(detail, namespace))      Loss, TokensPerSecond, StepTime
    emit(checkpoint_metrics(detail, namespace))    CheckpointStep, CheckpointStall
    emit(run_metrics(run, namespace))              Goodput, LostTime, CostUSD, Restarts
    for document in lost_time_metrics(run, namespace):
        emit(document)                             LostTime by Cause (startup, restart:HANG, ...)
    emit(detection_metrics(run_name, failure, namespace))   DetectionLatency by FailureClass (Recover)
    emit(stall_metrics(run, stack, now, namespace))         SecondsSinceProgress by run and by stack
                                                            (the reaper's sweep; the no-progress alarm)

Every metric carries the dimension RunName. Pure builders return the EMF document (a dict);
emit() writes it as one line.
"""

import json
import math
import sys
import time
from typing import IO, Any

from datetime import datetime

from trainfleet.core.events import CheckpointCommitted, TrainingProgress
from trainfleet.core.records import FailureRecord, RunRecord

__all__ = ["emf_document", "progress_metrics", "checkpoint_metrics", "run_metrics", "lost_time_metrics",
           "detection_metrics", "stall_metrics", "emit"]

UNITS = frozenset({"Seconds", "Milliseconds", "Count", "Count/Second", "Percent", "None", "Bytes"})
"""CloudWatch standard units used here."""


def emf_document(namespace: str, dimensions: dict[str, str], metrics: dict[str, tuple[float, str]],
                 timestamp_ms: int | None = None, dimension_sets: list[list[str]] | None = None) -> dict[str, Any]:
    """An EMF document: `metrics` maps name -> (value, unit); values must be finite numbers.
    Each metric is published once per dimension set (default: all `dimensions` together).

    A NaN loss is dropped rather than sent: CloudWatch rejects non-finite values, and the
    divergence itself is reported as a TrainerFailed event."""
    finite = {name: (value, unit) for name, (value, unit) in metrics.items() if math.isfinite(value)}
    for name, (_, unit) in finite.items():
        if unit not in UNITS:
            raise ValueError(f"metric {name}: unit {unit!r} is not one of {sorted(UNITS)}")
        if name in dimensions or name == "_aws":
            raise ValueError(f"metric {name} clashes with a dimension or the _aws key")
    return {
        "_aws": {
            "Timestamp": timestamp_ms if timestamp_ms is not None else int(time.time() * 1000),
            "CloudWatchMetrics": [{
                "Namespace": namespace,
                "Dimensions": dimension_sets or [sorted(dimensions)],
                "Metrics": [{"Name": name, "Unit": unit} for name, (_, unit) in finite.items()],
            }],
        },
        **dimensions,
        **{name: value for name, (value, _) in finite.items()},
    }


def progress_metrics(detail: TrainingProgress, namespace: str, timestamp_ms: int | None = None) -> dict[str, Any]:
    return emf_document(namespace, {"RunName": detail.run_name}, {
        "Loss": (detail.loss, "None"),
        "TokensPerSecond": (detail.tokens_per_second, "Count/Second"),
        "StepTime": (detail.step_seconds, "Seconds"),
        "Step": (detail.step, "Count"),
    }, timestamp_ms)


def checkpoint_metrics(detail: CheckpointCommitted, namespace: str, timestamp_ms: int | None = None) -> dict[str, Any]:
    return emf_document(namespace, {"RunName": detail.run_name}, {
        "CheckpointStep": (detail.step, "Count"),
        "CheckpointStall": (detail.stall_seconds, "Seconds"),
    }, timestamp_ms)


def run_metrics(run: RunRecord, namespace: str, timestamp_ms: int | None = None) -> dict[str, Any]:
    ledger = run.ledger
    return emf_document(namespace, {"RunName": run.run_name}, {
        "Goodput": (100 * ledger.goodput, "Percent"),
        "LostTime": (ledger.lost_seconds, "Seconds"),
        "CostUSD": (ledger.cost_usd, "None"),
        "Restarts": (run.restarts, "Count"),
    }, timestamp_ms)


def lost_time_metrics(run: RunRecord, namespace: str, timestamp_ms: int | None = None) -> list[dict[str, Any]]:
    """LostTime of each cause on the run's books, one document per cause (an EMF document holds
    one value per dimension), with the dimensions RunName and Cause."""
    return [emf_document(namespace, {"RunName": run.run_name, "Cause": cause}, {"LostTime": (seconds, "Seconds")},
                         timestamp_ms)
            for cause, seconds in sorted(run.ledger.lost_by_cause.items())]


def detection_metrics(run_name: str, failure: FailureRecord, namespace: str,
                      timestamp_ms: int | None = None) -> dict[str, Any]:
    """How long a failure went from its first sign to Recover's decision (FailureRecord.detection_seconds)."""
    return emf_document(namespace, {"RunName": run_name, "FailureClass": failure.failure_class.value},
                        {"DetectionLatency": (failure.detection_seconds, "Seconds")}, timestamp_ms)


def stall_metrics(run: RunRecord, stack_name: str, now: datetime, namespace: str,
                  timestamp_ms: int | None = None) -> dict[str, Any]:
    """How long a live run has gone without a reported step (since its creation, before its
    first): per run for the dashboard, and per stack, whose maximum the no-progress alarm watches."""
    since = run.last_progress_at or run.created_at or now
    return emf_document(namespace, {"RunName": run.run_name, "StackName": stack_name},
                        {"SecondsSinceProgress": (max(0.0, (now - since).total_seconds()), "Seconds")},
                        timestamp_ms, dimension_sets=[["RunName"], ["StackName"]])


def emit(document: dict[str, Any], stream: IO[str] | None = None) -> None:
    """Write the document as one line (CloudWatch Logs treats each line as one event), to
    `stream` or the sys.stdout of the moment: whatever replaced it since this module was
    imported (a runtime capturing a function's output) gets the line."""
    stream = stream or sys.stdout
    stream.write(json.dumps(document, separators=(",", ":")) + "\n")
    stream.flush()
