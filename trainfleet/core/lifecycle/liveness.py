"""Node liveness: which nodes a crash or a hang blames when no event named one (a frozen
instance, a partitioned node, a rendezvous it never joined: failures that produce no EC2 event,
DESIGN.md section 9), and the pace of the agents' looks that tells it (trainfleet.core.pace).

Every agent looks at the control plane once per `poll_interval` (5-10 s, drawn, so a fleet's
looks spread out; longer in runs above FULL_RATE_NODES nodes, so that a run's agents together
make at most about FULL_RATE_NODES / 7.5 = 34 looks a second whatever the node count; shorter
when the hang timeout is, so a frozen node's agent is known silent by the time its hang is
declared). A look is one eventually consistent read of the run's state and, while its trainer
runs, one write of its own liveness record (NodeLiveness) to the liveness table, keyed by its
instance (trainfleet/adapters/liveness.py): the nodes' role needs no write access to the run
table, where a node could otherwise overwrite the run's records.
"""

from collections.abc import Mapping, Sequence
from datetime import datetime
from types import MappingProxyType
from typing import Any

from trainfleet.core.events import LOST_STATES
from trainfleet.core.pace import (FULL_RATE_NODES, POLL_MAX_S, POLL_MIN_S, SILENT_LOOKS, looks_per_second,
                                  poll_interval, silent_after)
from trainfleet.core.records import FailureClass, FailureRecord, FailureReport, NodeLiveness, NodeRecord, NodeRole

__all__ = ["FULL_RATE_NODES", "POLL_MAX_S", "POLL_MIN_S", "SILENT_LOOKS", "looks_per_second", "poll_interval",
           "silent_after", "IMPAIRED", "world_workers", "silent_workers", "trainers_alive", "agents_alive",
           "blame_silent_workers", "needs_liveness_look", "first_silent", "hang_onset"]

IMPAIRED = "impaired"
"""What EC2's troubles name an instance whose instance or system status check failed."""

# Failures that name no node but may hide one: a silent node takes the world down with it.
_MAY_HIDE_A_NODE = frozenset({FailureClass.PROCESS_CRASH, FailureClass.HANG, FailureClass.UNKNOWN})


def world_workers(nodes: list[NodeRecord], attempt: int) -> list[NodeRecord]:
    """The workers of `attempt`'s world, whose instances' EC2 state may name a crash's cause: those
    not retired, and those retired while the attempt ran (its agent confirmed them for it). EC2's
    state-change event of a lost instance comes seconds to a minute after the instance stopped,
    after or before its peers' crash reports: when the crash answered the attempt's wait first,
    the event that followed retired the node before Recover looked, and the node is still the
    one the world lost."""
    return [node for node in nodes if node.role is NodeRole.WORKER and (
        not node.state.is_retired or (node.ready_attempt is not None and node.ready_attempt >= attempt))]


