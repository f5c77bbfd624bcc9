"""How an attempt ends, handler by handler against the local cloud (fixtures of test_handlers):
a Spot warning, a rebalance recommendation or a scheduled retirement waits for the emergency
checkpoint, then fails the Train task once; the attempt's
time is booked on the goodput ledger by Recover and Teardown and shown in the run report."""

import json
import uuid
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

import pytest

from test_adapters_checkpoints import save
from test_handlers import (REPO, Context, agent_event, cloud, finished, handlers, parked_token,  # noqa: F401
                           node_network, recorded_run, resources, state_change)
from trainfleet.core.lifecycle import DEFERRED_LEAD, SPOT_NOTICE, unaccounted_seconds
from trainfleet.core.records import (FAILURE_ERROR, CheckpointRef, FailureClass, FailureReport, NodeState, RunRecord,
                                     TaskWait)


SPOT_WARNING = "ec2-spot-instance-interruption-warning.json"
REBALANCE = "ec2-instance-rebalance-recommendation.json"
RETIREMENT = "aws-health-ec2-instance-retirement.json"
ANNOUNCEMENTS = [(SPOT_WARNING, FailureClass.SPOT_INTERRUPTION),
                 (RETIREMENT, FailureClass.HEALTH_EVENT)]
"""AWS's announced departures that are due at once (samples from its documentation: the
retirement's start time is long past), and the class each fails with."""
NOT_DUE_YET = [(REBALANCE, FailureClass.SPOT_REBALANCE, None),
               (RETIREMENT, FailureClass.HEALTH_EVENT, timedelta(days=21))]
"""Announced departures with time left: a rebalance recommendation (no date), a retirement
three weeks ahead."""


def announcement(instance_id: str, sample: str = SPOT_WARNING, starts_in: timedelta | None = None) -> dict:
    event = json.loads((REPO / "events" / "aws" / sample).read_text())
    event["id"] = str(uuid.uuid4())
    if "affectedEntities" in event["detail"]:
        event["detail"]["affectedEntities"] = [{"entityValue": instance_id}]
    else:
        event["detail"]["instance-id"] = instance_id
    if starts_in is not None:
        event["detail"]["startTime"] = format_datetime(datetime.now(timezone.utc) + starts_in, usegmt=True)
    return event


def spot_warning(instance_id: str) -> dict:
    return announcement(instance_id)


def training_run(cloud, resources):
    """A recorded run whose Train task waits on a real token; (store, run, nodes, execution)."""
    store, run, nodes = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="train", attempt=0, token=token))
    return store, run, nodes, execution


def warned(handlers, store, run, worker, sample: str = SPOT_WARNING,
           failure_class: FailureClass = FailureClass.SPOT_INTERRUPTION,
           departure_class: FailureClass | None = None) -> None:
    """The departure is recorded on the worker (of the first announcement's class), every agent
    is asked for a checkpoint (the run record), and training goes on (the task stays parked)."""
    assert handlers.events.handler(announcement(worker, sample), Context())["outcome"] == (
        f"{failure_class.value}: training on until the emergency checkpoint")
    node = store.node(run.run_name, worker)
    assert node.state is NodeState.REGISTERED and node.departure_noticed_at is not None
    assert node.departure_class is (departure_class or failure_class)
    after = store.run(run.run_name)
    assert after.waiting is not None and after.checkpoint_requested_at is not None
    assert after.checkpoint_requested_at >= node.departure_noticed_at


def spot_failure(cloud, execution: str) -> dict:
    result = finished(cloud, execution)
    assert result["status"] == "FAILED" and result["error"] == FAILURE_ERROR
    return json.loads(result["cause"])


def commit(cloud, run, instance_id: str, step: int, **reason: str) -> dict:
    """A checkpoint committed in S3 as the trainer does it, and its agent's announcement (`reason`
    given or, like an older agent's event, absent)."""
    save(cloud.client("s3"), run.spec.checkpoint.s3_uri, step)
    return agent_event("CheckpointCommitted", {"run_name": run.run_name, "attempt": 0, "instance_id": instance_id,
                                               "step": step, "uri": f"{run.spec.checkpoint.s3_uri}/step-{step:09d}",
                                               **reason})


