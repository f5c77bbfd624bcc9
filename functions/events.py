"""One handler for every event about a run: EC2 state changes, Spot warnings, rebalance
recommendations, AWS Health events, and the node agents' own events. EventBridge delivers the
AWS events here; the agents' events reach the same processing in batches (functions/agent_events.py).

Idempotent on the event id (Powertools, DynamoDB): a redelivered event is answered from the
idempotency table and acts once. Beyond that, what an event may change is decided from the
records: an agent event counts only from a node of the run it names, and speaks for its sender
alone (lifecycle.sender_problem; the node role lets a node put events under its own instance ARN
only); one of an attempt already replaced is ignored (lifecycle.is_stale), and an
AWS event about a node the run has already retired only records that the instance is gone.
A failure answers the parked task token with trainfleet.Failure only when it concerns the
run's current world: a lost spare is recorded, not fought over. With no token parked, the
attempt's next wait fails with it as it parks (common.fail_attempt). A Spot warning, a
rebalance recommendation or a scheduled retirement for a worker that trains marks the node
leaving and lets training go on until a checkpoint commits: the emergency one, asked of every
agent through the run record, when the node goes within minutes; the next interval one
otherwise (lifecycle.spot). Then the attempt fails with the announcement's class. A run on a
Capacity Block announces every worker leaving before EC2 ends the block (lifecycle.reservation);
a run that shrank asks for the nodes it lacks at its interval checkpoints, and grows back at one
once they are ready (lifecycle.growth).
"""

from __future__ import annotations

from datetime import datetime, timezone
from functools import cache
from collections.abc import Callable
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.idempotency import (DynamoDBPersistenceLayer, IdempotencyConfig,
                                                          idempotent_function)
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import (Aws, answer_if_world_complete, answer_task, aws, confirm_ready, fail_attempt, logger,
                              mark_terminating, metrics, record_nodes, tracer)
from functions.errors import NodeNotRecordedYet
from trainfleet.adapters.checkpoints import CheckpointInvalid, verify_checkpoint
from trainfleet.adapters.ec2_fleet import TAG_STACK, FleetError, allocate, instances_among, terminate
from trainfleet.adapters.metrics import checkpoint_metrics, emit, progress_metrics
from trainfleet.adapters.run_store import NodeNotFound, RunNotFound
from trainfleet.core.events import (AgentEvent, CheckpointCommitted, CheckpointReason, Ec2InstanceStateChange,
                                    FleetChecked, HealthEvent, NodeReady, NodeRegistered, ScalingChecked, StateRestored,
                                    TrainingCompleted, TrainingProgress, parse_event)
from trainfleet.core.lifecycle import (block_end_due, block_end_report, checkpoint_before_leaving, classify_event,
                                       departure_due_at, departure_wait_may_end, departure_wait_over,
                                       emergency_checkpoint_due, emergency_checkpoint_now, growth_report, is_stale,
                                       may_grow, missing_nodes, redone_cause, sender_problem, spares_to_launch,
                                       take_back, waits_for_emergency_checkpoint)
from trainfleet.core.records import FailureClass, FailureReport, NodeRecord, NodeRole, NodeState, RunRecord



def _now() -> datetime:
    return datetime.now(timezone.utc)


# --- agent events that move a node or the run forward --------------------------------------

def node_registered(run: RunRecord, detail: NodeRegistered) -> str:
    def register(node: NodeRecord) -> NodeRecord:
        # NodeReady may overtake this event (EventBridge keeps no order), also while this handler
        # runs: the state is decided on the record as it is written, so a late registration adds
        # the address and never moves the node back.
        moved = {"state": NodeState.REGISTERED} if node.state is NodeState.LAUNCHED else {}
        return node.model_copy(update={"private_ip": detail.private_ip, **moved,
                                       "availability_zone": detail.availability_zone or node.availability_zone})

    node = aws().store.modify_node(run.run_name, detail.instance_id, register)
    if node.state is NodeState.REGISTERED:
        return "node registered"
    # The address may be what completes the world.
    answered = answer_if_world_complete(run.run_name)
    return "node address recorded, world complete" if answered else "node address recorded"


