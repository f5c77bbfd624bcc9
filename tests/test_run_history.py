"""A run's history (trainfleet/core/run_history.py) from plain records: phases, attempts, failures."""

from datetime import datetime, timedelta, timezone

import pytest

from trainfleet.core.events import ProgressSample
from trainfleet.core.records import (CheckpointRef, FailureClass, FailureRecord, GoodputLedger, NodeRecord,
                                     RecoveryKind, RunRecord, RunState, StateRestoredFigures)
from trainfleet.core.run_history import ProgressReport, StateEntry, build_history, phases_of
from trainfleet.core.runspec import RunSpec

T0 = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def spec() -> RunSpec:
    return RunSpec.model_validate({
        "run_name": "r1", "instance_type": "c5.large", "node_count": 2,
        "capacity": {"subnet_ids": ["subnet-0123456789abcdef0"], "security_group_ids": ["sg-0123456789abcdef0"]},
        "image_id": "ami-0123456789abcdef0",
        "trainer": {"model": {"n_layers": 4}, "training": {"batch_size": 8, "steps": 60},
                    "parallel": {"pp": 2, "dp": 1, "schedule": "1f1b", "microbatches": 2}},
        "checkpoint": {"s3_uri": "s3://bucket/runs/r1/checkpoints", "interval_steps": 10}})


def sample(step: int, seconds: float) -> ProgressSample:
    return ProgressSample(step=step, loss=5.0 - step / 20, tokens_per_second=1000.0, step_seconds=0.5, at=at(seconds))


def reports(samples, reporter: str | None = "i-1") -> list[ProgressReport]:
    """(attempt, sample) pairs as kept reports of one step each, all by `reporter`'s agent."""
    return [ProgressReport(attempt, reporter, [one]) for attempt, one in samples]


STATES = [StateEntry("Validate", at(0), None), StateEntry("Allocate", at(1), 0), StateEntry("AwaitNodes", at(2), 0),
          StateEntry("Train", at(10), 0), StateEntry("Recover", at(30), 0), StateEntry("ReplacementsShort", at(31), 0),
          StateEntry("Recover", at(32), 0), StateEntry("RecoveryBackoff", at(33), 1), StateEntry("AwaitNodes", at(34), 1),
          StateEntry("LateWorkers", at(40), 1), StateEntry("WorldAfterSwap", at(41), 1), StateEntry("Train", at(42), 1),
          StateEntry("Teardown", at(70), 1), StateEntry("Report", at(72), 1), StateEntry("Outcome", at(73), 1),
          StateEntry("RunSucceeded", at(74), None), StateEntry("ExecutionSucceeded", at(74), None)]


def test_phases_merge_the_states_of_one_phase_and_attempt():
    phases = phases_of(STATES, until=at(80))
    assert [(phase.name, phase.attempt) for phase in phases] == [
        ("validate", 0), ("allocate", 0), ("await_nodes", 0), ("train", 0), ("recover", 0), ("backoff", 1),
        ("await_nodes", 1), ("train", 1), ("teardown", 1), ("report", 1)]
    recover, waiting = phases[4], phases[6]
    assert (recover.started_at, recover.ended_at) == (at(30), at(33)), "the capacity loop is one recovery"
    assert (waiting.started_at, waiting.ended_at) == (at(34), at(42))
    assert phases[-1].ended_at == at(74), "the final state ends the last phase"


def test_a_live_runs_last_phase_lasts_until_now():
    phases = phases_of(STATES[:4], until=at(25))
    assert (phases[-1].name, phases[-1].ended_at) == ("train", at(25))
    assert phases_of([], until=at(5)) == []


def finished_run() -> RunRecord:
    failure = FailureRecord(failure_class=FailureClass.INSTANCE_LOST, resume_step=20, at=at(30), attempt=0,
                            onset_at=at(28.5), last_step=25, instance_ids=["i-2"], message="EC2 reports i-2 terminated")
    ledger = GoodputLedger(productive_seconds=40.0, lost_seconds=34.0,
                           lost_by_cause={"startup": 12.0, "redone:INSTANCE_LOST": 3.0, "restart:INSTANCE_LOST": 15.0,
                                          "finishing": 4.0},
                           booked_until=at(74), node_seconds=150.0, cost_usd=0.004)
    return RunRecord(run_name="r1", spec=spec(), state=RunState.SUCCEEDED, attempt=1, restarts=1, failures=[failure],
                     latest_checkpoint=CheckpointRef(step=60, uri="s3://bucket/runs/r1/checkpoints/step-000000060"),
                     last_step=60, ledger=ledger, created_at=T0, updated_at=at(74))


