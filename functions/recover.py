"""Recover: classify the failure, decide restart / replace / shrink / give up, act on it.

1. Classify what the Catch caught: a FailureReport sent by the event handler, or a task timeout
   (boot or heartbeat, told apart by what the run was waiting for), as a failure of the attempt
   the state's input names. The input is the same for every retry of an invocation, so the
   retry classifies the same failure of the same attempt, whatever the first try recorded.
   A boot timeout after which not one node of the attempt ever reported is the run's set-up
   failing (its network, its image: SETUP_FAILED), given up at once in step 2.
   A crash or hang that names no node is checked against the nodes' liveness records and
   EC2's instance status first: the workers that failed silently are named, and replaced; a
   hang's first sign is the world's last step there, and a node named the first to fall silent
   in an earlier hang too is replaced.
2. Decide, and record the decision before acting on it: the ended attempt's time on the goodput
   ledger, a new attempt, the failure on the books, the blamed nodes TERMINATING, promoted spares
   made workers. Giving up raises RecoveryGaveUp, which the state machine sends to Teardown.
3. Act on the records, not on the decision, so a retried invocation (which finds the attempt
   already advanced and skips step 2) does the same: terminate the nodes the event handler
   marked UNHEALTHY and those marked TERMINATING (recorded first), confirm the survivors of a
   world repaired in place for the new attempt (their trainers were seen alive) and the READY
   spares stepping into it whose agents reported lately, launch what the plan and the
   spare count miss beside the nodes of earlier attempts, in the run's zone and placement group:
   a retry that finds part of this attempt's launch recorded asks EC2 the same again and gets
   the same instances back. Too few replacements raise CapacityUnavailable carrying a CAPACITY
   report of the new attempt: the state machine retries, then catches it back into Recover,
   where step 2 shrinks the plan onto the nodes there are (min_nodes set; workers it leaves out
   become spares) or decides again by the usual rules, which the restart budget and the
   crash-loop rule bound.
4. Hand the backoff to the state machine's Wait.
"""

import math
import random
from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import (CaughtError, RecoveryStep, RunPayload, aws, capacity_unavailable, confirm_ready,
                              fleet_token_prefix, logger, mark_terminating, metrics, record_nodes, swap_roles,
                              tracer, transient_errors_named)
from functions.errors import RecoveryGaveUp
from trainfleet.adapters.checkpoints import resume_checkpoint
from trainfleet.adapters.ec2_fleet import FleetError, allocate, terminate
from trainfleet.adapters.liveness import instance_troubles, read_liveness
from trainfleet.adapters.metrics import detection_metrics, emit
from trainfleet.core.lifecycle import (agents_alive, apply_decision, blame_silent_workers, book_attempt,
                                       classify_task_error, decide_recovery, hang_onset, needs_liveness_look,
                                       trainers_alive, unready_workers, world_workers)
from trainfleet.core.records import (FailureClass, FailureReport, NodeLiveness, NodeRecord, NodeRole, NodeState,
                                     RecoveryAction, RecoveryDecision, RunRecord, RunRef, RunState, TaskWait)

QUOTA_HELD_CODES = frozenset({"VcpuLimitExceeded"})
"""EC2 refusals of a replacement that instances still shutting down may cause: retried, as a
shortfall of capacity (at Allocate, nothing is shutting down: there it is the account's quota)."""


def liveness(run_name: str, nodes: list[NodeRecord]) -> list[NodeLiveness]:
    """The nodes' newest liveness records (each keyed by its instance's ARN)."""
    cloud = aws()
    return read_liveness(cloud.dynamodb, cloud.settings.liveness_table, run_name,
                         [cloud.instance_arn(node.instance_id) for node in nodes])


def classify(run: RunRecord, nodes: list[NodeRecord], caught: CaughtError, attempt: int) -> FailureReport:
    """Step 1, for the caught task's `attempt`. A timeout leaves the token parked, so `waiting`
    says which wait timed out; once a decision moved the run on, the attempt is decided and
    what stands in for the wait no longer matters."""
    waiting = run.waiting if run.waiting and run.waiting.attempt == attempt else TaskWait(
        purpose="train" if run.state is RunState.TRAINING else "await_nodes", attempt=attempt, token="(answered)")
    return classify_task_error(caught.Error, caught.Cause, waiting, nodes)


