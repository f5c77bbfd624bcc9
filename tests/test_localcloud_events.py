"""EventBridge in the local cloud: delivery to Lambda, Step Functions and SQS targets."""

import json
import time

import pytest

from localcloud.event_delivery import bus_event, render_input_template, target_input
from localcloud_helpers import (create_state_machine, deploy_function, event_sink, receive,
                                records, unique, wait_for_execution)

EVENT = {"version": "0", "id": "e-1", "detail-type": "NodeReady", "source": "trainfleet",
         "account": "123456789012", "time": "2026-01-02T03:04:05Z", "region": "us-east-1",
         "resources": [], "detail": {"node": "i-1", "rank": 3}}


def test_input_template_quotes_values_as_json_outside_strings():
    rendered = render_input_template('{"node": <node>, "rank": <rank>, "text": "node <node> is <rank>"}',
                                     {"node": "i-1", "rank": 3})
    assert json.loads(rendered) == {"node": "i-1", "rank": 3, "text": "node i-1 is 3"}


def test_target_input_forms():
    assert target_input({"Id": "t"}, EVENT, "r", "arn") == EVENT
    assert target_input({"Id": "t", "Input": '{"fixed": 1}'}, EVENT, "r", "arn") == {"fixed": 1}
    assert target_input({"Id": "t", "InputPath": "$.detail"}, EVENT, "r", "arn") == EVENT["detail"]
    transformer = {"InputPathsMap": {"node": "$.detail.node"},
                   "InputTemplate": '{"who": <node>, "rule": <aws.events.rule-name>}'}
    assert target_input({"Id": "t", "InputTransformer": transformer}, EVENT, "r", "arn") == \
        {"who": "i-1", "rule": "r"}
    text = {"InputPathsMap": {"node": "$.detail.node"}, "InputTemplate": '"node <node> is ready"'}
    assert target_input({"Id": "t", "InputTransformer": text}, EVENT, "r", "arn") == "node i-1 is ready"


def test_target_input_refuses_two_forms_and_bad_paths():
    with pytest.raises(ValueError, match="exclusive"):
        target_input({"Id": "t", "Input": "{}", "InputPath": "$.detail"}, EVENT, "r", "arn")
    with pytest.raises(ValueError, match="InputPath"):
        target_input({"Id": "t", "InputPath": "$.[[["}, EVENT, "r", "arn")


def test_bus_event_has_aws_time_and_no_moto_fields():
    event = bus_event({**EVENT, "time": 0, "ingestion-time": 1.5})
    assert event["time"] == "1970-01-01T00:00:00Z" and "ingestion-time" not in event


def test_rule_delivers_to_lambda_state_machine_and_queue(local_cloud, tmp_path):
    events = local_cloud.client("events")
    source = unique("test.app")
    record_file = tmp_path / "lambda.jsonl"
    function_arn = deploy_function(local_cloud, "echo", record_file)
    machine_arn = create_state_machine(local_cloud, {"StartAt": "Done", "States": {
        "Done": {"Type": "Pass", "End": True}}})
    log_group = f"/aws/events/{unique('log')}"
    local_cloud.client("logs").create_log_group(logGroupName=log_group)
    rule = unique("rule")
    events.put_rule(Name=rule, EventPattern=json.dumps({"source": [source], "detail": {"rank": [3]}}))
    events.put_targets(Rule=rule, Targets=[
        {"Id": "log", "Arn": f"arn:aws:logs:us-east-1:123456789012:log-group:{log_group}"},
        {"Id": "fn", "Arn": function_arn,
         "InputTransformer": {"InputPathsMap": {"node": "$.detail.node"},
                              "InputTemplate": '{"node": <node>}'}},
        {"Id": "sm", "Arn": machine_arn, "InputPath": "$.detail"},
    ])
    queue_url = event_sink(local_cloud, {"source": [source]})

    for rank in (3, 4):  # rank 4 matches the sink's rule only
        events.put_events(Entries=[{"Source": source, "DetailType": "NodeReady",
                                    "Detail": json.dumps({"node": "i-7", "rank": rank})}])

    delivered = receive(local_cloud, queue_url, 2)
    assert sorted(event["detail"]["rank"] for event in delivered) == [3, 4]
    assert delivered[0]["detail-type"] == "NodeReady" and delivered[0]["time"].endswith("Z")
    local_cloud.wait_until(lambda: records(record_file), "the Lambda target")
    assert [entry["event"] for entry in records(record_file)] == [{"node": "i-7"}]
    sfn = local_cloud.client("stepfunctions")
    local_cloud.wait_until(lambda: sfn.list_executions(stateMachineArn=machine_arn)["executions"], "the state machine target")
    [execution] = sfn.list_executions(stateMachineArn=machine_arn)["executions"]
    done = wait_for_execution(local_cloud, execution["executionArn"])
    assert json.loads(done["input"]) == {"node": "i-7", "rank": 3}
    logs = local_cloud.client("logs")

    def logged():
        return logs.filter_log_events(logGroupName=log_group)["events"]

    local_cloud.wait_until(logged, "the log group target")
    assert json.loads(logged()[0]["message"])["detail"] == {"node": "i-7", "rank": 3}
    assert local_cloud.delivery_failures == []


