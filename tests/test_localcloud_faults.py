"""Fault injection and request counting at the local cloud's endpoint and in its glue."""

import json

from localcloud_helpers import create_state_machine, deploy_function, records, run_execution, unique


def test_every_request_over_http_is_counted_by_service_and_action(local_cloud):
    bucket, table = unique("count"), unique("count")
    s3, dynamodb = local_cloud.client("s3"), local_cloud.client("dynamodb")
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="a/b.txt", Body=b"x")
    s3.copy_object(Bucket=bucket, Key="c.txt", CopySource={"Bucket": bucket, "Key": "a/b.txt"})
    s3.get_object(Bucket=bucket, Key="c.txt")
    s3.get_object(Bucket=bucket, Key="a/b.txt")
    s3.list_objects_v2(Bucket=bucket)
    dynamodb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                          KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
                          AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}])
    dynamodb.put_item(TableName=table, Item={"k": {"S": "1"}})
    local_cloud.client("ec2").describe_instances()
    local_cloud.client("events").put_events(Entries=[{"Source": "test", "DetailType": "x", "Detail": "{}"}])
    local_cloud.client("stepfunctions").list_state_machines()

    counted = local_cloud.requests
    assert counted[("s3", "CreateBucket")] == 1 and counted[("s3", "PutObject")] == 1
    assert counted[("s3", "CopyObject")] == 1 and counted[("s3", "GetObject")] == 2
    assert counted[("s3", "ListObjectsV2")] == 1
    assert counted[("dynamodb", "CreateTable")] == 1 and counted[("dynamodb", "PutItem")] == 1
    assert counted[("ec2", "DescribeInstances")] == 1
    assert counted[("events", "PutEvents")] == 1
    assert counted[("states", "ListStateMachines")] == 1


def test_state_transitions_and_lambda_invocations_are_counted(local_cloud, tmp_path):
    echo = deploy_function(local_cloud, "echo", tmp_path / "echo.jsonl")
    machine = create_state_machine(local_cloud, {"StartAt": "First", "States": {
        "First": {"Type": "Pass", "Next": "Call"},
        "Call": {"Type": "Task", "Resource": "arn:aws:states:::lambda:invoke",
                 "Parameters": {"FunctionName": echo, "Payload": {}}, "Next": "Done"},
        "Done": {"Type": "Succeed"}}})
    invokes_before = local_cloud.requests[("lambda", "Invoke")]

    assert run_execution(local_cloud, machine, {})["status"] == "SUCCEEDED"
    local_cloud.client("lambda").invoke(FunctionName=echo, Payload=b"{}")

    assert local_cloud.state_transitions[machine.split(":")[-1]] == 3
    assert local_cloud.lambda_invocations[echo.split(":")[-1]] == 2 == len(records(tmp_path / "echo.jsonl"))
    # The state machine's Lambda task calls Invoke over HTTP, as Step Functions calls Lambda.
    assert local_cloud.requests[("lambda", "Invoke")] - invokes_before == 2
    assert local_cloud.requests[("states", "StartExecution")] == 1


def test_lambda_invocations_by_an_eventbridge_rule_are_counted_though_not_requests(local_cloud, tmp_path):
    echo = deploy_function(local_cloud, "echo", tmp_path / "echo.jsonl")
    events, rule = local_cloud.client("events"), unique("rule")
    events.put_rule(Name=rule, EventPattern=json.dumps({"source": ["counting"]}))
    events.put_targets(Rule=rule, Targets=[{"Id": "echo", "Arn": echo}])
    invokes_before = local_cloud.requests[("lambda", "Invoke")]

    events.put_events(Entries=[{"Source": "counting", "DetailType": "x", "Detail": "{}"}])

    local_cloud.wait_until(lambda: records(tmp_path / "echo.jsonl"), 10, "the rule's target to run")
    assert local_cloud.lambda_invocations[echo.split(":")[-1]] == 1
    assert local_cloud.requests[("lambda", "Invoke")] == invokes_before
