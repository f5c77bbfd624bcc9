"""The lifecycle core: every branch of classification, re-planning, recovery, backoff and goodput."""

import json
from datetime import datetime, timedelta, timezone

import pytest

from trainfleet.core import lifecycle as lc
from trainfleet.core import pace
from trainfleet.core.events import (CheckpointCommitted, CheckpointReason, Ec2InstanceStateChange,
                                    Ec2RebalanceRecommendation, Ec2SpotInterruptionWarning, HealthCheckResult,
                                    HealthEvent, NodeReady,
                                    NodeRegistered, NodeUnhealthy, ScalingChecked, TrainerFailed, TrainerHung,
                                    TrainingProgress)
from trainfleet.core.records import (CAPACITY_ERROR, FAILURE_ERROR, CheckpointRef, FailureClass, FailureRecord,
                                     FailureReport, GoodputLedger, NodeLiveness, NodeRecord, NodeRole, NodeState,
                                     LaunchSpec, ParallelPlan, RecoveryAction, RecoveryDecision, RecoveryKind, RunRecord,
                                     ScalingCheckFigures, TaskWait, rendezvous_port)
from trainfleet.core.runspec import RecoveryPolicy, RunSpec, TrainerConfig

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def make_spec(**overrides) -> RunSpec:
    doc = {
        "run_name": "r1", "instance_type": "c5.large", "node_count": 4, "spare_count": 1, "min_nodes": 2,
        "capacity": {"subnet_ids": ["subnet-0123456789abcdef0"], "security_group_ids": ["sg-0123456789abcdef0"]},
        "image_id": "ami-0123456789abcdef0",
        "trainer": {"model": {"n_layers": 8}, "training": {"batch_size": 16},
                    "parallel": {"pp": 2, "dp": 2, "schedule": "1f1b", "microbatches": 4}},
        "checkpoint": {"s3_uri": "s3://bucket/runs/r1/checkpoints", "interval_steps": 10},
        "recovery": {"max_restarts": 5, "crash_loop_repeats": 3, "backoff_base_seconds": 10,
                     "backoff_max_seconds": 100, "backoff_jitter": 0.0},
    }
    doc.update(overrides)
    return RunSpec.model_validate(doc)


def make_run(spec: RunSpec | None = None, **fields) -> RunRecord:
    spec = spec or make_spec()
    if "plan" not in fields:
        par = spec.trainer.parallel
        fields["plan"] = ParallelPlan(nodes=spec.node_count, ranks_per_node=1, pp=par.pp, dp=par.dp)
    return RunRecord(run_name=spec.run_name, spec=spec, **{"attempt": 1, **fields})


def node(instance_id: str, role=NodeRole.WORKER, state=NodeState.READY, **fields) -> NodeRecord:
    if state is NodeState.READY:
        fields.setdefault("ready_attempt", 1)  # confirmed for make_run's attempt
    fields.setdefault("private_ip", f"10.0.0.{instance_id[-1]}")
    return NodeRecord(run_name="r1", instance_id=instance_id, role=role, state=state, **fields)


WORKERS = [node(f"i-{n}") for n in range(1, 5)]
SPARE = node("i-9", role=NodeRole.SPARE)


def report(failure_class, *instance_ids, attempt=1) -> FailureReport:
    return FailureReport(failure_class=failure_class, attempt=attempt, instance_ids=list(instance_ids),
                         message="test")


# --- classification -------------------------------------------------------------------------

@pytest.mark.parametrize("detail, expected, blamed", [
    (Ec2InstanceStateChange(instance_id="i-1", state="terminated"), FailureClass.INSTANCE_LOST, ["i-1"]),
    (Ec2InstanceStateChange(instance_id="i-1", state="stopping"), FailureClass.INSTANCE_LOST, ["i-1"]),
    (Ec2SpotInterruptionWarning(instance_id="i-2", instance_action="terminate"), FailureClass.SPOT_INTERRUPTION, ["i-2"]),
    (Ec2RebalanceRecommendation(instance_id="i-3"), FailureClass.SPOT_REBALANCE, ["i-3"]),
    (HealthEvent(eventArn="arn", service="EC2", eventTypeCode="AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
                 eventTypeCategory="scheduledChange", affectedEntities=[{"entityValue": "i-4"}]),
     FailureClass.HEALTH_EVENT, ["i-4"]),
    (NodeUnhealthy(run_name="r1", attempt=1, instance_id="i-1", reason="efa"), FailureClass.NODE_UNHEALTHY, ["i-1"]),
    (TrainerFailed(run_name="r1", attempt=1, instance_id="i-1", kind="crash"), FailureClass.PROCESS_CRASH, []),
    (TrainerFailed(run_name="r1", attempt=1, kind="nan_loss"), FailureClass.NUMERICAL, []),
    (TrainerFailed(run_name="r1", attempt=1, kind="config"), FailureClass.CONFIG_ERROR, []),
    (TrainerHung(run_name="r1", attempt=1, seconds_since_progress=901), FailureClass.HANG, []),
])
def test_failure_events_are_classified(detail, expected, blamed):
    failure = lc.classify_event(detail, attempt=1)
    assert (failure.failure_class, failure.instance_ids, failure.attempt) == (expected, blamed, 1)