def test_a_finished_run_with_a_failure_and_a_resume():
    samples = [(0, sample(step, 10 + step)) for step in range(1, 27)]
    samples += [(1, sample(step, 42 + step - 20)) for step in range(21, 61)]
    samples += [(1, sample(30, 52))]  # a redelivered event's steps count once
    history = build_history(finished_run(), [], reports(samples), STATES, now=at(500))
    assert [(a.attempt, a.resume_step, a.samples[0].step, a.samples[-1].step, len(a.samples))
            for a in history.attempts] == [(0, None, 1, 26, 26), (1, 20, 21, 60, 40)]
    (failure,) = history.failures
    assert failure.detection_seconds == 1.5 and failure.resume_step == 20
    assert failure.last_step == 26, "the last step the attempt reported, from its samples"
    assert [a.unknown_steps for a in history.attempts] == [None, None]
    assert failure.steps_lost == 6 == history.steps_lost
    assert history.until == at(74), "a finished run's history ends with its books"
    assert history.goodput == pytest.approx(40 / 74) and history.target_steps == 60
    assert len(history.samples) == 66


def test_an_attempt_restored_from_memory_resumed_where_its_trainer_said():
    restored = StateRestoredFigures(attempt=1, step=25, source="memory", shards=2, own_memory=1, peers=1,
                                    peer_bytes=1000, seconds=0.2)
    run = finished_run()
    run = run.model_copy(update={"failures": [run.failures[0].model_copy(update={"restored": restored})]})
    samples = [(0, sample(step, 10 + step)) for step in range(1, 27)]
    samples += [(1, sample(step, 42 + step - 25)) for step in range(26, 61)]
    history = build_history(run, [], reports(samples), STATES, now=at(500))
    (failure,) = history.failures
    assert (failure.resume_step, failure.from_memory, failure.steps_lost) == (25, True, 1)
    assert [(a.attempt, a.resume_step) for a in history.attempts] == [(0, None), (1, 25)]


def test_a_live_run_is_booked_up_to_now():
    run = RunRecord(run_name="r1", spec=spec(), state=RunState.TRAINING, attempt=0, last_step=12,
                    attempt_started_at=T0, first_step_at=at(10), last_progress_at=at(22), created_at=T0,
                    updated_at=at(22))
    nodes = [NodeRecord(run_name="r1", instance_id=f"i-{n}", launched_at=T0) for n in (1, 2)]
    history = build_history(run, nodes, reports([(0, sample(12, 22))]), STATES[:4], now=at(30))
    assert history.until == at(30) and history.phases[-1].ended_at == at(30)
    assert history.productive_seconds == pytest.approx(12.0) and history.lost_by_cause == {"startup": 10.0,
                                                                                          "finishing": 8.0}
    assert history.node_seconds == pytest.approx(60.0) and history.failures == []
    behind = build_history(run, nodes, [], [], now=at(15))
    assert behind.until == at(22), "a reader's clock behind the record's is taken at the record's last write"


def test_an_attempt_reached_at_least_the_checkpoint_it_is_resumed_from():
    """Global rank 0's node (i-2, the one lost) died: its steps since the last report went with it."""
    history = build_history(finished_run(), [], reports(((0, sample(step, 10 + step)) for step in range(1, 14)),
                                                        reporter="i-2"), STATES, now=at(500))
    (failure,) = history.failures
    assert (failure.last_step, failure.resume_step, failure.steps_lost) == (25, 20, 5)
    assert [(a.attempt, a.unknown_steps, a.reporter, a.reporter_lost) for a in history.attempts] == [
        (0, (14, 25), "i-2", True)], "steps 14 to 25 were trained: their losses died with the node that reports them"
    unreported = finished_run().model_copy(update={"failures": [finished_run().failures[0].model_copy(
        update={"last_step": None})]})
    history = build_history(unreported, [], reports((0, sample(step, 10 + step)) for step in range(1, 14)),
                            STATES, now=at(500))
    (failure,) = history.failures
    assert (failure.last_step, failure.steps_lost) == (20, 0)
    assert history.attempts[0].unknown_steps == (14, 20)
    silent = build_history(unreported, [], [], STATES, now=at(500))
    assert [(a.attempt, a.samples, a.unknown_steps) for a in silent.attempts] == [(0, [], (1, 20))], (
        "an attempt that reported nothing still trained up to the checkpoint it saved")


