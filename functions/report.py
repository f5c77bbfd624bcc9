"""Report: write the run report (outcome, attempts, failures, checkpoint, goodput, nodes) to S3."""

import json
from collections import Counter
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import RunPayload, aws, logger, report_key, tracer, transient_errors_named
from trainfleet.adapters.metrics import emit, run_metrics
from trainfleet.contracts import NodeRecord, RunRecord


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
        "ledger": run.ledger.model_dump(),
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
    cloud, name = aws(), event.run.run_name
    run = cloud.store.run(name)
    report = build_report(run, cloud.store.nodes(name))
    key = report_key(name)
    cloud.s3.put_object(Bucket=cloud.settings.bucket, Key=key, ContentType="application/json",
                        Body=json.dumps(report, indent=2).encode())
    emit(run_metrics(run, cloud.settings.metrics_namespace))
    logger.info("run report written", run_name=name, state=run.state.value, restarts=run.restarts)
    return {"report_uri": f"s3://{cloud.settings.bucket}/{key}"}
