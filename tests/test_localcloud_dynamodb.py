"""DynamoDB in the local cloud writes one item at a time: of writers racing on one version,
exactly one wins, as on DynamoDB (moto checks a condition and then writes, with no lock); and a
transaction that meets another on one item is cancelled, as on DynamoDB."""

import threading
import time
import uuid

import pytest
from moto.dynamodb.models.table import Table


def test_of_writers_racing_on_one_version_exactly_one_wins(local_cloud, monkeypatch):
    dynamodb = local_cloud.client("dynamodb")
    table = f"race-{uuid.uuid4().hex[:6]}"
    dynamodb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                          KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                          AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}])
    dynamodb.put_item(TableName=table, Item={"pk": {"S": "run"}, "version": {"N": "1"}})
    # Widen the gap between reading the item a condition is checked on and writing the new one,
    # so that racing writers would all read version 1 unless writes are one at a time.
    read = Table.get_item

    def slow_read(self, *args, **kwargs):
        current = read(self, *args, **kwargs)
        time.sleep(0.05)
        return current

    monkeypatch.setattr(Table, "get_item", slow_read)
    barrier, outcomes = threading.Barrier(4), []

    def write(writer: int) -> None:
        client = local_cloud.client("dynamodb")
        barrier.wait(timeout=10)
        try:
            client.put_item(TableName=table, Item={"pk": {"S": "run"}, "version": {"N": "2"},
                                                   "writer": {"N": str(writer)}},
                            ConditionExpression="version = :seen", ExpressionAttributeValues={":seen": {"N": "1"}})
            outcomes.append("won")
        except client.exceptions.ConditionalCheckFailedException:
            outcomes.append("lost")

    threads = [threading.Thread(target=write, args=(writer,)) for writer in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcomes) == ["lost"] * 3 + ["won"]


def _table(dynamodb, name: str) -> str:
    dynamodb.create_table(TableName=name, BillingMode="PAY_PER_REQUEST",
                          KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                          AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}])
    return name


def test_a_transaction_on_an_item_of_another_under_way_is_cancelled_as_dynamodb_cancels_it(local_cloud, monkeypatch):
    # DynamoDB cancels a transaction that meets another on one item (TransactionConflict) and
    # refuses a single-item write of it, where a lock would make both wait their turn.
    dynamodb = local_cloud.client("dynamodb")
    table = _table(dynamodb, f"conflict-{uuid.uuid4().hex[:6]}")
    dynamodb.put_item(TableName=table, Item={"pk": {"S": "count"}, "n": {"N": "0"}})
    entered, release = threading.Event(), threading.Event()
    read = Table.get_item

    def held_read(self, hash_key, *args, **kwargs):
        if self.name == table and hash_key.value == "node-a":  # the first transaction, under way
            entered.set()
            release.wait(timeout=30)
        return read(self, hash_key, *args, **kwargs)

    monkeypatch.setattr(Table, "get_item", held_read)

    def count_node(node: str) -> list:
        return [{"Put": {"TableName": table, "Item": {"pk": {"S": node}}, "ConditionExpression": "attribute_not_exists(pk)"}},
                {"Update": {"TableName": table, "Key": {"pk": {"S": "count"}}, "UpdateExpression": "ADD n :one",
                            "ExpressionAttributeValues": {":one": {"N": "1"}}}}]

    first = threading.Thread(target=lambda: local_cloud.client("dynamodb").transact_write_items(
        TransactItems=count_node("node-a")))
    first.start()
    assert entered.wait(timeout=30)
    try:
        with pytest.raises(dynamodb.exceptions.TransactionCanceledException) as cancelled:
            dynamodb.transact_write_items(TransactItems=count_node("node-b"))
        assert [reason["Code"] for reason in cancelled.value.response["CancellationReasons"]] == \
            ["None", "TransactionConflict"]
        with pytest.raises(dynamodb.exceptions.TransactionConflictException):
            dynamodb.update_item(TableName=table, Key={"pk": {"S": "count"}}, UpdateExpression="ADD n :one",
                                 ExpressionAttributeValues={":one": {"N": "1"}})
        # Reads never conflict.
        assert dynamodb.get_item(TableName=table, Key={"pk": {"S": "count"}})["Item"]["n"] == {"N": "0"}
    finally:
        release.set()
        first.join(timeout=30)
    dynamodb.transact_write_items(TransactItems=count_node("node-b"))  # the first is done: no conflict now
    assert dynamodb.get_item(TableName=table, Key={"pk": {"S": "count"}})["Item"]["n"] == {"N": "2"}
