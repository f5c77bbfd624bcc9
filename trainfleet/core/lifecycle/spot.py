"""Announced departures: checkpoint before the node goes, then replace it.

AWS announces some departures ahead: a Spot interruption warning (two minutes), a rebalance
recommendation (elevated risk of interruption, no date), a scheduled retirement (an AWS Health
event of category scheduledChange, dated by its startTime, often weeks ahead). For a worker of a
world that is training none of them fails the attempt at once. The node is marked leaving, with
the time it goes where AWS gave one (departure_due_at), and the run trains on:

- a departure due within DEFERRED_LEAD (a Spot warning always) asks every agent for a checkpoint
  now (RunRecord.checkpoint_requested_at; a request on any rank is a request on all), and the
  wait ends when that checkpoint commits;
- a later one (a rebalance, a retirement days away) waits for the next interval checkpoint and
  swaps the node then: restarting the world at once would throw away the steps since the last
  checkpoint for a node that may have weeks left. Should its time come within DEFERRED_LEAD
  first, the emergency checkpoint is asked for then (emergency_checkpoint_due, judged at each
  progress event).

The wait also ends, whatever was asked, when EC2 reports the instance leaving, or two minutes
(SPOT_NOTICE) after the emergency checkpoint was asked for; the heartbeat timeout still bounds a
world that hangs meanwhile. The attempt then fails with the first announcement's class
(SPOT_INTERRUPTION, SPOT_REBALANCE or HEALTH_EVENT) naming the leaving nodes; should it fail
for another reason first, the recovery replaces the leaving nodes with the blamed ones.

The requested checkpoint is told from the others by the reason its commit marker records
(`CheckpointCommitted.reason`): once an emergency checkpoint was asked for, an interval or final
checkpoint committing first does not end the wait, whatever its step.
"""

from datetime import datetime, timedelta

from trainfleet.core.events import (AnyDetail, CheckpointCommitted, CheckpointReason, Ec2RebalanceRecommendation,
                                    Ec2SpotInterruptionWarning, HealthEvent)
from trainfleet.core.records import FailureClass, FailureReport, NodeRecord, NodeRole, RunControl, RunRecord

SPOT_NOTICE = timedelta(minutes=2)
"""How long EC2 gives between a Spot warning and the interruption; the longest any announced
departure waits for its emergency checkpoint once it was asked for."""
DEFERRED_LEAD = timedelta(minutes=10)
"""How long before a dated departure its emergency checkpoint is asked for, when no interval
checkpoint came first: a checkpoint of a large model takes minutes to stage and upload."""


def checkpoint_before_leaving(detail: AnyDetail) -> bool:
    """Whether an AWS event announces a departure with time to checkpoint first: a Spot warning,
    a rebalance recommendation, a scheduled retirement. An ongoing Health issue does not wait."""
    return isinstance(detail, (Ec2SpotInterruptionWarning, Ec2RebalanceRecommendation)) or (
        isinstance(detail, HealthEvent) and detail.event_type_category == "scheduledChange")


def departure_due_at(detail: AnyDetail, observed_at: datetime) -> datetime | None:
    """When an announced node goes: two minutes after a Spot warning, a retirement's start time
    (or now, when the Health event gives none); None for a rebalance recommendation, which
    names no time."""
    if isinstance(detail, Ec2SpotInterruptionWarning):
        return observed_at + SPOT_NOTICE
    if isinstance(detail, HealthEvent):
        return detail.starts_at or observed_at
    return None


def emergency_checkpoint_due(due_at: datetime | None, now: datetime) -> bool:
    """Whether a departure due at `due_at` needs its checkpoint asked for now rather than at the
    next interval: it goes within DEFERRED_LEAD."""
    return due_at is not None and now >= due_at - DEFERRED_LEAD


def emergency_checkpoint_now(run: RunRecord, now: datetime) -> bool:
    """Whether a departure of the current attempt that waited for the next interval checkpoint
    must ask for the emergency one now (judged on the run record alone, at each progress event)."""
    return (run.departure_noticed_at is not None and run.checkpoint_requested_at is None
            and not _failed(run, run.attempt) and emergency_checkpoint_due(run.departure_due_at, now))