def name_silent_workers(run: RunRecord, nodes: list[NodeRecord], failure: FailureReport) -> FailureReport:
    """Step 1, continued: a crash or a hang that no event pinned on a node names the workers that
    went silent or left (EC2 reports the instance leaving or its status checks impaired, an agent
    that stopped reporting, a trainer that never joined or fell behind), so they are replaced now
    rather than failing every restart. A peer's crash reaches the survivors' agents, which report
    it at once; the lost instance's state tells Recover whose loss it was, also where EC2's event
    came after the crash and retired the node before this look (lifecycle.world_workers)."""
    if not needs_liveness_look(failure):
        return failure
    cloud = aws()
    workers = [node.instance_id for node in world_workers(nodes, failure.attempt)]
    troubles = instance_troubles(cloud.ec2, workers) if workers else {}
    records = liveness(run.run_name, nodes)
    named = blame_silent_workers(failure, nodes, records, datetime.now(timezone.utc),
                                 run.spec.recovery.hang_timeout_seconds, troubles)
    return hang_onset(named, records, nodes, run.plan.ranks_per_node if run.plan else 1, run.failures)


def decide_and_record(run: RunRecord, nodes: list[NodeRecord], failure: FailureReport) -> RecoveryDecision:
    """Step 2."""
    cloud, name = aws(), run.run_name
    now = datetime.now(timezone.utc)
    # The newest commit in S3 is where the next attempt resumes (Launch reads it again): a node
    # lost before its agent announced a commit leaves the run record a checkpoint behind, and the
    # failure, the crash-loop rule and the time lost would be judged against an older one.
    newest = resume_checkpoint(cloud.s3, run.spec)
    run = run.knowing(newest)
    # The cost ceiling is judged with the ended attempt on the books (its cost does not depend on
    # where the next attempt resumes from; which of its time is kept does).
    booked = run.model_copy(update={"ledger": book_attempt(run, nodes, now, False, failure.failure_class)})
    alive = trainers_alive(nodes, liveness(name, nodes), run.attempt, now,
                           run.spec.recovery.hang_timeout_seconds) if run.spec.repairable else frozenset()
    decision = decide_recovery(booked, nodes, failure, jitter_draw=random.random(), now=now, trainers_alive=alive)
    # The attempt is booked in the same write as the decision, so a retry books it once. A give-up
    # starts the books afresh too, so Teardown adds only the time after it.
    def record(current: RunRecord) -> RunRecord:
        current = current.knowing(newest)
        ledger = book_attempt(current, nodes, now, False, failure.failure_class, decision.restore_from_memory)
        kept_on_memory = ledger.productive_seconds - book_attempt(current, nodes, now, False,
                                                                  failure.failure_class).productive_seconds
        return apply_decision(current, failure, decision, now, kept_on_memory).model_copy(update={
            "state": RunState.RECOVERING, "ledger": ledger, "attempt_started_at": now, "first_step_at": None})

    recorded = cloud.store.modify_run(name, record)
    logger.info("recovery decided", run_name=name, decision=decision.model_dump(mode="json"))
    detected = recorded.failures[-1]
    if detected.detection_seconds is not None:
        emit(detection_metrics(name, detected, cloud.settings.metrics_namespace))
    if decision.action is RecoveryAction.GIVE_UP:
        raise RecoveryGaveUp(decision.reason)
    for instance_id in decision.terminate_instance_ids:
        mark_terminating(name, instance_id, failure_class=failure.failure_class, reason=failure.message)
    swap_roles(name, decision.promote_spare_ids, decision.demote_worker_ids)
    return decision