def test_disabled_rule_delivers_nothing(local_cloud):
    source = unique("test.disabled")
    disabled_queue = event_sink(local_cloud, {"source": [source]})
    events = local_cloud.client("events")
    disabled_rule = events.list_rules(NamePrefix="sink-")["Rules"]
    events.disable_rule(Name=next(rule["Name"] for rule in disabled_rule
                                  if json.loads(rule["EventPattern"]) == {"source": [source]}))
    enabled_queue = event_sink(local_cloud, {"source": [source]})

    events.put_events(Entries=[{"Source": source, "DetailType": "X", "Detail": "{}"}])

    receive(local_cloud, enabled_queue, 1)
    assert local_cloud.client("sqs").receive_message(QueueUrl=disabled_queue).get("Messages", []) == []


def test_unreachable_target_is_recorded(local_cloud):
    events = local_cloud.client("events")
    source, rule = unique("test.missing"), unique("rule")
    missing = "arn:aws:lambda:us-east-1:123456789012:function:no-such-function"
    events.put_rule(Name=rule, EventPattern=json.dumps({"source": [source]}))
    events.put_targets(Rule=rule, Targets=[{"Id": "gone", "Arn": missing}])

    events.put_events(Entries=[{"Source": source, "DetailType": "X", "Detail": "{}"}])

    local_cloud.wait_until(lambda: local_cloud.delivery_failures, "the failed delivery")
    assert local_cloud.delivery_failures[0].target_arn == missing


@pytest.mark.slow
def test_failed_lambda_target_is_retried_twice(local_cloud, tmp_path):
    record_file = tmp_path / "attempts.jsonl"
    function_arn = deploy_function(local_cloud, "fail_until", record_file)
    events = local_cloud.client("events")
    source, rule = unique("test.retry"), unique("rule")
    events.put_rule(Name=rule, EventPattern=json.dumps({"source": [source]}))
    events.put_targets(Rule=rule, Targets=[{"Id": "fn", "Arn": function_arn,
                                            "Input": json.dumps({"succeed_on": 3})}])

    events.put_events(Entries=[{"Source": source, "DetailType": "X", "Detail": "{}"}])

    local_cloud.wait_until(lambda: len(records(record_file)) == 3, "two retries")
    assert local_cloud.delivery_failures == []


def test_a_schedule_rule_sends_scheduled_events_on_scaled_time(local_cloud):
    """rate(1 minute) at time_scale 0.02: an event every 1.2 s, until the rule is disabled."""
    sqs, events = local_cloud.client("sqs"), local_cloud.client("events")
    name = unique("every-minute")
    queue_url = sqs.create_queue(QueueName=name)["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    rule_arn = events.put_rule(Name=name, ScheduleExpression="rate(1 minute)")["RuleArn"]
    events.put_targets(Rule=name, Targets=[{"Id": "queue", "Arn": queue_arn}])

    first, second = receive(local_cloud, queue_url, 2)
    assert (first["source"], first["detail-type"], first["detail"]) == ("aws.events", "Scheduled Event", {})
    assert first["resources"] == [rule_arn] and first["id"] != second["id"]

    events.disable_rule(Name=name)
    local_cloud.wait_until(lambda: not sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=0).get("Messages"), "the last event of the enabled rule")
    time.sleep(local_cloud.scaled(150))
    assert not sqs.receive_message(QueueUrl=queue_url, WaitTimeSeconds=0).get("Messages"), "a disabled rule fired"