def silent_workers(nodes: list[NodeRecord], liveness: list[NodeLiveness], attempt: int, now: datetime,
                   hang_timeout_s: float, ec2_troubles: Mapping[str, str] = MappingProxyType({})) -> dict[str, str]:
    """Workers of the attempt's world that failed silently, instance id -> why.

    A worker is blamed when EC2 reports its instance leaving (`ec2_troubles`: instance id -> a
    state of LOST_STATES, or "impaired" for a failed status check), when its agent stopped
    reporting, when it has no report of this attempt or its trainer never joined the rendezvous
    while its peers trained (every agent reports before it starts torchrun, and a rendezvous
    completes only once every node's torchrun joined it), or when its trainer stopped advancing
    more than a step behind its peers. A report is held against the steps its peers had reported
    by the time it was written, never against later ones: the world steps together, and a report
    that is only older (its agent's writes failed for a while, as they do while S3 throttles) is
    no sign of a node behind. The liveness rules blame no one when every worker looks
    silent: that says more about the reports' path than about the nodes, and replacing the whole
    world would not help. What EC2 reports blames its worker all the same, a worker of the
    attempt's world an event retired already too (world_workers).
    """
    live = [node for node in nodes if not node.state.is_retired]
    workers = [node for node in live if node.role is NodeRole.WORKER]
    reports = {record.instance_id: record for record in liveness if record.attempt == attempt}
    limit = silent_after(len(live), hang_timeout_s)  # the agents pace their looks by both
    def lead_by(moment: datetime | None) -> int | None:
        """The furthest step reported by `moment` (None: ever)."""
        return max((record.step for record in reports.values() if record.step is not None
                    and (moment is None or record.reported_at <= moment)), default=None)

    why: dict[str, str] = {}
    for node in workers:
        report = reports.get(node.instance_id)
        lead = lead_by(report.reported_at if report else None)
        if report is None:
            if lead is not None:
                why[node.instance_id] = f"no liveness report in attempt {attempt} while its peers reached step {lead}"
        elif now - report.reported_at > limit:
            why[node.instance_id] = f"agent silent for {(now - report.reported_at).total_seconds():.0f} s"
        elif report.step is None and lead is not None:
            why[node.instance_id] = f"never joined the rendezvous while its peers reached step {lead}"
        elif report.step is not None and lead is not None and lead - report.step > 1:
            why[node.instance_id] = f"stopped advancing at step {report.step} while its peers reached {lead}"
    if len(why) == len(workers):
        why = {}
    for node in world_workers(nodes, attempt):
        trouble = ec2_troubles.get(node.instance_id)
        if trouble == IMPAIRED:
            why[node.instance_id] = "EC2 instance status impaired"
        elif trouble in LOST_STATES:
            why[node.instance_id] = f"EC2 reports the instance {trouble}"
    return why


def trainers_alive(nodes: list[NodeRecord], liveness: list[NodeLiveness], attempt: int, now: datetime,
                   hang_timeout_s: float) -> frozenset[str]:
    """The workers whose agents reported their trainer running in `attempt` recently enough not
    to count as silent (an agent reports only while its torchrun runs, and says so when it
    exited): those that can receive a repair order (recovery.repair_in_place)."""
    workers = {node.instance_id for node in nodes if node.role is NodeRole.WORKER}
    return frozenset(record.instance_id for record in _reported_lately(nodes, liveness, now, hang_timeout_s)
                     if record.attempt == attempt and record.trainer_running and record.instance_id in workers)


def agents_alive(nodes: list[NodeRecord], liveness: list[NodeLiveness], now: datetime,
                 hang_timeout_s: float) -> frozenset[str]:
    """The nodes whose agents reported lately, with a trainer running or idle (a READY spare's
    agent reports while the run trains): a spare promoted into a world repaired in place that
    is alive to join it at once (Recover confirms it for the new attempt)."""
    return frozenset(record.instance_id for record in _reported_lately(nodes, liveness, now, hang_timeout_s))


def _reported_lately(nodes: list[NodeRecord], liveness: list[NodeLiveness], now: datetime,
                     hang_timeout_s: float) -> list[NodeLiveness]:
    """The reports of the nodes not retired, written too lately for their agents to count as silent."""
    limit = silent_after(sum(not node.state.is_retired for node in nodes), hang_timeout_s)
    live = {node.instance_id for node in nodes if not node.state.is_retired}
    return [record for record in liveness if record.instance_id in live and now - record.reported_at <= limit]


