"""From launched instances to a launch spec: roles, readiness, node ranks."""

from trainfleet.core.records import (LaunchSpec, NodeRecord, NodeRole, NodeState, ParallelPlan, RunRecord, WorldRepair,
                                     rendezvous_port)
from trainfleet.core.runspec import RunSpec


def new_node_records(spec: RunSpec, attempt: int, instance_ids: list[str], workers_wanted: int,
                     availability_zone: str, subnet_id: str) -> list[NodeRecord]:
    """Records for freshly launched instances: the first `workers_wanted` work, the rest are spares."""
    return [NodeRecord(run_name=spec.run_name, instance_id=instance_id, attempt=attempt,
                       role=NodeRole.WORKER if index < workers_wanted else NodeRole.SPARE,
                       availability_zone=availability_zone, subnet_id=subnet_id, market=spec.capacity.kind)
            for index, instance_id in enumerate(instance_ids)]


def confirmed(node: NodeRecord, attempt: int) -> bool:
    """Whether a READY node's agent confirmed it for `attempt` (NodeRecord.ready_attempt)."""
    return node.state is NodeState.READY and node.ready_attempt is not None and node.ready_attempt >= attempt


def unready_workers(nodes: list[NodeRecord], attempt: int) -> list[str]:
    """Workers still booting, in preflight, or not confirmed for `attempt`: the ones to blame
    when AwaitNodes times out."""
    return sorted(node.instance_id for node in nodes if node.role is NodeRole.WORKER and (
        node.state in (NodeState.LAUNCHED, NodeState.REGISTERED)
        or (node.state is NodeState.READY and not confirmed(node, attempt))))


def silent_fleet(nodes: list[NodeRecord]) -> list[NodeRecord]:
    """The nodes the run holds (workers and spares, not retired), when not one of them has ever
    reported (no agent registered: it would have given its address); empty when any did."""
    live = [node for node in nodes if not node.state.is_retired]
    return live if all(node.state is NodeState.LAUNCHED and node.private_ip is None for node in live) else []


def rank_order(node: NodeRecord) -> tuple[bool, int, str]:
    """Sort key: nodes with a rank from an earlier attempt first, in rank order, then by id.

    Keeping earlier ranks keeps node rank 0 (the rendezvous host) where it was when it survived.
    """
    return node.node_rank is None, node.node_rank or 0, node.instance_id


def ready_workers(nodes: list[NodeRecord], attempt: int) -> list[NodeRecord]:
    """Workers that passed preflight and confirmed for `attempt`, in rank_order."""
    ready = [node for node in nodes if node.role is NodeRole.WORKER and confirmed(node, attempt)]
    return sorted(ready, key=rank_order)


def world_complete(nodes: list[NodeRecord], plan: ParallelPlan, attempt: int) -> bool:
    """Whether enough workers are ready for `attempt` to start the plan (AwaitNodes may succeed)."""
    return len(ready_workers(nodes, attempt)) >= plan.nodes


def world_attempt(node: NodeRecord) -> int | None:
    """The attempt whose world `node` counts toward: the one its agent last confirmed, for an
    addressed READY worker; None for any other node. Agents confirm only attempts the run has
    reached, so while the run is at attempt k the workers ready for it are exactly the nodes
    whose world_attempt is k: the run store counts them per attempt as node records change
    (RunStore.ready_workers), and no one need read every node to know that a world is complete."""
    if node.role is NodeRole.WORKER and node.state is NodeState.READY and node.private_ip:
        return node.ready_attempt
    return None


def may_start(run: RunRecord, ready_workers: int) -> bool:
    """Whether AwaitNodes of the run's current attempt may succeed: it is waiting, the attempt
    has not failed, and `ready_workers` (the run store's count for that attempt) fill the plan."""
    waiting = run.waiting is not None and (run.waiting.purpose, run.waiting.attempt) == ("await_nodes", run.attempt)
    failed = run.attempt_failure is not None and run.attempt_failure.attempt == run.attempt
    return waiting and not failed and run.plan is not None and ready_workers >= run.plan.nodes


