"""Goodput and cost: where the run's time and money went."""

from collections.abc import Iterable
from datetime import datetime

from trainfleet.catalogue import instance_facts
from trainfleet.contracts import GoodputLedger, NodeRecord, NodeState, RunRecord, RunSpec


def settle_attempt(ledger: GoodputLedger, started_at: datetime, first_step_at: datetime | None,
                   last_checkpoint_at: datetime | None, ended_at: datetime, completed: bool) -> GoodputLedger:
    """Book one attempt, from its start (allocation or restart) to its end.

    Start-up until the first step is lost time. Training is productive up to the last checkpoint
    committed in the attempt, or to the end when the attempt completed the run; what came after
    the checkpoint of a failed attempt is redone by the next one, so it is lost.
    """
    if ended_at < started_at:
        raise ValueError(f"attempt ends ({ended_at}) before it starts ({started_at})")
    if first_step_at is None:
        return ledger.model_copy(update={"lost_seconds": ledger.lost_seconds + _seconds(started_at, ended_at)})
    startup = _seconds(started_at, first_step_at)
    if completed:
        kept_until = ended_at
    elif last_checkpoint_at is not None and last_checkpoint_at > first_step_at:
        kept_until = min(last_checkpoint_at, ended_at)
    else:
        kept_until = first_step_at
    productive = _seconds(first_step_at, kept_until)
    redone = _seconds(kept_until, ended_at)
    return ledger.model_copy(update={
        "productive_seconds": ledger.productive_seconds + productive,
        "lost_seconds": ledger.lost_seconds + startup + redone,
    })


def settle_run_attempt(run: RunRecord, ended_at: datetime, completed: bool) -> GoodputLedger:
    """The run's ledger with its current attempt booked (settle_attempt over the record's times).

    Attempt 0 starts when the run was recorded. The latest checkpoint counts for this attempt
    only if it was committed after the attempt's first step (settle_attempt's own rule), so an
    earlier attempt's checkpoint keeps nothing of this one.
    """
    started_at = run.attempt_started_at or run.created_at
    if started_at is None:
        raise ValueError(f"run {run.run_name!r}: attempt {run.attempt} has no start time (attempt_started_at, created_at)")
    checkpoint = run.latest_checkpoint
    return settle_attempt(run.ledger, started_at, run.first_step_at, checkpoint.committed_at if checkpoint else None,
                          ended_at, completed)


def book_attempt(run: RunRecord, nodes: Iterable[NodeRecord], ended_at: datetime, completed: bool) -> GoodputLedger:
    """settle_run_attempt, plus what the attempt's instances cost.

    Each node is paid for from the later of its launch and the attempt's start until the attempt
    ends, or, once terminated, until its record last changed (the termination). The rate is the
    catalogue's on-demand price: an upper bound for Spot and reserved capacity, whose prices the
    catalogue does not know.
    """
    ledger = settle_run_attempt(run, ended_at, completed)
    started_at = run.attempt_started_at or run.created_at
    usd_per_hour = instance_facts(run.spec.instance_type).on_demand_usd_per_hour
    for node in nodes:
        paid_from = max(started_at, node.launched_at or started_at)
        paid_until = min(ended_at, node.updated_at or ended_at) if node.state is NodeState.TERMINATED else ended_at
        ledger = accrue_cost(ledger, 1, usd_per_hour, _seconds(paid_from, paid_until))
    return ledger


def accrue_cost(ledger: GoodputLedger, node_count: int, usd_per_hour: float, seconds: float) -> GoodputLedger:
    """Book `node_count` instances (spares included) running for `seconds`."""
    if node_count < 0 or seconds < 0:
        raise ValueError(f"node_count and seconds must be >= 0, got {node_count}, {seconds}")
    node_seconds = node_count * seconds
    return ledger.model_copy(update={
        "node_seconds": ledger.node_seconds + node_seconds,
        "cost_usd": ledger.cost_usd + node_seconds / 3600 * usd_per_hour,
    })


def over_cost_ceiling(spec: RunSpec, ledger: GoodputLedger) -> bool:
    """Whether the run has spent its cost ceiling (never, without one)."""
    return spec.cost_ceiling_usd is not None and ledger.cost_usd >= spec.cost_ceiling_usd


def _seconds(start: datetime, end: datetime) -> float:
    return max(0.0, (end - start).total_seconds())