def test_a_hang_an_agent_tells_began_at_the_worlds_last_sign_of_life():
    told = datetime(2026, 12, 5, 10, 0, 40, tzinfo=timezone.utc)
    failure = lc.classify_event(TrainerHung(run_name="r1", attempt=1, seconds_since_progress=40.0), 1, told)
    assert failure.observed_at == datetime(2026, 12, 5, 10, 0, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("detail", [
    Ec2InstanceStateChange(instance_id="i-1", state="running"),
    HealthEvent(eventArn="arn", service="EC2", eventTypeCode="AWS_EC2_OPERATIONAL_NOTIFICATION",
                eventTypeCategory="accountNotification", affectedEntities=[{"entityValue": "i-1"}]),
    HealthEvent(eventArn="arn", service="S3", eventTypeCode="AWS_S3_OPERATIONAL_ISSUE",
                eventTypeCategory="issue", affectedEntities=[{"entityValue": "i-1"}]),
    NodeReady(run_name="r1", attempt=1, instance_id="i-1"),
    CheckpointCommitted(run_name="r1", attempt=1, step=10, uri="s3://b/step-000000010"),
    TrainingProgress(run_name="r1", attempt=1, step=1, loss=1.0, tokens_per_second=1, step_seconds=1),
])
def test_events_that_are_not_failures(detail):
    assert lc.classify_event(detail, attempt=1) is None


def test_stale_agent_events_and_aws_events():
    assert lc.is_stale(TrainerHung(run_name="r1", attempt=0, seconds_since_progress=1), current_attempt=1)
    assert not lc.is_stale(TrainerHung(run_name="r1", attempt=1, seconds_since_progress=1), current_attempt=1)
    assert not lc.is_stale(Ec2RebalanceRecommendation(instance_id="i-1"), current_attempt=5)


def test_task_errors_are_classified():
    train = TaskWait(purpose="train", attempt=2, token="t")
    boot = TaskWait(purpose="await_nodes", attempt=2, token="t")
    sent = report(FailureClass.SPOT_INTERRUPTION, "i-3", attempt=2)
    assert lc.classify_task_error(FAILURE_ERROR, sent.model_dump_json(), train) == sent
    for error in ("States.HeartbeatTimeout", "States.Timeout"):
        assert lc.classify_task_error(error, None, train).failure_class is FailureClass.HANG
    booting = [node("i-1", ready_attempt=2), node("i-2", state=NodeState.LAUNCHED, private_ip=None)]
    timed_out = lc.classify_task_error("States.Timeout", None, boot, booting)
    assert (timed_out.failure_class, timed_out.instance_ids) == (FailureClass.NODE_UNHEALTHY, ["i-2"])
    short = lc.classify_task_error("CapacityUnavailable", "us-east-1a: InsufficientInstanceCapacity", boot)
    assert (short.failure_class, short.instance_ids) == (FailureClass.CAPACITY, [])
    unknown = lc.classify_task_error("Lambda.ServiceException", "boom", train)
    assert (unknown.failure_class, unknown.attempt) == (FailureClass.UNKNOWN, 2)
    assert "boom" in unknown.message


def silent(instance_id: str, **fields) -> NodeRecord:
    """A node whose agent never reported: launched, no address."""
    return node(instance_id, state=NodeState.LAUNCHED, private_ip=None, subnet_id="subnet-0a", **fields)


def test_a_boot_timeout_no_node_ever_reported_in_is_the_runs_set_up_failing_and_ends_the_run():
    """A fleet that cannot reach AWS stays silent: replacing it would bill it again and again until
    the restart budget is spent; one boot timeout says what no node did, and the run gives up."""
    boot = TaskWait(purpose="await_nodes", attempt=0, token="t")
    fleet = [silent("i-1"), silent("i-2"), silent("i-9", role=NodeRole.SPARE)]
    failure = lc.classify_task_error("States.Timeout", None, boot, fleet)
    assert (failure.failure_class, failure.instance_ids) == (FailureClass.SETUP_FAILED, [])
    assert "not one of the 3 nodes of attempt 0 reported within the boot timeout" in failure.message
    assert "from subnet-0a" in failure.message
    decision = lc.decide_recovery(make_run(attempt=0), fleet, failure, jitter_draw=0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP
    assert decision.reason.startswith("the run's set-up failed: States.Timeout: not one of the 3 nodes")


@pytest.mark.parametrize("fleet", [
    [node("i-1"), silent("i-2")],  # a survivor reported: the silent one is a sick replacement
    [node("i-1", state=NodeState.REGISTERED, ready_attempt=None), silent("i-2")],  # one registered, not ready
    [silent("i-1"), node("i-9", role=NodeRole.SPARE)],  # a spare reported: the network works
])
def test_a_boot_timeout_with_any_node_heard_from_blames_the_silent_workers(fleet):
    boot = TaskWait(purpose="await_nodes", attempt=1, token="t")
    failure = lc.classify_task_error("States.Timeout", None, boot, fleet)
    assert failure.failure_class is FailureClass.NODE_UNHEALTHY
    assert set(failure.instance_ids) == {node.instance_id for node in fleet
                                         if node.role is NodeRole.WORKER and node.state is not NodeState.READY}


def test_the_capacity_error_name_is_the_one_the_handlers_raise():
    from functions.errors import CapacityUnavailable

    assert CapacityUnavailable.__name__ == CAPACITY_ERROR


def test_a_capacity_report_in_the_lambda_error_keeps_the_attempt_that_came_up_short():
    # Recover raises CapacityUnavailable with a report of its new attempt; the Catch gives the
    # runtime's error document as the cause, and the run is waiting on nothing by then.
    short = report(FailureClass.CAPACITY, attempt=5)
    cause = json.dumps({"errorMessage": short.model_dump_json(), "errorType": CAPACITY_ERROR, "stackTrace": []})
    idle = TaskWait(purpose="await_nodes", attempt=4, token="(answered)")
    assert lc.classify_task_error(CAPACITY_ERROR, cause, idle) == short
    plain = json.dumps({"errorMessage": "us-east-1a: InsufficientInstanceCapacity", "errorType": CAPACITY_ERROR})
    assert lc.classify_task_error(CAPACITY_ERROR, plain, idle).attempt == 4


# --- re-planning ----------------------------------------------------------------------------

def trainer(**parallel) -> TrainerConfig:
    base = {"pp": 2, "dp": 2, "schedule": "1f1b", "microbatches": 4}
    return TrainerConfig.model_validate({"model": {"n_layers": 8}, "training": {"batch_size": 16},
                                         "parallel": {**base, **parallel}})


def test_plan_keeps_pp_and_shrinks_dp():
    assert lc.plan_layout(trainer(), 1, available_nodes=4, min_nodes=1, preferred_pp=2) == \
        ParallelPlan(nodes=4, ranks_per_node=1, pp=2, dp=2)
    assert lc.plan_layout(trainer(), 8, available_nodes=1, min_nodes=1, preferred_pp=2) == \
        ParallelPlan(nodes=1, ranks_per_node=8, pp=2, dp=4)


def test_plan_keeps_tp_inside_each_node():
    # 2 nodes of 8 ranks with tp=4: 4 tensor-parallel groups, pp=2 x dp=2 of them.
    assert lc.plan_layout(trainer(tp=4), 8, available_nodes=2, min_nodes=1, preferred_pp=2) == \
        ParallelPlan(nodes=2, ranks_per_node=8, pp=2, dp=2, tp=4)
    # dp_shard=4 must divide dp, which only pp=1 x dp=4 of those 4 groups allows.
    assert lc.plan_layout(trainer(pp=1, dp=4, tp=4, dp_shard=4), 8, available_nodes=2, min_nodes=1, preferred_pp=2) == \
        ParallelPlan(nodes=2, ranks_per_node=8, pp=1, dp=4, tp=4)


def test_a_shrink_takes_only_layouts_that_fit_in_gpu_memory():
    # A 7B-parameter model on p4d (40 GiB): FSDP over 16 ranks fits, over 8 the shards and the
    # larger microbatches do not, at any pp.
    config = TrainerConfig.model_validate({
        "model": {"n_layers": 32, "d_model": 4096, "n_heads": 32, "vocab_size": 32000, "seq_len": 4096},
        "parallel": {"pp": 1, "dp": 16, "schedule": "1f1b", "microbatches": 64}, "training": {"batch_size": 1024}})
    assert lc.plan_layout(config, 8, available_nodes=2, min_nodes=1, preferred_pp=1, memory_gib=40) == \
        ParallelPlan(nodes=2, ranks_per_node=8, pp=1, dp=16)
    assert lc.plan_layout(config, 8, available_nodes=1, min_nodes=1, preferred_pp=1) is not None  # memory unchecked
    assert lc.plan_layout(config, 8, available_nodes=1, min_nodes=1, preferred_pp=1, memory_gib=40) is None


def test_plan_moves_pp_when_dp_cannot_divide_the_batch():
    # 3 ranks: pp=1 x dp=3 cannot split a batch of 16; pp=3 x dp=1 can (1f1b: 4 microbatches >= 3 stages).
    assert lc.plan_layout(trainer(), 1, available_nodes=3, min_nodes=1, preferred_pp=2) == \
        ParallelPlan(nodes=3, ranks_per_node=1, pp=3, dp=1)


def test_plan_prefers_larger_pp_to_smaller():
    # Preferred pp=3 does not divide 4 ranks: pp=4 (above) wins over pp=2 (below).
    assert lc.plan_layout(trainer(), 1, 4, 1, preferred_pp=3).pp == 4


def test_plan_drops_nodes_when_no_layout_runs_on_all_of_them():
    # 5 ranks: pp=5 starves 1f1b (4 microbatches < 5 stages), dp=5 does not divide a batch of 16.
    plan = lc.plan_layout(trainer(), 1, available_nodes=5, min_nodes=2, preferred_pp=2)
    assert plan == ParallelPlan(nodes=4, ranks_per_node=1, pp=2, dp=2)


def test_initial_plan_is_the_specs_own_or_the_best_on_what_came():
    spec = make_spec()
    assert lc.initial_plan(spec, allocated_nodes=5) == ParallelPlan(nodes=4, ranks_per_node=1, pp=2, dp=2)
    assert lc.initial_plan(spec, allocated_nodes=3) == ParallelPlan(nodes=3, ranks_per_node=1, pp=3, dp=1)
    assert lc.initial_plan(spec, allocated_nodes=1) is None  # below min_nodes=2


def test_plan_none_below_min_nodes_or_when_pinned():
    assert lc.plan_layout(trainer(), 1, available_nodes=1, min_nodes=2, preferred_pp=2) is None
    pinned = trainer(layers_per_stage=[4, 4])
    assert lc.plan_layout(pinned, 1, available_nodes=3, min_nodes=2, preferred_pp=2) == \
        ParallelPlan(nodes=2, ranks_per_node=1, pp=2, dp=1)


# --- recovery decisions ---------------------------------------------------------------------

def test_config_error_gives_up_at_once():
    decision = lc.decide_recovery(make_run(), WORKERS, report(FailureClass.CONFIG_ERROR), 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP and "config" in decision.reason


def boot_failure(instance_id: str, step: str = "copying the artifacts") -> FailureReport:
    """What the event handler makes of a node's failed bootstrap step (NodeUnhealthy, check "bootstrap")."""
    from trainfleet.core.events import BOOT_CHECK

    detail = NodeUnhealthy(run_name="r1", attempt=1, instance_id=instance_id,
                           reason=f"bootstrap failed at: {step} (exit 1, 5 tries)",
                           checks=[HealthCheckResult(name=BOOT_CHECK, passed=False, detail="SlowDown")])
    return lc.classify_event(detail, 1, T0)


def test_a_node_whose_bootstrap_step_failed_every_try_is_replaced_as_a_sick_node():
    """One node's copy of the artifacts outlasted its retries (S3 answering SlowDown, a network
    blip): that node is replaced, and the run goes on (it used to end the run of 512 nodes)."""
    report = boot_failure("i-2")
    assert report.failure_class is FailureClass.BOOT_FAILED and report.instance_ids == ["i-2"]
    decision = lc.decide_recovery(make_run(), [*WORKERS, SPARE], report, 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE
    assert decision.terminate_instance_ids == ["i-2"] and decision.promote_spare_ids == ["i-9"]


def test_several_nodes_failing_at_the_same_bootstrap_step_end_the_run():
    """Software that does not install fails alike on every node: the third node that failed at
    one step within the restart window ends the run, naming them; other steps, or failures of
    longer ago, are no such sign."""
    failed = [node(f"i-{n}", state=NodeState.UNHEALTHY, failure_class=FailureClass.BOOT_FAILED,
                   reason=boot_failure(f"i-{n}").message, updated_at=T0 - timedelta(minutes=5)) for n in (5, 6)]
    other_step = node("i-7", state=NodeState.UNHEALTHY, failure_class=FailureClass.BOOT_FAILED,
                      reason=boot_failure("i-7", "unpacking the artifacts").message, updated_at=T0)
    decision = lc.decide_recovery(make_run(), [*WORKERS, *failed, other_step], boot_failure("i-2"), 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP
    assert decision.reason.startswith("the node software did not install: 3 nodes failed at the same step "
                                      "(i-2, i-5, i-6); last: i-2: bootstrap failed at: copying the artifacts")
    long_ago = [failed_node.model_copy(update={"updated_at": T0 - timedelta(days=2)}) for failed_node in failed]
    assert lc.decide_recovery(make_run(), [*WORKERS, *long_ago[:1], *failed[1:], other_step], boot_failure("i-2"),
                              0.0, now=T0).action is RecoveryAction.REPLACE
    preflight = NodeUnhealthy(run_name="r1", attempt=1, instance_id="i-2", reason="gpu_count 7 of 8",
                              checks=[HealthCheckResult(name="gpu_count", passed=False)])
    assert lc.classify_event(preflight, 1, T0).failure_class is FailureClass.NODE_UNHEALTHY


def test_cost_ceiling_gives_up():
    run = make_run(make_spec(cost_ceiling_usd=10), ledger=GoodputLedger(cost_usd=10.5))
    decision = lc.decide_recovery(run, WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP and "ceiling" in decision.reason


def crashes_hours_ago(*hours: float) -> list[FailureRecord]:
    """Crashes on healthy nodes, each at a step of its own (no crash loop), `hours` before T0."""
    return [FailureRecord(failure_class=FailureClass.PROCESS_CRASH, resume_step=step, at=T0 - timedelta(hours=ago))
            for step, ago in enumerate(hours)]


def test_restart_budget_counts_the_window_and_gives_up_when_spent():
    """max_restarts=5 a day: five recoveries in the last 24 h spend it; the same five spread over
    three weeks, or older ones, do not (the lifetime count of a long run would)."""
    spent = make_run(failures=crashes_hours_ago(20, 15, 10, 5, 1), restarts=5)
    decision = lc.decide_recovery(spent, WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP and "budget spent (5 of 5 in 24 h)" in decision.reason
    spread = make_run(failures=crashes_hours_ago(*range(500, 20, -24), 10, 1), restarts=22)
    assert lc.decide_recovery(spread, WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0).action \
        is RecoveryAction.RESTART


def test_what_aws_announces_and_short_capacity_never_spend_the_budget():
    spent = make_run(failures=crashes_hours_ago(5, 4, 3, 2, 1), restarts=5)
    notice = lc.decide_recovery(spent, [*WORKERS, SPARE], report(FailureClass.SPOT_INTERRUPTION, "i-2"), 0.0, now=T0)
    assert notice.action is RecoveryAction.REPLACE
    interrupted = make_run(failures=[FailureRecord(failure_class=FailureClass.SPOT_INTERRUPTION, resume_step=step,
                                                   instance_ids=[f"i-{step}"], at=T0 - timedelta(hours=1))
                                     for step in range(8)], restarts=8)
    assert lc.decide_recovery(interrupted, WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0).action \
        is RecoveryAction.RESTART


def test_different_nodes_lost_one_after_another_are_no_crash_loop():
    """Three INSTANCE_LOST within one checkpoint interval, each on another (already replaced)
    node: each is replaced; the same node blamed three times, or nodes never blamed, loop."""
    lost = [FailureRecord(failure_class=FailureClass.INSTANCE_LOST, resume_step=100, instance_ids=[victim], at=T0)
            for victim in ("i-1", "i-5")]
    checkpointed = {"latest_checkpoint": CheckpointRef(step=100, uri="s3://b/step-000000100")}
    run = make_run(failures=lost, **checkpointed)
    decision = lc.decide_recovery(run, [*WORKERS, SPARE], report(FailureClass.INSTANCE_LOST, "i-3"), 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE and decision.backoff_seconds == 40, "alike: it waits longer"
    same = make_run(failures=[record.model_copy(update={"instance_ids": ["i-3"]}) for record in lost], **checkpointed)
    looped = lc.decide_recovery(same, [*WORKERS, SPARE], report(FailureClass.INSTANCE_LOST, "i-3"), 0.0, now=T0)
    assert looped.action is RecoveryAction.GIVE_UP and "crash loop" in looped.reason


def test_capacity_is_waited_for_with_backoff_until_the_runs_limit():
    """No min_nodes: a missing replacement is retried, the waits growing, the fleet kept, for
    capacity_wait_hours (6 by default); three rounds no longer end the run."""
    run = make_run(make_spec(min_nodes=None))
    short = [FailureRecord(failure_class=FailureClass.CAPACITY, resume_step=None, at=T0 - timedelta(hours=hours))
             for hours in (5, 4, 3, 2, 1)]
    waiting = lc.decide_recovery(run.model_copy(update={"failures": short}), WORKERS[:3],
                                 report(FailureClass.CAPACITY), 0.0, now=T0)
    assert waiting.action is RecoveryAction.REPLACE and waiting.allocate_workers == 1
    assert waiting.backoff_seconds == 100, "the longest wait by now"
    late = [FailureRecord(failure_class=FailureClass.CAPACITY, resume_step=None, at=T0 - timedelta(hours=7)), *short]
    given_up = lc.decide_recovery(run.model_copy(update={"failures": late}), WORKERS[:3],
                                  report(FailureClass.CAPACITY), 0.0, now=T0)
    assert given_up.action is RecoveryAction.GIVE_UP and "capacity short for 7.0 h" in given_up.reason


def history(failure_class, count, step):
    return [FailureRecord(failure_class=failure_class, resume_step=step, at=T0)] * count


def test_crash_loop_gives_up():
    run = make_run(failures=history(FailureClass.PROCESS_CRASH, 2, step=100),
                   latest_checkpoint=CheckpointRef(step=100, uri="s3://b/step-000000100"))
    decision = lc.decide_recovery(run, WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP and "crash loop" in decision.reason


def test_progress_or_another_class_breaks_the_streak():
    ckpt = CheckpointRef(step=200, uri="s3://b/step-000000200")
    progressed = make_run(failures=history(FailureClass.PROCESS_CRASH, 2, step=100), latest_checkpoint=ckpt)
    assert lc.decide_recovery(progressed, WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0).action \
        is RecoveryAction.RESTART
    mixed = make_run(failures=history(FailureClass.HANG, 2, step=None))
    assert lc.decide_recovery(mixed, WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0).action \
        is RecoveryAction.RESTART


def test_announced_aws_events_never_make_a_crash_loop():
    run = make_run(failures=history(FailureClass.SPOT_INTERRUPTION, 4, step=None))
    decision = lc.decide_recovery(run, [*WORKERS, SPARE], report(FailureClass.SPOT_INTERRUPTION, "i-2"), 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE


def test_crash_on_healthy_nodes_restarts_them():
    decision = lc.decide_recovery(make_run(), WORKERS, report(FailureClass.PROCESS_CRASH), 0.0, now=T0)
    assert decision.action is RecoveryAction.RESTART
    assert decision.terminate_instance_ids == [] and decision.plan == make_run().plan
    assert decision.backoff_seconds == 10


def test_lost_worker_is_replaced_by_a_spare_and_the_spare_refilled():
    decision = lc.decide_recovery(make_run(), [*WORKERS, SPARE], report(FailureClass.INSTANCE_LOST, "i-3"), 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE
    assert decision.terminate_instance_ids == ["i-3"] and decision.promote_spare_ids == ["i-9"]
    assert (decision.allocate_workers, decision.allocate_spares) == (0, 1)


def test_lost_worker_without_spare_is_allocated_anew():
    booting_spare = node("i-8", role=NodeRole.SPARE, state=NodeState.REGISTERED)
    decision = lc.decide_recovery(make_run(), [*WORKERS, booting_spare],
                                  report(FailureClass.NODE_UNHEALTHY, "i-1", "i-2"), 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE
    assert decision.terminate_instance_ids == ["i-1", "i-2"] and decision.promote_spare_ids == []
    assert (decision.allocate_workers, decision.allocate_spares) == (2, 0)


def test_bad_spare_is_terminated_and_refilled_without_touching_workers():
    decision = lc.decide_recovery(make_run(), [*WORKERS, SPARE], report(FailureClass.HEALTH_EVENT, "i-9"), 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE
    assert decision.terminate_instance_ids == ["i-9"] and decision.promote_spare_ids == []
    assert (decision.allocate_workers, decision.allocate_spares) == (0, 1)


def test_worker_already_gone_counts_as_missing():
    gone = [*WORKERS[:3], node("i-4", state=NodeState.TERMINATED)]
    decision = lc.decide_recovery(make_run(), gone, report(FailureClass.INSTANCE_LOST, "i-4"), 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE
    assert decision.terminate_instance_ids == [] and decision.allocate_workers == 1


def test_capacity_short_shrinks_when_allowed():
    three = WORKERS[:3]
    decision = lc.decide_recovery(make_run(), three, report(FailureClass.CAPACITY), 0.0, now=T0)
    assert decision.action is RecoveryAction.SHRINK
    assert decision.plan == ParallelPlan(nodes=3, ranks_per_node=1, pp=3, dp=1)
    assert decision.allocate_workers == 0 and decision.allocate_spares == 0


def test_capacity_short_uses_spares_before_shrinking_further():
    two_and_spare = [*WORKERS[:2], SPARE]
    decision = lc.decide_recovery(make_run(), two_and_spare, report(FailureClass.CAPACITY), 0.0, now=T0)
    assert decision.action is RecoveryAction.SHRINK
    assert decision.plan.nodes == 3 and decision.promote_spare_ids == ["i-9"]


def test_workers_a_smaller_layout_leaves_out_become_spares_up_to_the_spare_count():
    # 6 workers at pp=2 x dp=3 (batch 24); after one is lost, 5 ranks have no runnable layout
    # (dp=5 does not divide 24, pp=5 starves 1f1b with 4 microbatches), so the run goes to 4.
    spec = make_spec(node_count=6, spare_count=0, min_nodes=2,
                     trainer={"model": {"n_layers": 8}, "training": {"batch_size": 24},
                              "parallel": {"pp": 2, "dp": 3, "schedule": "1f1b", "microbatches": 4}})
    run = make_run(spec)
    six = [node(f"i-{n}", node_rank=n - 1) for n in range(1, 7)]
    decision = lc.decide_recovery(run, six, report(FailureClass.CAPACITY, "i-2"), 0.0, now=T0)
    assert decision.action is RecoveryAction.SHRINK
    assert decision.plan == ParallelPlan(nodes=4, ranks_per_node=1, pp=2, dp=2)
    # No spare wanted (spare_count 0): the worker left out is terminated, not kept idle and billed.
    assert decision.terminate_instance_ids == ["i-2", "i-6"] and decision.demote_worker_ids == []
    with_a_spare = make_run(make_spec(**{**spec.model_dump(mode="json"), "spare_count": 1}))
    kept = lc.decide_recovery(with_a_spare, six, report(FailureClass.CAPACITY, "i-2"), 0.0, now=T0)
    assert kept.terminate_instance_ids == ["i-2"] and kept.demote_worker_ids == ["i-6"]


def test_capacity_short_without_shrink_retries_allocation():
    run = make_run(make_spec(min_nodes=None))
    decision = lc.decide_recovery(run, WORKERS[:3], report(FailureClass.CAPACITY), 0.0, now=T0)
    assert decision.action is RecoveryAction.REPLACE
    assert (decision.allocate_workers, decision.allocate_spares) == (1, 0)


def test_capacity_short_below_min_nodes_gives_up():
    decision = lc.decide_recovery(make_run(), WORKERS[:1], report(FailureClass.CAPACITY), 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP and "no layout" in decision.reason


# --- backoff and bookkeeping -----------------------------------------------------------------

def test_backoff_grows_caps_and_jitters():
    policy = RecoveryPolicy(backoff_base_seconds=10, backoff_multiplier=3, backoff_max_seconds=50,
                            backoff_jitter=0.5)
    assert [lc.backoff_seconds(policy, streak, 0.0) for streak in (1, 2, 3)] == [10, 30, 50]
    assert lc.backoff_seconds(policy, 1, 0.5) == 7.5
    with pytest.raises(ValueError, match="jitter_draw"):
        lc.backoff_seconds(policy, 1, 1.0)


def test_backoff_grows_along_a_streak_in_decisions():
    run = make_run(failures=history(FailureClass.HANG, 1, step=None))
    assert lc.decide_recovery(run, WORKERS, report(FailureClass.HANG), 0.0, now=T0).backoff_seconds == 20


def test_a_replacement_waits_no_backoff_until_it_fails_alike():
    lost = report(FailureClass.INSTANCE_LOST, "i-3")
    assert lc.decide_recovery(make_run(), [*WORKERS, SPARE], lost, 0.0, now=T0).backoff_seconds == 0
    again = make_run(failures=history(FailureClass.INSTANCE_LOST, 1, step=None))
    assert lc.decide_recovery(again, [*WORKERS, SPARE], lost, 0.0, now=T0).backoff_seconds == 20


def test_apply_decision_opens_a_new_attempt():
    failure = report(FailureClass.INSTANCE_LOST, "i-3").model_copy(update={"observed_at": T0 - timedelta(seconds=4)})
    run = make_run(latest_checkpoint=CheckpointRef(step=30, uri="s3://b/step-000000030"), attempt_failure=failure,
                   last_step=34, first_step_at=T0 - timedelta(minutes=5))
    decision = lc.decide_recovery(run, [*WORKERS, SPARE], failure, 0.0, now=T0)
    after = lc.apply_decision(run, failure, decision, now=T0)
    assert (after.attempt, after.restarts, after.attempt_started_at) == (2, 1, T0)
    assert after.attempt_failure is None  # the failure of the attempt before never fails the new one's waits
    assert after.failures[-1] == FailureRecord(
        failure_class=FailureClass.INSTANCE_LOST, resume_step=30, at=T0, attempt=1, onset_at=T0 - timedelta(seconds=4),
        last_step=34, instance_ids=["i-3"], instances_blamed=1, message="test", recovery=RecoveryKind.RESTARTED,
        decision=decision.reason)
    assert after.failures[-1].detection_seconds == 4.0
    gave_up = lc.apply_decision(run, report(FailureClass.CONFIG_ERROR),
                                lc.decide_recovery(run, WORKERS, report(FailureClass.CONFIG_ERROR), 0.0, now=T0), T0)
    assert (gave_up.attempt, gave_up.restarts) == (1, 0) and "config" in gave_up.error
    assert gave_up.failures[-1].recovery is RecoveryKind.GAVE_UP and gave_up.failures[-1].decision == gave_up.error


def minutes(m):
    return T0 + timedelta(minutes=m)


def test_goodput_of_a_failed_attempt_counts_redone_work_as_lost():
    ledger = lc.settle_attempt(GoodputLedger(), started_at=T0, first_step_at=minutes(5),
                               last_checkpoint_at=minutes(45), ended_at=minutes(55), completed=False,
                               redone="redone:HANG")
    assert (ledger.productive_seconds, ledger.lost_seconds) == (40 * 60, 15 * 60)
    assert ledger.lost_by_cause == {"startup": 5 * 60, "redone:HANG": 10 * 60}
    assert ledger.booked_until == minutes(55)
    assert ledger.goodput == pytest.approx(40 / 55)


def test_an_attempt_resumed_from_memory_keeps_its_training_up_to_its_last_reported_step():
    checkpoint = CheckpointRef(step=40, uri="s3://bucket/runs/r1/checkpoints/step-000000040", committed_at=minutes(45))
    run = make_run(attempt=0, created_at=T0, attempt_started_at=T0, first_step_at=minutes(5),
                   latest_checkpoint=checkpoint, last_progress_at=minutes(54))
    from_s3 = lc.settle_run_attempt(run, minutes(55), completed=False, failure_class=FailureClass.INSTANCE_LOST)
    assert from_s3.lost_by_cause == {"startup": 300, "redone:INSTANCE_LOST": 600}
    from_memory = lc.settle_run_attempt(run, minutes(55), completed=False, failure_class=FailureClass.INSTANCE_LOST,
                                        resumed_from_memory=True)
    assert from_memory.productive_seconds == 49 * 60
    assert from_memory.lost_by_cause == {"startup": 300, "redone:INSTANCE_LOST": 60}


def test_time_kept_for_a_restore_from_memory_that_came_from_s3_is_taken_back_as_redone():
    ledger = GoodputLedger(productive_seconds=3000.0, lost_seconds=300.0, lost_by_cause={"startup": 300.0})
    taken = lc.take_back(ledger, 540.0, lc.redone_cause(FailureClass.INSTANCE_LOST))
    assert (taken.productive_seconds, taken.lost_seconds) == (2460.0, 840.0)
    assert taken.lost_by_cause == {"startup": 300.0, "redone:INSTANCE_LOST": 540.0}


def test_goodput_of_a_completed_attempt_and_of_attempts_without_progress():
    done = lc.settle_attempt(GoodputLedger(), T0, minutes(5), None, minutes(65), completed=True)
    assert (done.productive_seconds, done.lost_by_cause) == (3600, {"startup": 300})
    # After its last reported step, a completed run only finishes (final checkpoint, exit).
    finished = lc.settle_attempt(GoodputLedger(), T0, minutes(5), None, minutes(65), completed=True,
                                 last_step_at=minutes(64))
    assert (finished.productive_seconds, finished.lost_by_cause) == (59 * 60, {"startup": 300, "finishing": 60})
    # Its final checkpoint, committed after the last (sampled) report, ends the training.
    saved = lc.settle_attempt(GoodputLedger(), T0, minutes(5), minutes(64.5), minutes(65), completed=True,
                              last_step_at=minutes(64))
    assert (saved.productive_seconds, saved.lost_by_cause) == (59.5 * 60, {"startup": 300, "finishing": 30})
    no_ckpt = lc.settle_attempt(GoodputLedger(), T0, minutes(5), None, minutes(20), completed=False)
    assert (no_ckpt.productive_seconds, no_ckpt.lost_by_cause) == (0, {"startup": 300, "redone:UNKNOWN": 900})
    never_started = lc.settle_attempt(done, T0, None, None, minutes(10), completed=False, startup="restart:HANG")
    assert never_started.lost_by_cause == {"startup": 300, "restart:HANG": 600}
    assert never_started.lost_seconds == 300 + 600 and never_started.booked_until == minutes(10)
    with pytest.raises(ValueError, match="before it starts"):
        lc.settle_attempt(GoodputLedger(), minutes(1), None, None, T0, completed=False)
    assert GoodputLedger().goodput == 1.0


def test_an_attempt_is_cut_at_times_clamped_into_it():
    # A first step recorded before the attempt's start, a checkpoint (the trainer's clock) after
    # its end: each piece stays inside the attempt, so they add up to its length.
    ledger = lc.settle_attempt(GoodputLedger(), minutes(10), minutes(9), minutes(31), minutes(30), completed=False)
    assert (ledger.productive_seconds, ledger.lost_by_cause) == (20 * 60, {})
    finished = lc.settle_attempt(GoodputLedger(), minutes(10), minutes(12), None, minutes(30), completed=True,
                                 last_step_at=minutes(11))
    assert (finished.productive_seconds, finished.lost_by_cause) == (0, {"startup": 120, "finishing": 18 * 60})


def test_an_older_record_books_on_after_its_unattributed_loss():
    older = GoodputLedger.model_validate({"productive_seconds": 90, "lost_seconds": 10})
    again = lc.settle_attempt(older, T0, None, None, minutes(1), completed=False)
    assert again.lost_by_cause == {"unattributed": 10, "startup": 60} and again.lost_seconds == 70
    assert GoodputLedger.model_validate_json(again.model_dump_json()) == again


def test_a_run_attempt_is_booked_from_the_records_times():
    kept = CheckpointRef(step=40, uri="s3://bucket/runs/r1/checkpoints/step-000000040", committed_at=minutes(45))
    first = make_run(attempt=0, created_at=T0, first_step_at=minutes(5), latest_checkpoint=kept)
    booked = lc.settle_run_attempt(first, minutes(55), completed=False, failure_class=FailureClass.HANG)
    assert booked == GoodputLedger(productive_seconds=40 * 60, lost_seconds=15 * 60, booked_until=minutes(55),
                                   lost_by_cause={"startup": 5 * 60, "redone:HANG": 10 * 60})
    # The next attempt starts at its recovery, its start-up lost to the failure the recovery
    # handled; the old checkpoint keeps nothing of it.
    second = first.model_copy(update={
        "attempt": 1, "attempt_started_at": minutes(56), "first_step_at": minutes(58),
        "failures": [FailureRecord(failure_class=FailureClass.HANG, resume_step=40, at=minutes(56))],
        "ledger": GoodputLedger(productive_seconds=10)})
    assert lc.settle_run_attempt(second, minutes(60), completed=False, failure_class=FailureClass.NUMERICAL) == \
        GoodputLedger(productive_seconds=10, lost_seconds=4 * 60, booked_until=minutes(60),
                      lost_by_cause={"restart:HANG": 2 * 60, "redone:NUMERICAL": 2 * 60})
    # Given up (the reason recorded, the books started afresh at the decision): all of it waits
    # for Teardown, even if the trainer still reported a step meanwhile.
    gave_up = second.model_copy(update={"error": "no progress", "first_step_at": minutes(61)})
    assert lc.settle_run_attempt(gave_up, minutes(62), completed=False).lost_by_cause == {"give_up:HANG": 6 * 60}
    with pytest.raises(ValueError, match="attempt 1 has no start time"):
        lc.settle_run_attempt(make_run(), minutes(1), completed=True)


def recover(run: RunRecord, failure: FailureReport, action: RecoveryAction, now: datetime) -> RunRecord:
    """What Recover writes: the ended attempt booked, the decision applied, the books restarted."""
    decision = RecoveryDecision(action=action, failure_class=failure.failure_class, reason="test", plan=run.plan)
    return lc.apply_decision(run, failure, decision, now).model_copy(update={
        "ledger": lc.book_attempt(run, [], now, False, failure.failure_class),
        "attempt_started_at": now, "first_step_at": None})


def teardown(run: RunRecord, completed: bool, now: datetime) -> RunRecord:
    """What Teardown writes: the last attempt booked."""
    return run.model_copy(update={"ledger": lc.book_attempt(run, [], now, completed)})


def test_the_books_account_for_every_second_of_any_timeline_by_cause():
    """Property over drawn timelines: several attempts, each failing before or after its first
    step, with or without a checkpoint of its own, a restart or a give-up, ending completed, given
    up or failed unclassified. The books hold creation to last booking, each piece by its cause."""
    import random
    checked_causes = set()
    for seed in range(300):
        draw = random.Random(seed)
        run = make_run(attempt=0, created_at=T0)
        now, expected, productive = T0, {}, 0

        def lose(cause, seconds):
            if seconds:
                expected[cause] = expected.get(cause, 0) + seconds

        def train(start_cause):
            """Advance through one attempt: start-up, then maybe training and a checkpoint;
            (seconds trained, seconds after the checkpoint) of what it drew."""
            nonlocal run, now
            startup = draw.randint(0, 300)
            now += timedelta(seconds=startup)
            lose(start_cause, startup)
            if draw.random() < 0.2:
                return None
            run = run.model_copy(update={"first_step_at": now})
            kept, after = draw.randint(0, 900), draw.randint(0, 900)
            committed = now + timedelta(seconds=kept) if kept else run.first_step_at - timedelta(seconds=5)
            now += timedelta(seconds=kept + after)
            run = run.model_copy(update={"last_progress_at": now, "latest_checkpoint": CheckpointRef(
                step=1, uri="s3://bucket/runs/r1/checkpoints/step-000000001", committed_at=committed)})
            return kept, after

        start_cause = "startup"
        for _ in range(draw.randint(0, 4)):
            trained = train(start_cause)
            failure_class = draw.choice(list(FailureClass))
            if trained:
                productive += trained[0]
                lose(f"redone:{failure_class}", trained[1])
            run = recover(run, report(failure_class, attempt=run.attempt), RecoveryAction.RESTART, now)
            start_cause = f"restart:{failure_class}"
        trained = train(start_cause)
        ending = draw.choice(["completed", "gave up", "failed"])
        if ending == "completed":
            if trained:
                productive += sum(trained)
                if draw.random() < 0.5:  # the final checkpoint, after the last report
                    final = draw.randint(1, 30)
                    now += timedelta(seconds=final)
                    productive += final
                    run = run.model_copy(update={"latest_checkpoint": CheckpointRef(
                        step=2, uri="s3://bucket/runs/r1/checkpoints/step-000000002", committed_at=now)})
                finishing = draw.randint(0, 60)
                now += timedelta(seconds=finishing)
                lose("finishing", finishing)
            run = teardown(run, True, now)
        else:
            failure_class = draw.choice(list(FailureClass)) if ending == "gave up" else FailureClass.UNKNOWN
            if trained:
                productive += trained[0]
                lose(f"redone:{failure_class}", trained[1])
            if ending == "gave up":
                run = recover(run, report(failure_class, attempt=run.attempt), RecoveryAction.GIVE_UP, now)
                waited = draw.randint(0, 30)
                now += timedelta(seconds=waited)
                lose(f"give_up:{failure_class}", waited)
            run = teardown(run, False, now)
        ledger = run.ledger
        assert (ledger.productive_seconds, ledger.lost_by_cause) == (productive, pytest.approx(expected)), seed
        assert ledger.booked_until == now
        assert lc.unaccounted_seconds(run) == pytest.approx(0, abs=1e-6), seed
        checked_causes |= {cause.split(":")[0] for cause in ledger.lost_by_cause}
    assert checked_causes == {"startup", "restart", "redone", "give_up", "finishing"}


def test_unaccounted_seconds_shows_time_skipped_or_booked_twice():
    run = make_run(attempt=0, created_at=T0)
    assert lc.unaccounted_seconds(run) == 0
    booked = run.model_copy(update={"ledger": lc.settle_run_attempt(run, minutes(10), completed=False)})
    assert lc.unaccounted_seconds(booked) == 0
    # The next attempt started a minute after the booking: that minute is on nobody's books.
    late = booked.model_copy(update={"attempt": 1, "attempt_started_at": minutes(11)})
    assert lc.unaccounted_seconds(late.model_copy(update={
        "ledger": lc.settle_run_attempt(late, minutes(20), completed=False)})) == 60
    early = booked.model_copy(update={"attempt": 1, "attempt_started_at": minutes(9)})
    assert lc.unaccounted_seconds(early.model_copy(update={
        "ledger": lc.settle_run_attempt(early, minutes(20), completed=False)})) == -60
    with pytest.raises(ValueError, match="no creation time"):
        lc.unaccounted_seconds(make_run())


def test_a_spot_warning_waits_only_for_a_worker_of_a_training_world():
    training = make_run(waiting=TaskWait(purpose="train", attempt=1, token="t"))
    assert lc.waits_for_emergency_checkpoint(training, WORKERS[0])
    assert not lc.waits_for_emergency_checkpoint(training, SPARE)
    assert not lc.waits_for_emergency_checkpoint(make_run(waiting=TaskWait(purpose="await_nodes", attempt=1,
                                                                           token="t")), WORKERS[0])
    assert not lc.waits_for_emergency_checkpoint(make_run(), WORKERS[0])


def committed(step: int, reason: CheckpointReason) -> CheckpointCommitted:
    return CheckpointCommitted(run_name="r1", attempt=1, instance_id="i-1", step=step,
                               uri=f"s3://bucket/runs/r1/checkpoints/step-{step:09d}", reason=reason)


def test_the_spot_wait_ends_at_the_requested_checkpoint_the_instance_leaving_or_the_notice_running_out():
    run = make_run(departure_noticed_at=T0, checkpoint_requested_at=T0)  # checkpoints every 10 steps
    spot = {"departure_noticed_at": T0, "departure_class": FailureClass.SPOT_INTERRUPTION}
    warned = node("i-2", **spot)
    nodes = [WORKERS[0], warned, node("i-3", state=NodeState.UNHEALTHY, **spot)]
    almost = T0 + lc.SPOT_NOTICE - timedelta(seconds=1)
    assert lc.departure_wait_over(run, nodes, almost) is None
    assert lc.departure_wait_over(run, nodes, almost, leaving_instance_ids=frozenset({"i-1"})) is None
    # Only a checkpoint saved on request is the one the warning asked for, whatever its step.
    for reason in (CheckpointReason.INTERVAL, CheckpointReason.FINAL, CheckpointReason.UNKNOWN):
        assert lc.departure_wait_over(run, nodes, almost, committed=committed(43, reason)) is None
    for trigger, why in [({"committed": committed(40, CheckpointReason.REQUESTED)},
                          "emergency checkpoint step 40 committed"),
                         ({"leaving_instance_ids": frozenset({"i-2"})}, "instance leaving"),
                         ({"now": T0 + lc.SPOT_NOTICE}, "notice ran out")]:
        over = lc.departure_wait_over(run, nodes, **{"now": almost, **trigger})
        assert (over.failure_class, over.attempt, over.instance_ids) == (FailureClass.SPOT_INTERRUPTION, 1, ["i-2"])
        assert why in over.message
    # Nothing interrupting (or only retired nodes): nothing ends.
    assert lc.departure_wait_over(run, WORKERS, T0, committed=committed(43, CheckpointReason.REQUESTED)) is None
    assert lc.departure_wait_over(run, nodes[2:], T0 + lc.SPOT_NOTICE) is None


def test_the_run_record_alone_tells_when_the_departure_wait_may_be_over():
    almost = T0 + lc.SPOT_NOTICE - timedelta(seconds=1)
    quiet = make_run()
    for trigger in ({}, {"leaving": True}, {"committed": committed(40, CheckpointReason.REQUESTED)}):
        assert not lc.departure_wait_may_end(quiet, T0 + lc.SPOT_NOTICE, **trigger), "no node is leaving"
    run = make_run(departure_noticed_at=T0, checkpoint_requested_at=T0)
    assert not lc.departure_wait_may_end(run, almost)
    assert not lc.departure_wait_may_end(run, almost, committed=committed(43, CheckpointReason.INTERVAL))
    assert lc.departure_wait_may_end(run, almost, committed=committed(40, CheckpointReason.REQUESTED))
    assert lc.departure_wait_may_end(run, almost, leaving=True)
    assert lc.departure_wait_may_end(run, T0 + lc.SPOT_NOTICE)
    failed = run.model_copy(update={"attempt_failure": report(FailureClass.SPOT_INTERRUPTION, "i-2")})
    assert not lc.departure_wait_may_end(failed, T0 + lc.SPOT_NOTICE, leaving=True), "the wait ended already"
    # Whenever the nodes say the wait is over, so does the run record (its notice is the first).
    nodes = [WORKERS[0], node("i-2", departure_noticed_at=T0 + timedelta(seconds=30),
                              departure_class=FailureClass.SPOT_INTERRUPTION)]
    for now in (almost, T0 + lc.SPOT_NOTICE, T0 + lc.SPOT_NOTICE + timedelta(seconds=30)):
        if lc.departure_wait_over(run, nodes, now) is not None:
            assert lc.departure_wait_may_end(run, now)
    assert lc.departure_wait_may_end(run, T0 + lc.SPOT_NOTICE) and lc.departure_wait_over(
        run, WORKERS, T0 + lc.SPOT_NOTICE) is None, "the run may look, the nodes say who leaves"
    assert lc.apply_decision(run, report(FailureClass.SPOT_INTERRUPTION, "i-2"), lc.decide_recovery(
        run, nodes, report(FailureClass.SPOT_INTERRUPTION, "i-2"), 0.5, now=T0), T0).departure_noticed_at is None


def test_announced_departures_checkpoint_first_and_fail_with_their_own_class():
    retirement = HealthEvent.model_validate({
        "eventArn": "arn:x", "service": "EC2", "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
        "eventTypeCategory": "scheduledChange", "affectedEntities": [{"entityValue": "i-2"}]})
    assert lc.checkpoint_before_leaving(retirement)
    assert lc.checkpoint_before_leaving(Ec2RebalanceRecommendation(instance_id="i-2"))
    assert lc.checkpoint_before_leaving(Ec2SpotInterruptionWarning(instance_id="i-2", instance_action="terminate"))
    assert not lc.checkpoint_before_leaving(retirement.model_copy(update={"event_type_category": "issue"}))
    assert not lc.checkpoint_before_leaving(Ec2InstanceStateChange(instance_id="i-2", state="stopping"))
    rebalanced = node("i-2", departure_noticed_at=T0, departure_class=FailureClass.SPOT_REBALANCE)
    later = node("i-3", departure_noticed_at=T0 + timedelta(seconds=5), departure_class=FailureClass.HEALTH_EVENT)
    over = lc.departure_wait_over(make_run(departure_noticed_at=T0, checkpoint_requested_at=T0),
                                  [WORKERS[0], later, rebalanced], T0 + lc.SPOT_NOTICE)
    assert (over.failure_class, over.instance_ids) == (FailureClass.SPOT_REBALANCE, ["i-2", "i-3"])


def retirement_at(start_time: str | None) -> HealthEvent:
    return HealthEvent.model_validate({
        "eventArn": "arn:x", "service": "EC2", "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
        "eventTypeCategory": "scheduledChange", "affectedEntities": [{"entityValue": "i-2"}],
        **({"startTime": start_time} if start_time else {})})


def test_a_departure_is_due_when_aws_says_and_its_checkpoint_is_asked_for_only_when_it_nears():
    spot = Ec2SpotInterruptionWarning(instance_id="i-2", instance_action="terminate")
    assert lc.departure_due_at(spot, T0) == T0 + lc.SPOT_NOTICE
    assert lc.departure_due_at(Ec2RebalanceRecommendation(instance_id="i-2"), T0) is None, "a rebalance names no time"
    in_three_weeks = datetime(2026, 1, 22, tzinfo=timezone.utc)
    assert lc.departure_due_at(retirement_at("Thu, 22 Jan 2026 00:00:00 GMT"), T0) == in_three_weeks  # as Health writes it
    assert lc.departure_due_at(retirement_at("2026-01-22T00:00:00Z"), T0) == in_three_weeks
    assert lc.departure_due_at(retirement_at(None), T0) == T0, "an undated retirement is taken as due now"
    assert lc.departure_due_at(retirement_at("next week"), T0) == T0
    # Asked for now when the node goes within DEFERRED_LEAD (a Spot warning always), else at the next interval.
    assert lc.emergency_checkpoint_due(lc.departure_due_at(spot, T0), T0)
    assert not lc.emergency_checkpoint_due(None, T0 + timedelta(days=30))
    assert not lc.emergency_checkpoint_due(in_three_weeks, T0)
    assert lc.emergency_checkpoint_due(in_three_weeks, in_three_weeks - lc.DEFERRED_LEAD)
    # The run record alone tells when a deferred departure's time has come.
    deferred = make_run(departure_noticed_at=T0, departure_due_at=in_three_weeks)
    assert not lc.emergency_checkpoint_now(deferred, T0 + timedelta(days=1))
    assert lc.emergency_checkpoint_now(deferred, in_three_weeks - lc.DEFERRED_LEAD)
    for settled in ({"checkpoint_requested_at": T0}, {"attempt_failure": report(FailureClass.HEALTH_EVENT, "i-2")},
                    {"departure_noticed_at": None}):
        assert not lc.emergency_checkpoint_now(deferred.model_copy(update=settled), in_three_weeks)


def test_a_departure_not_due_yet_swaps_the_node_at_the_next_interval_checkpoint():
    run = make_run(departure_noticed_at=T0)  # nothing asked for: the node may have weeks left
    nodes = [WORKERS[0], node("i-2", departure_noticed_at=T0, departure_class=FailureClass.SPOT_REBALANCE)]
    weeks = T0 + timedelta(days=20)
    assert lc.departure_wait_over(run, nodes, weeks) is None, "no notice runs out"
    for reason in (CheckpointReason.FINAL, CheckpointReason.UNKNOWN):
        assert lc.departure_wait_over(run, nodes, weeks, committed=committed(43, reason)) is None
        assert not lc.departure_wait_may_end(run, weeks, committed=committed(43, reason))
    for trigger, why in [({"committed": committed(50, CheckpointReason.INTERVAL)}, "interval checkpoint step 50"),
                         ({"committed": committed(44, CheckpointReason.REQUESTED)}, "emergency checkpoint step 44"),
                         ({"leaving_instance_ids": frozenset({"i-2"})}, "instance leaving")]:
        assert lc.departure_wait_may_end(run, weeks, **{"leaving": bool(trigger.get("leaving_instance_ids")),
                                                        "committed": trigger.get("committed")})
        over = lc.departure_wait_over(run, nodes, weeks, **trigger)
        assert (over.failure_class, over.instance_ids) == (FailureClass.SPOT_REBALANCE, ["i-2"])
        assert why in over.message
    # Once the emergency checkpoint was asked for, only it (or the instance leaving, or the
    # notice running out) ends the wait.
    asked = run.model_copy(update={"checkpoint_requested_at": weeks})
    assert lc.departure_wait_over(asked, nodes, weeks, committed=committed(50, CheckpointReason.INTERVAL)) is None


def test_a_world_that_restarts_anyway_takes_its_leaving_nodes_out_with_the_blamed():
    run = make_run(departure_noticed_at=T0)
    nodes = [*WORKERS[:2], node("i-3", departure_noticed_at=T0, departure_class=FailureClass.SPOT_REBALANCE),
             WORKERS[3], SPARE]
    decision = lc.decide_recovery(run, nodes, report(FailureClass.NODE_UNHEALTHY, "i-1"), 0.5, now=T0)
    assert decision.action is RecoveryAction.REPLACE
    assert decision.terminate_instance_ids == ["i-1", "i-3"] and decision.promote_spare_ids == ["i-9"]
    assert decision.allocate_workers == 1
    after = lc.apply_decision(run.model_copy(update={"departure_due_at": T0, "checkpoint_requested_at": T0}),
                              report(FailureClass.NODE_UNHEALTHY, "i-1"), decision, T0)
    assert (after.departure_noticed_at, after.departure_due_at, after.checkpoint_requested_at) == (None, None, None)


def test_cost_accrues_and_meets_the_ceiling():
    ledger = lc.accrue_cost(GoodputLedger(), node_count=5, usd_per_hour=55.04, seconds=1800)
    assert ledger.node_seconds == 9000 and ledger.cost_usd == pytest.approx(137.6)
    assert lc.over_cost_ceiling(make_spec(cost_ceiling_usd=137.6), ledger)
    assert not lc.over_cost_ceiling(make_spec(cost_ceiling_usd=200), ledger)
    assert not lc.over_cost_ceiling(make_spec(), ledger)
    with pytest.raises(ValueError, match="node_count"):
        lc.accrue_cost(ledger, node_count=-1, usd_per_hour=1, seconds=1)


# --- launch -----------------------------------------------------------------------------------

def test_new_nodes_fill_the_workers_first_then_the_spares():
    records = lc.new_node_records(make_spec(capacity={"kind": "spot", "subnet_ids": ["subnet-0123456789abcdef0"],
                                                      "security_group_ids": ["sg-0123456789abcdef0"]}),
                                  attempt=2, instance_ids=["i-b", "i-a", "i-c"], workers_wanted=2,
                                  availability_zone="us-east-1a", subnet_id="subnet-0123456789abcdef0")
    assert [(r.instance_id, r.role) for r in records] == [("i-b", NodeRole.WORKER), ("i-a", NodeRole.WORKER),
                                                          ("i-c", NodeRole.SPARE)]
    assert {(r.attempt, r.state, r.market.value) for r in records} == {(2, NodeState.LAUNCHED, "spot")}


def test_unready_workers_are_those_still_booting_or_not_confirmed_for_the_attempt():
    nodes = [node("i-1", state=NodeState.LAUNCHED), node("i-2", state=NodeState.REGISTERED), node("i-3"),
             node("i-4", state=NodeState.TERMINATED), node("i-8", role=NodeRole.SPARE, state=NodeState.LAUNCHED),
             node("i-5", ready_attempt=0)]
    assert lc.unready_workers(nodes, attempt=1) == ["i-1", "i-2", "i-5"]
    assert lc.unready_workers(nodes, attempt=0) == ["i-1", "i-2"]


def test_a_node_ready_in_an_earlier_attempt_counts_only_once_it_confirms_again():
    plan = ParallelPlan(nodes=2, ranks_per_node=1, pp=2, dp=1)
    survivor, replacement = node("i-1", node_rank=0, ready_attempt=0), node("i-2", ready_attempt=1)
    assert not lc.world_complete([survivor, replacement], plan, attempt=1)
    reconfirmed = survivor.model_copy(update={"ready_attempt": 1})
    assert lc.world_complete([reconfirmed, replacement], plan, attempt=1)
    assert lc.assign_ranks([reconfirmed, replacement], plan, attempt=1) == {"i-1": 0, "i-2": 1}
    with pytest.raises(ValueError, match="needs 2 ready workers, 1 are ready"):
        lc.assign_ranks([survivor, replacement], plan, attempt=1)


def test_a_node_counts_toward_the_world_of_the_attempt_it_confirmed_while_an_addressed_ready_worker():
    assert lc.world_attempt(node("i-1", ready_attempt=3)) == 3
    for other in (node("i-9", role=NodeRole.SPARE), node("i-2", state=NodeState.REGISTERED),
                  node("i-3", state=NodeState.UNHEALTHY, ready_attempt=1),
                  node("i-4").model_copy(update={"private_ip": None}), node("i-5", ready_attempt=None)):
        assert lc.world_attempt(other) is None, other
    # With no node confirmed past the run's attempt, counting world_attempt per attempt says
    # what ready_workers says after reading every node.
    nodes = [node("i-1", ready_attempt=0), node("i-2"), node("i-3", ready_attempt=1, state=NodeState.TERMINATED),
             node("i-4").model_copy(update={"private_ip": None}), node("i-5"), node("i-8", role=NodeRole.SPARE),
             node("i-6", state=NodeState.REGISTERED)]
    for attempt in (0, 1):
        addressed = [n for n in nodes if n.private_ip and (n.ready_attempt or 0) <= attempt]
        assert (sum(lc.world_attempt(n) == attempt for n in addressed)
                == len(lc.ready_workers(addressed, attempt))), attempt


def test_await_nodes_may_start_when_the_count_fills_the_plan_of_a_waiting_attempt_not_failed():
    waiting = make_run(waiting=TaskWait(purpose="await_nodes", attempt=1, token="t"))  # the plan: 4 nodes
    assert lc.may_start(waiting, 4) and lc.may_start(waiting, 5)
    assert not lc.may_start(waiting, 3)
    assert not lc.may_start(make_run(), 4), "nothing waits"
    assert not lc.may_start(make_run(waiting=TaskWait(purpose="train", attempt=1, token="t")), 4)
    assert not lc.may_start(make_run(waiting=TaskWait(purpose="await_nodes", attempt=0, token="t")), 4)
    assert not lc.may_start(waiting.model_copy(update={"attempt_failure": report(FailureClass.INSTANCE_LOST, "i-1")}),
                            4), "the attempt failed: its wait fails, it does not start"


@pytest.mark.parametrize("detail", [
    NodeRegistered(run_name="r1", attempt=0, instance_id="i-1", private_ip="10.0.0.1"),
    NodeReady(run_name="r1", attempt=0, instance_id="i-1"),
    NodeUnhealthy(run_name="r1", attempt=0, instance_id="i-1", reason="2 of 8 GPUs"),
])
def test_what_a_node_says_about_itself_is_never_stale(detail):
    # A node booting when the run moved to attempt 1 still belongs to it: its record judges.
    assert not lc.is_stale(detail, current_attempt=1)


def test_ranks_keep_survivors_first_and_need_enough_ready_nodes():
    nodes = [node("i-5"), node("i-2", node_rank=1), node("i-3", node_rank=0), node("i-4"),
             node("i-6", state=NodeState.REGISTERED), SPARE]
    plan = ParallelPlan(nodes=4, ranks_per_node=1, pp=2, dp=2)
    assert lc.world_complete(nodes, plan, attempt=1)
    assert lc.assign_ranks(nodes, plan, attempt=1) == {"i-3": 0, "i-2": 1, "i-4": 2, "i-5": 3}
    assert not lc.world_complete(nodes[:3], plan, attempt=1)
    with pytest.raises(ValueError, match="needs 4 ready workers, 3 are ready"):
        lc.assign_ranks(nodes[:3], plan, attempt=1)


def test_a_survivor_keeps_its_rank_and_a_newcomer_takes_the_one_left_free():
    # Its host memory holds its own shards and its previous node's: another rank would fetch them.
    nodes = [node("i-1", node_rank=0), node("i-3", node_rank=2), node("i-4", node_rank=3), node("i-9")]
    plan = ParallelPlan(nodes=4, ranks_per_node=1, pp=2, dp=2)
    assert lc.assign_ranks(nodes, plan, attempt=1) == {"i-1": 0, "i-9": 1, "i-3": 2, "i-4": 3}
    # A rank the plan no longer has (a smaller world) is given up.
    small = ParallelPlan(nodes=2, ranks_per_node=1, pp=2, dp=1)
    assert lc.assign_ranks(nodes[1:3], small, attempt=1) == {"i-3": 0, "i-4": 1}


RANKED = [node(f"i-{n}", node_rank=n - 1, launched_at=T0 - timedelta(hours=2),
               ready_at=T0 - timedelta(hours=2) + timedelta(seconds=300)) for n in range(1, 5)]
"""Four workers at node ranks 0-3, each booted and through preflight in 300 s."""


def trained_run(spec: RunSpec | None = None) -> RunRecord:
    """make_run's record of a run that has trained steps (its nodes hold copies)."""
    return make_run(spec, last_step=12)


def test_a_lost_node_is_restored_from_its_buddys_memory():
    decision = lc.decide_recovery(trained_run(), [*RANKED, SPARE], report(FailureClass.INSTANCE_LOST, "i-3"), 0.0,
                                  now=T0)
    assert decision.action is RecoveryAction.REPLACE and decision.restore_from_memory
    assert "node rank(s) 2 resume from their buddies' memory, the rest from their own" in decision.reason
    restart = lc.decide_recovery(trained_run(), RANKED, report(FailureClass.PROCESS_CRASH), 0.0, now=T0)
    assert restart.action is RecoveryAction.RESTART and restart.restore_from_memory
    assert "every node resumes from its own memory" in restart.reason
    # Non-adjacent losses keep a copy of each: ranks 0 and 2 are held by 1 and 3.
    apart = lc.decide_recovery(trained_run(), [*RANKED, SPARE], report(FailureClass.INSTANCE_LOST, "i-1", "i-3"),
                               0.0, now=T0)
    assert apart.restore_from_memory
    # A world that never trained a step has nothing in memory.
    fresh = lc.decide_recovery(make_run(), [*RANKED, SPARE], report(FailureClass.INSTANCE_LOST, "i-3"), 0.0, now=T0)
    assert not fresh.restore_from_memory and "no step trained yet, nothing in memory" in fresh.reason


@pytest.mark.parametrize("lost, why", [
    (["i-2", "i-3"], "node ranks 1 and 2 lost together, a node and its buddy: resume from S3"),
    (["i-4", "i-1"], "node ranks 3 and 0 lost together, a node and its buddy: resume from S3"),  # the ring closes
    (["i-1", "i-2", "i-3", "i-4"], "no node of the world is left: resume from S3"),
])
def test_a_node_lost_with_its_buddy_is_restored_from_s3(lost, why):
    decision = lc.decide_recovery(trained_run(), [*RANKED, SPARE], report(FailureClass.INSTANCE_LOST, *lost), 0.0,
                                  now=T0)
    assert decision.action is RecoveryAction.REPLACE and not decision.restore_from_memory
    assert why in decision.reason


def test_a_run_without_in_memory_checkpoints_or_with_a_new_layout_is_restored_from_s3():
    spec = make_spec(checkpoint={"s3_uri": "s3://bucket/runs/r1/checkpoints", "memory_interval_steps": 0})
    decision = lc.decide_recovery(trained_run(spec), [*RANKED, SPARE], report(FailureClass.INSTANCE_LOST, "i-3"),
                                  0.0, now=T0)
    assert not decision.restore_from_memory and "no in-memory checkpoints: resume from S3" in decision.reason
    # Capacity short: the world shrinks to a new layout, whose shards the copies do not match.
    shrunk = lc.decide_recovery(trained_run(), RANKED[:3], report(FailureClass.CAPACITY), 0.0, now=T0)
    assert shrunk.action is RecoveryAction.SHRINK and not shrunk.restore_from_memory
    # The next attempt's launch spec carries the choice.
    booked = lc.apply_decision(trained_run(), report(FailureClass.INSTANCE_LOST, "i-3"),
                               lc.decide_recovery(trained_run(), [*RANKED, SPARE],
                                                  report(FailureClass.INSTANCE_LOST, "i-3"), 0.0, now=T0), T0)
    assert booked.restore_from_memory
    promoted = SPARE.model_copy(update={"role": NodeRole.WORKER})
    ready = [n.model_copy(update={"ready_attempt": 2}) for n in [*RANKED[:2], RANKED[3], promoted]]
    launch = lc.build_launch_spec(booked, ready, heartbeat_task_token=None)
    assert launch.restore_from_memory and launch.node_ranks == {"i-1": 0, "i-2": 1, "i-9": 2, "i-4": 3}


def training_run(**fields) -> RunRecord:
    """A run whose current attempt trains (its first step taken), its nodes holding copies."""
    return make_run(last_step=12, first_step_at=T0, **fields)


ALIVE = frozenset(f"i-{n}" for n in range(1, 5))
"""Every worker's trainer seen alive in the attempt (its agent's liveness reports)."""


def test_a_lost_node_is_repaired_in_place_around_a_spare_when_every_survivor_lives():
    lost = report(FailureClass.INSTANCE_LOST, "i-3")
    decision = lc.decide_recovery(training_run(), [*RANKED, SPARE], lost, 0.0, now=T0, trainers_alive=ALIVE)
    assert decision.action is RecoveryAction.REPLACE and decision.restore_from_memory
    assert decision.repair.model_dump() == {"generation": 1, "launched_attempt": 1, "survivor_ids": ["i-1", "i-2", "i-4"]}
    assert "repair the world in place (generation 1): the survivors keep their trainers" in decision.reason
    # The attempt after it records the repair; a second one continues the same world's generations.
    repaired = lc.apply_decision(training_run(), lost, decision, T0)
    assert repaired.repair == decision.repair and repaired.attempt == 2
    again = lc.decide_recovery(repaired.model_copy(update={"first_step_at": T0, "last_step": 15}),
                               [*RANKED[:2], RANKED[3], SPARE.model_copy(update={"role": NodeRole.WORKER, "node_rank": 2})],
                               report(FailureClass.INSTANCE_LOST, "i-2", attempt=2), 0.0, now=T0,
                               trainers_alive=frozenset({"i-1", "i-4", "i-9"}))
    assert (again.repair.generation, again.repair.launched_attempt, again.repair.survivor_ids) == (2, 1, ["i-1", "i-4", "i-9"])
    # A restart of every trainer (a hang's) ends the repairs: the next world is a new launch.
    restart = lc.decide_recovery(repaired.model_copy(update={"first_step_at": T0}), RANKED,
                                 report(FailureClass.HANG, attempt=2), 0.0, now=T0, trainers_alive=ALIVE)
    assert restart.action is RecoveryAction.RESTART and lc.apply_decision(repaired, report(
        FailureClass.HANG, attempt=2), restart, T0).repair is None


def test_a_world_is_repaired_only_where_the_order_reaches_its_survivors_within_their_repair_wait():
    """The survivors' trainers wait for the order as long as the start-up timeout (1800 s), then
    end: a repair chosen seconds after a loss with no READY spare sent the order after a
    replacement's boot, to survivors gone by then, and was booked as a repair of a world that
    restarted. A READY spare steps in at once; a new instance takes as long as this run's nodes
    took to boot (300 s here, 1,500 s slow), or the boot timeout where none was measured."""
    lost = report(FailureClass.INSTANCE_LOST, "i-3").model_copy(update={"observed_at": T0 - timedelta(seconds=20)})
    run = training_run()
    assert lc.decide_recovery(run, RANKED, lost, 0.0, now=T0, trainers_alive=ALIVE).repair is not None
    slow = [worker.model_copy(update={"ready_at": worker.launched_at + timedelta(seconds=1500)}) for worker in RANKED]
    late = lc.decide_recovery(run, slow, lost, 0.0, now=T0, trainers_alive=ALIVE)
    assert late.action is RecoveryAction.REPLACE and late.repair is None
    assert ("restart every trainer: the order would reach the survivors about 1520 s after the failure (20 s so far, "
            "1500 s to come), past 75% of the 1800 s their trainers wait for it") in late.reason
    unmeasured = [worker.model_copy(update={"ready_at": None}) for worker in RANKED]
    assert lc.decide_recovery(run, unmeasured, lost, 0.0, now=T0, trainers_alive=ALIVE).repair is None
    assert lc.decide_recovery(run, [*slow, SPARE], lost, 0.0, now=T0, trainers_alive=ALIVE).repair is not None
    # The failure began long ago (a control plane that could not act: an outage of its stores).
    old = lost.model_copy(update={"observed_at": T0 - timedelta(seconds=1400)})
    assert lc.decide_recovery(run, [*RANKED, SPARE], old, 0.0, now=T0, trainers_alive=ALIVE).repair is None


def test_a_repair_that_did_not_take_is_booked_as_the_restart_it_became():
    """The survivors' trainers had ended when the order came (they reported no trainer to repair
    with), so the repaired world failed before its first step and every trainer restarted."""
    lost = report(FailureClass.INSTANCE_LOST, "i-3")
    decision = lc.decide_recovery(training_run(), [*RANKED, SPARE], lost, 0.0, now=T0, trainers_alive=ALIVE)
    repaired = lc.apply_decision(training_run(), lost, decision, T0)
    assert repaired.failures[-1].recovery is RecoveryKind.REPAIRED
    crash = report(FailureClass.PROCESS_CRASH, "i-1", attempt=2)
    restart = lc.decide_recovery(repaired, RANKED, crash, 0.0, now=T0 + timedelta(minutes=5), trainers_alive=ALIVE)
    after = lc.apply_decision(repaired, crash, restart, T0 + timedelta(minutes=5))
    assert [failure.recovery for failure in after.failures] == [RecoveryKind.RESTARTED, RecoveryKind.RESTARTED]
    assert "the repair did not take: the repaired world failed before its first step (PROCESS_CRASH)" in \
        after.failures[0].decision
    # A repaired world that trained kept its repair: the next failure is its own.
    trained = repaired.model_copy(update={"first_step_at": T0 + timedelta(minutes=1)})
    assert lc.apply_decision(trained, crash, restart, T0 + timedelta(minutes=5)).failures[0].recovery is \
        RecoveryKind.REPAIRED


def test_a_repaired_world_whose_trainers_ended_with_nothing_to_restore_is_restarted():
    """A repaired world that finds neither a whole copy in memory nor an S3 commit raises in every
    trainer (trainer/train.py restore), which ends: their agents report it, none is alive, and the
    next attempt restarts every trainer instead of repairing again."""
    lost = report(FailureClass.INSTANCE_LOST, "i-3")
    repaired = lc.apply_decision(training_run(), lost, lc.decide_recovery(
        training_run(), [*RANKED, SPARE], lost, 0.0, now=T0, trainers_alive=ALIVE), T0)
    workers = [*RANKED[:2], SPARE.model_copy(update={"role": NodeRole.WORKER, "node_rank": 2}), RANKED[3]]
    ended = lc.decide_recovery(repaired, workers, report(FailureClass.PROCESS_CRASH, attempt=2), 0.0, now=T0,
                               trainers_alive=frozenset())
    assert ended.action is RecoveryAction.RESTART and ended.repair is None, ended.reason
    assert lc.apply_decision(repaired, report(FailureClass.PROCESS_CRASH, attempt=2), ended, T0).repair is None


@pytest.mark.parametrize("run, lost, alive, why", [
    (training_run(), "i-1", ALIVE, "node rank 0, which hosts the rendezvous, is not among the survivors"),
    (training_run(), "i-3", ALIVE - {"i-4"}, "no sign of life from the trainers of i-4"),
    (make_run(last_step=12), "i-3", ALIVE, "the failed world had not trained"),
])
def test_a_world_is_restarted_where_it_cannot_be_repaired_and_the_reason_says_why(run, lost, alive, why):
    decision = lc.decide_recovery(run, [*RANKED, SPARE], report(FailureClass.INSTANCE_LOST, lost), 0.0, now=T0,
                                  trainers_alive=alive)
    assert decision.action is RecoveryAction.REPLACE and decision.restore_from_memory and decision.repair is None
    assert f"restart every trainer: {why}" in decision.reason


def test_any_replaced_node_with_copies_in_memory_is_repaired_in_place():
    # A node sick or announced leaving is terminated before the new world forms, as a lost one is gone.
    for failure_class in (FailureClass.SPOT_INTERRUPTION, FailureClass.NODE_UNHEALTHY, FailureClass.HEALTH_EVENT):
        decision = lc.decide_recovery(training_run(), [*RANKED, SPARE], report(failure_class, "i-3"), 0.0, now=T0,
                                      trainers_alive=ALIVE)
        assert decision.terminate_instance_ids == ["i-3"] and decision.repair.survivor_ids == ["i-1", "i-2", "i-4"]
    # A node lost with its buddy: S3, so no repair (its shards are in no memory), and nothing said of one.
    both = lc.decide_recovery(training_run(), [*RANKED, SPARE, node("i-8", role=NodeRole.SPARE)],
                              report(FailureClass.INSTANCE_LOST, "i-2", "i-3"), 0.0, now=T0, trainers_alive=ALIVE)
    assert both.repair is None and "restart every trainer" not in both.reason
    for off in ({"checkpoint": {"s3_uri": "s3://bucket/runs/r1/checkpoints", "memory_interval_steps": 0}},
                {"recovery": {"repair_in_place": False}}):
        decision = lc.decide_recovery(training_run(spec=make_spec(**off)), [*RANKED, SPARE],
                                      report(FailureClass.INSTANCE_LOST, "i-3"), 0.0, now=T0, trainers_alive=ALIVE)
        assert decision.repair is None and "restart every trainer" not in decision.reason, off


def test_the_repaired_worlds_launch_spec_keeps_the_survivors_ranks_and_draws_a_port_no_store_holds():
    lost = report(FailureClass.INSTANCE_LOST, "i-3")
    repaired = lc.apply_decision(training_run(), lost, lc.decide_recovery(
        training_run(), [*RANKED, SPARE], lost, 0.0, now=T0, trainers_alive=ALIVE), T0)
    promoted = SPARE.model_copy(update={"role": NodeRole.WORKER})
    ready = [n.model_copy(update={"ready_attempt": 2}) for n in [*RANKED[:2], RANKED[3], promoted]]
    launch = lc.build_launch_spec(repaired, ready, heartbeat_task_token=None)
    assert launch.repairable and launch.repair == repaired.repair
    assert launch.node_ranks == {"i-1": 0, "i-2": 1, "i-9": 2, "i-4": 3} and launch.rendezvous_host == "10.0.0.1"
    assert launch.rendezvous_port != lc.build_launch_spec(training_run(), RANKED, None).rendezvous_port
    # A draw that falls on the port of a store still open on node rank 0 (the survivors' torchrun
    # rendezvous, an earlier generation's) is drawn again.
    for attempt in range(2, 300):
        confirmed = [n.model_copy(update={"ready_attempt": attempt}) for n in ready]
        port = lc.build_launch_spec(repaired.model_copy(update={"attempt": attempt}), confirmed, None).rendezvous_port
        assert port not in {rendezvous_port(f"r1-{earlier}") for earlier in range(1, attempt)}
    # A spec that would repair a world without its node rank 0 is refused.
    with pytest.raises(ValueError, match="a repaired world keeps node rank 0"):
        LaunchSpec.model_validate(launch.model_dump() | {"repair": {"generation": 1, "launched_attempt": 1,
                                                                    "survivor_ids": ["i-2", "i-4"]}})
    assert lc.build_launch_spec(make_run(spec=make_spec(recovery={"repair_in_place": False})), RANKED,
                                None).repairable is False


def test_after_a_crash_the_nodes_whose_trainers_live_keep_them_and_the_others_start_new_ones():
    crash = report(FailureClass.PROCESS_CRASH)
    decision = lc.decide_recovery(training_run(), RANKED, crash, 0.0, now=T0, trainers_alive=ALIVE - {"i-3"})
    assert decision.action is RecoveryAction.RESTART and decision.terminate_instance_ids == []
    assert decision.repair.survivor_ids == ["i-1", "i-2", "i-4"] and "repair the world in place" in decision.reason
    repaired = lc.apply_decision(training_run(), crash, decision, T0)
    launch = lc.build_launch_spec(repaired, [n.model_copy(update={"ready_attempt": 2}) for n in RANKED], None)
    assert launch.node_ranks == {"i-1": 0, "i-2": 1, "i-3": 2, "i-4": 3} and "i-3" not in launch.repair.survivor_ids
    # Node rank 0's trainer ended: its torchrun held the rendezvous; every trainer restarts.
    lost_host = lc.decide_recovery(training_run(), RANKED, crash, 0.0, now=T0, trainers_alive=ALIVE - {"i-1"})
    assert lost_host.repair is None and "node rank 0, which hosts the rendezvous, is not among" in lost_host.reason
    # A hang or a NaN restarts every trainer: a hung rank may not come to the repaired world.
    for failure_class in (FailureClass.HANG, FailureClass.NUMERICAL):
        decision = lc.decide_recovery(training_run(), RANKED, report(failure_class), 0.0, now=T0, trainers_alive=ALIVE)
        assert decision.action is RecoveryAction.RESTART and decision.repair is None, failure_class


def test_the_trainers_seen_alive_are_the_workers_that_reported_in_the_attempt_lately():
    def seen(instance_id, attempt=1, ago=0.0):
        return NodeLiveness(instance_id=instance_id, attempt=attempt, step=10, step_at=T0,
                            reported_at=T0 - timedelta(seconds=ago))
    records = [seen("i-1"), seen("i-2", ago=3600), seen("i-3", attempt=0), seen("i-4", ago=5), seen("i-9")]
    assert lc.trainers_alive([*RANKED, SPARE], records, 1, T0, 60) == {"i-1", "i-4"}
    ended = records[0].model_copy(update={"trainer_running": False})  # its torchrun exited: its agent said so
    assert lc.trainers_alive([*RANKED, SPARE], [ended, *records[1:]], 1, T0, 60) == {"i-4"}
    # An agent alive, a trainer or none (an idle spare's reports), in whatever attempt it confirmed.
    idle = seen("i-9", attempt=0).model_copy(update={"trainer_running": False})
    assert lc.agents_alive([*RANKED, SPARE], [ended, *records[1:4], idle], T0, 60) == {"i-1", "i-3", "i-4", "i-9"}


# --- hot spares at the start of an attempt ---------------------------------------------------

def test_a_ready_spare_takes_the_place_of_a_worker_still_booting_which_becomes_a_spare():
    nodes = [*WORKERS[:3], node("i-4", state=NodeState.REGISTERED), SPARE]
    swap = lc.swap_late_workers(nodes, attempt=1)
    assert (swap.promote_spare_ids, swap.demote_worker_ids, swap.release_instance_ids) == (["i-9"], ["i-4"], [])
    swapped = [n.model_copy(update={"role": NodeRole.WORKER if n.instance_id == "i-9" else
                                    NodeRole.SPARE if n.instance_id == "i-4" else n.role}) for n in nodes]
    assert lc.world_complete(swapped, make_run().plan, attempt=1)


def test_a_worker_that_passed_preflight_and_went_silent_is_released_first():
    silent = node("i-4", ready_attempt=0)  # ready in attempt 0, never confirmed attempt 1
    nodes = [node("i-1", state=NodeState.LAUNCHED), *WORKERS[1:3], silent, SPARE]
    swap = lc.swap_late_workers(nodes, attempt=1)
    assert (swap.promote_spare_ids, swap.demote_worker_ids, swap.release_instance_ids) == (["i-9"], [], ["i-4"])


def test_late_workers_are_swapped_only_as_far_as_confirmed_spares_go():
    nodes = [node("i-1", state=NodeState.REGISTERED), node("i-2", state=NodeState.LAUNCHED), *WORKERS[2:],
             SPARE, node("i-8", role=NodeRole.SPARE, ready_attempt=0),  # a spare silent this attempt
             node("i-7", role=NodeRole.SPARE, state=NodeState.REGISTERED)]  # a spare still in preflight
    swap = lc.swap_late_workers(nodes, attempt=1)
    # The one furthest from ready goes first.
    assert (swap.promote_spare_ids, swap.demote_worker_ids, swap.release_instance_ids) == (["i-9"], ["i-2"], [])


def test_nothing_is_swapped_when_every_worker_confirmed_or_no_spare_is_ready():
    assert lc.swap_late_workers([*WORKERS, SPARE], attempt=1) == lc.swap_late_workers(
        [node("i-1", state=NodeState.LAUNCHED), *WORKERS[1:]], attempt=1)
    assert lc.swap_late_workers([*WORKERS, SPARE], attempt=1).model_dump() == {
        "promote_spare_ids": [], "demote_worker_ids": [], "release_instance_ids": []}


def test_launch_spec_carries_layout_resume_point_and_token():
    run = make_run(latest_checkpoint=CheckpointRef(step=40, uri="s3://bucket/runs/r1/checkpoints/step-000000040"))
    spec = lc.build_launch_spec(run, WORKERS, heartbeat_task_token="tok")
    assert spec.rendezvous_host == "10.0.0.1" and spec.rendezvous_id == "r1-1"
    assert spec.resume_step == 40 and spec.heartbeat_task_token == "tok"
    config = spec.trainer_config
    assert (config["parallel"]["pp"], config["parallel"]["dp"]) == (2, 2)
    assert config["checkpoint"] == {"uri": "s3://bucket/runs/r1/checkpoints", "interval": 10,
                                    "keep_last": 3, "resume": "40", "memory_interval": 1,
                                    "memory_dir": "/dev/shm/trainfleet/r1"}
    assert not spec.restore_from_memory  # attempt 1 of a record that no recovery decided
    assert lc.build_launch_spec(make_run(), WORKERS, None).trainer_config["checkpoint"]["resume"] == "none"


def test_a_run_resumed_from_another_starts_from_its_newest_commit_then_from_its_own():
    spec = make_spec().model_copy(update={"resume_from": "ended-run"})
    assert spec.resume_from_uri == "s3://bucket/runs/ended-run/checkpoints"
    theirs = CheckpointRef(step=40, uri="s3://bucket/runs/ended-run/checkpoints/step-000000040")
    first = lc.build_launch_spec(make_run(spec, latest_checkpoint=theirs), WORKERS, None).trainer_config["checkpoint"]
    assert (first["uri"], first["resume"], first["resume_uri"]) == (
        "s3://bucket/runs/r1/checkpoints", "40", "s3://bucket/runs/ended-run/checkpoints")
    ours = CheckpointRef(step=50, uri="s3://bucket/runs/r1/checkpoints/step-000000050")
    later = lc.build_launch_spec(make_run(spec, latest_checkpoint=ours), WORKERS, None).trainer_config["checkpoint"]
    assert later["resume"] == "50" and "resume_uri" not in later


def test_launch_spec_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="no parallel plan"):
        lc.build_launch_spec(make_run(plan=None), WORKERS, None)
    no_ip = [NodeRecord(run_name="r1", instance_id="i-1", state=NodeState.READY, ready_attempt=1), *WORKERS[1:]]
    with pytest.raises(ValueError, match="private IP"):
        lc.build_launch_spec(make_run(), no_ip, None)


# --- liveness ---------------------------------------------------------------------------------

def live(instance_id: str, step: int | None, seconds_ago: float, attempt: int = 1) -> NodeLiveness:
    return NodeLiveness(instance_id=instance_id, attempt=attempt, step=step, step_at=None,
                        reported_at=T0 - timedelta(seconds=seconds_ago))


HANG_S = 600  # RecoveryPolicy's default: the usual pace of the looks


def test_the_read_rate_of_a_run_stays_bounded_whatever_its_node_count():
    assert [lc.poll_interval(2, draw, HANG_S) for draw in (0.0, 0.5)] == [5.0, 7.5]
    assert lc.poll_interval(512, 0.0, HANG_S) == 10.0  # twice FULL_RATE_NODES: half as often
    assert lc.looks_per_second(2, HANG_S) == pytest.approx(0.267, abs=1e-3)
    assert lc.looks_per_second(512, HANG_S) == lc.looks_per_second(4096, HANG_S) == pytest.approx(34.13, abs=0.01)
    with pytest.raises(ValueError, match="draw"):
        lc.poll_interval(2, 1.0, HANG_S)


def test_unless_its_trainer_steps_every_agent_looks_at_the_full_rate_whatever_the_run_size():
    """What a node waits for between attempts (the next launch spec) comes at its next look: at
    2,048 nodes a paced look is 80 s of every GPU idle, so the pace applies only while it steps."""
    assert lc.poll_interval(2048, 0.999, HANG_S) == pytest.approx(80.0 * 0.9995, rel=1e-3)
    assert lc.poll_interval(2048, 0.999, HANG_S, stepping=False) == pytest.approx(10.0 * 0.9995, rel=1e-3)
    assert lc.poll_interval(2, 0.5, HANG_S, stepping=False) == lc.poll_interval(2, 0.5, HANG_S) == 7.5
    assert lc.poll_interval(2048, 0.0, 10, stepping=False) == lc.poll_interval(2, 0.0, 10) == 1.25


def test_a_trainer_without_a_step_for_three_steps_and_ten_seconds_has_stalled():
    assert not pace.stalled(9.9, None) and pace.stalled(10.1, None)
    assert pace.stalled(10.1, 0.5) and not pace.stalled(17.9, 6.0) and pace.stalled(18.1, 6.0)


def test_a_world_has_hung_after_five_of_its_recent_median_step_times_never_less_than_the_floor():
    assert pace.hung_after([], 8) is None and pace.hung_after([2.0, 2.0], 8) is None  # the cadence is unknown
    assert pace.hung_after([2.0, 2.0, 2.0], 8) == 10.0
    assert pace.hung_after([0.1] * 5, 30) == 30  # fast steps: the floor
    assert pace.hung_after([2.0] * 19 + [600.0], 8) == 10.0  # one slow step (a save) moves the median little
    assert pace.hung_after([600.0] * 30 + [2.0] * 20, 8) == 10.0  # only the recent steps count


def test_a_short_hang_timeout_quickens_the_heartbeats_and_looks_so_a_silent_agent_is_known_in_time():
    assert [pace.heartbeat_pace(hang) for hang in (5, 10, 20, 600)] == [1.25, 2.5, 5.0, 5.0]
    # 10 s: a beat every 2.5 s; a hang is declared at least 7.5 s after the node froze, when its
    # agent has missed three looks of at most 2.5 s.
    assert [lc.poll_interval(2, draw, 10) for draw in (0.0, 0.5)] == [1.25, 1.875]
    assert lc.silent_after(2, 10) == timedelta(seconds=7.5) and lc.silent_after(2, HANG_S) == timedelta(seconds=30)
    for nodes in (2, 100, 256, 512, 4096):
        for hang in (pace.least_hang_timeout(nodes), 20, 35, 60, 600, 3600):
            longest = max(lc.poll_interval(nodes, 1 - 1e-12, hang), lc.poll_interval(nodes, 0.0, hang))
            slowest_silence = pace.SILENT_LOOKS * longest
            assert lc.silent_after(nodes, hang).total_seconds() == pytest.approx(slowest_silence)
            if hang >= pace.least_hang_timeout(nodes):
                assert slowest_silence <= hang - pace.heartbeat_pace(hang) + 1e-9, (nodes, hang)


def test_a_hang_timeout_too_short_for_the_run_read_rate_is_refused_naming_the_least_that_fits():
    assert [pace.least_hang_timeout(nodes) for nodes in (2, 100, 256, 512, 4096)] == [5, 16, 35, 65, 485]
    for nodes in (2, 100, 256, 512, 4096):
        least = pace.least_hang_timeout(nodes)
        assert pace.hang_timeout_problem(nodes, least) is None
        assert lc.looks_per_second(nodes, least) <= pace.READ_RATE_BOUND * (1 + 1e-9)
        if least > pace.HANG_TIMEOUT_MIN_S:
            problem = pace.hang_timeout_problem(nodes, least - 1)
            assert f"hang_timeout_seconds={least - 1} is too short for {nodes} nodes (node_count" in problem
            assert problem.endswith(f"give at least {least} s")


def test_a_crash_names_the_workers_that_went_silent_never_joined_or_fell_behind():
    crash = report(FailureClass.PROCESS_CRASH)
    records = [live("i-1", 40, 2), live("i-2", 40, 300), live("i-3", None, 3), live("i-4", 37, 1)]
    blamed = lc.blame_silent_workers(crash, WORKERS, records, T0, HANG_S)
    assert blamed.instance_ids == ["i-2", "i-3", "i-4"] and blamed.failure_class is FailureClass.PROCESS_CRASH
    assert "i-2: agent silent for 300 s" in blamed.message and "i-3: never joined the rendezvous" in blamed.message
    assert "i-4: stopped advancing at step 37" in blamed.message
    # A step behind is a pipeline in flight, not a silent node; a record of an older attempt is none,
    # which counts once the peers trained (every agent reports before its torchrun starts).
    records = [live("i-1", 40, 2), live("i-2", 39, 2), live("i-3", 40, 1), live("i-4", 40, 3, attempt=0)]
    blamed = lc.blame_silent_workers(crash, WORKERS, records, T0, HANG_S)
    assert blamed.instance_ids == ["i-4"] and "no liveness report in attempt 1" in blamed.message
    not_yet = [live("i-1", None, 2), live("i-2", None, 2)]  # still in the rendezvous
    assert lc.blame_silent_workers(crash, WORKERS, not_yet, T0, HANG_S).instance_ids == []


def test_a_report_that_is_only_older_than_its_peers_is_no_sign_of_a_node_behind():
    """The world steps together: a report written before the peers' newest ones is judged against
    the steps reported by its own time (its agent's writes may have failed for a while)."""
    crash = report(FailureClass.PROCESS_CRASH)
    older = [live("i-1", 40, 1), live("i-2", 40, 1), live("i-3", 31, 5), live("i-4", None, 6)]
    assert lc.blame_silent_workers(crash, WORKERS, older, T0, HANG_S).instance_ids == []
    behind_then = [live("i-1", 40, 1), live("i-2", 38, 6), live("i-3", 31, 5), live("i-4", None, 4)]
    blamed = lc.blame_silent_workers(crash, WORKERS, behind_then, T0, HANG_S)
    assert blamed.instance_ids == ["i-3", "i-4"]
    assert "i-3: stopped advancing at step 31 while its peers reached 38" in blamed.message
    assert "i-4: never joined the rendezvous while its peers reached step 38" in blamed.message


def test_an_agent_is_silent_after_missing_three_looks_at_the_pace_of_its_run_hang_timeout():
    hang = report(FailureClass.HANG)
    records = [live("i-1", 40, 1), live("i-2", 40, 9), live("i-3", 40, 2), live("i-4", 40, 1)]
    assert lc.blame_silent_workers(hang, WORKERS, records, T0, 10).instance_ids == ["i-2"]
    assert lc.blame_silent_workers(hang, WORKERS, records, T0, HANG_S).instance_ids == []


def test_liveness_blames_no_one_when_every_worker_looks_silent_but_ec2_impairment_counts():
    hang = report(FailureClass.HANG)
    silent = [live(f"i-{n}", 40, 600) for n in range(1, 5)]
    assert lc.blame_silent_workers(hang, WORKERS, silent, T0, HANG_S).instance_ids == []
    impaired = lc.blame_silent_workers(hang, WORKERS, silent, T0, HANG_S, {"i-3": lc.IMPAIRED, "i-9": lc.IMPAIRED})
    assert impaired.instance_ids == ["i-3"] and "EC2 instance status impaired" in impaired.message
    assert impaired.failure_class is FailureClass.HANG


@pytest.mark.parametrize("state", ["shutting-down", "terminated", "stopping", "stopped"])
def test_a_crash_of_a_world_that_lost_an_instance_is_that_instance_loss(state):
    """The survivors' agents report a peer's death as a crash at once; EC2's state of the
    instance, read by Recover, names the lost node and the failure is its loss."""
    crash = report(FailureClass.PROCESS_CRASH)
    answering = [live(f"i-{n}", 40, 1) for n in range(1, 5)]  # the lost node's agent died a moment ago
    lost = lc.blame_silent_workers(crash, WORKERS, answering, T0, HANG_S, {"i-2": state, "i-3": "running"})
    assert lost.instance_ids == ["i-2"] and lost.failure_class is FailureClass.INSTANCE_LOST
    assert f"i-2: EC2 reports the instance {state}" in lost.message
    assert lc.blame_silent_workers(crash, WORKERS, answering, T0, HANG_S, {"i-3": "running"}) == crash


@pytest.mark.parametrize("recorded", [NodeState.READY, NodeState.UNHEALTHY, NodeState.TERMINATED])
def test_a_lost_instance_is_the_failure_whichever_came_first_its_ec2_event_or_its_peers_crash(recorded):
    """EC2's state-change event comes seconds to a minute after an instance stopped, its peers'
    crash reports often before it: the first to arrive answers the attempt's wait. The event, once
    it arrives, retires the node (`recorded`: READY before it arrived, UNHEALTHY after, TERMINATED
    after EC2's `terminated`). Recover decides the same whichever came first: the instance's loss,
    that node alone replaced. A node lost in an earlier attempt is no part of this one's world."""
    replaced_before = node("i-5", state=NodeState.TERMINATED, ready_attempt=0, failure_class=FailureClass.INSTANCE_LOST)
    lost = WORKERS[1].model_copy(update={
        "state": recorded, "failure_class": None if recorded is NodeState.READY else FailureClass.INSTANCE_LOST})
    nodes = [WORKERS[0], lost, *WORKERS[2:], replaced_before]
    answering = [live(f"i-{n}", 40, 1) for n in range(1, 5)]  # the lost node's agent died a moment ago
    troubles = {"i-2": "shutting-down" if recorded is NodeState.READY else "terminated", "i-5": "terminated"}
    event = lc.classify_event(Ec2InstanceStateChange(instance_id="i-2", state="shutting-down"), 1, T0)
    crash = lc.classify_event(TrainerFailed(run_name="r1", attempt=1, instance_id="i-1", kind="crash"), 1, T0)
    for first in (event, crash):
        failure = lc.blame_silent_workers(first, nodes, answering, T0, HANG_S, troubles)
        assert (failure.failure_class, failure.instance_ids) == (FailureClass.INSTANCE_LOST, ["i-2"]), first.message
        decision = lc.decide_recovery(make_run(), nodes, failure, 0.0, now=T0)
        assert (decision.action, decision.failure_class) == (RecoveryAction.REPLACE, FailureClass.INSTANCE_LOST)
        assert (decision.allocate_workers, decision.promote_spare_ids) == (1, [])
        assert decision.terminate_instance_ids == ([] if recorded.is_retired else ["i-2"])
    assert [worker.instance_id for worker in lc.world_workers(nodes, 1)] == ["i-1", "i-2", "i-3", "i-4"]


def test_failures_that_name_a_node_or_cannot_hide_one_are_left_alone():
    records = [live("i-1", 40, 2), live("i-2", 40, 300)]
    for failure in (report(FailureClass.INSTANCE_LOST, "i-1"), report(FailureClass.NUMERICAL),
                    report(FailureClass.CONFIG_ERROR)):
        assert not lc.needs_liveness_look(failure)
        assert lc.blame_silent_workers(failure, WORKERS, records, T0, HANG_S, {"i-2": "terminated"}) == failure


# --- the world checks, the first sign of a failure ----------------------------------------

def scaling_figures(passed: bool) -> ScalingCheckFigures:
    return ScalingCheckFigures(
        attempt=1, passed=passed, efficiency=0.9 if passed else 0.2, efficiency_floor=0.7, step_seconds=1.0,
        expected_step_seconds=0.9 if passed else 0.2, tokens_per_second=100, expected_tokens_per_second=111,
        steps=5, slowest_stages=[1], slowest_stage_seconds=0.2, slowest_stage_instance_ids=["i-2"], slowest_rank=1,
        slowest_rank_instance_id="i-2", slowest_rank_seconds=0.2)


def test_a_world_that_does_not_scale_is_a_failure_no_node_is_blamed_for_and_ends_the_run():
    checked = ScalingChecked(run_name="r1", attempt=1, instance_id="i-1", figures=scaling_figures(False))
    failure = lc.classify_event(checked, attempt=1, observed_at=T0)
    assert (failure.failure_class, failure.instance_ids, failure.observed_at) == (FailureClass.POOR_SCALING, [], T0)
    assert "slowest stage 1" in failure.message
    assert lc.classify_event(checked.model_copy(update={"figures": scaling_figures(True)}), attempt=1) is None
    decision = lc.decide_recovery(make_run(), WORKERS, failure, 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP and "does not scale" in decision.reason


def test_the_scaling_check_is_due_until_a_world_of_the_run_passed_it():
    gpu = make_spec(instance_type="p4d.24xlarge", node_count=4, trainer={
        "model": {"n_layers": 8}, "training": {"batch_size": 32},
        "parallel": {"pp": 4, "dp": 8, "schedule": "1f1b", "microbatches": 4}})
    run = make_run(gpu, plan=ParallelPlan(nodes=4, ranks_per_node=8, pp=4, dp=8))
    assert lc.build_launch_spec(run, WORKERS, None).trainer_config["scaling_check"]["enabled"]
    passed = run.model_copy(update={"scaling_check": scaling_figures(True)})
    assert not lc.build_launch_spec(passed, WORKERS, None).trainer_config["scaling_check"]["enabled"]
    cpu = lc.build_launch_spec(make_run(), WORKERS, None).trainer_config["scaling_check"]
    assert cpu == {"enabled": False, "warmup_steps": 2, "steps": 5, "efficiency_floor": 0.7}, "off on CPU by default"
    asked = make_run(make_spec(scaling_check={"enabled": True, "efficiency_floor": 0.5}))
    assert lc.build_launch_spec(asked, WORKERS, None).trainer_config["scaling_check"]["enabled"]


def test_a_hang_no_event_observed_began_at_the_worlds_last_step():
    hang = report(FailureClass.HANG)
    stepped = {"i-1": 31, "i-2": 14, "i-3": 12}  # seconds ago each worker's trainer last stepped
    records = [live(node, 41, 2).model_copy(update={"step_at": T0 - timedelta(seconds=ago)})
               for node, ago in stepped.items()] + [live("i-4", None, 2)]
    assert lc.hang_onset(hang, records).observed_at == T0 - timedelta(seconds=12)
    older_attempt = [record.model_copy(update={"attempt": 0}) for record in records]
    assert lc.hang_onset(hang, older_attempt).observed_at is None
    seen = hang.model_copy(update={"observed_at": T0})
    assert lc.hang_onset(seen, records) == seen
    crash = report(FailureClass.PROCESS_CRASH)
    assert lc.hang_onset(crash, records) == crash


def test_a_hang_names_the_node_whose_trainer_fell_silent_first():
    hang = report(FailureClass.HANG).model_copy(update={"observed_at": T0})
    silent = {"i-1": 3.0, "i-2": 7.5, "i-3": 3.4, "i-4": 3.2}  # seconds ago each trainer last gave a sign of life
    records = [live(node, 41, 1).model_copy(update={"alive_at": T0 - timedelta(seconds=ago)})
               for node, ago in silent.items()]
    assert lc.first_silent(records, 1) == ("i-2", 4.1)
    named = lc.hang_onset(hang, records, RANKED, ranks_per_node=8)
    assert named.message == "test [the trainer of i-2 (node rank 1: ranks 8-15) fell silent first, 4.1 s before any other]"
    assert "the trainer of i-2 fell silent first" in lc.hang_onset(hang, records).message  # no node record at hand
    assert named.instance_ids == [] and named.observed_at == T0, "named, not blamed"
    # Silent within the agents' half-second looks of each other: the world stalled as a whole.
    together = [record.model_copy(update={"alive_at": T0 - timedelta(seconds=3 + index / 4)})
                for index, record in enumerate(records)]
    assert lc.first_silent(together, 1) is None and lc.hang_onset(hang, together) == hang
    assert lc.first_silent(records, 0) is None and lc.first_silent(records[:1], 1) is None


def test_a_node_named_the_first_to_fall_silent_in_a_second_hang_is_replaced():
    silent = {"i-1": 3.0, "i-2": 7.5, "i-3": 3.4, "i-4": 3.2}  # seconds ago each trainer last gave a sign of life
    records = [live(node_id, 41, 1).model_copy(update={"alive_at": T0 - timedelta(seconds=ago)})
               for node_id, ago in silent.items()]
    first = lc.hang_onset(report(FailureClass.HANG), records, RANKED, 8)
    assert (first.first_silent, first.instance_ids) == ("i-2", []), "named once: not blamed"
    run = make_run(latest_checkpoint=CheckpointRef(step=40, uri="s3://b/runs/r1/step-40"))
    run = lc.apply_decision(run, first, lc.decide_recovery(run, RANKED, first, 0.0, T0), T0)
    assert run.failures[-1].first_silent == "i-2" and run.failures[-1].instance_ids == []

    # The next attempt hangs again with i-2's trainer silent first (after a commit: no loop).
    again = [record.model_copy(update={"attempt": 2}) for record in records]
    second = lc.hang_onset(report(FailureClass.HANG, attempt=2), again, RANKED, 8, run.failures)
    assert second.instance_ids == ["i-2"] and "named so in attempt 1's hang too: replaced" in second.message
    run = run.model_copy(update={"latest_checkpoint": CheckpointRef(step=50, uri="s3://b/runs/r1/step-50")})
    decision = lc.decide_recovery(run, [*RANKED, SPARE], second, 0.0, T0 + timedelta(hours=1))
    assert decision.action is RecoveryAction.REPLACE and decision.terminate_instance_ids == ["i-2"]
    assert decision.promote_spare_ids == ["i-9"]
    # Another node falling silent first is named, not blamed; a hang already blaming a node keeps it.
    other = [record.model_copy(update={"alive_at": T0 - timedelta(seconds=9)}) if record.instance_id == "i-3"
             else record for record in again]
    assert lc.hang_onset(report(FailureClass.HANG, attempt=2), other, RANKED, 8, run.failures).instance_ids == []
    blamed = report(FailureClass.HANG, "i-4", attempt=2)
    assert lc.hang_onset(blamed, again, RANKED, 8, run.failures).instance_ids == ["i-4"]


def test_a_capacity_block_stops_the_run_before_ec2_ends_its_instances():
    stop_by = T0 + timedelta(hours=2)
    run = make_run(capacity_stop_by=stop_by, latest_checkpoint=CheckpointRef(step=40, uri="s3://b/runs/r1/step-40"))
    assert not lc.block_end_due(run, stop_by - lc.DEFERRED_LEAD - timedelta(seconds=1))
    assert lc.block_end_due(run, stop_by - lc.DEFERRED_LEAD)
    assert not lc.block_end_due(make_run(), stop_by), "no block, no end"
    # A departure already due by then is under way; a rebalance waiting for the interval is not.
    assert not lc.block_end_due(run.model_copy(update={"departure_noticed_at": T0, "departure_due_at": stop_by}),
                                stop_by)
    assert lc.block_end_due(run.model_copy(update={"departure_noticed_at": T0}), stop_by)
    report = lc.block_end_report(run, ["i-2", "i-1"])
    assert (report.failure_class, report.instance_ids) == (FailureClass.CAPACITY_BLOCK_END, ["i-1", "i-2"])
    # Nothing replaces the block: the run ends, naming the step to resume from and the command that does.
    decision = lc.decide_recovery(run, WORKERS, report, 0.5, now=stop_by)
    assert decision.action is RecoveryAction.GIVE_UP
    assert ("stopped with checkpoint step 40: go on from it on a new block with `trainfleet run start RUNSPEC "
            f"--run-name NEW_NAME --resume-from {run.run_name}`") in decision.reason
    nothing_saved = lc.decide_recovery(run.model_copy(update={"latest_checkpoint": None}), WORKERS, report, 0.5,
                                       now=stop_by)
    assert nothing_saved.reason.endswith("stopped with no checkpoint: start it again on a new block")
    # The block's end names the failure whatever was announced first.
    nodes = [node("i-1", departure_noticed_at=T0, departure_class=FailureClass.SPOT_REBALANCE),
             node("i-2", departure_noticed_at=T0 + timedelta(seconds=1), departure_class=FailureClass.CAPACITY_BLOCK_END)]
    asked = run.model_copy(update={"departure_noticed_at": T0, "checkpoint_requested_at": T0})
    over = lc.departure_wait_over(asked, nodes, T0, committed=committed(41, CheckpointReason.REQUESTED))
    assert over.failure_class is FailureClass.CAPACITY_BLOCK_END


def test_a_shrunk_run_asks_for_what_it_lacks_at_most_every_grow_retry_and_grows_once_spares_are_ready():
    shrunk = make_run(plan=ParallelPlan(nodes=2, ranks_per_node=1, pp=2, dp=1))
    workers = [node("i-1"), node("i-2")]
    assert lc.missing_nodes(shrunk) == 2 and lc.missing_nodes(make_run()) == 0
    # The 2 missing and the pool's 1 spare, less the spares alive already.
    assert lc.spares_to_launch(shrunk, workers, T0) == 3
    booting = node("i-8", role=NodeRole.SPARE, state=NodeState.LAUNCHED)
    assert lc.spares_to_launch(shrunk, [*workers, booting], T0) == 2
    tried = shrunk.model_copy(update={"grow_tried_at": T0})
    assert lc.spares_to_launch(tried, workers, T0 + lc.GROW_RETRY - timedelta(seconds=1)) == 0
    assert lc.spares_to_launch(tried, workers, T0 + lc.GROW_RETRY) == 3
    assert lc.spares_to_launch(make_run(), workers, T0) == 0, "a run that did not shrink asks for nothing"
    # A larger world needs READY spares (booting ones do not count) and a layout on more nodes:
    # one spare makes pp=3 on 3 nodes; a model of 2 layers has none there.
    ready = [node(f"i-{n}", role=NodeRole.SPARE) for n in (7, 8)]
    assert not lc.may_grow(shrunk, [*workers, booting])
    assert lc.may_grow(shrunk, [*workers, ready[0]]) and lc.grown_plan(shrunk, 3).pp == 3
    two_layers = make_run(make_spec(trainer={"model": {"n_layers": 2}, "training": {"batch_size": 16},
                                             "parallel": {"pp": 2, "dp": 2, "schedule": "1f1b", "microbatches": 4}}),
                          plan=ParallelPlan(nodes=2, ranks_per_node=1, pp=2, dp=1))
    assert lc.grown_plan(two_layers, 3).nodes == 2 and not lc.may_grow(two_layers, [*workers, ready[0]])
    assert lc.may_grow(shrunk, [*workers, *ready])
    # The recovery promotes them and re-plans for the planned size; the budget is not spent.
    report = lc.growth_report(shrunk, 40)
    assert report.failure_class is FailureClass.CAPACITY_RETURNED and report.instance_ids == []
    spent = shrunk.model_copy(update={"failures": [
        FailureRecord(failure_class=FailureClass.PROCESS_CRASH, at=T0, attempt=0, resume_step=30)] * 5})
    decision = lc.decide_recovery(spent, [*workers, *ready], report, 0.5, now=T0)
    assert decision.action is RecoveryAction.GROW and decision.backoff_seconds == 0
    assert (decision.plan.nodes, decision.plan.pp, decision.plan.dp) == (4, 2, 2)
    assert decision.promote_spare_ids == ["i-7", "i-8"] and decision.allocate_spares == 1
    after = lc.apply_decision(tried, report, decision, T0)
    assert after.plan.nodes == 4 and after.grow_tried_at is None
