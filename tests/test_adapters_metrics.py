"""EMF documents: the structure CloudWatch needs to extract metrics from a log line."""

import io
import json
from pathlib import Path

import pytest

from trainfleet.adapters import metrics
from trainfleet.core.events import CheckpointCommitted, TrainingProgress
from trainfleet.core.records import GoodputLedger, RunRecord
from trainfleet.core.runspec import RunSpec

EXAMPLE_SPEC = RunSpec.model_validate_json((Path(__file__).parents[1] / "events" / "example-run.json").read_text())


def assert_valid_emf(document):
    """The EMF specification's rules for one document."""
    directive = document["_aws"]
    assert isinstance(directive["Timestamp"], int)
    for block in directive["CloudWatchMetrics"]:
        for dimension_set in block["Dimensions"]:
            assert len(dimension_set) <= 30
            assert all(isinstance(document[name], str) for name in dimension_set)
        assert len(block["Metrics"]) <= 100
        for metric in block["Metrics"]:
            assert isinstance(document[metric["Name"]], (int, float)) and metric["Unit"] in metrics.UNITS


def test_progress_becomes_one_emf_line():
    detail = TrainingProgress(run_name="r1", attempt=2, step=120, loss=2.75, tokens_per_second=5.5e5, step_seconds=0.9)
    stream = io.StringIO()
    metrics.emit(metrics.progress_metrics(detail, "Trainfleet", timestamp_ms=1_700_000_000_000), stream)
    line = stream.getvalue()
    assert line.count("\n") == 1
    document = json.loads(line)
    assert_valid_emf(document)
    assert document["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "Trainfleet"
    assert document["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["RunName"]]
    assert (document["RunName"], document["Loss"], document["StepTime"]) == ("r1", 2.75, 0.9)


def test_non_finite_values_are_dropped_not_sent():
    detail = TrainingProgress(run_name="r1", attempt=0, step=5, loss=float("nan"), tokens_per_second=1.0, step_seconds=1.0)
    document = metrics.progress_metrics(detail, "Trainfleet", 0)
    assert "Loss" not in document
    assert "Loss" not in [m["Name"] for m in document["_aws"]["CloudWatchMetrics"][0]["Metrics"]]
    assert_valid_emf(document)


def test_checkpoint_and_run_metrics():
    stall = metrics.checkpoint_metrics(CheckpointCommitted(run_name="r1", attempt=0, step=200, uri="s3://b/x",
                                                           stall_seconds=0.08), "Trainfleet", 0)
    assert_valid_emf(stall) and stall["CheckpointStall"] == 0.08
    run = RunRecord(run_name="r1", spec=EXAMPLE_SPEC, restarts=2,
                    ledger=GoodputLedger(productive_seconds=900, lost_seconds=100, cost_usd=12.5))
    document = metrics.run_metrics(run, "Trainfleet", 0)
    assert_valid_emf(document)
    assert (document["Goodput"], document["CostUSD"], document["Restarts"]) == (90.0, 12.5, 2)


def test_bad_units_and_clashing_names_are_refused():
    with pytest.raises(ValueError, match="unit 'Furlongs'"):
        metrics.emf_document("N", {"RunName": "r"}, {"Distance": (1.0, "Furlongs")})
    with pytest.raises(ValueError, match="RunName clashes"):
        metrics.emf_document("N", {"RunName": "r"}, {"RunName": (1.0, "Count")})


def test_lost_time_goes_out_by_cause():
    run = RunRecord(run_name="r1", spec=EXAMPLE_SPEC, ledger=GoodputLedger(
        productive_seconds=900, lost_seconds=100, lost_by_cause={"startup": 70, "restart:HANG": 30}))
    documents = metrics.lost_time_metrics(run, "Trainfleet", 0)
    for document in documents:
        assert_valid_emf(document)
        assert document["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["Cause", "RunName"]]
    assert [(d["RunName"], d["Cause"], d["LostTime"]) for d in documents] == [
        ("r1", "restart:HANG", 30), ("r1", "startup", 70)]
    assert metrics.lost_time_metrics(RunRecord(run_name="r1", spec=EXAMPLE_SPEC), "Trainfleet", 0) == []


def test_emit_writes_to_the_stdout_of_the_moment(capsys):
    # A runtime that captures a function's output replaces sys.stdout after this module is imported.
    metrics.emit(metrics.emf_document("N", {"RunName": "r"}, {"Restarts": (1, "Count")}, 0))
    assert json.loads(capsys.readouterr().out)["Restarts"] == 1


def test_detection_latency_goes_out_by_failure_class():
    from datetime import datetime, timedelta, timezone

    from trainfleet.core.records import FailureClass, FailureRecord

    decided = datetime(2026, 12, 1, tzinfo=timezone.utc)
    failure = FailureRecord(failure_class=FailureClass.HANG, resume_step=10, at=decided,
                            onset_at=decided - timedelta(seconds=612))
    document = metrics.detection_metrics("r1", failure, "Trainfleet", 0)
    assert_valid_emf(document)
    assert document["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["FailureClass", "RunName"]]
    assert (document["FailureClass"], document["DetectionLatency"]) == ("HANG", 612.0)


def test_seconds_since_progress_go_out_per_run_and_per_stack():
    from datetime import datetime, timedelta, timezone

    now = datetime(2026, 12, 1, tzinfo=timezone.utc)
    run = RunRecord(run_name="r1", spec=EXAMPLE_SPEC, created_at=now - timedelta(hours=2),
                    last_progress_at=now - timedelta(seconds=90))
    document = metrics.stall_metrics(run, "trainfleet", now, "Trainfleet", 0)
    assert_valid_emf(document)
    assert document["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["RunName"], ["StackName"]]
    assert (document["RunName"], document["StackName"], document["SecondsSinceProgress"]) == ("r1", "trainfleet", 90)
    starting = run.model_copy(update={"last_progress_at": None})
    assert metrics.stall_metrics(starting, "trainfleet", now, "Trainfleet", 0)["SecondsSinceProgress"] == 7200
