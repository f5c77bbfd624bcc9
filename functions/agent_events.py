"""AgentEvents: the node agents' events, in batches that EventBridge queued and Lambda hands over.

After a recovery every node reports ready within seconds; one invocation takes a batch of
them (template.yaml: up to 100 gathered for a second) instead of one invocation per node. Each
record's body is the EventBridge event itself, processed as functions.events processes every
event, idempotent on its id. A record that raised is named in batchItemFailures: only it goes
back to the queue, to be tried again once its visibility timeout lapses.
"""

from typing import Any

from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType, process_partial_response
from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import logger, metrics, tracer
from functions.events import idempotent_processing

processor = BatchProcessor(event_type=EventType.SQS)


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def handler(event: dict[str, Any], context: LambdaContext) -> dict[str, Any]:
    process = idempotent_processing(context)

    def record_handler(record: SQSRecord) -> dict[str, str]:
        return process(event=record.json_body)

    return process_partial_response(event=event, record_handler=record_handler, processor=processor, context=context)