def assign_ranks(nodes: list[NodeRecord], plan: ParallelPlan, attempt: int) -> dict[str, int]:
    """instance id -> node rank for the plan's nodes; ValueError when too few are ready.

    A node keeps the rank it had, where the plan still has it: its host memory holds its own
    shards and its previous node's (trainer/memory_checkpoint.py), which a rank elsewhere would
    have to fetch. Newcomers take the ranks left free, in rank_order."""
    chosen = ready_workers(nodes, attempt)[:plan.nodes]
    if len(chosen) < plan.nodes:
        raise ValueError(f"the plan needs {plan.nodes} ready workers, {len(chosen)} are ready")
    kept: dict[str, int] = {}
    for node in chosen:
        if node.node_rank is not None and node.node_rank < plan.nodes and node.node_rank not in kept.values():
            kept[node.instance_id] = node.node_rank
    free = iter(sorted(set(range(plan.nodes)) - set(kept.values())))
    return {node.instance_id: kept[node.instance_id] if node.instance_id in kept else next(free) for node in chosen}


def build_launch_spec(run: RunRecord, nodes: list[NodeRecord], heartbeat_task_token: str | None) -> LaunchSpec:
    """The launch spec of the run's current attempt; the run must have a plan."""
    if run.plan is None:
        raise ValueError(f"run {run.run_name} has no parallel plan yet")
    ranks = assign_ranks(nodes, run.plan, run.attempt)
    by_id = {node.instance_id: node for node in nodes}
    host = next(instance for instance, rank in ranks.items() if rank == 0)
    if by_id[host].private_ip is None:
        raise ValueError(f"node rank 0 ({host}) has not reported its private IP")
    rendezvous_id = f"{run.run_name}-{run.attempt}"
    if run.repair:
        rendezvous_id = _repair_rendezvous_id(run.run_name, run.repair, run.attempt)
    resume_step = run.latest_checkpoint.step if run.latest_checkpoint else None
    return LaunchSpec(
        run_name=run.run_name,
        attempt=run.attempt,
        plan=run.plan,
        node_ranks=ranks,
        rendezvous_host=by_id[host].private_ip,
        rendezvous_port=rendezvous_port(rendezvous_id),
        rendezvous_id=rendezvous_id,
        trainer_config=run.spec.trainer_mapping(run.plan.pp, run.plan.dp, resume_step,
                                                scaling_check_due=not (run.scaling_check and run.scaling_check.passed),
                                                resume_uri=resumed_elsewhere(run)),
        resume_step=resume_step,
        restore_from_memory=run.restore_from_memory,
        repairable=run.spec.repairable,
        repair=run.repair,
        heartbeat_task_token=heartbeat_task_token,
        hang_timeout_seconds=run.spec.recovery.hang_timeout_seconds,
        startup_timeout_seconds=run.spec.recovery.startup_timeout_seconds,
        stall_floor_seconds=run.spec.recovery.stall_floor_seconds,
    )


def resumed_elsewhere(run: RunRecord) -> str | None:
    """Where the run's resume point lies when it is not the run's own: the checkpoints of the run
    it resumes (RunSpec.resume_from_uri), before it committed one of its own; else None."""
    uri = run.spec.resume_from_uri
    latest = run.latest_checkpoint
    return uri if uri and latest and latest.uri.startswith(uri.rstrip("/") + "/") else None


def _repair_rendezvous_id(run_name: str, repair: WorldRepair, attempt: int) -> str:
    """The id that draws a repaired world's store port on node rank 0: not the port of a store
    still open there (the survivors' torchrun rendezvous, the earlier generations' stores)."""
    taken = {rendezvous_port(f"{run_name}-{earlier}") for earlier in range(repair.launched_attempt, attempt)}
    rendezvous_id, salt = f"{run_name}-{attempt}", 0
    while rendezvous_port(rendezvous_id) in taken:
        salt += 1
        rendezvous_id = f"{run_name}-{attempt}-{salt}"
    return rendezvous_id
