"""Teardown: on every path out of a run, terminate its instances and delete what it created.

Instances are found by their run tag in EC2, not only in the run's records, so one launched by
an interrupted Allocate is not forgotten. The last attempt's time goes on the goodput ledger
first, with the move to TEARING_DOWN; the outcome is recorded last.
"""

from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import RunPayload, aws, logger, tracer, transient_errors_named
from functions.errors import TeardownIncomplete
from trainfleet.adapters.ec2_fleet import teardown
from trainfleet.contracts import NodeState, RunRecord, RunState
from trainfleet.lifecycle import book_attempt

_LEFT = frozenset({NodeState.TERMINATING, NodeState.TERMINATED})


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=RunPayload)
def handler(event: RunPayload, context: LambdaContext) -> dict[str, Any]:
    cloud, name = aws(), event.run.run_name
    store = cloud.store
    run = store.run(name)
    if not run.state.is_final:
        error = run.error or (f"{event.failure.Error}: {event.failure.Cause}" if event.failure else None)
        now, nodes = datetime.now(timezone.utc), store.nodes(name)

        def tear_down(current: RunRecord) -> RunRecord:
            if current.state is RunState.TEARING_DOWN:
                return current  # a retry: the attempt is booked already
            booked = book_attempt(current, nodes, now, completed=event.failure is None)
            return current.model_copy(update={"state": RunState.TEARING_DOWN, "error": error, "ledger": booked})
        store.modify_run(name, tear_down)
    for node in store.nodes(name):
        if node.state not in _LEFT:
            store.transition_node(name, node.instance_id, NodeState.TERMINATING)
    result = teardown(cloud.ec2, name, cloud.settings.stack_name)
    logger.info("run torn down", run_name=name, terminated=len(result.terminated))
    if result.placement_groups_in_use:
        raise TeardownIncomplete(f"placement groups still in use: {result.placement_groups_in_use}")
    if not run.state.is_final:
        store.transition_run(name, RunState.FAILED if event.failure else RunState.SUCCEEDED)
    return {"terminated": len(result.terminated)}
