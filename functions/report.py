"""Report: write the run report (outcome, attempts, failures, checkpoint, goodput, lost time by
cause, nodes) to S3, and the run's final metrics."""

import json
from collections import Counter
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import RunPayload, aws, logger, report_key, tracer, transient_errors_named
from trainfleet.adapters.metrics import emit, lost_time_metrics, run_metrics
from trainfleet.contracts import NodeRecord, RunRecord
from trainfleet.lifecycle import unaccounted_seconds


def build_report(run: RunRecord, nodes: list[NodeRecord]) -> dict[str, Any]:
    """The report document: what happened, for people and for tooling."""
    return {
        "run_name": run.run_name,
        "execution_arn": run.execution_arn,
        "state": run.state.value,
        "error": run.error,
        "attempts": run.attempt + 1,
        "restarts": run.restarts,
        "failures": [failure.model_dump(mode="json") for failure in run.failures],
        "plan": run.plan.model_dump() if run.plan else None,
        "latest_checkpoint": run.latest_checkpoint.model_dump(mode="json") if run.latest_checkpoint else None,
        "last_step": run.last_step,
        "goodput": run.ledger.goodput,
        "ledger": run.ledger.model_dump(mode="json"),
        # Creation to the last booking less what the books hold: ~0 when every second is booked once.
        "unaccounted_seconds": unaccounted_seconds(run) if run.created_at else None,
        "nodes": {
            "launched": len(nodes),
            "by_state": dict(Counter(node.state.value for node in nodes)),
            "replaced": sorted(node.instance_id for node in nodes if node.failure_class is not None),
        },
        "created_at": run.created_at.isoformat() if run.created_at else None,
        "updated_at": run.updated_at.isoformat() if run.updated_at else None,
    }


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=RunPayload)
def handler(event: RunPayload, context: LambdaContext) -> dict[str, Any]:
    return {"report_uri": write_report(event.run.run_name)}


def write_report(run_name: str) -> str:
    """Write the run's report to S3 and emit its final metrics; the report's URI."""
    cloud = aws()
    run = cloud.store.run(run_name)
    report = build_report(run, cloud.store.nodes(run_name))
    key = report_key(run_name)
    cloud.s3.put_object(Bucket=cloud.settings.bucket, Key=key, ContentType="application/json",
                        Body=json.dumps(report, indent=2).encode())
    emit(run_metrics(run, cloud.settings.metrics_namespace))
    for document in lost_time_metrics(run, cloud.settings.metrics_namespace):
        emit(document)
    logger.info("run report written", run_name=run_name, state=run.state.value, restarts=run.restarts)
    return f"s3://{cloud.settings.bucket}/{key}"
