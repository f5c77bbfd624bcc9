"""Growing back: a run that shrank for want of capacity returns to its planned size when the
capacity comes back.

A shrink (lifecycle.recovery, step 7) keeps the run training on the nodes it has. From then on,
at each interval checkpoint, the run looks for what it lacks: when GROW_RETRY has passed since
its last try, it asks EC2 for the missing nodes as spares (`spares_to_launch`); once READY
spares make a larger layout possible (`may_grow`), the attempt ends right there, at the
checkpoint just committed (nothing to redo), with the class CAPACITY_RETURNED, and the recovery
promotes the spares and re-plans pp x dp for as many nodes as it can, up to the planned size
(`grown_plan`). A capacity shortfall while
trying costs nothing: the run trains on and tries again later.
"""

from datetime import datetime, timedelta

from trainfleet.core.lifecycle.replan import plan_layout
from trainfleet.core.records import (FailureClass, FailureReport, NodeRecord, NodeRole, NodeState, ParallelPlan,
                                     RunRecord)

GROW_RETRY = timedelta(minutes=30)
"""Least time between two requests for the nodes a shrunk run lacks."""


def missing_nodes(run: RunRecord) -> int:
    """Nodes the run's world lacks of its planned size (0 unless it shrank)."""
    return max(0, run.spec.node_count - run.plan.nodes) if run.plan else 0


def spares_to_launch(run: RunRecord, nodes: list[NodeRecord], now: datetime) -> int:
    """How many spares to ask EC2 for now: the nodes missing plus the spare pool, less the spares
    alive already (booting or READY); 0 when the run did not shrink or tried under GROW_RETRY ago."""
    missing = missing_nodes(run)
    if missing == 0 or (run.grow_tried_at is not None and now - run.grow_tried_at < GROW_RETRY):
        return 0
    alive = sum(node.role is NodeRole.SPARE and not node.state.is_retired for node in nodes)
    return max(0, missing + run.spec.spare_count - alive)


def may_grow(run: RunRecord, nodes: list[NodeRecord]) -> bool:
    """Whether the shrunk world and its READY spares hold a larger layout than the world's."""
    if missing_nodes(run) == 0:
        return False
    live = [node for node in nodes if not node.state.is_retired]
    workers = sum(node.role is NodeRole.WORKER for node in live)
    ready = sum(node.role is NodeRole.SPARE and node.state is NodeState.READY for node in live)
    grown = grown_plan(run, workers + ready)
    return grown is not None and grown.nodes > run.plan.nodes


def growth_report(run: RunRecord, step: int) -> FailureReport:
    """The end of the current attempt so that the run grows, at the checkpoint of `step`."""
    return FailureReport(failure_class=FailureClass.CAPACITY_RETURNED, attempt=run.attempt,
                         message=f"capacity returned: {missing_nodes(run)} node(s) ready to bring the world from "
                                 f"{run.plan.nodes} back to {run.spec.node_count} at checkpoint step {step}")


def grown_plan(run: RunRecord, available: int) -> ParallelPlan | None:
    """The layout on `available` nodes, up to the planned size; None when none runs there."""
    spec = run.spec
    return plan_layout(spec.trainer, spec.facts.ranks_per_node, min(available, spec.node_count), spec.shrink_floor,
                       preferred_pp=spec.trainer.parallel.pp, memory_gib=spec.facts.memory_per_rank_gib,
                       accelerator=spec.facts.accelerator)
