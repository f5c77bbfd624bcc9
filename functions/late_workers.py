"""LateWorkers: AwaitNodes' late-worker deadline passed (its task timed out, so Step Functions
fired it, not a poll). READY spares take the places of the workers that have not confirmed
(lifecycle.swap_late_workers), and the Choice after this state goes on to Train if the world
is complete now, back to AwaitNodes for another round if not, or to Recover once the attempt
has waited its whole boot timeout.

The swap is recorded before anything is acted on: promoted spares become workers, late workers
still booting become spares, silent ones are marked TERMINATING and then terminated. A retry
decides again from the records, which already show the first try's swap.
"""

from datetime import datetime, timedelta, timezone
from typing import Any

from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import (LateWorkersStep, RunPayload, addressed, aws, logger, mark_terminating, metrics,
                              swap_roles, tracer, transient_errors_named)
from trainfleet.adapters.ec2_fleet import terminate
from trainfleet.core.lifecycle import swap_late_workers, world_complete
from trainfleet.core.records import FailureClass, NodeState


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=RunPayload)
def handler(event: RunPayload, context: LambdaContext) -> dict[str, Any]:
    cloud, name, attempt = aws(), event.run.run_name, event.run.attempt
    store = cloud.store
    swap = swap_late_workers(store.nodes(name), attempt)
    swap_roles(name, swap.promote_spare_ids, swap.demote_worker_ids)
    for instance_id in swap.release_instance_ids:
        mark_terminating(name, instance_id, failure_class=FailureClass.NODE_UNHEALTHY,
                         reason=f"passed preflight, then did not confirm attempt {attempt} in time: silent")
    nodes = store.nodes(name)  # as the writes above left them
    terminate(cloud.ec2, [node.instance_id for node in nodes if node.state is NodeState.TERMINATING])

    run, nodes = store.run(name), addressed(nodes)
    complete = world_complete(nodes, run.plan, attempt)
    waited = datetime.now(timezone.utc) - (run.nodes_launched_at or run.attempt_started_at or run.created_at)
    step = LateWorkersStep(world_complete=complete,
                           boot_over=not complete and waited >= timedelta(seconds=event.timeouts.boot_seconds))
    metrics.add_metric(name="SparesSwappedIn", unit=MetricUnit.Count, value=len(swap.promote_spare_ids))
    logger.info("late workers", run_name=name, attempt=attempt, swap=swap.model_dump(), **step.model_dump())
    return step.to_state()