def progress(run, instance_id: str, step: int) -> dict:
    return agent_event("TrainingProgress", {"run_name": run.run_name, "attempt": 0, "instance_id": instance_id,
                                            "step": step, "loss": 2.0, "tokens_per_second": 100.0,
                                            "step_seconds": 0.1})


# --- Spot interruption ------------------------------------------------------------------------

@pytest.mark.parametrize("sample, failure_class", ANNOUNCEMENTS)
def test_an_announced_departure_waits_for_the_emergency_checkpoint_then_fails_train_once(
        handlers, cloud, resources, sample, failure_class):
    store, run, (victim, survivor), execution = training_run(cloud, resources)
    warned(handlers, store, run, victim, sample, failure_class)
    again = handlers.events.handler(announcement(victim, sample), Context())["outcome"]
    assert again == f"ignored: {failure_class.value} already recorded"
    every = run.spec.checkpoint.interval_steps
    # Checkpoints committed after the warning but not asked for are recorded; the wait goes on.
    # An older agent's event (no reason) is never taken for the requested one.
    for step, reason in [(every, {"reason": "interval"}), (every + 1, {"reason": "final"}), (every + 2, {})]:
        event = commit(cloud, run, survivor, step, **reason)
        assert handlers.events.handler(event, Context())["outcome"] == f"checkpoint step {step} recorded"
    assert store.run(run.run_name).waiting is not None
    requested = commit(cloud, run, survivor, 2 * every, reason="requested")  # on the interval grid
    outcome = handlers.events.handler(requested, Context())["outcome"]
    assert outcome == f"checkpoint step {2 * every} recorded; {failure_class.value}: task failed"
    report = spot_failure(cloud, execution)
    assert report["failure_class"] == failure_class.value and report["instance_ids"] == [victim]
    assert f"emergency checkpoint step {2 * every} committed" in report["message"]
    after = store.run(run.run_name)
    assert after.latest_checkpoint.step == 2 * every and after.waiting is None
    assert store.node(run.run_name, victim).state is NodeState.UNHEALTHY
    assert store.node(run.run_name, survivor).state is NodeState.REGISTERED
    # The instance leaving later is news about a retired node; a late duplicate commit fails nothing.
    assert handlers.events.handler(state_change(victim, "terminated"), Context())["outcome"] == "node terminated"
    redelivered = {**requested, "id": str(uuid.uuid4())}
    assert handlers.events.handler(redelivered, Context())["outcome"] == f"checkpoint step {2 * every} recorded"


def test_the_interrupted_instance_leaving_first_fails_train_as_a_spot_interruption(handlers, cloud, resources):
    store, run, (victim, _), execution = training_run(cloud, resources)
    warned(handlers, store, run, victim)
    outcome = handlers.events.handler(state_change(victim, "shutting-down"), Context())["outcome"]
    assert outcome == "SPOT_INTERRUPTION: task failed"
    report = spot_failure(cloud, execution)
    assert report["failure_class"] == FailureClass.SPOT_INTERRUPTION.value and report["instance_ids"] == [victim]
    assert "instance leaving" in report["message"]


def test_a_node_blamed_once_keeps_that_failure_when_a_second_event_saw_it_live(handlers, cloud, resources):
    """The requested checkpoint commits (SPOT_INTERRUPTION) while EC2's report of the instance
    leaving is handled from a read taken before: the node keeps the failure that retired it."""
    store, run, (victim, _), execution = training_run(cloud, resources)
    warned(handlers, store, run, victim)
    seen_live = store.nodes(run.run_name)
    requested = commit(cloud, run, victim, 23, reason="requested")
    assert handlers.events.handler(requested, Context())["outcome"].endswith("SPOT_INTERRUPTION: task failed")
    lost = FailureReport(failure_class=FailureClass.INSTANCE_LOST, attempt=0, instance_ids=[victim],
                         message=f"EC2 reports instance {victim} shutting-down")
    assert handlers.events.failure(store.run(run.run_name), seen_live, lost) == "INSTANCE_LOST recorded"
    node = store.node(run.run_name, victim)
    assert (node.state, node.failure_class) == (NodeState.UNHEALTHY, FailureClass.SPOT_INTERRUPTION)
    assert spot_failure(cloud, execution)["failure_class"] == FailureClass.SPOT_INTERRUPTION.value


