"""The attempt's instances on the books: what book_attempt charges, and the ceiling it feeds."""

from datetime import datetime, timedelta, timezone

from test_lifecycle import make_run, make_spec, report

from trainfleet.core.catalogue import instance_facts
from trainfleet.core.lifecycle import book_attempt, decide_recovery, settle_run_attempt
from trainfleet.core.records import FailureClass, NodeRecord, NodeState, RecoveryAction, RunRecord

T0 = datetime(2026, 11, 1, tzinfo=timezone.utc)
PRICE = instance_facts("c5.large").on_demand_usd_per_hour


def _run(**spec_fields) -> RunRecord:
    return make_run(make_spec(**spec_fields), created_at=T0, attempt_started_at=T0,
                    first_step_at=T0 + timedelta(minutes=10))


def _node(instance_id: str, launched_minutes: int, state=NodeState.READY, updated_minutes: int | None = None):
    return NodeRecord(run_name="r1", instance_id=instance_id, state=state,
                      launched_at=T0 + timedelta(minutes=launched_minutes),
                      updated_at=None if updated_minutes is None else T0 + timedelta(minutes=updated_minutes))


def test_each_node_is_paid_from_its_launch_until_the_attempt_ends_or_it_terminated():
    run = _run()
    nodes = [_node("i-a", 0), _node("i-b", 30), _node("i-c", 0, NodeState.TERMINATED, updated_minutes=15)]
    ended = T0 + timedelta(hours=1)
    ledger = book_attempt(run, nodes, ended, completed=False)
    assert ledger.node_seconds == 3600 + 1800 + 900
    assert abs(ledger.cost_usd - (3600 + 1800 + 900) / 3600 * PRICE) < 1e-9
    # the time accounting is settle_run_attempt's, unchanged
    time_only = settle_run_attempt(run, ended, completed=False)
    assert (ledger.productive_seconds, ledger.lost_seconds) == (time_only.productive_seconds, time_only.lost_seconds)


def test_a_node_terminated_in_an_earlier_attempt_costs_nothing_now():
    run = _run().model_copy(update={"attempt_started_at": T0 + timedelta(hours=2), "first_step_at": None})
    gone = _node("i-old", 0, NodeState.TERMINATED, updated_minutes=60)
    assert book_attempt(run, [gone], T0 + timedelta(hours=3), completed=False).node_seconds == 0


def test_the_booked_attempt_can_spend_the_ceiling():
    run = _run(cost_ceiling_usd=PRICE * 1.5)  # one and a half node-hours
    nodes = [_node("i-a", 0), _node("i-b", 0)]
    failure = report(FailureClass.PROCESS_CRASH)
    before = decide_recovery(run, nodes, failure, jitter_draw=0.5, now=T0)
    assert before.action is not RecoveryAction.GIVE_UP
    booked = run.model_copy(update={"ledger": book_attempt(run, nodes, T0 + timedelta(hours=1), completed=False)})
    after = decide_recovery(booked, nodes, failure, jitter_draw=0.5, now=T0)
    assert after.action is RecoveryAction.GIVE_UP
    assert "ceiling" in after.reason
