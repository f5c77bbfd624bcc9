"""Goodput and cost: where the run's time and money went."""

from collections.abc import Iterable
from datetime import datetime

from trainfleet.core.catalogue import instance_facts
from trainfleet.core.records import FailureClass, GoodputLedger, NodeRecord, NodeState, RunRecord
from trainfleet.core.runspec import RunSpec


STARTUP = "startup"
"""Lost cause: attempt 0 from the run's creation to its first step."""
FINISHING = "finishing"
"""Lost cause: a completed run from its final checkpoint or last reported step to Teardown."""


def restart_cause(failure_class: FailureClass | None) -> str:
    """Lost cause: a later attempt from the recovery decision to its first step."""
    return f"restart:{failure_class or FailureClass.UNKNOWN}"


def redone_cause(failure_class: FailureClass | None) -> str:
    """Lost cause: training after the last committed checkpoint of an attempt that failed."""
    return f"redone:{failure_class or FailureClass.UNKNOWN}"


def give_up_cause(failure_class: FailureClass | None) -> str:
    """Lost cause: from the decision to give up to Teardown."""
    return f"give_up:{failure_class or FailureClass.UNKNOWN}"


def settle_attempt(ledger: GoodputLedger, started_at: datetime, first_step_at: datetime | None,
                   last_checkpoint_at: datetime | None, ended_at: datetime, completed: bool, *,
                   startup: str = STARTUP, redone: str = redone_cause(None),
                   last_step_at: datetime | None = None) -> GoodputLedger:
    """Book one attempt, from its start (allocation or restart) to its end, into `booked_until`.

    Start-up until the first step is lost to the cause `startup`. Training is productive up to the
    last checkpoint committed in the attempt; when the attempt completed the run, up to that
    checkpoint (its final one) or its last reported step (`last_step_at`, sampled), whichever is
    later (the end without either), the rest lost to FINISHING. What came after the checkpoint of
    a failed attempt is redone by the next one, lost to `redone`.
    The pieces are cut at times clamped into the attempt, so they add up to its length exactly.
    """
    if ended_at < started_at:
        raise ValueError(f"attempt ends ({ended_at}) before it starts ({started_at})")
    if first_step_at is None:
        return _book(ledger, ended_at, 0.0, {startup: _seconds(started_at, ended_at)})
    first_step_at = min(max(first_step_at, started_at), ended_at)
    checkpointed = last_checkpoint_at if last_checkpoint_at is not None and last_checkpoint_at > first_step_at else None
    if completed:
        seen = [moment for moment in (last_step_at, checkpointed) if moment is not None]
        kept_until, tail_cause = max(seen, default=ended_at), FINISHING
    else:
        kept_until, tail_cause = checkpointed or first_step_at, redone
    kept_until = min(max(kept_until, first_step_at), ended_at)
    return _book(ledger, ended_at, _seconds(first_step_at, kept_until), {
        startup: _seconds(started_at, first_step_at), tail_cause: _seconds(kept_until, ended_at)})


def settle_run_attempt(run: RunRecord, ended_at: datetime, completed: bool,
                       failure_class: FailureClass | None = None, resumed_from_memory: bool = False) -> GoodputLedger:
    """The run's ledger with its current attempt booked (settle_attempt over the record's times),
    `failure_class` being what ended it (None: completed, or an error no recovery classified).

    Attempt 0 starts when the run was recorded, its start-up lost to STARTUP; a later one at its
    recovery decision, its start-up lost to restart_cause of the failure that decision handled
    (the last on the books: this attempt's own is added after it is booked). The latest
    checkpoint counts for this attempt only if it was committed after the attempt's first step
    (settle_attempt's own rule), so an earlier attempt's checkpoint keeps nothing of this one.
    After a give-up (Recover records the failure and its reason as `error`, books the attempt
    and starts the books afresh at the decision) the run only waits for Teardown: all of that is
    lost to give_up_cause, whatever the trainer still reported meanwhile.
    `resumed_from_memory`: the next attempt resumes from the nodes' in-memory checkpoints, a copy
    of at most a step before the last one the control plane heard of: training is kept up to
    that step's report (`last_progress_at`), not the last commit to S3.
    """
    started_at = run.attempt_started_at or run.created_at
    if started_at is None:
        raise ValueError(f"run {run.run_name!r}: attempt {run.attempt} has no start time (attempt_started_at, created_at)")
    handled = run.failures[-1].failure_class if run.failures else None
    if run.error is not None:
        return settle_attempt(run.ledger, started_at, None, None, ended_at, completed, startup=give_up_cause(handled))
    checkpoint = run.latest_checkpoint
    kept_until = checkpoint.committed_at if checkpoint else None
    if resumed_from_memory and run.last_progress_at is not None:
        kept_until = max(kept_until or run.last_progress_at, run.last_progress_at)
    return settle_attempt(run.ledger, started_at, run.first_step_at, kept_until,
                          ended_at, completed, startup=restart_cause(handled) if run.attempt else STARTUP,
                          redone=redone_cause(failure_class), last_step_at=run.last_progress_at)


def take_back(ledger: GoodputLedger, seconds: float, cause: str) -> GoodputLedger:
    """`ledger` with `seconds` of productive time booked lost to `cause` instead: what an attempt
    booked as kept on the promise of an in-memory restore that came from S3 after all."""
    seconds = min(seconds, ledger.productive_seconds)
    by_cause = {**ledger.lost_by_cause, cause: ledger.lost_by_cause.get(cause, 0.0) + seconds}
    return ledger.model_copy(update={"productive_seconds": ledger.productive_seconds - seconds,
                                     "lost_by_cause": by_cause, "lost_seconds": sum(by_cause.values())})


def book_attempt(run: RunRecord, nodes: Iterable[NodeRecord], ended_at: datetime, completed: bool,
                 failure_class: FailureClass | None = None, resumed_from_memory: bool = False) -> GoodputLedger:
    """settle_run_attempt, plus what the attempt's instances cost.

    Each node is paid for from the later of its launch and the attempt's start until the attempt
    ends, or, once terminated, until its record last changed (the termination). The rate is the
    catalogue's on-demand price: an upper bound for Spot and reserved capacity, whose prices the
    catalogue does not know.
    """
    ledger = settle_run_attempt(run, ended_at, completed, failure_class, resumed_from_memory)
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


def unaccounted_seconds(run: RunRecord) -> float:
    """The run's span on the books (its creation to the last booking) less the time the ledger
    accounts for (productive and lost): 0 when every second is booked exactly once, up to float
    rounding; positive when time was skipped, negative when some was booked twice."""
    ledger = run.ledger
    if run.created_at is None:
        raise ValueError(f"run {run.run_name!r} has no creation time")
    span = (ledger.booked_until - run.created_at).total_seconds() if ledger.booked_until else 0.0
    return span - (ledger.productive_seconds + ledger.lost_seconds)


def _book(ledger: GoodputLedger, ended_at: datetime, productive: float, lost: dict[str, float]) -> GoodputLedger:
    """`ledger` plus an attempt's productive and lost seconds, booked until `ended_at`."""
    by_cause = dict(ledger.lost_by_cause)
    for cause, seconds in lost.items():
        if seconds:
            by_cause[cause] = by_cause.get(cause, 0.0) + seconds
    return ledger.model_copy(update={
        "productive_seconds": ledger.productive_seconds + productive,
        "lost_by_cause": by_cause, "lost_seconds": sum(by_cause.values()), "booked_until": ended_at})


def _seconds(start: datetime, end: datetime) -> float:
    return max(0.0, (end - start).total_seconds())
