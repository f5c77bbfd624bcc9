"""DataPrep: the handlers of statemachine/data_prep.asl.json, token shards from text at any size.

Plan lists the inputs and writes the preparation's plan and the items not done yet (trainer/prepare.py)
into the destination, where the Distributed Map's ItemReader reads them; Tokenise turns one item into
its shard and part record; WriteIndex writes the index once every item's part is there. An item that
failed for good leaves `.prepare/failed-<n>.json` naming why (a malformed record, by file and line),
so what stopped a preparation is read where its shards are; run again, it does only the items left.

The tokenising is trainer/prepare.py's, as `trainfleet data prepare` runs it on a machine: the same
items give the same shards wherever they are tokenised.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Annotated, Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext
from pydantic import BaseModel, Field

from functions.common import logger, tracer, transient_errors_named
from trainer import prepare
from trainer.prepare import Preparation, PrepareError

FAILED_PREFIX = ".prepare/failed-"


class PlanInput(BaseModel):
    """The execution input, as `trainfleet data prepare --on-stack` starts it (or the console does)."""

    inputs: list[Annotated[str, Field(pattern=r"^s3://[^/]+")]] = Field(min_length=1)
    """s3:// objects or prefixes of JSON Lines (also .gz, .zst), Parquet or text."""
    tokenizer: str = Field(pattern=r"^(bytes|s3://[^/]+/.+)$")
    """A tokenizer.json's s3:// URI, or bytes."""
    destination: str = Field(pattern=r"^s3://[^/]+/.+")
    """s3://BUCKET/data/NAME."""
    text_field: str = "text"
    item_bytes: int = Field(default=prepare.ITEM_BYTES, ge=1)
    skip_bad: bool = False
    max_concurrency: int = Field(default=100, ge=1, le=10_000)
    """Items tokenised at once (the Map's MaxConcurrency): at most this many functions run."""


class ItemInput(BaseModel):
    item: dict[str, Any]
    destination: str
    skip_bad: bool


class IndexInput(BaseModel):
    destination: str


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=PlanInput)
def plan(event: PlanInput, context: LambdaContext) -> dict[str, Any]:
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


@cache
def _preparation(destination: str) -> tuple[Preparation, Any]:
    """The preparation and its tokenizer, read once per execution environment (warm invocations reuse them)."""
    preparation = Preparation.resume(destination)
    return preparation, preparation.tokenizer()


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=ItemInput)
def tokenise(event: ItemInput, context: LambdaContext) -> dict[str, Any]:
    preparation, tok = _preparation(event.destination)
    try:
        part = prepare.tokenise_item(event.item, tok, preparation.store, event.skip_bad)
    except PrepareError as error:
        preparation.store.write(f"{FAILED_PREFIX}{event.item['number']:05d}.json",
                                json.dumps({"item": event.item, "error": str(error)}).encode())
        raise
    logger.info("item tokenised", number=part["number"], tokens=part["tokens"], documents=part["documents"])
    return {key: part[key] for key in ("number", "tokens", "documents", "bad_records")}


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=IndexInput)
def write_index(event: IndexInput, context: LambdaContext) -> dict[str, Any]:
    preparation = Preparation.resume(event.destination)
    failures = failure_messages(preparation)
    try:
        index = preparation.index() or preparation.write_index()
    except PrepareError as error:
        raise PrepareError(f"{error}{'; ' + failures[0] if failures else ''}") from None
    logger.info("index written", destination=event.destination, tokens=index["tokens"], shards=len(index["shards"]))
    return {key: index[key] for key in ("documents", "tokens", "dtype", "vocab_size", "tokenizer", "bad_records")} \
        | {"shards": len(index["shards"])}


def failure_messages(preparation: Preparation) -> list[str]:
    """Why items failed for good, as their functions wrote it."""
    return [json.loads(preparation.store.read(name))["error"] for name in preparation.store.names(FAILED_PREFIX)]