def test_a_notice_run_out_fails_train_at_the_next_progress(handlers, cloud, resources):
    store, run, (victim, survivor), execution = training_run(cloud, resources)
    warned(handlers, store, run, victim)
    assert handlers.events.handler(progress(run, survivor, 14), Context())["outcome"] == "progress at step 14"
    assert store.run(run.run_name).waiting is not None
    # The notice's two minutes pass: the request is dated back on the run record.
    ran_out = {"checkpoint_requested_at": store.run(run.run_name).checkpoint_requested_at - SPOT_NOTICE
               - timedelta(seconds=1)}
    store.modify_run(run.run_name, lambda record: record.model_copy(update=ran_out))
    outcome = handlers.events.handler(progress(run, survivor, 15), Context())["outcome"]
    assert outcome == "progress at step 15; SPOT_INTERRUPTION: task failed"
    assert "notice ran out" in spot_failure(cloud, execution)["message"]


@pytest.mark.parametrize("sample, failure_class, starts_in", NOT_DUE_YET)
def test_a_departure_not_due_yet_trains_on_to_the_next_interval_checkpoint_then_swaps_the_node(
        handlers, cloud, resources, sample, failure_class, starts_in):
    store, run, (victim, survivor), execution = training_run(cloud, resources)
    event = announcement(victim, sample, starts_in)
    outcome = handlers.events.handler(event, Context())["outcome"]
    assert outcome == f"{failure_class.value}: training on until the next interval checkpoint"
    after = store.run(run.run_name)
    assert after.checkpoint_requested_at is None, "no agent is asked to save now"
    assert after.departure_noticed_at is not None and store.node(run.run_name, victim).departure_class is failure_class
    assert handlers.events.handler(progress(run, survivor, 7), Context())["outcome"] == "progress at step 7"
    every = run.spec.checkpoint.interval_steps
    assert handlers.events.handler(commit(cloud, run, survivor, every + 1, reason="final"), Context())["outcome"] == (
        f"checkpoint step {every + 1} recorded")
    outcome = handlers.events.handler(commit(cloud, run, survivor, 2 * every, reason="interval"), Context())["outcome"]
    assert outcome == f"checkpoint step {2 * every} recorded; {failure_class.value}: task failed"
    report = spot_failure(cloud, execution)
    assert report["instance_ids"] == [victim]
    assert f"interval checkpoint step {2 * every} committed" in report["message"]


def test_a_departure_asks_for_its_checkpoint_when_its_time_nears_or_a_spot_warning_brings_it_forward(
        handlers, cloud, resources):
    store, run, (victim, survivor), _ = training_run(cloud, resources)
    assert handlers.events.handler(announcement(victim, REBALANCE), Context())["outcome"] == (
        "SPOT_REBALANCE: training on until the next interval checkpoint")
    warned(handlers, store, run, victim, failure_class=FailureClass.SPOT_INTERRUPTION,
           departure_class=FailureClass.SPOT_REBALANCE)
    # A retirement three weeks ahead waits; at each progress event it is judged again, and
    # DEFERRED_LEAD before its time the emergency checkpoint is asked for.
    store, run, (victim, survivor), _ = training_run(cloud, resources)
    handlers.events.handler(announcement(victim, RETIREMENT, timedelta(days=21)), Context())
    assert handlers.events.handler(progress(run, survivor, 14), Context())["outcome"] == "progress at step 14"
    near = {"departure_due_at": datetime.now(timezone.utc) + DEFERRED_LEAD - timedelta(seconds=1)}
    store.modify_run(run.run_name, lambda record: record.model_copy(update=near))
    outcome = handlers.events.handler(progress(run, survivor, 15), Context())["outcome"]
    assert outcome.startswith("progress at step 15; emergency checkpoint asked for: a leaving node goes at ")
    assert store.run(run.run_name).checkpoint_requested_at is not None
    assert handlers.events.handler(progress(run, survivor, 16), Context())["outcome"] == "progress at step 16"


