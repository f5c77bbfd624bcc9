"""The recovery decision: restart, replace, shrink or give up; the budget, the crash loop, backoff.

decide_recovery() works in numbered steps, each a rule a person can check:
    1. a config error never heals, nor does node software that does not install (several nodes
       failing at the same bootstrap step; one is a sick node, replaced in 6), nor a fleet of which
       no node ever reported (its network, its image), nor a world that does not scale; a
       Capacity Block that ends has nothing left to run on: give up;
    2. the cost ceiling is reached: give up;
    3. the restart budget of the window is spent, or capacity has been short longer than the
       run waits for it: give up;
    4. a crash loop (the same failure K times in a row on the same nodes or none, no checkpoint
       in between): give up;
    5. no node is blamed: restart on the same nodes;
       (5 and 6 resume from the nodes' in-memory checkpoints unless a lost node's buddy is lost
       too: memory_restore; the nodes whose trainers live keep them where they can, after a
       crash in 5 and in 6: repair_in_place);
    6. blamed workers (and any AWS announced leaving) are covered by healthy spares and/or new
       instances: replace (at once on the first failure of a streak: the nodes that failed are gone);
    7. capacity ran out and the run may shrink: re-plan pp x dp on the nodes left (workers it
       leaves out become spares up to the spare count, the rest are terminated), or give up;
    8. capacity came back to a run that shrank: READY spares join and pp x dp is re-planned
       for the planned size (lifecycle.growth).
"""

from datetime import datetime, timedelta

from trainfleet.core.events import failed_boot_step
from trainfleet.core.lifecycle.goodput import over_cost_ceiling
from trainfleet.core.lifecycle.growth import grown_plan
from trainfleet.core.lifecycle.launch import rank_order
from trainfleet.core.lifecycle.replan import plan_layout
from trainfleet.core.records import (FailureClass, FailureRecord, FailureReport, NodeRecord, NodeRole, NodeState,
                                     ParallelPlan, RecoveryAction, RecoveryDecision, RecoveryKind, RunRecord,
                                     WorldRepair)
from trainfleet.core.runspec import RecoveryPolicy, RunSpec

FAILURES_KEPT = 50
"""The newest failures a run record keeps beside those the recovery rules count (kept_failures)."""
MESSAGE_KEPT_CHARS = 600
"""How much of a failure's message its record keeps: its start (what was raised) and its end."""
IDS_KEPT = 16
"""How many of the nodes a failure blamed its record keeps (the count is kept whole): 50 failures
naming 128 nodes each made a run record of 272 KB. The crash-loop rule compares the kept ones."""

# AWS announces these; they say nothing about the job.
ANNOUNCED_BY_AWS = frozenset({FailureClass.SPOT_INTERRUPTION, FailureClass.SPOT_REBALANCE,
                              FailureClass.HEALTH_EVENT})
# Nor do these: they never spend the restart budget nor make a crash loop.
NOT_THE_JOBS = ANNOUNCED_BY_AWS | {FailureClass.CAPACITY, FailureClass.CAPACITY_RETURNED}


BOOT_FAILURES_TO_GIVE_UP = 3
"""Nodes that failed at the same bootstrap step (every try) within the restart window before the
run gives up: one is a sick node (a disk, a network blip longer than its retries) and is
replaced; software that does not install fails alike on all, so three say that, whatever the
fleet's size."""


def failed_at_boot_step(nodes: list[NodeRecord], failure: FailureReport, since: datetime) -> list[str]:
    """The nodes that failed at the bootstrap step `failure` names (its own and those recorded so,
    since `since`), sorted; none when it names no step."""
    step = failed_boot_step(failure.message)
    if step is None:
        return []
    failed = {node.instance_id for node in nodes if node.failure_class is FailureClass.BOOT_FAILED
              and failed_boot_step(node.reason or "") == step and (node.updated_at is None or node.updated_at >= since)}
    return sorted(failed | set(failure.instance_ids))


