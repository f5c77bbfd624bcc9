"""Teardown: on every path out of a run, terminate its instances and delete what it created (its
launch template, placement groups and node role).

Instances are found by their run tag in EC2, not only in the run's records, so one launched by
an interrupted Allocate is not forgotten, and they are terminated even when the records cannot
be read or written (the teardown then fails for its retry to record). The last attempt's time
goes on the goodput ledger first, with the move to TEARING_DOWN; the outcome is recorded once
the instances are terminating. A placement group is still in use while its instances shut down (minutes for
p4d and p5): it does not hold up the outcome or the report, and the reaper deletes it once its
instances are gone.
"""

from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import RunPayload, aws, logger, tracer, transient_errors_named
from trainfleet.adapters.ec2_fleet import Teardown, teardown
from trainfleet.adapters.node_roles import delete_node_profile
from trainfleet.core.lifecycle import book_attempt
from trainfleet.core.records import NodeState, RunRecord, RunState

_LEFT = frozenset({NodeState.TERMINATING, NodeState.TERMINATED})


def remove_run_resources(run_name: str) -> Teardown:
    """Terminate the run's instances, delete its launch template, its placement groups (once
    free) and its node role and instance profile."""
    cloud = aws()
    result = teardown(cloud.ec2, run_name, cloud.settings.stack_name)
    delete_node_profile(cloud.iam, run_name, cloud.settings.stack_name)
    return result


def tear_down(run_name: str, failure: str | None, outcome: RunState | None = None) -> Teardown:
    """End the run: book its last attempt, retire its nodes, terminate its instances, delete
    its launch template (and its placement groups when already free), record the outcome
    (`outcome` where given, else FAILED when `failure` says why, else SUCCEEDED). Safe to
    repeat; a run already final keeps its outcome and only has its leftovers removed."""
    outcome = outcome or (RunState.FAILED if failure else RunState.SUCCEEDED)
    cloud = aws()
    store = cloud.store
    try:
        run = store.run(run_name)
        if not run.state.is_final:
            now, nodes = datetime.now(timezone.utc), store.nodes(run_name)

            def tearing_down(current: RunRecord) -> RunRecord:
                if current.state is RunState.TEARING_DOWN or current.state.is_final:
                    return current  # a retry, or another teardown got here first: booked already
                booked = book_attempt(current, nodes, now, completed=outcome is RunState.SUCCEEDED)
                return current.model_copy(update={"state": RunState.TEARING_DOWN,
                                                  "error": current.error or failure, "ledger": booked})
            store.modify_run(run_name, tearing_down)
        for node in store.nodes(run_name):
            if node.state not in _LEFT:
                store.transition_node(run_name, node.instance_id, NodeState.TERMINATING)
    finally:
        # Found by tag, not by the records: a record that cannot be read or written now (an
        # outage, an item at DynamoDB's size limit) must not leave the instances running. The
        # error still fails the teardown, whose retry records what this one could not.
        result = remove_run_resources(run_name)
    store.modify_run(run_name, lambda current: current if current.state.is_final
                     else current.model_copy(update={"state": outcome}))
    logger.info("run torn down", run_name=run_name, terminated=len(result.terminated),
                placement_groups_in_use=result.placement_groups_in_use)
    return result


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=RunPayload)
def handler(event: RunPayload, context: LambdaContext) -> dict[str, Any]:
    failure = f"{event.failure.Error}: {event.failure.Cause}" if event.failure else None
    result = tear_down(event.run.run_name, failure)
    return {"terminated": len(result.terminated), "placement_groups_in_use": result.placement_groups_in_use}