def node_ready(run: RunRecord, detail: NodeReady) -> str:
    store = aws().store
    node = store.node(run.run_name, detail.instance_id)
    if node.state.is_retired:
        return "ignored: node already retired"
    if node.state is NodeState.LAUNCHED:
        store.transition_node(run.run_name, detail.instance_id, NodeState.REGISTERED)

    confirm_ready(run.run_name, detail.instance_id, detail.attempt)
    answered = answer_if_world_complete(run.run_name)
    return "node ready, world complete" if answered else "node ready"


def checkpoint_committed(run: RunRecord, detail: CheckpointCommitted) -> str:
    cloud = aws()
    try:
        # An agent's claim is checked against S3 (marker and every file) before it counts.
        checkpoint = verify_checkpoint(cloud.s3, run.spec.checkpoint.s3_uri, detail.step)
    except CheckpointInvalid as exc:
        newest = run.latest_checkpoint.step if run.latest_checkpoint else None
        if newest is not None and newest > detail.step:
            # Pruned by keep_last since the agent listed it: the newer commit is recorded, nothing is wrong.
            logger.info("checkpoint claim of a step pruned since", run_name=run.run_name, step=detail.step,
                        recorded=newest)
            return f"ignored: step {detail.step} pruned since, step {newest} recorded"
        logger.warning("checkpoint claim rejected", run_name=run.run_name, step=detail.step, error=str(exc))
        return "ignored: checkpoint not whole"
    cloud.store.modify_run(run.run_name, lambda current: current.knowing(checkpoint))
    emit(checkpoint_metrics(detail, cloud.settings.metrics_namespace))
    recorded = f"checkpoint step {checkpoint.step} recorded"
    then = end_departure_wait(run, committed=detail) or (
        grow_back(run, detail.step) if detail.reason is CheckpointReason.INTERVAL else None)
    return f"{recorded}; {then}" if then else recorded


def grow_back(run: RunRecord, step: int) -> str | None:
    """At an interval checkpoint of a run that shrank (lifecycle.growth): end the attempt here,
    nothing to redo, once READY spares make a larger world; else, at most every GROW_RETRY, ask
    EC2 for the nodes the world lacks, as spares. None for a run that did not shrink."""
    if missing_nodes(run) == 0:
        return None
    cloud, now = aws(), _now()
    nodes = cloud.store.nodes(run.run_name)
    if may_grow(run, nodes):
        return failure(run, nodes, growth_report(run, step))
    wanted = spares_to_launch(run, nodes, now)
    if wanted == 0:
        return None
    # The token is the last try's: a retry of this one after a launch gets the same instances.
    tried = run.grow_tried_at.isoformat() if run.grow_tried_at else "never"
    try:
        allocation = allocate(cloud.ec2, run.spec, cloud.settings.stack_name, run.launch_template_id, [run.subnet_id],
                              target=wanted, minimum=1, token_prefix=f"{run.run_name}/{run.attempt}/grow/{tried}")
    except FleetError as refused:
        allocation = None
        logger.warning("growing back: EC2 refused the spares", run_name=run.run_name, error=str(refused))
    if allocation is not None:
        record_nodes(run.spec, run.attempt, allocation, 0)
    cloud.store.modify_run(run.run_name, lambda current: current.model_copy(update={"grow_tried_at": now}))
    launched = len(allocation.instance_ids) if allocation else 0
    return f"growing back: {launched} of {wanted} spare(s) launched"


