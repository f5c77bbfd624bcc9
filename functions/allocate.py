"""Allocate: the run's node role, launch template, cluster placement group, CreateFleet; record
the nodes and the plan (and, on a Capacity Block, when the run must stop by).

Workers first, then spares. Fewer instances than node_count are accepted only down to the
RunSpec's min_nodes, with pp x dp re-planned for what came; none at all, or too few for any
layout of the trainer (those are terminated: they are paid for and useless), raises
CapacityUnavailable, which the state machine retries with backoff and a new fleet request.
"""

from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import (RunPayload, aws, capacity_unavailable, count_unfilled_request, fleet_token_prefix,
                              logger, metrics, record_nodes, tracer, transient_errors_named)
from functions.errors import TransientError
from trainfleet.adapters.ec2_fleet import FleetError, allocate, ensure_launch_template, terminate
from trainfleet.adapters.node_roles import ensure_node_profile
from trainfleet.core.lifecycle import plan_layout
from trainfleet.core.records import RunState


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=RunPayload)
def handler(event: RunPayload, context: LambdaContext) -> dict[str, Any]:
    cloud, name = aws(), event.run.run_name
    run = cloud.store.transition_run(name, RunState.ALLOCATING)
    spec = run.spec
    profile = ensure_node_profile(cloud.iam, name, cloud.settings.stack_name, cloud.settings.node_policy_arn,
                                  spec.resume_from)
    template_id = ensure_launch_template(cloud.ec2, spec, cloud.settings, profile)
    try:
        allocation = allocate(cloud.ec2, spec, cloud.settings.stack_name, template_id, spec.capacity.subnet_ids,
                              target=spec.node_count + spec.spare_count, minimum=spec.shrink_floor,
                              token_prefix=fleet_token_prefix(run))
    except FleetError as refused:
        if refused.profile_not_visible:  # a profile made seconds ago: the retry, a new request, finds it
            count_unfilled_request(name)
            raise TransientError(f"the run's instance profile is not visible to EC2 yet: {refused}") from refused
        raise
    if not allocation.instance_ids:
        raise capacity_unavailable(name, "; ".join(allocation.errors) or "no subnet launched any instance")
    workers = min(len(allocation.instance_ids), spec.node_count)
    plan = plan_layout(spec.trainer, spec.facts.ranks_per_node, available_nodes=workers,
                       min_nodes=spec.shrink_floor, preferred_pp=spec.trainer.parallel.pp,
                       memory_gib=spec.facts.memory_per_rank_gib, accelerator=spec.facts.accelerator)
    if plan is None:
        terminate(cloud.ec2, allocation.instance_ids)
        raise capacity_unavailable(name, f"{workers} nodes launched and no layout of the trainer runs on "
                                         f"{spec.shrink_floor}..{workers} of them; terminated them")
    record_nodes(spec, run.attempt, allocation, plan.nodes)
    recorded_at = datetime.now(timezone.utc)
    cloud.store.modify_run(name, lambda current: current.model_copy(update={
        "plan": plan, "subnet_id": allocation.subnet_id, "availability_zone": allocation.availability_zone,
        "placement_group": allocation.placement_group, "launch_template_id": template_id,
        "capacity_stop_by": allocation.stop_by, "nodes_launched_at": recorded_at}))
    metrics.add_metric(name="InstancesLaunched", unit=MetricUnit.Count, value=len(allocation.instance_ids))
    logger.info("fleet allocated", run_name=name, instances=len(allocation.instance_ids),
                zone=allocation.availability_zone, shortfall=allocation.shortfall, plan=plan.model_dump())
    return {"instances": len(allocation.instance_ids), "workers": plan.nodes,
            "availability_zone": allocation.availability_zone}