def test_a_world_repaired_in_place_keeps_each_step_with_the_attempt_that_trained_it():
    """Node rank 1 (i-2) lost after step 19; the world repaired in place around its replacement,
    from the nodes' memory at step 19. The survivor i-1 reports the steps, attempt 0's up to 19
    and attempt 1's from 20 (the kill demo)."""
    restored = StateRestoredFigures(attempt=1, step=19, source="memory", shards=2, own_memory=1, peers=1,
                                    peer_bytes=1000, seconds=0.2)
    failure = FailureRecord(failure_class=FailureClass.INSTANCE_LOST, resume_step=10, at=at(30), attempt=0,
                            onset_at=at(29.5), last_step=19, instance_ids=["i-2"], recovery=RecoveryKind.REPAIRED,
                            restored=restored, message="EC2 reports i-2 terminated")
    run = finished_run().model_copy(update={"failures": [failure]})
    trained = [(0, sample(step, 10 + step)) for step in range(1, 20)]
    trained += [(1, sample(step, 42 + step - 19)) for step in range(20, 61)]
    history = build_history(run, [], reports(trained, reporter="i-1"), STATES, now=at(500))
    assert [(a.attempt, a.resume_step, a.samples[0].step, a.samples[-1].step, a.unknown_steps, a.reporter)
            for a in history.attempts] == [(0, None, 1, 19, None, "i-1"), (1, 19, 20, 60, None, "i-1")]
    (mark,) = history.failures
    assert (mark.last_step, mark.resume_step, mark.from_memory, mark.steps_lost, mark.recovery) == (
        19, 19, True, 0, RecoveryKind.REPAIRED)
    assert min(one.at for one in history.attempts[1].samples) > mark.decided_at, "attempt 1 trains after it began"

    # Had the survivor's agent not reported steps 15-19, they were trained all the same (the
    # failure's report says so): never reported, by a node that was not lost.
    unreported = [(attempt, one) for attempt, one in trained if not 15 <= one.step <= 19]
    first = build_history(run, [], reports(unreported, reporter="i-1"), STATES, now=at(500)).attempts[0]
    assert (first.unknown_steps, first.reporter, first.reporter_lost) == ((15, 19), "i-1", False)
    # Had the lost node been the one that reports them, they died with it.
    first = build_history(run, [], reports(unreported, reporter="i-2"), STATES, now=at(500)).attempts[0]
    assert (first.unknown_steps, first.reporter, first.reporter_lost) == ((15, 19), "i-2", True)


def test_a_long_attempts_samples_are_thinned_as_they_come_and_keep_the_newest():
    """Three weeks of steps (a sample per step, 200,000 of them): the history keeps at most about
    twice HISTORY_POINTS of them, evenly spread, the first and the newest always, a redelivered
    one once."""
    from trainfleet.core.events import ProgressSample
    from trainfleet.core.run_history import HISTORY_POINTS

    def sample(step: int) -> ProgressSample:
        return ProgressSample(step=step, loss=1.0, tokens_per_second=1.0, step_seconds=1.0, at=T0)

    steps = [*range(1, 200_001), 200_000, 199_999]  # two redelivered at the end
    history = build_history(finished_run(), [], (ProgressReport(0, None, [sample(step)]) for step in steps), [], T0)
    (kept,) = [attempt.samples for attempt in history.attempts]
    kept_steps = [one.step for one in kept]
    assert len(kept_steps) <= 2 * HISTORY_POINTS + 2 and kept_steps == sorted(set(kept_steps))
    assert (kept_steps[0], kept_steps[-1]) == (1, 200_000)
    gaps = {after - before for before, after in zip(kept_steps[1:], kept_steps[2:-1])}
    assert len(gaps) == 1, "evenly spread"