def training_progress(run: RunRecord, detail: TrainingProgress) -> str:
    cloud, now = aws(), _now()
    if detail.samples:
        cloud.store.record_progress(run.run_name, detail.attempt, detail.samples, detail.instance_id)
    # A commit may have been announced since the steps this event carries (commits go out at
    # the agent's look, progress every PROGRESS_EVERY_S): the last step is never below it.
    cloud.store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "last_step": max(detail.step, current.latest_checkpoint.step if current.latest_checkpoint else 0),
        "last_progress_at": now, "first_step_at": current.first_step_at or now}))
    emit(progress_metrics(detail, cloud.settings.metrics_namespace))
    # Progress comes every few seconds while training: the tick that asks for a departure's
    # checkpoint when its time comes, and ends a notice run out.
    departure = block_ending(run) or ask_for_emergency_checkpoint(run) or end_departure_wait(run)
    return f"progress at step {detail.step}; {departure}" if departure else f"progress at step {detail.step}"


_CHECK_FIELDS: dict[type, str] = {FleetChecked: "fleet_check", ScalingChecked: "scaling_check"}
"""The run record's field for each world check's figures."""


def world_checked(run: RunRecord, detail: FleetChecked | ScalingChecked) -> str | None:
    """Record a world check's figures; None when the world is below its floor, a failure of the
    attempt: the fleet check's slow nodes are replaced (spares first) before a step is trained,
    a world that does not scale ends the run (classify_event, decide_recovery)."""
    field, figures = _CHECK_FIELDS[type(detail)], detail.figures
    aws().store.modify_run(run.run_name, lambda current: current.model_copy(update={field: figures}))
    return f"{field.replace('_', ' ')} passed: {figures.describe()}" if figures.passed else None


def state_restored(run: RunRecord, detail: StateRestored) -> str:
    """Record where the attempt's state came from, on the run and on the failure that led to the
    attempt (the live view and the report show it)."""
    figures = detail.figures

    def record(current: RunRecord) -> RunRecord:
        ledger, failures = current.ledger, []
        for failure in current.failures:
            if failure.attempt == figures.attempt - 1:
                if figures.source != "memory" and failure.kept_on_memory_seconds:
                    # Recover kept the training since the last commit for a restore from memory.
                    ledger = take_back(ledger, failure.kept_on_memory_seconds, redone_cause(failure.failure_class))
                failure = failure.model_copy(update={"restored": figures, "kept_on_memory_seconds": 0.0})
            failures.append(failure)
        return current.model_copy(update={"restored": figures, "failures": failures, "ledger": ledger})

    aws().store.modify_run(run.run_name, record)
    return f"state restored: {figures.describe()}"


def training_completed(run: RunRecord, detail: TrainingCompleted) -> str:
    aws().store.modify_run(run.run_name, lambda current: current.model_copy(update={"last_step": detail.final_step}))
    answered = answer_task(run.run_name, "train", run.attempt, output={"final_step": detail.final_step})
    return "training completed" if answered else "ignored: training was not waiting"


# --- failures -----------------------------------------------------------------------------

def failure(run: RunRecord, nodes: list[NodeRecord], report: FailureReport) -> str:
    """Retire the blamed nodes, then fail the parked task if the failure touches the world; a
    failure of spares alone ends them at once (no recovery runs for it, and an idle node that
    cannot step in is billed for nothing: the next recovery refills the pool)."""
    cloud = aws()
    blamed = [node for node in nodes if node.instance_id in report.instance_ids]
    for node in blamed:
        # Checked on the record as it is now, not as `nodes` saw it: two events about one node
        # handled at once (a Spot notice's checkpoint committing as EC2 reports the instance
        # gone) must not let the second overwrite the failure the first blamed it for.
        cloud.store.modify_node(run.run_name, node.instance_id, lambda current: current if current.state.is_retired
                                else current.model_copy(update={"state": NodeState.UNHEALTHY,
                                                                "failure_class": report.failure_class,
                                                                "reason": report.message}))
    spares_alone = bool(blamed) and all(node.role is NodeRole.SPARE for node in blamed)
    if spares_alone and report.failure_class is not FailureClass.INSTANCE_LOST:  # a lost one is gone already
        for node in blamed:
            mark_terminating(run.run_name, node.instance_id)
        terminate(cloud.ec2, [node.instance_id for node in blamed])
        return f"{report.failure_class.value}: spare(s) terminated"
    world_hit = not report.instance_ids or any(node.role is NodeRole.WORKER for node in blamed)
    answered = world_hit and fail_attempt(run.run_name, report)
    return f"{report.failure_class.value}: task failed" if answered else f"{report.failure_class.value} recorded"