def act(run: RunRecord) -> int:
    """Step 3; the number of instances launched."""
    cloud, name, spec = aws(), run.run_name, run.spec
    for node in cloud.store.nodes(name):
        if node.state is NodeState.UNHEALTHY:
            mark_terminating(name, node.instance_id)
    nodes = cloud.store.nodes(name)
    terminate(cloud.ec2, [node.instance_id for node in nodes if node.state is NodeState.TERMINATING])
    if run.repair:
        # The survivors' trainers were seen alive (the repair's condition) and keep running, and a
        # READY spare stepping in whose agent reported lately reads the launch spec every second
        # (node/spare.py): the new attempt waits on none of their looks.
        alive = agents_alive(nodes, liveness(name, nodes), datetime.now(timezone.utc),
                             spec.recovery.hang_timeout_seconds)
        spares_in = [node.instance_id for node in nodes
                     if node.role is NodeRole.WORKER and node.state is NodeState.READY
                     and node.instance_id in alive and node.instance_id not in run.repair.survivor_ids]
        for instance_id in [*run.repair.survivor_ids, *spares_in]:
            confirm_ready(name, instance_id, run.attempt)
    # What this attempt launched is left out of the count: a retry that finds some of it recorded
    # sends EC2 the request the first try sent, under the same ClientToken, and gets the same
    # instances back (EC2 refuses that token with another request: IdempotentParameterMismatch).
    kept = [node for node in nodes if not node.state.is_retired and node.attempt < run.attempt]
    missing_workers = max(0, run.plan.nodes - sum(node.role is NodeRole.WORKER for node in kept))
    missing_spares = max(0, spec.spare_count - sum(node.role is NodeRole.SPARE for node in kept))
    if missing_workers + missing_spares == 0:
        return 0
    try:
        allocation = allocate(cloud.ec2, spec, cloud.settings.stack_name, run.launch_template_id, [run.subnet_id],
                              target=missing_workers + missing_spares, minimum=max(1, missing_workers),
                              token_prefix=fleet_token_prefix(run))
    except FleetError as refused:
        if not refused.codes or not refused.codes <= QUOTA_HELD_CODES:
            raise
        # The instances just terminated still hold their vCPUs while they shut down (minutes
        # for p4d and p5): a shortfall that passes, waited for as capacity is.
        raise capacity_unavailable(name, FailureReport(
            failure_class=FailureClass.CAPACITY, attempt=run.attempt, message=str(refused)).model_dump_json())
    if len(allocation.instance_ids) < missing_workers:
        # The report names this attempt, so the Recover that catches it decides once (shrink or
        # give up) and a retry of that Recover carries on instead of deciding again.
        raise capacity_unavailable(name, FailureReport(
            failure_class=FailureClass.CAPACITY, attempt=run.attempt,
            message=f"{missing_workers} replacement(s) needed in {run.subnet_id}: "
                    + ("; ".join(allocation.errors) or "none launched")).model_dump_json())
    record_nodes(spec, run.attempt, allocation, missing_workers)
    recorded_before = {node.instance_id for node in nodes}
    return sum(instance_id not in recorded_before for instance_id in allocation.instance_ids)


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=RunPayload)
def handler(event: RunPayload, context: LambdaContext) -> dict[str, Any]:
    store, name = aws().store, event.run.run_name
    if event.failure is None:
        raise ValueError("Recover needs the caught error in $.failure")
    run, nodes = store.run(name), store.nodes(name)
    failure = classify(run, nodes, event.failure, event.run.attempt)
    if failure.attempt == run.attempt:
        failure = name_silent_workers(run, nodes, failure)
        decision = decide_and_record(run, nodes, failure)
        step = RecoveryStep(action=decision.action, reason=decision.reason,
                            backoff_seconds=math.ceil(decision.backoff_seconds))
    else:
        step = RecoveryStep(reason=f"continuing the recovery into attempt {run.attempt}", backoff_seconds=0)
    launched = act(store.run(name))
    metrics.add_metric(name="Recoveries", unit=MetricUnit.Count, value=1)
    metrics.add_metric(name="InstancesLaunched", unit=MetricUnit.Count, value=launched)
    attempt = store.run(name).attempt
    return RunPayload(run=RunRef(run_name=name, attempt=attempt), timeouts=event.timeouts,
                      recovery=step).to_state()
