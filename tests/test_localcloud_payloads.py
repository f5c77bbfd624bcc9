"""The local cloud keeps the largest payload of each kind, sized as each service sizes it
against its limit: a state's input or output, a DynamoDB item written, an event put."""

import json
import uuid

from localcloud.glue.events import entry_size


def test_the_largest_state_input_or_output_is_kept_with_its_state(local_cloud):
    sfn = local_cloud.client("stepfunctions")
    result = {"blob": "x" * 3000}
    definition = {"StartAt": "Grow", "States": {
        "Grow": {"Type": "Pass", "Result": result, "Next": "Shrink"},
        "Shrink": {"Type": "Pass", "Result": {"small": 1}, "End": True}}}
    name = f"payloads-{uuid.uuid4().hex[:6]}"
    machine = sfn.create_state_machine(name=name, definition=json.dumps(definition),
                                       roleArn="arn:aws:iam::123456789012:role/sfn")["stateMachineArn"]
    local_cloud.largest_payloads.clear()
    execution = sfn.start_execution(stateMachineArn=machine, name=uuid.uuid4().hex, input=json.dumps({"a": 1}))
    local_cloud.wait_until(lambda: sfn.describe_execution(executionArn=execution["executionArn"])["status"]
                           != "RUNNING", "the execution to end")
    largest = local_cloud.largest_payloads["states"]
    # Grow's output is Shrink's input: both the result, as the history writes it.
    assert largest.size_bytes == len(json.dumps(result, separators=(",", ":")).encode())
    assert largest.what in (f"{name} Grow output", f"{name} Shrink input")


def test_the_largest_item_written_is_kept_with_its_key_and_a_bigger_update_replaces_it(local_cloud):
    dynamodb = local_cloud.client("dynamodb")
    table = f"sizes-{uuid.uuid4().hex[:6]}"
    dynamodb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                          KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                          AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}])
    local_cloud.largest_payloads.clear()
    dynamodb.put_item(TableName=table, Item={"pk": {"S": "k"}, "blob": {"S": "é" * 500}})
    # Attribute names and values in UTF-8: pk (2) + k (1) + blob (4) + 500 two-byte characters.
    assert local_cloud.largest_payloads["dynamodb"] == (2 + 1 + 4 + 1000, f"{table} k")
    dynamodb.update_item(TableName=table, Key={"pk": {"S": "k"}}, UpdateExpression="SET n = :n",
                         ExpressionAttributeValues={":n": {"N": "12345"}})
    assert local_cloud.largest_payloads["dynamodb"].size_bytes == 1007 + 1 + 5
    dynamodb.put_item(TableName=table, Item={"pk": {"S": "small"}})
    assert local_cloud.largest_payloads["dynamodb"].size_bytes == 1013, "a smaller item leaves the largest"


def test_the_largest_event_is_sized_as_eventbridge_sizes_an_entry(local_cloud):
    events = local_cloud.client("events")
    entry = {"Source": "trainfleet", "DetailType": "NodeReady", "Detail": json.dumps({"instance_id": "i-1" * 200}),
             "Resources": ["arn:aws:ec2:us-east-1:123456789012:instance/i-1"]}
    assert entry_size(entry) == len("trainfleet") + len("NodeReady") + len(entry["Detail"]) + len(entry["Resources"][0])
    assert entry_size({**entry, "Time": "2026-01-01T00:00:00Z"}) == entry_size(entry) + 14
    local_cloud.largest_payloads.clear()
    events.put_events(Entries=[entry, {**entry, "Detail": "{}"}])
    assert local_cloud.largest_payloads["events"] == (entry_size(entry), "trainfleet NodeReady")