def departure_notice(run: RunRecord, nodes: list[NodeRecord], report: FailureReport, due_at: datetime | None) -> str:
    """Mark a training worker leaving (going at `due_at`, where AWS said) and train on: until the
    emergency checkpoint, asked for now, when it goes within DEFERRED_LEAD; until the next
    interval checkpoint otherwise (lifecycle.spot). A spare or a world not training yet has
    nothing to save, so that fails (or is recorded) at once. A later notice for a node already
    leaving may only bring its time forward (a Spot warning after a rebalance recommendation)."""
    waiting = [node for node in nodes if waits_for_emergency_checkpoint(run, node)]
    if not waiting:
        return failure(run, nodes, report)
    store, now = aws().store, _now()

    def leaving(node: NodeRecord) -> NodeRecord:
        return node.model_copy(update={"departure_noticed_at": node.departure_noticed_at or now,
                                       "departure_class": node.departure_class or report.failure_class,
                                       "departure_due_at": _earliest(node.departure_due_at, due_at)})

    before = {node.instance_id: node.departure_due_at for node in waiting if node.departure_noticed_at}
    marked = [store.modify_node(run.run_name, node.instance_id, leaving) for node in waiting]
    if all(node.instance_id in before and node.departure_due_at == before[node.instance_id] for node in marked):
        return f"ignored: {report.failure_class.value} already recorded"
    def departing(current: RunRecord) -> RunRecord:
        due = _earliest(current.departure_due_at, due_at)
        asked = current.checkpoint_requested_at or (now if emergency_checkpoint_due(due, now) else None)
        return current.model_copy(update={"departure_noticed_at": current.departure_noticed_at or now,
                                          "departure_due_at": due, "checkpoint_requested_at": asked})

    after = store.modify_run(run.run_name, departing)
    until = "the emergency checkpoint" if after.checkpoint_requested_at else "the next interval checkpoint"
    return f"{report.failure_class.value}: training on until {until}"


def _earliest(*times: datetime | None) -> datetime | None:
    return min((at for at in times if at is not None), default=None)


def block_ending(run: RunRecord) -> str | None:
    """Announce every worker leaving when the run's Capacity Block nears its end
    (lifecycle.reservation): the emergency checkpoint, then the run stops. None until then."""
    if not block_end_due(run, _now()):
        return None
    workers = [node for node in aws().store.nodes(run.run_name)
               if node.role is NodeRole.WORKER and not node.state.is_retired]
    return departure_notice(run, workers, block_end_report(run, [node.instance_id for node in workers]),
                            run.capacity_stop_by)


def ask_for_emergency_checkpoint(run: RunRecord) -> str | None:
    """Ask every agent for the checkpoint now when a departure that waited for the next interval
    checkpoint comes within DEFERRED_LEAD of its time; None when nothing is asked."""
    now = _now()
    if not emergency_checkpoint_now(run, now):
        return None
    aws().store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "checkpoint_requested_at": current.checkpoint_requested_at or now}))
    return f"emergency checkpoint asked for: a leaving node goes at {run.departure_due_at:%Y-%m-%d %H:%M:%S} UTC"


def end_departure_wait(run: RunRecord, committed: CheckpointCommitted | None = None,
                       leaving_instance_ids: frozenset[str] = frozenset()) -> str | None:
    """Fail the attempt once its wait for an emergency checkpoint is over (what just happened:
    a checkpoint committed, announced instances leaving, or only time passing; see
    lifecycle.departure_wait_over); None while it goes on or nothing waits. The nodes are read
    only when the run record says the wait may be over: once per departure, not per event."""
    now = _now()
    if not departure_wait_may_end(run, now, committed=committed, leaving=bool(leaving_instance_ids)):
        return None
    nodes = aws().store.nodes(run.run_name)
    report = departure_wait_over(run, nodes, now, committed=committed, leaving_instance_ids=leaving_instance_ids)
    return None if report is None else failure(run, nodes, report)


