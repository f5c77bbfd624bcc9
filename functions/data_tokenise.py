"""DataTokenise: one work item of a preparation into its shard and part record (functions/data_prep.py)."""

import json
from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import logger, tracer, transient_errors_named
from functions.data_prep import FAILED_PREFIX, ItemInput, preparation_of
from trainer import prepare
from trainer.prepare import PrepareError


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=ItemInput)
def handler(event: ItemInput, context: LambdaContext) -> dict[str, Any]:
    preparation, tok = preparation_of(event.destination)
    try:
        part = prepare.tokenise_item(event.item, tok, preparation.store, event.skip_bad)
    except PrepareError as error:
        preparation.store.write(f"{FAILED_PREFIX}{event.item['number']:05d}.json",
                                json.dumps({"item": event.item, "error": str(error)}).encode())
        raise
    logger.info("item tokenised", number=part["number"], tokens=part["tokens"], documents=part["documents"])
    return {key: part[key] for key in ("number", "tokens", "documents", "bad_records")}