def waits_for_emergency_checkpoint(run: RunRecord, node: NodeRecord) -> bool:
    """Whether an announced departure of `node` lets training go on until the checkpoint asked for.

    Only a worker of a world that is training has something to save; a spare, or a world still
    booting, is failed (or replaced) at once.
    """
    training = run.waiting is not None and run.waiting.purpose == "train" and run.waiting.attempt == run.attempt
    return training and node.role is NodeRole.WORKER and not node.state.is_retired


def checkpoint_request_answered(run: RunControl, attempt: int) -> bool:
    """Whether the run's request for a checkpoint needs no new save from an agent of `attempt`: a
    checkpoint committed after the run asked, or the wait for it is over (the attempt failed).

    One departure reaches a world along several paths - the leaving node's own notice, then the
    run's control item at each agent's next look - and each would otherwise start another save.
    One arriving after the requested checkpoint committed would train on and save again, so the
    next attempt would resume from a later step than the one the failure recorded.
    """
    committed_since = (run.checkpoint_committed_at is not None and run.checkpoint_requested_at is not None
                       and run.checkpoint_committed_at >= run.checkpoint_requested_at)
    return committed_since or run.failed_attempt == attempt


def departure_wait_may_end(run: RunRecord, now: datetime, *, committed: CheckpointCommitted | None = None,
                           leaving: bool = False) -> bool:
    """Whether the wait for the departure's checkpoint may be over, judged on the run record alone
    (RunRecord.departure_noticed_at, the attempt's first notice): False while no node of the
    current attempt was announced leaving, once the attempt has failed, and while nothing that
    ends the wait happened. Only then need the nodes be read (departure_wait_over decides on
    them), so a progress or checkpoint event reads one item whatever the fleet's size.

    committed: a checkpoint of the current attempt verified just now. leaving: EC2 reports an
    announced node shutting down, stopping or terminated.
    """
    if run.departure_noticed_at is None or _failed(run, run.attempt):
        return False
    return _why_the_wait_ends(run, now, committed, leaving) is not None


def departure_wait_over(run: RunRecord, nodes: list[NodeRecord], now: datetime, *,
                        committed: CheckpointCommitted | None = None,
                        leaving_instance_ids: frozenset[str] = frozenset()) -> FailureReport | None:
    """The failure (of the run's current attempt, of the first announcement's class) to report
    once the wait for the departure's checkpoint is over, naming every leaving node; None while it
    goes on, or when no node is leaving.

    committed: a checkpoint of the current attempt verified just now. leaving_instance_ids:
    instances EC2 reports shutting down, stopping or terminated.
    """
    leaving = sorted((node for node in nodes if node.departure_noticed_at is not None and not node.state.is_retired),
                     key=lambda node: node.departure_noticed_at)
    if not leaving:
        return None
    why = _why_the_wait_ends(run, now, committed, any(node.instance_id in leaving_instance_ids for node in leaving))
    if why is None:
        return None
    ids = sorted(node.instance_id for node in leaving)
    # The first announcement names the failure, unless the Capacity Block ends: nothing replaces that.
    classes = [node.departure_class for node in leaving]
    failure_class = FailureClass.CAPACITY_BLOCK_END if FailureClass.CAPACITY_BLOCK_END in classes else classes[0]
    return FailureReport(failure_class=failure_class, attempt=run.attempt, instance_ids=ids,
                         message=f"{failure_class.value} of {', '.join(ids)}: {why}")


def _failed(run: RunRecord, attempt: int) -> bool:
    return run.attempt_failure is not None and run.attempt_failure.attempt == attempt


def _why_the_wait_ends(run: RunRecord, now: datetime, committed: CheckpointCommitted | None,
                       leaving: bool) -> str | None:
    requested = run.checkpoint_requested_at
    if committed is not None and committed.reason is CheckpointReason.REQUESTED:
        return f"emergency checkpoint step {committed.step} committed"
    if committed is not None and requested is None and committed.reason is CheckpointReason.INTERVAL:
        return f"interval checkpoint step {committed.step} committed"
    if leaving:
        return "instance leaving before its checkpoint"
    if requested is not None and now >= requested + SPOT_NOTICE:
        return "notice ran out before the emergency checkpoint"
    return None