def instance_gone(run: RunRecord, node: NodeRecord, detail: Ec2InstanceStateChange) -> str:
    """EC2 news about a node the run already retired: only the record follows."""
    if detail.state == "terminated" and node.state is not NodeState.TERMINATED:
        aws().store.transition_node(run.run_name, node.instance_id, NodeState.TERMINATED)
        return "node terminated"
    return "ignored: node already retired"


# --- routing ------------------------------------------------------------------------------

_AGENT_STEPS: dict[type, Callable[[RunRecord, Any], str | None]] = {
    NodeRegistered: node_registered,
    NodeReady: node_ready,
    CheckpointCommitted: checkpoint_committed,
    TrainingProgress: training_progress,
    TrainingCompleted: training_completed,
    FleetChecked: world_checked,
    ScalingChecked: world_checked,
    StateRestored: state_restored,
}
"""What an agent event moves forward; a step's None says the event also reports a failure."""


def _named_nodes(run_name: str, instance_ids: list[str]) -> list[NodeRecord]:
    """The run's records of these instances; an instance without one is none of the run's."""
    found = []
    for instance_id in instance_ids:
        try:
            found.append(aws().store.node(run_name, instance_id))
        except NodeNotFound:
            continue
    return found


def _aws_event_nodes(instance_ids: list[str]) -> list[NodeRecord]:
    """The run nodes of the instances an AWS event names; instances of no run are not ours."""
    found = (aws().store.node_by_instance(instance_id) for instance_id in instance_ids)
    return [node for node in found if node is not None]


def _this_stacks(instance_ids: list[str]) -> list[str]:
    """Those of the instances this stack launched (its tag)."""
    return instances_among(aws().ec2, instance_ids, {"Name": f"tag:{TAG_STACK}", "Values": [aws().settings.stack_name]})


def _recorded_node(run_name: str, instance_id: str | None) -> bool:
    if instance_id is None:
        return False
    try:
        aws().store.node(run_name, instance_id)
    except NodeNotFound:
        return False
    return True


def handle_agent_event(detail: AgentEvent, observed_at: datetime, sender: str | None) -> str:
    try:
        run = aws().store.run(detail.run_name)
    except RunNotFound:
        return "ignored: unknown run"
    if run.state.is_final:
        return "ignored: run finished"
    problem = sender_problem(detail, sender, _recorded_node(run.run_name, sender))
    if problem is not None:
        if sender and aws().store.node_by_instance(sender) is None and _this_stacks([sender]):
            raise NodeNotRecordedYet(f"{sender}: launched by this stack, not recorded by a run yet")
        logger.warning("agent event refused", run_name=detail.run_name, sender=sender, problem=problem)
        return f"ignored: {problem}"
    if is_stale(detail, run.attempt):
        if isinstance(detail, TrainingProgress) and detail.samples:
            # Its steps stay in the run's history (the report's curves); nothing else of it counts.
            aws().store.record_progress(run.run_name, detail.attempt, detail.samples, detail.instance_id)
            return f"steps of attempt {detail.attempt} recorded; it was replaced by {run.attempt}"
        return f"ignored: attempt {detail.attempt} was replaced by {run.attempt}"
    step = _AGENT_STEPS.get(type(detail))
    outcome = step(run, detail) if step is not None else None
    if outcome is not None:
        return outcome
    report = classify_event(detail, run.attempt, observed_at)
    if report is None:
        return "ignored: no failure"
    return report_failure(run, report)