def blame_silent_workers(failure: FailureReport, nodes: list[NodeRecord], liveness: list[NodeLiveness],
                         now: datetime, hang_timeout_s: float,
                         ec2_troubles: Mapping[str, str] = MappingProxyType({})) -> FailureReport:
    """`failure` naming the workers that failed silently, when it is a crash or a hang that named
    no node; unchanged otherwise. The nodes named are replaced on this first failure instead of
    failing every restart until the crash-loop rule gives up. When EC2 reports one of them
    leaving, the failure is that instance's loss: the crash was its peers' view of it (the
    agents report a crash without waiting for EC2's event, which may come later or not at all
    before Recover looks)."""
    if not needs_liveness_look(failure):
        return failure
    why = silent_workers(nodes, liveness, failure.attempt, now, hang_timeout_s, ec2_troubles)
    if not why:
        return failure
    blamed = "; ".join(f"{instance_id}: {reason}" for instance_id, reason in sorted(why.items()))
    lost = any(ec2_troubles.get(instance_id) in LOST_STATES for instance_id in why)
    return failure.model_copy(update={
        "instance_ids": sorted(why), "message": f"{failure.message} [{blamed}]",
        "failure_class": FailureClass.INSTANCE_LOST if lost else failure.failure_class})


def needs_liveness_look(failure: FailureReport) -> bool:
    """Whether Recover should look at liveness and instance status before deciding."""
    return not failure.instance_ids and failure.failure_class in _MAY_HIDE_A_NODE


FIRST_SILENT_MARGIN_S = 1.0
"""How much sooner than every other node's trainer one must have fallen silent to be named the one
that stopped: twice the half second at which agents look at their trainers' files."""


def first_silent(liveness: list[NodeLiveness], attempt: int) -> tuple[str, float] | None:
    """The node whose trainer fell silent first in `attempt`, and how many seconds before any
    other's; None where none did clearly first (a world stalled as a whole: a network, a store)."""
    seen = sorted((record.alive_at, record.instance_id) for record in liveness
                  if record.attempt == attempt and record.alive_at is not None)
    if len(seen) < 2:
        return None
    (stopped_at, stopped), (next_at, _) = seen[:2]
    lead = (next_at - stopped_at).total_seconds()
    return (stopped, lead) if lead >= FIRST_SILENT_MARGIN_S else None


def hang_onset(failure: FailureReport, liveness: list[NodeLiveness], nodes: list[NodeRecord] = (),
               ranks_per_node: int = 1, history: Sequence[FailureRecord] = ()) -> FailureReport:
    """A hang with its first sign and, where one node's trainer fell silent clearly first, that
    node named (`first_silent`, and in its message with its ranks: `nodes`' node ranks,
    `ranks_per_node` each). Named once, it is not blamed: a hang on healthy hardware would follow
    it nowhere, and a node is not replaced for one stall. Named the first to fall silent in an
    earlier hang of the run too (`history`), it is blamed and so replaced: a GPU that hangs again
    and again would otherwise restart the world on it until the crash-loop rule ends the run.
    The first sign, when the hang has none (a heartbeat timed out: no event observed it), is the
    world's last step, the newest step a worker of the attempt reported."""
    if failure.failure_class is not FailureClass.HANG:
        return failure
    update: dict[str, Any] = {}
    if failure.observed_at is None:
        update["observed_at"] = max((record.step_at for record in liveness
                                     if record.attempt == failure.attempt and record.step_at), default=None)
    stopped = first_silent(liveness, failure.attempt)
    if stopped is not None:
        instance_id, lead = stopped
        rank = next((node.node_rank for node in nodes if node.instance_id == instance_id), None)
        ranks = (f" (node rank {rank}: ranks {rank * ranks_per_node}-{(rank + 1) * ranks_per_node - 1})"
                 if rank is not None else "")
        update["first_silent"] = instance_id
        update["message"] = (f"{failure.message} [the trainer of {instance_id}{ranks} fell silent first, "
                             f"{lead:.1f} s before any other]")
        before = [past for past in history if past.failure_class is FailureClass.HANG and past.first_silent == instance_id]
        if before and not failure.instance_ids:
            update["instance_ids"] = [instance_id]
            update["message"] += (f" [named so in attempt {before[-1].attempt}'s hang too: replaced]")
    return failure.model_copy(update=update)
