"""A recovered run as the live view shows it (tests/test_live_view.py): every field filled in,
the long ones as long as a real run makes them. Run as a script, it prints the view on this
terminal, as `trainfleet run status` does."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from test_adapters_run_store import spec
from trainfleet.core.events import ProgressSample
from trainfleet.core.records import (CheckpointRef, FailureClass, FailureRecord, FleetCheckFigures, GoodputLedger,
                                     NodeRecord, NodeRole, NodeState, RecoveryKind, RunRecord, RunState)
from trainfleet.core.run_history import StateEntry
from trainfleet.operator.runs import RunStatus

START = datetime(2026, 12, 5, 3, 12, 1, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return START + timedelta(seconds=seconds)


def recovered_run() -> RunStatus:
    name = "local-demo-7d9d"
    run_spec = spec(name)
    run_spec.trainer.training.__pydantic_extra__["steps"] = 60
    ledger = GoodputLedger(productive_seconds=61.0, lost_seconds=34.2,
                           lost_by_cause={"startup": 12.0, "restart:INSTANCE_LOST": 19.1, "redone:INSTANCE_LOST": 3.1},
                           node_seconds=190.4, cost_usd=0.0045)
    record = RunRecord(
        run_name=name, spec=run_spec, state=RunState.SUCCEEDED, attempt=1, restarts=1, last_step=60,
        latest_checkpoint=CheckpointRef(step=60, uri=f"s3://bucket/runs/{name}/step-000000060", committed_at=at(95)),
        failures=[FailureRecord(failure_class=FailureClass.INSTANCE_LOST, resume_step=20, at=at(40), attempt=0,
                                onset_at=at(37), instance_ids=["i-0a1b2c3d4e5f60718"], recovery=RecoveryKind.RESTARTED,
                                decision="INSTANCE_LOST: replace 1 node(s), 0 from spares, 1 new, resume from S3")],
        fleet_check=FleetCheckFigures(attempt=1, passed=True, busbw_gbytes_per_s=0.412, floor_gbytes_per_s=0.02,
                                      slowest_link_gbytes_per_s=0.318,
                                      slowest_link=["i-0a1b2c3d4e5f60719", "i-0a1b2c3d4e5f6071a"], seconds=1.4),
        ledger=ledger)
    nodes = [NodeRecord(run_name=name, instance_id=instance, state=state, role=NodeRole.WORKER, attempt=attempt,
                        node_rank=rank, failure_class=failure)
             for instance, state, attempt, rank, failure in (
                 ("i-0a1b2c3d4e5f60718", NodeState.TERMINATED, 0, 1, FailureClass.INSTANCE_LOST),
                 ("i-0a1b2c3d4e5f60719", NodeState.TERMINATED, 0, 0, None),
                 ("i-0a1b2c3d4e5f6071a", NodeState.TERMINATED, 1, 1, None))]
    states = [StateEntry(state, at(seconds), 1) for state, seconds in (
        ("AwaitNodes", 52), ("Train", 60), ("Teardown", 96), ("Report", 99), ("Outcome", 101))]
    return RunStatus(run_name=name, execution_status="SUCCEEDED", started_at=START, stopped_at=at(102), now=at(102),
                     record=record, nodes=nodes,
                     latest=(1, ProgressSample(step=60, loss=5.6630, tokens_per_second=5663.4, step_seconds=0.09,
                                               at=at(94))),
                     recent_states=states)


if __name__ == "__main__":
    from rich.console import Console

    from trainfleet.operator.live_view import view

    Console().print(view(recovered_run()))
