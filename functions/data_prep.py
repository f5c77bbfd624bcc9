"""DataPrep: what the handlers of statemachine/data_prep.asl.json share (functions/data_plan.py,
data_tokenise.py, data_index.py), token shards from text at any size.

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

from pydantic import BaseModel, Field

from trainer import prepare
from trainer.prepare import Preparation

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


@cache
def preparation_of(destination: str) -> tuple[Preparation, Any]:
    """The preparation and its tokenizer, read once per execution environment (warm invocations reuse them)."""
    preparation = Preparation.resume(destination)
    return preparation, preparation.tokenizer()


def failure_messages(preparation: Preparation) -> list[str]:
    """Why items failed for good, as their functions wrote it."""
    return [json.loads(preparation.store.read(name))["error"] for name in preparation.store.names(FAILED_PREFIX)]