def failure_streak(history: list[FailureRecord], failure_class: FailureClass, resume_step: int | None,
                   same_nodes_as: list[str] | None = None) -> int:
    """How many failures in a row, counting this one, share its class and made no progress; with
    `same_nodes_as` (the nodes this one blames), only those that blamed some of them, or, like
    it, none."""
    streak = 1
    for past in reversed(history):
        if past.failure_class != failure_class or past.resume_step != resume_step:
            break
        if same_nodes_as is not None:
            related = set(past.instance_ids) & set(same_nodes_as) if same_nodes_as else not past.instance_ids
            if not related:
                break
        streak += 1
    return streak


def restarts_in_window(history: list[FailureRecord], now: datetime, window: timedelta) -> int:
    """Recoveries the budget counts in the window up to `now`: those from failures the job may cause."""
    return sum(1 for past in history if past.at > now - window and past.failure_class not in NOT_THE_JOBS)


def capacity_wait(history: list[FailureRecord], now: datetime) -> timedelta:
    """How long capacity has been short: since the first of the capacity failures the history
    ends with (zero when it ends with none)."""
    first = None
    for past in reversed(history):
        if past.failure_class is not FailureClass.CAPACITY:
            break
        first = past.at
    return now - first if first else timedelta(0)


def backoff_seconds(policy: RecoveryPolicy, streak: int, jitter_draw: float) -> float:
    """Wait before retry number `streak` (1 = first) of a streak; jitter_draw in [0, 1) from the caller.

    Exponential, capped, and shortened by up to `backoff_jitter` of itself so that many runs
    hit by the same outage do not retry in lockstep.
    """
    if not 0 <= jitter_draw < 1:
        raise ValueError(f"jitter_draw must be in [0, 1), got {jitter_draw}")
    wait = min(policy.backoff_max_seconds,
               policy.backoff_base_seconds * policy.backoff_multiplier ** (streak - 1))
    return wait * (1 - policy.backoff_jitter * jitter_draw)


