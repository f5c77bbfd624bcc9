"""DynamoDB in the local cloud writes one item at a time: of writers racing on one version,
exactly one wins, as on DynamoDB (moto checks a condition and then writes, with no lock)."""

import threading
import time
import uuid

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
