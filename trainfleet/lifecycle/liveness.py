"""Node liveness: how often agents look at the control plane, and which nodes a crash or a hang
blames when no event named one (a frozen instance, a partitioned node, a rendezvous it never
joined: failures that produce no EC2 event, DESIGN.md section 9).

Every agent looks at the control plane once per `poll_interval` (5-10 s, drawn, so a fleet's
looks spread out; longer in runs above FULL_RATE_NODES nodes, so that a run's agents together
make at most about FULL_RATE_NODES / 7.5 = 34 looks a second whatever the node count). A look
is one eventually consistent GetItem of the run record (0.5 RCU per 4 KB) and, while its trainer
runs, one S3 PUT of its own liveness record (NodeLiveness). So a run's partition of the run
table serves about nodes / 7.5 reads a second up to 256 nodes and 34 above (512 nodes: 34 reads,
at most 2 RCU each for a run record under 16 KB: 68 RCU of the partition's 3,000), and the
agents write nothing to it. The liveness records go to S3, one object per node: S3 takes 3,500
PUTs a second per prefix, the nodes' role already writes `runs/*`, and it needs no write access
to the run table, where a node could otherwise overwrite the run's records. (The same records as
items of the run's partition would be nodes / 7.5 WCU: 34 of its 1,000 at 512 nodes, fine for
DynamoDB too.)
"""

from datetime import datetime, timedelta

from trainfleet.contracts import FailureClass, FailureReport, NodeLiveness, NodeRecord, NodeRole

POLL_MIN_S = 5.0
"""Least time between two looks of one agent at the control plane."""
POLL_MAX_S = 10.0
"""Most time between two looks, in runs up to FULL_RATE_NODES nodes."""
FULL_RATE_NODES = 256
"""Above this many nodes every agent looks proportionally less often: the run's read rate stays
bounded."""
SILENT_LOOKS = 3
"""Looks an agent may miss before it counts as silent."""

# Failures that name no node but may hide one: a silent node takes the world down with it.
_MAY_HIDE_A_NODE = frozenset({FailureClass.PROCESS_CRASH, FailureClass.HANG, FailureClass.UNKNOWN})


def _slowdown(nodes: int) -> float:
    return max(1.0, nodes / FULL_RATE_NODES)


def poll_interval(nodes: int, draw: float) -> float:
    """Seconds until an agent's next look, for a run of `nodes` nodes; draw in [0, 1) from the caller."""
    if not 0 <= draw < 1:
        raise ValueError(f"draw must be in [0, 1), got {draw}")
    return (POLL_MIN_S + (POLL_MAX_S - POLL_MIN_S) * draw) * _slowdown(nodes)


def looks_per_second(nodes: int) -> float:
    """Mean looks a second of a run's agents together (each one read of the run record)."""
    return nodes / ((POLL_MIN_S + POLL_MAX_S) / 2 * _slowdown(nodes))


def silent_after(nodes: int) -> timedelta:
    """How long without a liveness report before an agent counts as silent."""
    return timedelta(seconds=SILENT_LOOKS * POLL_MAX_S * _slowdown(nodes))


def silent_workers(nodes: list[NodeRecord], liveness: list[NodeLiveness], attempt: int, now: datetime,
                   impaired_ids: frozenset[str] = frozenset()) -> dict[str, str]:
    """Workers of the attempt's world that failed silently, instance id -> why.

    A worker is blamed when EC2 reports its instance status impaired, when its agent stopped
    reporting, when it has no report of this attempt or its trainer never joined the rendezvous
    while its peers trained (every agent reports before it starts torchrun, and a rendezvous
    completes only once every node's torchrun joined it), or when its trainer stopped advancing
    more than a step behind its peers. The liveness rules blame no one when every worker looks silent: that says more
    about the reports' path than about the nodes, and replacing the whole world would not help.
    """
    live = [node for node in nodes if not node.state.is_retired]
    workers = [node for node in live if node.role is NodeRole.WORKER]
    reports = {record.instance_id: record for record in liveness if record.attempt == attempt}
    limit = silent_after(len(live))  # the agents pace their looks by the run's node count
    steps = [record.step for record in reports.values() if record.step is not None]
    lead = max(steps, default=None)
    why: dict[str, str] = {}
    for node in workers:
        report = reports.get(node.instance_id)
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
    for node in workers:
        if node.instance_id in impaired_ids:
            why[node.instance_id] = "EC2 instance status impaired"
    return why


def blame_silent_workers(failure: FailureReport, nodes: list[NodeRecord], liveness: list[NodeLiveness],
                         now: datetime, impaired_ids: frozenset[str] = frozenset()) -> FailureReport:
    """`failure` naming the workers that failed silently, when it is a crash or a hang that named
    no node; unchanged otherwise. The nodes named are replaced on this first failure instead of
    failing every restart until the crash-loop rule gives up."""
    if not needs_liveness_look(failure):
        return failure
    why = silent_workers(nodes, liveness, failure.attempt, now, impaired_ids)
    if not why:
        return failure
    blamed = "; ".join(f"{instance_id}: {reason}" for instance_id, reason in sorted(why.items()))
    return failure.model_copy(update={"instance_ids": sorted(why), "message": f"{failure.message} [{blamed}]"})


def needs_liveness_look(failure: FailureReport) -> bool:
    """Whether Recover should look at liveness and instance status before deciding."""
    return not failure.instance_ids and failure.failure_class in _MAY_HIDE_A_NODE