def report_failure(run: RunRecord, report: FailureReport) -> str:
    """An agent's failure report acted on, unless the nodes it blames are retired already."""
    # Only the nodes the report names are read: a crash of the world names none, and each
    # survivor's agent reports it.
    named = _named_nodes(run.run_name, report.instance_ids)
    retired = {node.instance_id for node in named if node.state.is_retired}
    if report.instance_ids and set(report.instance_ids) <= retired:
        return "ignored: node already retired"
    return failure(run, [node for node in named if node.instance_id not in retired], report)


def handle_aws_event(detail: Any, observed_at: datetime) -> str:
    outcomes = []
    by_run: dict[str, list[NodeRecord]] = {}
    named = detail.instance_ids if isinstance(detail, HealthEvent) else [detail.instance_id]
    nodes = _aws_event_nodes(named)
    if not nodes and named and (unrecorded := _this_stacks(named)):
        raise NodeNotRecordedYet(f"{', '.join(unrecorded)}: launched by this stack, not recorded by a run yet")
    for node in nodes:
        by_run.setdefault(node.run_name, []).append(node)
    for run_name, named in by_run.items():
        run = aws().store.run(run_name)
        live = [node for node in named if not node.state.is_retired]
        if run.state.is_final or not live:
            outcomes += [instance_gone(run, node, detail) if isinstance(detail, Ec2InstanceStateChange)
                         else "ignored: node already retired" for node in named]
            continue
        report = classify_event(detail, run.attempt, observed_at)
        if report is None:
            outcomes.append("ignored: no failure")
            continue
        # Only the run's own, still live nodes are blamed (a Health event may name others too).
        live_ids = {node.instance_id for node in live}
        report = report.model_copy(update={"instance_ids": [i for i in report.instance_ids if i in live_ids]})
        if checkpoint_before_leaving(detail):
            outcomes.append(departure_notice(run, live, report, departure_due_at(detail, observed_at)))
            continue
        # A node leaving after its departure was announced ends the wait: the failure is the
        # announced one.
        announced_leaving = (isinstance(detail, Ec2InstanceStateChange)
                             and any(node.departure_noticed_at for node in live))
        departure = end_departure_wait(run, leaving_instance_ids=frozenset(live_ids)) if announced_leaving else None
        outcomes.append(departure or failure(run, live, report))
        if isinstance(detail, Ec2InstanceStateChange) and detail.state == "terminated":
            for node in live:
                aws().store.transition_node(run.run_name, node.instance_id, NodeState.TERMINATED)
    return "; ".join(outcomes) or "ignored: no instance of a run"


def process_event(event: dict[str, Any]) -> dict[str, str]:
    """Act on one EventBridge event; the outcome says what it changed (or why nothing)."""
    envelope = parse_event(event)
    detail = envelope.detail
    if isinstance(detail, AgentEvent):
        outcome = handle_agent_event(detail, envelope.time, envelope.sender)
    else:
        outcome = handle_aws_event(detail, envelope.time)
    metrics.add_metric(name="EventsIgnored" if outcome.startswith("ignored") else "EventsActedOn",
                       unit=MetricUnit.Count, value=1)
    logger.info("event handled", event_id=envelope.id, detail_type=envelope.detail_type.value, outcome=outcome)
    return {"event_id": envelope.id, "outcome": outcome}


@cache
def _idempotent_process(cloud: Aws) -> tuple[IdempotencyConfig, Callable[..., dict[str, str]]]:
    config = IdempotencyConfig(event_key_jmespath="id", expires_after_seconds=24 * 3600)
    persistence = DynamoDBPersistenceLayer(table_name=cloud.idempotency_table, boto3_client=cloud.dynamodb)
    return config, idempotent_function(data_keyword_argument="event", config=config,
                                       persistence_store=persistence)(process_event)


def idempotent_processing(context: LambdaContext) -> Callable[..., dict[str, str]]:
    """process_event, idempotent on the event id, for this invocation (Powertools reads its
    remaining time: a record left in progress by an invocation that timed out expires with it)."""
    config, process = _idempotent_process(aws())
    config.register_lambda_context(context)
    return process


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, str]:
    return idempotent_processing(context)(event=event)
