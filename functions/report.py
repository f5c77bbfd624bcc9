"""Report: write the run report (trainfleet/report/files.py: report.json, report.html and its
plots as PNGs) under s3://BUCKET/runs/RUN/, and the run's final metrics."""

from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import RunPayload, aws, logger, report_prefix, tracer, transient_errors_named
from trainfleet.adapters.metrics import emit, lost_time_metrics, run_metrics
from trainfleet.adapters.run_history import read_history
from trainfleet.report.files import REPORT_HTML, report_files


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=RunPayload)
def handler(event: RunPayload, context: LambdaContext) -> dict[str, Any]:
    return {"report_uri": write_report(event.run.run_name)}


def write_report(run_name: str) -> str:
    """Write the run's report to S3 and emit its final metrics; the report page's URI."""
    cloud = aws()
    run, nodes = cloud.store.run(run_name), cloud.store.nodes(run_name)
    history = read_history(cloud.store, cloud.sfn, run, nodes, datetime.now(timezone.utc))
    prefix = report_prefix(run_name)
    for name, file in report_files(run, nodes, history).items():
        cloud.s3.put_object(Bucket=cloud.settings.bucket, Key=prefix + name, ContentType=file.content_type,
                            Body=file.body)
    emit(run_metrics(run, cloud.settings.metrics_namespace))
    for document in lost_time_metrics(run, cloud.settings.metrics_namespace):
        emit(document)
    logger.info("run report written", run_name=run_name, state=run.state.value, restarts=run.restarts)
    return f"s3://{cloud.settings.bucket}/{prefix}{REPORT_HTML}"
