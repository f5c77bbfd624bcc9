"""DataPlan: list a preparation's inputs, write its plan and the items not done yet where the
Distributed Map's ItemReader reads them (functions/data_prep.py)."""

import json
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import logger, tracer, transient_errors_named
from functions.data_prep import FAILED_PREFIX, PlanInput
from trainer import prepare
from trainer.prepare import Preparation


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=PlanInput)
def handler(event: PlanInput, context: LambdaContext) -> dict[str, Any]:
    preparation = Preparation.start(event.inputs, event.tokenizer, event.destination, event.text_field,
                                    event.item_bytes)
    pending = [] if preparation.index() is not None else preparation.pending()
    for name in preparation.store.names(FAILED_PREFIX):  # failures of an earlier execution, tried again now
        preparation.store.delete(name)
    preparation.store.write(prepare.ITEMS_NAME, json.dumps(pending).encode())
    store = preparation.store
    logger.info("preparation planned", destination=event.destination, items=len(preparation.plan["items"]),
                pending=len(pending))
    return {"destination": event.destination, "skip_bad": event.skip_bad, "pending": len(pending),
            "max_concurrency": event.max_concurrency,
            "items": {"Bucket": store.bucket, "Key": store.key(prepare.ITEMS_NAME)},
            "results": {"Bucket": store.bucket, "Prefix": store.key(".prepare/map-runs")}}
