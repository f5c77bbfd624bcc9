"""DynamoDB glue: item writes one at a time, and the size of each item written.

moto 5.2.5 checks a write's condition and then writes, with no lock: two requests on server
threads can both pass `version = :seen` and both write, where DynamoDB lets exactly one win.
Its TransactWriteItems also rolls a failed transaction back by restoring a copy of each table
taken before it, which undoes every write other threads made meanwhile. Here every item write
(PutItem, UpdateItem, DeleteItem, TransactWriteItems) of the backend holds one lock, so a
conditional write and a transaction are atomic as DynamoDB documents them. Reads take no lock,
as on DynamoDB, where they never block writers.

Each item written is sized as moto sizes it against DynamoDB's 400 KB limit (attribute names
plus values) and the largest is kept in `LocalCloud.largest_payloads["dynamodb"]`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from moto.dynamodb.models import DynamoDBBackend

from localcloud.glue import active_cloud

_write_lock = threading.RLock()
"""Held by every item write; re-entered by TransactWriteItems' own puts and updates."""


def _one_at_a_time(write: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(write)
    def serialized(self: DynamoDBBackend, *args: Any, **kwargs: Any) -> Any:
        with _write_lock:
            return write(self, *args, **kwargs)
    return serialized


def _sized(write: Callable[..., Any]) -> Callable[..., Any]:
    """Note the size of the item a put or an update leaves (also those inside a transaction)."""
    @functools.wraps(write)
    def sized(self: DynamoDBBackend, table_name: str, *args: Any, **kwargs: Any) -> Any:
        item = write(self, table_name, *args, **kwargs)
        cloud = active_cloud()
        if cloud is not None:
            key = "/".join(str(part.value) for part in (item.hash_key, item.range_key) if part is not None)
            cloud.note_payload("dynamodb", item.size(), f"{table_name} {key}")
        return item
    return sized


def apply() -> None:
    DynamoDBBackend.put_item = _sized(_one_at_a_time(DynamoDBBackend.put_item))
    DynamoDBBackend.update_item = _sized(_one_at_a_time(DynamoDBBackend.update_item))
    DynamoDBBackend.delete_item = _one_at_a_time(DynamoDBBackend.delete_item)
    DynamoDBBackend.transact_write_items = _one_at_a_time(DynamoDBBackend.transact_write_items)
