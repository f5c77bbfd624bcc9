"""Lifecycle core: the control plane's decisions as pure functions over plain data (no boto3).

Offers:
    classify:  sender_problem(detail, sender, sender_is_runs_node), is_stale(detail, attempt),
               classify_event(detail, attempt, observed_at) -> FailureReport | None,
               classify_task_error(error, cause, waiting, nodes) -> FailureReport
    replan:    plan_layout(trainer_config, ranks_per_node, available_nodes, min_nodes, preferred_pp, memory_gib),
               initial_plan(spec, allocated_nodes)
    recovery:  decide_recovery(run, nodes, failure, jitter_draw, now, trainers_alive) -> RecoveryDecision,
               memory_restore(run, survivors, plan) -> (from memory?, why),
               repair_in_place(run, survivors, trainers_alive) -> (WorldRepair | None, why),
               apply_decision(run, failure, decision, now, kept_on_memory_seconds) -> RunRecord,
               failure_streak(history, failure_class, resume_step), backoff_seconds(policy, streak, draw),
               ANNOUNCED_BY_AWS
    goodput:   settle_attempt(ledger, started_at, first_step_at, last_checkpoint_at, ended_at, completed, ...),
               settle_run_attempt(run, ended_at, completed, failure_class, resumed_from_memory),
               book_attempt(run, nodes, ended_at, completed, failure_class, resumed_from_memory),
               take_back(ledger, seconds, cause), redone_cause(failure_class), unaccounted_seconds(run),
               accrue_cost(ledger, node_count, usd_per_hour, seconds), over_cost_ceiling(spec, ledger)
    spot:      checkpoint_before_leaving(detail), waits_for_emergency_checkpoint(run, node),
               departure_due_at(detail, observed_at), emergency_checkpoint_due(due_at, now),
               emergency_checkpoint_now(run, now), DEFERRED_LEAD, departure_wait_may_end(run, now, ...),
               departure_wait_over(run, nodes, now, ...) -> FailureReport | None, SPOT_NOTICE,
               checkpoint_request_answered(run, attempt)
    growth:    missing_nodes(run), spares_to_launch(run, nodes, now), may_grow(run, nodes),
               growth_report(run, step), grown_plan(run, available), GROW_RETRY
    reservation: Reservation, reservation_problem(spec, reservation, now), block_end_due(run, now),
               block_end_report(run, worker_ids), BLOCK_TERMINATION_LEAD
    spares:    swap_late_workers(nodes, attempt) -> LateWorkerSwap
    launch:    new_node_records(spec, attempt, instance_ids, workers_wanted, zone, subnet_id),
               confirmed(node, attempt), ready_workers(nodes, attempt), unready_workers(nodes, attempt),
               silent_fleet(nodes),
               world_complete(nodes, plan, attempt), world_attempt(node), may_start(run, ready_workers),
               assign_ranks(nodes, plan, attempt),
               build_launch_spec(run, nodes, heartbeat_task_token) -> LaunchSpec
    liveness:  poll_interval(nodes, draw, hang_timeout_s), looks_per_second(nodes, hang_timeout_s),
               silent_after(nodes, hang_timeout_s) (trainfleet.core.pace's rules),
               world_workers(nodes, attempt),
               silent_workers(nodes, liveness, attempt, now, hang_timeout_s, ec2_troubles),
               trainers_alive(nodes, liveness, attempt, now, hang_timeout_s),
               agents_alive(nodes, liveness, now, hang_timeout_s),
               blame_silent_workers(failure, ...) -> FailureReport, needs_liveness_look(failure), IMPAIRED,
               first_silent(liveness, attempt),
               hang_onset(failure, liveness, nodes, ranks_per_node, history) -> FailureReport

Randomness (backoff jitter) and time come in as arguments, so every decision is reproducible.
"""

from trainfleet.core.lifecycle.classify import classify_event, classify_task_error, is_stale, sender_problem
from trainfleet.core.lifecycle.goodput import (accrue_cost, book_attempt, over_cost_ceiling, redone_cause,
                                               settle_attempt, settle_run_attempt, take_back, unaccounted_seconds)
from trainfleet.core.lifecycle.growth import (GROW_RETRY, grown_plan, growth_report, may_grow, missing_nodes,
                                              spares_to_launch)
from trainfleet.core.lifecycle.launch import (assign_ranks, build_launch_spec, confirmed, may_start, new_node_records,
                                              ready_workers, silent_fleet, unready_workers, world_attempt,
                                              world_complete)
from trainfleet.core.lifecycle.liveness import (IMPAIRED, agents_alive, blame_silent_workers, first_silent,
                                                hang_onset, looks_per_second, needs_liveness_look, poll_interval,
                                                silent_after, silent_workers, trainers_alive, world_workers)
from trainfleet.core.lifecycle.recovery import (ANNOUNCED_BY_AWS, apply_decision, backoff_seconds, decide_recovery,
                                                failure_streak, memory_restore, repair_in_place)
from trainfleet.core.lifecycle.replan import initial_plan, plan_layout
from trainfleet.core.lifecycle.reservation import (BLOCK_TERMINATION_LEAD, Reservation, block_end_due, block_end_report,
                                                   reservation_problem)
from trainfleet.core.lifecycle.spares import swap_late_workers
from trainfleet.core.lifecycle.spot import (DEFERRED_LEAD, SPOT_NOTICE, checkpoint_before_leaving,
                                            checkpoint_request_answered, departure_due_at, departure_wait_may_end,
                                            departure_wait_over, emergency_checkpoint_due, emergency_checkpoint_now,
                                            waits_for_emergency_checkpoint)

__all__ = [
    "classify_event", "classify_task_error", "is_stale", "sender_problem",
    "plan_layout", "initial_plan",
    "decide_recovery", "apply_decision", "failure_streak", "backoff_seconds", "ANNOUNCED_BY_AWS", "memory_restore",
    "repair_in_place",
    "settle_attempt", "settle_run_attempt", "book_attempt", "unaccounted_seconds", "accrue_cost", "take_back",
    "redone_cause",
    "over_cost_ceiling",
    "checkpoint_before_leaving", "waits_for_emergency_checkpoint", "departure_wait_may_end", "departure_wait_over",
    "departure_due_at", "emergency_checkpoint_due", "emergency_checkpoint_now", "DEFERRED_LEAD", "SPOT_NOTICE",
    "checkpoint_request_answered",
    "missing_nodes", "spares_to_launch", "may_grow", "growth_report", "grown_plan", "GROW_RETRY",
    "Reservation", "reservation_problem", "block_end_due", "block_end_report", "BLOCK_TERMINATION_LEAD",
    "new_node_records", "confirmed", "ready_workers", "unready_workers", "silent_fleet", "world_complete",
    "world_attempt",
    "may_start", "assign_ranks",
    "build_launch_spec", "swap_late_workers",
    "poll_interval", "looks_per_second", "silent_after", "silent_workers", "trainers_alive", "agents_alive",
    "blame_silent_workers", "first_silent", "hang_onset", "world_workers",
    "needs_liveness_look", "IMPAIRED",
]
