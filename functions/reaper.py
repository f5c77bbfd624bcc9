"""Reaper: tear down what a run left behind when its execution ended without Teardown.

StopExecution, an execution's own timeout and a Teardown that kept failing run no Catch, so
the state machine cannot clean up after them. This function does, invoked two ways:

- by the rule on the state machine's "Step Functions Execution Status Change" events
  (ABORTED, TIMED_OUT, FAILED): the run named in the execution's input is torn down at once
  and its report written;
- every few minutes by a schedule, which also catches a lost or undelivered status event:
  each run of this stack that still holds an instance or a placement group (found by the
  stack's tag in EC2) is torn down unless its execution is still RUNNING. That is also how
  a placement group Teardown left in use is deleted once its instances are gone. For each run
  still RUNNING it publishes how long the run has gone without a step (SecondsSinceProgress),
  which the no-progress alarm watches: a run can be alive and make no progress (stuck waiting
  for capacity, recovering in a loop the crash-loop rule does not catch).

The schedule's cost follows what exists in EC2 now, not the number of runs there ever were:
no scan of the run table. A run recorded but holding nothing in EC2 costs nothing while its
record waits for the status event.
"""

import json
from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import aws, logger, tracer, transient_errors_named
from functions.errors import ReapIncomplete
from functions.report import write_report
from functions.teardown import remove_run_resources, tear_down
from trainfleet.adapters.ec2_fleet import runs_with_resources
from trainfleet.adapters.metrics import emit, stall_metrics
from trainfleet.adapters.run_store import RunNotFound
from trainfleet.core.records import RunState

STATUS_CHANGE = "Step Functions Execution Status Change"


def reap(run_name: str, execution_arn: str | None = None, execution_status: str | None = None) -> bool:
    """Tear the run down unless its execution is RUNNING (a run already ended only has its
    leftovers removed); True if it was.

    Given an execution (a status event), only the run that execution recorded is touched: a
    second execution refused for reusing a live run's name fails too, and must not end that
    run. A run of no record has its resources removed by tag: nothing else drives them."""
    cloud = aws()
    try:
        run = cloud.store.run(run_name)
    except RunNotFound:
        remove_run_resources(run_name)
        return True
    if execution_arn is not None and run.execution_arn != execution_arn:
        return False
    if run.state.is_final:  # ended: only leftovers remain (a group that was still in use)
        tear_down(run_name, None)
        return True
    if execution_status is None:
        if not run.execution_arn:
            return False
        try:
            execution_status = cloud.sfn.describe_execution(executionArn=run.execution_arn)["status"]
        except cloud.sfn.exceptions.ExecutionDoesNotExist:  # closed executions are kept 90 days
            execution_status = "EXPIRED"
    if execution_status == "RUNNING":
        emit(stall_metrics(run, cloud.settings.stack_name, datetime.now(timezone.utc), cloud.settings.metrics_namespace))
        return False
    if execution_status == "ABORTED":  # stopped on purpose (StopExecution): nothing failed
        tear_down(run_name, None, RunState.STOPPED)
    else:
        tear_down(run_name, f"ExecutionEnded: the execution is {execution_status}")
    write_report(run_name)  # the execution that would have written it has ended
    return True


def sweep() -> list[str]:
    """Reap every run of this stack that still holds EC2 resources; the names reaped. One run
    that cannot be torn down now does not keep the others' instances running: it is named in
    ReapIncomplete once the others are done."""
    cloud = aws()
    reaped, failed = [], {}
    for name in sorted(runs_with_resources(cloud.ec2, cloud.settings.stack_name)):
        try:
            if reap(name):
                reaped.append(name)
        except Exception as exc:
            logger.exception("run not reaped", run_name=name)
            failed[name] = f"{type(exc).__name__}: {exc}"
    if failed:
        raise ReapIncomplete(f"reaped {reaped}; not reaped: {failed}")
    return reaped


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    if event.get("detail-type") == STATUS_CHANGE:
        detail = event["detail"]
        run_spec = json.loads(detail.get("input") or "{}")
        run_name = run_spec.get("run_name") if isinstance(run_spec, dict) else None
        ended = isinstance(run_name, str) and reap(run_name, detail["executionArn"], detail["status"])
        reaped = [run_name] if ended else []
    else:
        reaped = sweep()
    logger.info("reaped", runs=reaped)
    return {"reaped": reaped}