def test_a_capacity_block_nearing_its_end_checkpoints_and_ends_the_run(handlers, cloud, resources):
    """DEFERRED_LEAD before EC2 begins terminating the block's instances, every worker is
    announced leaving; the emergency checkpoint ends the attempt, and the recovery ends the run."""
    store, run, (first, second), execution = training_run(cloud, resources)
    stop_by = datetime.now(timezone.utc) + DEFERRED_LEAD + timedelta(minutes=5)
    store.modify_run(run.run_name, lambda record: record.model_copy(update={"capacity_stop_by": stop_by}))
    assert handlers.events.handler(progress(run, first, 20), Context())["outcome"] == "progress at step 20"
    near = {"capacity_stop_by": datetime.now(timezone.utc) + DEFERRED_LEAD - timedelta(seconds=1)}
    store.modify_run(run.run_name, lambda record: record.model_copy(update=near))
    outcome = handlers.events.handler(progress(run, first, 21), Context())["outcome"]
    assert outcome == "progress at step 21; CAPACITY_BLOCK_END: training on until the emergency checkpoint"
    assert {store.node(run.run_name, worker).departure_class for worker in (first, second)} == {
        FailureClass.CAPACITY_BLOCK_END}
    assert handlers.events.handler(progress(run, first, 22), Context())["outcome"] == "progress at step 22"
    step = 2 * run.spec.checkpoint.interval_steps
    outcome = handlers.events.handler(commit(cloud, run, second, step, reason="requested"), Context())["outcome"]
    assert outcome == f"checkpoint step {step} recorded; CAPACITY_BLOCK_END: task failed"
    report = spot_failure(cloud, execution)
    assert report["failure_class"] == "CAPACITY_BLOCK_END" and report["instance_ids"] == sorted([first, second])


def test_a_spot_warning_before_training_fails_the_wait_at_once(handlers, cloud, resources):
    store, run, (victim, _) = recorded_run(cloud, resources)
    execution, token = parked_token(cloud)
    store.park_task(run.run_name, TaskWait(purpose="await_nodes", attempt=0, token=token))
    assert handlers.events.handler(spot_warning(victim), Context())["outcome"] == "SPOT_INTERRUPTION: task failed"
    assert spot_failure(cloud, execution)["instance_ids"] == [victim]
    assert store.node(run.run_name, victim).departure_noticed_at is None


# --- goodput ledger ---------------------------------------------------------------------------

def earlier(run: RunRecord, seconds: float) -> RunRecord:
    """The run as if all it recorded so far had happened `seconds` earlier: time passing."""
    shift = timedelta(seconds=seconds)
    return run.model_copy(update={
        "created_at": run.created_at - shift, "attempt_started_at": run.attempt_started_at - shift,
        "failures": [failure.model_copy(update={"at": failure.at - shift}) for failure in run.failures],
        "ledger": run.ledger.model_copy(update={"booked_until": run.ledger.booked_until - shift})})


