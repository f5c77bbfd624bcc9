"""AwaitNodes: park the task token on the run; the event handler answers it when the world is
ready. Nodes that were ready before the token was parked are answered for here, and so is a
failure of the attempt reported before it (a worker lost after Recover decided)."""

from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import (TaskPayload, answer_if_world_complete, aws, logger, metrics, park_task, tracer,
                              transient_errors_named)
from trainfleet.core.records import RunState, TaskWait


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
@event_parser(model=TaskPayload)
def handler(event: TaskPayload, context: LambdaContext) -> dict[str, Any]:
    store, ref = aws().store, event.run.run
    store.transition_run(ref.run_name, RunState.AWAITING_NODES)
    wait = TaskWait(purpose="await_nodes", attempt=ref.attempt, token=event.task_token)
    answered = park_task(ref.run_name, wait) or answer_if_world_complete(ref.run_name)
    logger.info("waiting for nodes", run_name=ref.run_name, attempt=ref.attempt, answered_now=answered)
    return {"answered_now": answered}
