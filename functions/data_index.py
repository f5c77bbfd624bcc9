"""DataIndex: a preparation's index, once every item's shard is there; else what is left and why
(functions/data_prep.py)."""

from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import logger, tracer, transient_errors_named
from functions.data_prep import IndexInput, failure_messages
from trainer.prepare import Preparation, PrepareError


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=IndexInput)
def handler(event: IndexInput, context: LambdaContext) -> dict[str, Any]:
    preparation = Preparation.resume(event.destination)
    failures = failure_messages(preparation)
    try:
        index = preparation.index() or preparation.write_index()
    except PrepareError as error:
        raise PrepareError(f"{error}{'; ' + failures[0] if failures else ''}") from None
    logger.info("index written", destination=event.destination, tokens=index["tokens"], shards=len(index["shards"]))
    return {key: index[key] for key in ("documents", "tokens", "dtype", "vocab_size", "tokenizer", "bad_records")} \
        | {"shards": len(index["shards"])}