def test_recover_and_teardown_book_each_attempt_and_the_report_shows_the_ledger(handlers, cloud, resources, capsys):
    import functions.report
    import functions.teardown

    store, run, _ = recorded_run(cloud, resources)
    now = datetime.now(timezone.utc)
    # Attempt 0, from the run's creation: 30 s of start-up, 60 s of training kept by a checkpoint,
    # then ~40 s redone.
    store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "created_at": now - timedelta(seconds=130), "first_step_at": now - timedelta(seconds=100),
        "latest_checkpoint": CheckpointRef(step=20, uri=f"{run.spec.checkpoint.s3_uri}/step-000000020",
                                           committed_at=now - timedelta(seconds=40))}))
    crash = {"failure_class": "PROCESS_CRASH", "attempt": 0, "instance_ids": [], "message": "trainer crashed"}
    payload = {"run": {"run_name": run.run_name, "attempt": 0},
               "timeouts": {"boot_seconds": 60, "late_worker_seconds": 60, "heartbeat_seconds": 60},
               "failure": {"Error": FAILURE_ERROR, "Cause": json.dumps(crash)}}
    handlers.recover.handler(payload, Context())
    recovered = store.run(run.run_name)
    ledger = recovered.ledger
    assert ledger.productive_seconds == pytest.approx(60)
    assert ledger.lost_seconds == pytest.approx(70, abs=5)
    assert set(ledger.lost_by_cause) == {"startup", "redone:PROCESS_CRASH"}
    assert ledger.lost_by_cause["startup"] == pytest.approx(30)
    # The next attempt starts where this one was booked: the books cover creation to the decision.
    assert recovered.attempt_started_at == ledger.booked_until
    assert unaccounted_seconds(recovered) == pytest.approx(0, abs=1e-3)
    assert ledger.node_seconds > 0 and ledger.cost_usd > 0  # the run's instances, on the books
    # A retry of the same Recover carries on: the attempt is not booked twice.
    handlers.recover.handler(payload, Context())
    assert store.run(run.run_name).ledger == ledger

    # Attempt 1, its recovery 120 s ago: 20 s to its first step, trains to a last reported step
    # 10 s ago, completes; then Teardown and Report.
    store.modify_run(run.run_name, lambda current: earlier(current, 120))
    start = store.run(run.run_name).attempt_started_at
    store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "first_step_at": start + timedelta(seconds=20), "last_progress_at": start + timedelta(seconds=110)}))
    done = {"run": {"run_name": run.run_name, "attempt": 1}, "timeouts": payload["timeouts"]}
    functions.teardown.handler(done, Context())
    torn_down = store.run(run.run_name)
    booked = torn_down.ledger
    assert booked.productive_seconds == pytest.approx(60 + 90)
    assert set(booked.lost_by_cause) == {"startup", "redone:PROCESS_CRASH", "restart:PROCESS_CRASH", "finishing"}
    assert booked.lost_by_cause["restart:PROCESS_CRASH"] == pytest.approx(20)
    assert booked.lost_by_cause["finishing"] == pytest.approx(10, abs=5)
    # Every second from the run's creation to Teardown's booking, each lost one with its cause.
    assert booked.booked_until - torn_down.created_at == pytest.approx(timedelta(seconds=250), abs=timedelta(seconds=5))
    assert unaccounted_seconds(torn_down) == pytest.approx(0, abs=1e-3)
    functions.teardown.handler(done, Context())  # Teardown's retry books nothing again
    assert store.run(run.run_name).ledger == booked
    capsys.readouterr()
    uri = functions.report.handler(done, Context())["report_uri"]
    bucket, page = uri.removeprefix("s3://").split("/", 1)
    assert page == f"runs/{run.run_name}/report.html"
    report = json.loads(cloud.client("s3").get_object(Bucket=bucket, Key=f"runs/{run.run_name}/report.json")["Body"].read())
    assert report["ledger"]["productive_seconds"] == pytest.approx(booked.productive_seconds)
    assert report["ledger"]["lost_seconds"] == pytest.approx(booked.lost_seconds)
    assert report["ledger"]["lost_by_cause"] == pytest.approx(booked.lost_by_cause)
    assert report["unaccounted_seconds"] == pytest.approx(0, abs=1e-3)
    assert report["ledger"]["cost_usd"] == pytest.approx(booked.cost_usd) and booked.cost_usd > ledger.cost_usd
    assert report["goodput"] == pytest.approx(booked.goodput) and 0 < report["goodput"] < 1
    # CloudWatch gets the lost time of each cause (EMF lines on the function's output).
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"CloudWatchMetrics"' in line]
    by_cause = {line["Cause"]: line["LostTime"] for line in lines if "Cause" in line}
    assert by_cause == pytest.approx(booked.lost_by_cause)
