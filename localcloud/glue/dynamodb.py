"""DynamoDB glue: item writes one at a time, transactions that conflict as DynamoDB's do, and the
size of each item written.

moto 5.2.5 checks a write's condition and then writes, with no lock: two requests on server
threads can both pass `version = :seen` and both write, where DynamoDB lets exactly one win.
Its TransactWriteItems also rolls a failed transaction back by restoring a copy of each table
taken before it, which undoes every write other threads made meanwhile. Here every item write
(PutItem, UpdateItem, DeleteItem, TransactWriteItems) of the backend holds one lock, so a
conditional write and a transaction are atomic as DynamoDB documents them. Reads take no lock,
as on DynamoDB, where they never block writers.

That lock alone would make transactions wait for each other, where DynamoDB cancels them
("Transaction conflict handling", DynamoDB developer guide): an item of a TransactWriteItems that
is part of another one under way cancels the later one (TransactionCanceledException, reason
TransactionConflict for that item), and a PutItem, UpdateItem or DeleteItem of such an item is
refused (TransactionConflictException). A transaction is under way here from the moment the
backend takes it until its writes are done (waiting for the lock included: on DynamoDB a
transaction's items are held from its prepare phase to its commit). GetItem never conflicts.

Each item written is sized as moto sizes it against DynamoDB's 400 KB limit (attribute names
plus values) and the largest is kept in `LocalCloud.largest_payloads["dynamodb"]`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from moto.dynamodb.exceptions import ERROR_TYPE_PREFIX, DynamodbException, TransactionCanceledException
from moto.dynamodb.models import DynamoDBBackend

from localcloud.glue import active_cloud

_write_lock = threading.RLock()
"""Held by every item write; re-entered by TransactWriteItems' own puts and updates."""
_transactions_lock = threading.Lock()
_in_transactions: set[tuple[str, str]] = set()
"""(table, key) of every item of the transactions under way."""
_this_thread = threading.local()
"""`items`: the (table, key) of the transaction this server thread runs, while it runs one."""

CONFLICT_MESSAGE = "Transaction is ongoing for the item"


class TransactionConflict(DynamodbException):
    """What DynamoDB answers a single-item write of an item a transaction under way holds."""

    def __init__(self) -> None:
        super().__init__(ERROR_TYPE_PREFIX + "TransactionConflictException", CONFLICT_MESSAGE)


def _item_key(backend: DynamoDBBackend, table_name: str, key_or_item: dict[str, Any]) -> tuple[str, str] | None:
    """(table, the item's key) of a write's Key or Item; None for a table that does not exist
    (moto answers that request itself)."""
    table = backend.tables.get(table_name)
    if table is None:
        return None
    names = [name for name in (table.hash_key_attr, table.range_key_attr) if name]
    return table_name, repr([key_or_item.get(name) for name in names])


def _refuse_if_in_transaction(backend: DynamoDBBackend, table_name: str, key_or_item: dict[str, Any]) -> None:
    """TransactionConflictException for a single-item write of an item of a transaction under way
    (other than the one this thread runs: its own writes go through here too)."""
    key = _item_key(backend, table_name, key_or_item)
    own = getattr(_this_thread, "items", ())
    with _transactions_lock:
        if key in _in_transactions and key not in own:
            raise TransactionConflict()


def _single_item_write(write: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(write)
    def one_at_a_time(self: DynamoDBBackend, table_name: str, key_or_item: dict[str, Any], *args: Any,
                      **kwargs: Any) -> Any:
        _refuse_if_in_transaction(self, table_name, key_or_item)
        with _write_lock:
            return write(self, table_name, key_or_item, *args, **kwargs)
    return one_at_a_time


def _transaction(transact: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(transact)
    def conflicting(self: DynamoDBBackend, transact_items: list[dict[str, Any]]) -> Any:
        keys = []
        for entry in transact_items:
            operation, detail = next(iter(entry.items()))
            keys.append(_item_key(self, detail.get("TableName", ""), detail.get("Item" if operation == "Put" else "Key")
                                  or {}))
        held = [key for key in keys if key is not None]
        with _transactions_lock:
            conflicts = [key is not None and key in _in_transactions for key in keys]
            if not any(conflicts):
                _in_transactions.update(held)
        if any(conflicts):
            raise TransactionCanceledException([("TransactionConflict", CONFLICT_MESSAGE, None) if conflict
                                                else (None, None, None) for conflict in conflicts])
        _this_thread.items = frozenset(held)
        try:
            with _write_lock:
                return transact(self, transact_items)
        finally:
            _this_thread.items = frozenset()
            with _transactions_lock:
                _in_transactions.difference_update(held)
    return conflicting


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
    DynamoDBBackend.put_item = _sized(_single_item_write(DynamoDBBackend.put_item))
    DynamoDBBackend.update_item = _sized(_single_item_write(DynamoDBBackend.update_item))
    DynamoDBBackend.delete_item = _single_item_write(DynamoDBBackend.delete_item)
    DynamoDBBackend.transact_write_items = _transaction(DynamoDBBackend.transact_write_items)
