"""Spot interruption: checkpoint during the two-minute notice, then replace the node.

A warning for a worker that is training does not fail the attempt at once: the node's agent
asks its trainer for a checkpoint, and the run trains on until that checkpoint commits. The wait
ends, and the attempt fails with SPOT_INTERRUPTION, at whichever comes first: the requested
checkpoint committed, EC2 reporting the instance leaving, or the notice running out. The Train
task's heartbeat timeout still bounds a world that hangs meanwhile.

The requested checkpoint is told from the others by the reason its commit marker records
(`CheckpointCommitted.reason`): an interval or final checkpoint committing just after the
warning does not end the wait before the requested one, whatever its step.
"""

from datetime import datetime, timedelta

from trainfleet.contracts import (CheckpointCommitted, CheckpointReason, FailureClass, FailureReport, NodeRecord,
                                  NodeRole, NodeState, RunRecord)

SPOT_NOTICE = timedelta(minutes=2)
"""How long EC2 gives between the warning and the interruption."""

_RETIRED = frozenset({NodeState.UNHEALTHY, NodeState.TERMINATING, NodeState.TERMINATED})


def waits_for_emergency_checkpoint(run: RunRecord, node: NodeRecord) -> bool:
    """Whether a Spot warning for `node` lets training go on until the checkpoint it asked for.

    Only a worker of a world that is training has something to save; a spare, or a world still
    booting, is failed (or replaced) at once.
    """
    training = run.waiting is not None and run.waiting.purpose == "train" and run.waiting.attempt == run.attempt
    return training and node.role is NodeRole.WORKER and node.state not in _RETIRED


def spot_interruption_over(run: RunRecord, nodes: list[NodeRecord], now: datetime, *,
                           committed: CheckpointCommitted | None = None,
                           leaving_instance_ids: frozenset[str] = frozenset()) -> FailureReport | None:
    """The SPOT_INTERRUPTION failure (of the run's current attempt) to report once the wait for
    the emergency checkpoint is over, naming every interrupting node; None while it goes on, or
    when no node is interrupting.

    committed: a checkpoint of the current attempt verified just now. leaving_instance_ids:
    instances EC2 reports shutting down, stopping or terminated.
    """
    interrupting = [node for node in nodes if node.spot_warned_at is not None and node.state not in _RETIRED]
    if not interrupting:
        return None
    if committed is not None and committed.reason is CheckpointReason.REQUESTED:
        why = f"emergency checkpoint step {committed.step} committed"
    elif any(node.instance_id in leaving_instance_ids for node in interrupting):
        why = "instance leaving before its emergency checkpoint"
    elif any(now >= node.spot_warned_at + SPOT_NOTICE for node in interrupting):
        why = "notice ran out before the emergency checkpoint"
    else:
        return None
    ids = sorted(node.instance_id for node in interrupting)
    return FailureReport(failure_class=FailureClass.SPOT_INTERRUPTION, attempt=run.attempt, instance_ids=ids,
                         message=f"Spot interruption of {', '.join(ids)}: {why}")