def _hours_or_seconds(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"


def memory_restore(run: RunRecord, survivors: list[NodeRecord], plan: ParallelPlan | None) -> tuple[bool, str]:
    """Whether the next attempt may resume from the in-memory checkpoints, and why (or why not),
    given the workers that stay in the world.

    Node n's shards are kept on node n and on its buddy node n+1 (mod the world's nodes,
    trainer/memory_checkpoint.py buddy_of), so the copies survive unless a lost node's buddy is
    lost too. Copies are per layout: a re-planned world cannot use them.
    """
    if not run.spec.checkpoint.memory_interval_steps:
        return False, "no in-memory checkpoints: resume from S3"
    if plan is None or plan != run.plan:
        return False, "a new layout: resume from S3"
    if run.last_step is None:
        return False, "no step trained yet, nothing in memory: resume from S3"
    gone = sorted(set(range(plan.nodes)) - {node.node_rank for node in survivors})
    if len(gone) == plan.nodes:
        return False, "no node of the world is left: resume from S3"
    together = [(rank, (rank + 1) % plan.nodes) for rank in gone if (rank + 1) % plan.nodes in gone]
    if together:
        pairs = ", ".join(f"{rank} and {buddy}" for rank, buddy in together)
        return False, f"node ranks {pairs} lost together, a node and its buddy: resume from S3"
    if gone:
        return True, f"node rank(s) {', '.join(map(str, gone))} resume from their buddies' memory, the rest from their own"
    return True, "every node resumes from its own memory"


REPAIR_WAIT_SHARE = 0.75
"""The share of the survivors' repair wait the order may be predicted to take: boots vary."""


def predicted_boot_seconds(nodes: list[NodeRecord], spec: RunSpec) -> float:
    """How long a new instance of this run takes to boot and pass preflight: the slowest its nodes
    took so far (launch to first READY), else the boot timeout (nothing measured: the worst)."""
    booted = [(node.ready_at - node.launched_at).total_seconds() for node in nodes
              if node.ready_at is not None and node.launched_at is not None]
    return max(booted, default=float(spec.recovery.boot_timeout_seconds))


def repair_in_place(run: RunRecord, survivors: list[NodeRecord], trainers_alive: frozenset[str],
                    waited_s: float = 0.0, order_in_s: float = 0.0) -> tuple[WorldRepair | None, str]:
    """Whether the next world may be the failed one repaired in place (trainer/repair.py), and
    why not; given the workers that stay in the world (the lost ones' places are taken, their
    shards come from their buddies' memory: memory_restore said yes), the workers whose trainers
    were seen alive in the failed attempt (their agents' liveness reports), how long ago the
    failure began (`waited_s`) and in how long the order is predicted to reach the survivors
    (`order_in_s`: the backoff, and a replacement's boot where no READY spare steps in).

    The nodes replaced leave with their instances, which Recover terminates before the new world
    forms (a node lost, sick or announced leaving alike); after a crash on nodes that stay, the
    nodes whose trainers ended start new ones into the repaired world. The survivors' trainers
    keep their processes only where each one is alive to receive the order, node rank 0
    survives (it hosts torchrun's rendezvous, which every survivor's torchrun holds on to, and
    the next generation's store), and the order comes well within the time a survivor waits for
    it once its step failed: the trainer's repair wait, the run's start-up timeout, longer than
    its collective timeout (runspec.collective_timeout_order), so a rank held in a collective on
    the lost peer still waits. Past it, the survivors' trainers have ended and the world would
    restart anyway, late."""
    if not run.spec.repairable:
        return None, ""
    if run.first_step_at is None:
        return None, "restart every trainer: the failed world had not trained"
    if not any(node.node_rank == 0 for node in survivors):
        return None, "restart every trainer: node rank 0, which hosts the rendezvous, is not among the survivors"
    silent = sorted(node.instance_id for node in survivors if node.instance_id not in trainers_alive)
    if silent:
        return None, f"restart every trainer: no sign of life from the trainers of {', '.join(silent)}"
    repair_wait = run.spec.recovery.startup_timeout_seconds
    if waited_s + order_in_s > REPAIR_WAIT_SHARE * repair_wait:
        return None, (f"restart every trainer: the order would reach the survivors about {waited_s + order_in_s:.0f} s "
                      f"after the failure ({waited_s:.0f} s so far, {order_in_s:.0f} s to come), past "
                      f"{REPAIR_WAIT_SHARE:.0%} of the {repair_wait} s their trainers wait for it")
    repaired = run.repair
    repair = WorldRepair(generation=repaired.generation + 1 if repaired else 1,
                         launched_attempt=repaired.launched_attempt if repaired else run.attempt,
                         survivor_ids=sorted(node.instance_id for node in survivors))
    return repair, f"repair the world in place (generation {repair.generation}): the survivors keep their trainers"


def decide_recovery(run: RunRecord, nodes: list[NodeRecord], failure: FailureReport,
                    jitter_draw: float, now: datetime,
                    trainers_alive: frozenset[str] = frozenset()) -> RecoveryDecision:
    """What to do about `failure` (classified for the run's current attempt), decided at `now`;
    `trainers_alive`: the workers whose trainers were seen alive in that attempt (repair_in_place)."""
    spec, policy = run.spec, run.spec.recovery
    resume_step = run.latest_checkpoint.step if run.latest_checkpoint else None

    def give_up(reason: str) -> RecoveryDecision:
        return RecoveryDecision(action=RecoveryAction.GIVE_UP, failure_class=failure.failure_class,
                                reason=reason)

    # 1-4: the reasons to stop.
    if failure.failure_class is FailureClass.CONFIG_ERROR:
        return give_up(f"the trainer refused its config: {failure.message}")
    if failure.failure_class is FailureClass.BOOT_FAILED:
        failed = failed_at_boot_step(nodes, failure, now - timedelta(hours=policy.restart_window_hours))
        if len(failed) >= BOOT_FAILURES_TO_GIVE_UP:
            return give_up(f"the node software did not install: {len(failed)} nodes failed at the same step "
                           f"({', '.join(failed)}); last: {failure.message}")
    if failure.failure_class is FailureClass.SETUP_FAILED:
        return give_up(f"the run's set-up failed: {failure.message}")
    if failure.failure_class is FailureClass.POOR_SCALING and not failure.instance_ids:
        # Uniformly poor: no replacement can help. A slow node named is replaced as a sick one is.
        return give_up(f"the fleet does not scale: {failure.message}")
    if failure.failure_class is FailureClass.CAPACITY_BLOCK_END:
        if resume_step is None:
            return give_up(f"{failure.message}; stopped with no checkpoint: start it again on a new block")
        return give_up(f"{failure.message}; stopped with checkpoint step {resume_step}: go on from it on a new "
                       f"block with `trainfleet run start RUNSPEC --run-name NEW_NAME --resume-from {run.run_name}` "
                       "(the RunSpec naming the new block's reservation)")
    if over_cost_ceiling(spec, run.ledger):
        return give_up(f"cost ${run.ledger.cost_usd:,.2f} reached the ceiling ${spec.cost_ceiling_usd:,.2f}")
    window = timedelta(hours=policy.restart_window_hours)
    recent = restarts_in_window(run.failures, now, window)
    if failure.failure_class not in NOT_THE_JOBS and recent >= policy.max_restarts:
        return give_up(f"restart budget spent ({recent} of {policy.max_restarts} in "
                       f"{policy.restart_window_hours:g} h); last: {failure.message}")
    waited = capacity_wait(run.failures, now)
    if failure.failure_class is FailureClass.CAPACITY and waited > timedelta(hours=policy.capacity_wait_hours):
        return give_up(f"capacity short for {_hours_or_seconds(waited.total_seconds())}, longer than the "
                       f"{_hours_or_seconds(policy.capacity_wait_hours * 3600)} the run waits; last: {failure.message}")
    # A loop is the same nodes (or none) failing alike; a replacement failing as the node it
    # replaced did is no loop, but it waits longer before the next try (the streak's backoff).
    looped = failure_streak(run.failures, failure.failure_class, resume_step, same_nodes_as=failure.instance_ids)
    if failure.failure_class not in NOT_THE_JOBS and looped >= policy.crash_loop_repeats:
        return give_up(f"crash loop: {failure.failure_class.value} {looped} times in a row without a "
                       f"new checkpoint; last: {failure.message}")
    streak = failure_streak(run.failures, failure.failure_class, resume_step)

    live = [node for node in nodes if not node.state.is_retired]
    # Nodes AWS announced leaving go with the blamed ones: the world restarts now anyway.
    blamed = set(failure.instance_ids) | {node.instance_id for node in live if node.departure_noticed_at}
    workers = [node for node in live if node.role is NodeRole.WORKER and node.instance_id not in blamed]
    spare_pool = [node for node in live if node.role is NodeRole.SPARE and node.instance_id not in blamed]
    spares = [node for node in spare_pool if node.state is NodeState.READY]  # only these can step in now
    terminate = sorted(node.instance_id for node in live if node.instance_id in blamed)
    plan = run.plan
    needed = plan.nodes if plan else spec.node_count
    missing = max(0, needed - len(workers))
    promote = sorted(node.instance_id for node in spares)[:missing]
    uncovered = missing - len(promote)
    common = dict(failure_class=failure.failure_class, terminate_instance_ids=terminate,
                  promote_spare_ids=promote, backoff_seconds=backoff_seconds(policy, streak, jitter_draw))

    # 8: the spares that came since a shrink join the world.
    if failure.failure_class is FailureClass.CAPACITY_RETURNED:
        grown = grown_plan(run, len(workers) + len(spares))
        if grown is not None and grown.nodes > len(workers):
            promote = sorted(node.instance_id for node in spares)[:grown.nodes - len(workers)]
            refill = max(0, spec.spare_count - (len(spare_pool) - len(promote)))
            return RecoveryDecision(action=RecoveryAction.GROW, plan=grown, allocate_spares=refill,
                                    **{**common, "promote_spare_ids": promote, "backoff_seconds": 0.0,
                                       "restore_from_memory": False},
                                    reason=f"capacity returned: grow to {grown.nodes} nodes at pp={grown.pp} x "
                                           f"dp={grown.dp}; {failure.message}")

    from_memory, restore = memory_restore(run, workers, plan)
    common["restore_from_memory"] = from_memory

    # How long the survivors of a repair have waited for its order, and how long it will take:
    # the backoff, and the boot of a new instance where no READY spare steps in.
    waited = max(0.0, (now - (failure.observed_at or now)).total_seconds())
    order_in = common["backoff_seconds"]

    # 5: nothing to swap. After a crash, the nodes whose trainers live keep them: those whose
    # trainers ended start new ones into the repaired world.
    if not terminate and missing == 0:
        repair, how = (repair_in_place(run, [node for node in workers if node.instance_id in trainers_alive],
                                       trainers_alive, waited, order_in)
                       if from_memory and failure.failure_class is FailureClass.PROCESS_CRASH else (None, ""))
        return RecoveryDecision(action=RecoveryAction.RESTART, plan=plan, repair=repair, **common,
                                reason=f"{failure.failure_class.value} on healthy nodes: restart them, {restore}"
                                       f"{'; ' + how if how else ''}; {failure.message}")

    # 7: allocation already came up short; shrink onto what is there, if allowed.
    if failure.failure_class is FailureClass.CAPACITY and uncovered and spec.min_nodes is not None:
        available = len(workers) + len(spares)
        shrunk = plan_layout(spec.trainer, spec.facts.ranks_per_node, available, spec.min_nodes,
                             preferred_pp=plan.pp if plan else spec.trainer.parallel.pp,
                             memory_gib=spec.facts.memory_per_rank_gib, accelerator=spec.facts.accelerator)
        if shrunk is None:
            return give_up(f"only {available} nodes available and no layout runs on "
                           f"{spec.min_nodes}..{available} of them")
        promote = sorted(node.instance_id for node in spares)[:max(0, shrunk.nodes - len(workers))]
        leaving = [node.instance_id for node in sorted(workers, key=rank_order)[shrunk.nodes:]]
        # Workers the smaller world leaves out become spares, up to the spare count; the rest
        # are terminated rather than kept idle and billed.
        room = max(0, spec.spare_count - (len(spare_pool) - len(promote)))
        demote, trimmed = leaving[:room], leaving[room:]
        return RecoveryDecision(action=RecoveryAction.SHRINK, plan=shrunk, demote_worker_ids=demote,
                                **{**common, "promote_spare_ids": promote, "restore_from_memory": False,
                                   "terminate_instance_ids": sorted([*terminate, *trimmed])},
                                reason=f"capacity short: continue on {shrunk.nodes} nodes at pp={shrunk.pp} "
                                       f"x dp={shrunk.dp}")

    # 6: replace the blamed nodes; spares first, new instances for the rest. The first failure of
    # a streak does not wait: a backoff is for retrying what may fail the same way again, and
    # the nodes it blamed are gone (a replacement failing alike starts the waits).
    spares_left = len(spare_pool) - len(promote)
    refill = 0 if failure.failure_class is FailureClass.CAPACITY else max(0, spec.spare_count - spares_left)
    if streak == 1:
        common["backoff_seconds"] = 0.0
    order_in = common["backoff_seconds"] + (predicted_boot_seconds(nodes, spec) if uncovered else 0.0)
    repair, how = repair_in_place(run, workers, trainers_alive, waited, order_in) if from_memory else (None, "")
    return RecoveryDecision(action=RecoveryAction.REPLACE, plan=plan, allocate_workers=uncovered,
                            allocate_spares=refill, repair=repair, **common,
                            reason=f"{failure.failure_class.value}: replace {len(terminate)} node(s), "
                                   f"{len(promote)} from spares, {uncovered} new, {restore}"
                                   f"{'; ' + how if how else ''}; {failure.message}")


def kept_failures(history: list[FailureRecord], now: datetime, window: timedelta) -> list[FailureRecord]:
    """What a run record keeps of its failures: the newest FAILURES_KEPT, every one the restart
    budget counts in its window, and the first of a capacity shortfall still going on. About 175
    failures filled the 400 KB item before, and the Recover that could not write failed the run."""
    keep = set(range(max(0, len(history) - FAILURES_KEPT), len(history)))
    keep |= {index for index, past in enumerate(history)
             if past.at > now - window and past.failure_class not in NOT_THE_JOBS}
    shortfall = len(history)
    while shortfall > 0 and history[shortfall - 1].failure_class is FailureClass.CAPACITY:
        shortfall -= 1
    keep |= {shortfall} - {len(history)}
    return [history[index] for index in sorted(keep)]


def clipped(message: str) -> str:
    """A message cut to MESSAGE_KEPT_CHARS: its start and its end."""
    if len(message) <= MESSAGE_KEPT_CHARS:
        return message
    half = MESSAGE_KEPT_CHARS // 2
    return f"{message[:half]} ... {message[-half:]}"


def apply_decision(run: RunRecord, failure: FailureReport, decision: RecoveryDecision,
                   now: datetime, kept_on_memory_seconds: float = 0.0) -> RunRecord:
    """The run record after acting on a decision: a new attempt, the failure on the books
    (`kept_on_memory_seconds`: FailureRecord's). A world repaired in place that fails before its
    first step did not come back by the repair: the failure it was to repair is booked as the
    restart it became (the survivors' trainers had ended, or the world did not form): it came back
    as this decision brings it back."""
    kind = (RecoveryKind.GAVE_UP if decision.action is RecoveryAction.GIVE_UP else
            RecoveryKind.REPAIRED if decision.repair else RecoveryKind.RESTARTED)
    earlier = run.failures
    if (run.repair is not None and run.first_step_at is None and earlier
            and earlier[-1].recovery is RecoveryKind.REPAIRED and earlier[-1].attempt == run.attempt - 1):
        undone = earlier[-1].model_copy(update={"recovery": kind, "decision": clipped(
            f"{earlier[-1].decision}; the repair did not take: the repaired world failed before its first "
            f"step ({failure.failure_class.value})")})
        earlier = [*earlier[:-1], undone]
    history = [*earlier, FailureRecord(
        failure_class=failure.failure_class, at=now,
        resume_step=run.latest_checkpoint.step if run.latest_checkpoint else None, attempt=failure.attempt,
        onset_at=failure.observed_at, last_step=run.last_step if run.first_step_at else None,
        instance_ids=failure.instance_ids[:IDS_KEPT], instances_blamed=len(failure.instance_ids),
        first_silent=failure.first_silent, message=clipped(failure.message),
        kept_on_memory_seconds=kept_on_memory_seconds, decision=clipped(decision.reason), recovery=kind)]
    kept = kept_failures(history, now, timedelta(hours=run.spec.recovery.restart_window_hours))
    books = {"failures": kept, "earlier_failures": run.earlier_failures + len(history) - len(kept)}
    if decision.action is RecoveryAction.GIVE_UP:
        return run.model_copy(update={**books, "error": decision.reason})
    return run.model_copy(update={
        **books,
        "attempt": run.attempt + 1,
        "restarts": run.restarts + 1,
        "plan": decision.plan,
        "restore_from_memory": decision.restore_from_memory,
        "repair": decision.repair,
        "waiting": None,
        "attempt_failure": None,
        "attempt_started_at": now,
        "nodes_launched_at": now,
        "first_step_at": None,
        "checkpoint_requested_at": None,
        "departure_noticed_at": None,
        "departure_due_at": None,
        "grow_tried_at": None if decision.action is RecoveryAction.GROW else run.grow_tried_at,
    })
