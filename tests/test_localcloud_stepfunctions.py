"""Step Functions in the local cloud: moto's interpreter with in-process Lambda and the glue."""

import json
import logging
import re
from datetime import datetime
import sys
import time
from pathlib import Path

import pytest

from localcloud import LocalCloud
from localcloud.cloud import EVENT_WAIT_S
from localcloud.waiting import run_captured
from localcloud_helpers import (create_state_machine, deploy_function, event_sink, history, receive, records,
                                run_execution, unique, wait_for_execution)

TASK_CLIENT = Path(__file__).with_name("localcloud_task_client.py")


def test_lambda_tasks_choice_map_retry_and_catch(local_cloud, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    double = deploy_function(local_cloud, "double")
    flaky = deploy_function(local_cloud, "fail_until", tmp_path / "flaky.jsonl")
    broken = deploy_function(local_cloud, "always_fail")
    definition = {
        "StartAt": "Double",
        "States": {
            "Double": {"Type": "Task", "Resource": "arn:aws:states:::lambda:invoke",
                       "Parameters": {"FunctionName": double, "Payload": {"value.$": "$.value"}},
                       "ResultSelector": {"value.$": "$.Payload.value"},
                       "ResultPath": "$.first", "Next": "Big?"},
            "Big?": {"Type": "Choice",
                     "Choices": [{"Variable": "$.first.value", "NumericGreaterThan": 5, "Next": "EachItem"}],
                     "Default": "Small"},
            "Small": {"Type": "Fail", "Error": "TooSmall"},
            "EachItem": {"Type": "Map", "ItemsPath": "$.items", "ResultPath": "$.doubled",
                         "Parameters": {"value.$": "$$.Map.Item.Value"},
                         "Iterator": {"StartAt": "DoubleItem", "States": {
                             "DoubleItem": {"Type": "Task", "Resource": double, "End": True}}},
                         "Next": "Flaky"},
            "Flaky": {"Type": "Task", "Resource": flaky, "Parameters": {"succeed_on": 3},
                      "ResultPath": "$.flaky",
                      "Retry": [{"ErrorEquals": ["CapacityError"], "MaxAttempts": 3,
                                 "IntervalSeconds": 5, "BackoffRate": 2}],
                      "Next": "Broken"},
            "Broken": {"Type": "Task", "Resource": broken,
                       "Catch": [{"ErrorEquals": ["CapacityError"], "ResultPath": "$.caught",
                                  "Next": "Done"}],
                       "End": True},
            "Done": {"Type": "Succeed"},
        },
    }
    machine = create_state_machine(local_cloud, definition)

    done = run_execution(local_cloud, machine, {"value": 3, "items": [1, 2]})

    assert done["status"] == "SUCCEEDED", done
    output = json.loads(done["output"])
    assert output["first"] == {"value": 6}
    assert output["doubled"] == [{"value": 2}, {"value": 4}]
    assert output["flaky"] == {"attempts": 3}
    assert len(records(tmp_path / "flaky.jsonl")) == 3
    assert output["caught"]["Error"] == "CapacityError"
    assert json.loads(output["caught"]["Cause"])["errorMessage"] == "never any capacity"

    small = run_execution(local_cloud, machine, {"value": 1, "items": []})
    assert small["status"] == "FAILED" and small["error"] == "TooSmall"
    # The failures retried, caught and final are in the executions' histories, as Step Functions
    # keeps them; the interpreter printed none of them (`trainfleet local up`'s terminal).
    said = [record.getMessage() for record in caplog.records if record.name.startswith("moto.stepfunctions")
            and record.levelno >= logging.WARNING]
    assert said == [], [line[:300] for line in said]


def test_jsonata_and_jsonpath_assign_variables(local_cloud):
    definition = {
        "StartAt": "Remember",
        "States": {
            "Remember": {"Type": "Pass", "Assign": {"run.$": "$.run", "nodes.$": "$.nodes"},
                         "Next": "Compute"},
            "Compute": {"Type": "Pass", "QueryLanguage": "JSONata",
                        "Assign": {"total": "{% $sum($nodes) %}"},
                        "Output": {"label": "{% $run & ' has ' & $string($count($nodes)) & ' nodes' %}",
                                   "quoted": "{% $run %}"},
                        "Next": "Report"},
            "Report": {"Type": "Pass", "Parameters": {"total.$": "$total", "label.$": "$.label",
                                                      "quoted.$": "$.quoted"},
                       "End": True},
        },
    }
    machine = create_state_machine(local_cloud, definition)

    done = run_execution(local_cloud, machine, {"run": 'say "hi"\n', "nodes": [4, 5, 6]})

    assert done["status"] == "SUCCEEDED", done
    assert json.loads(done["output"]) == {"total": 15, "label": 'say "hi"\n has 3 nodes',
                                          "quoted": 'say "hi"\n'}


def wait_for_token(record_file: Path) -> str:
    deadline = time.monotonic() + EVENT_WAIT_S
    while not records(record_file):
        if time.monotonic() > deadline:
            raise TimeoutError("the task never handed out its token")
        time.sleep(0.05)
    return records(record_file)[0]["token"]


def answer(cloud, token: str, action: str, error: str = "") -> None:
    """Answer a task token from a separate process, through the HTTP endpoint."""
    answered = run_captured([sys.executable, str(TASK_CLIENT), token, action, error],
                            what=f"the task client's {action}", env=cloud.env() | {"PATH": "/usr/bin:/bin"})
    assert answered.returncode == 0, answered.stderr


def callback_machine(cloud, record_file: Path, heartbeat_s: int | None, catch: list[str],
                     timeout_s: int | None = 60) -> str:
    task = {"Type": "Task", "Resource": "arn:aws:states:::lambda:invoke.waitForTaskToken",
            "Parameters": {"FunctionName": deploy_function(cloud, "store_token", record_file),
                           "Payload": {"token.$": "$$.Task.Token"}},
            "ResultPath": "$.answer", "End": True}
    if timeout_s is not None:
        task["TimeoutSeconds"] = timeout_s
    if heartbeat_s is not None:
        task["HeartbeatSeconds"] = heartbeat_s
    if catch:
        task["Catch"] = [{"ErrorEquals": catch, "ResultPath": "$.caught", "Next": "Recovered"}]
    return create_state_machine(cloud, {"StartAt": "AwaitAgent", "States": {
        "AwaitAgent": task, "Recovered": {"Type": "Pass", "End": True}}})


def start(cloud, machine: str) -> str:
    return cloud.client("stepfunctions").start_execution(
        stateMachineArn=machine, name=unique("run"), input="{}")["executionArn"]


@pytest.mark.slow
def test_task_token_answered_from_another_process(local_cloud, tmp_path):
    machine = callback_machine(local_cloud, tmp_path / "ok.jsonl", heartbeat_s=30, catch=["AgentFailed"])
    succeeding = start(local_cloud, machine)
    token = wait_for_token(tmp_path / "ok.jsonl")
    answer(local_cloud, token, "heartbeat")
    answer(local_cloud, token, "success")
    done = wait_for_execution(local_cloud, succeeding)
    assert done["status"] == "SUCCEEDED", done
    assert json.loads(done["output"])["answer"] == {"answered_by": "agent"}

    machine = callback_machine(local_cloud, tmp_path / "fail.jsonl", heartbeat_s=30, catch=["AgentFailed"])
    failing = start(local_cloud, machine)
    answer(local_cloud, wait_for_token(tmp_path / "fail.jsonl"), "failure", "AgentFailed")
    done = wait_for_execution(local_cloud, failing)
    assert done["status"] == "SUCCEEDED", done
    assert json.loads(done["output"])["caught"] == {"Error": "AgentFailed",
                                                    "Cause": "reported by the agent"}


def test_a_second_answer_to_a_task_token_is_refused_with_task_timed_out(local_cloud, tmp_path):
    """Step Functions takes the first answer; a later SendTaskSuccess/Failure is TaskTimedOut
    (a client error, never a server fault that the SDK would retry)."""
    machine = callback_machine(local_cloud, tmp_path / "twice.jsonl", heartbeat_s=None, catch=[])
    sfn = local_cloud.client("stepfunctions")
    definition = json.loads(sfn.describe_state_machine(stateMachineArn=machine)["definition"])
    del definition["States"]["AwaitAgent"]["End"]
    definition["States"]["AwaitAgent"]["Next"] = "Linger"
    definition["States"]["Linger"] = {"Type": "Wait", "Seconds": 300, "End": True}  # 6 s scaled
    sfn.update_state_machine(stateMachineArn=machine, definition=json.dumps(definition))
    start(local_cloud, machine)
    token = wait_for_token(tmp_path / "twice.jsonl")
    sfn.send_task_success(taskToken=token, output="{}")
    for second in (lambda: sfn.send_task_success(taskToken=token, output="{}"),
                   lambda: sfn.send_task_failure(taskToken=token, error="Late")):
        with pytest.raises(sfn.exceptions.TaskTimedOut):
            second()


@pytest.mark.slow
@pytest.mark.parametrize("catch", [["States.HeartbeatTimeout"], ["States.Timeout"], []])
def test_missed_heartbeat_is_states_heartbeat_timeout(local_cloud, tmp_path, catch):
    record_file = tmp_path / "token.jsonl"
    execution = start(local_cloud, callback_machine(local_cloud, record_file, heartbeat_s=1, catch=catch))
    wait_for_token(record_file)  # the agent got its token and then never beats

    done = wait_for_execution(local_cloud, execution)

    if catch:
        assert done["status"] == "SUCCEEDED", done
        assert json.loads(done["output"])["caught"]["Error"] == "States.HeartbeatTimeout"
    else:
        assert done["status"] == "FAILED" and done["error"] == "States.HeartbeatTimeout"
    timed_out = [event for event in history(local_cloud, execution) if event["type"] == "TaskTimedOut"]
    assert timed_out[0]["taskTimedOutEventDetails"]["error"] == "States.HeartbeatTimeout"


@pytest.mark.slow
def test_a_task_with_heartbeats_and_no_timeout_runs_past_a_minute(local_cloud, tmp_path):
    """AWS's default TimeoutSeconds is 99999999 whether or not the task has HeartbeatSeconds:
    a task kept alive by heartbeats for more than a minute is not timed out."""
    record_file = tmp_path / "token.jsonl"
    execution = start(local_cloud, callback_machine(local_cloud, record_file, heartbeat_s=10, catch=[],
                                                    timeout_s=None))
    token = wait_for_token(record_file)
    sfn = local_cloud.client("stepfunctions")
    beating_until = time.monotonic() + 70
    while time.monotonic() < beating_until:
        sfn.send_task_heartbeat(taskToken=token)
        time.sleep(5)
    assert sfn.describe_execution(executionArn=execution)["status"] == "RUNNING"
    sfn.send_task_success(taskToken=token, output=json.dumps({"trained": "70 s"}))

    done = wait_for_execution(local_cloud, execution)
    assert done["status"] == "SUCCEEDED", done
    assert json.loads(done["output"])["answer"] == {"trained": "70 s"}


def test_wait_and_retry_run_on_scaled_time():
    """An hour of Wait and a ten-minute Retry interval take seconds at time_scale 0.0005."""
    with LocalCloud(time_scale=0.0005) as cloud:
        broken = deploy_function(cloud, "always_fail")
        machine = create_state_machine(cloud, {"StartAt": "Nap", "States": {
            "Nap": {"Type": "Wait", "Seconds": 3600, "Next": "Try"},
            "Try": {"Type": "Task", "Resource": broken,
                    "Retry": [{"ErrorEquals": ["States.ALL"], "MaxAttempts": 1, "IntervalSeconds": 600}],
                    "End": True}}})
        execution = start(cloud, machine)
        done = wait_for_execution(cloud, execution)
        attempts = [event for event in history(cloud, execution) if event["type"] == "LambdaFunctionFailed"]
    assert done["status"] == "FAILED" and done["error"] == "CapacityError"
    assert len(attempts) == 2


def test_service_integrations_start_executions_and_return_timestamps(local_cloud):
    child = create_state_machine(local_cloud, {"StartAt": "Answer", "States": {
        "Answer": {"Type": "Pass", "Result": {"child": "done"}, "End": True}}})
    queue_url = local_cloud.client("sqs").create_queue(QueueName=unique("integration"))["QueueUrl"]
    instance = local_cloud.client("ec2").run_instances(
        MinCount=1, MaxCount=1, ImageId="ami-12c6146b", InstanceType="t3.micro")["Instances"][0]
    machine = create_state_machine(local_cloud, {"StartAt": "Child", "States": {
        "Child": {"Type": "Task", "Resource": "arn:aws:states:::states:startExecution.sync:2",
                  "Parameters": {"StateMachineArn": child, "Input": {"from": "parent"}},
                  "ResultSelector": {"output.$": "$.Output", "status.$": "$.Status"},
                  "ResultPath": "$.child", "Next": "FireAndForget"},
        "FireAndForget": {"Type": "Task", "Resource": "arn:aws:states:::states:startExecution",
                          "Parameters": {"StateMachineArn": child}, "ResultPath": "$.started",
                          "Next": "Notify"},
        "Notify": {"Type": "Task", "Resource": "arn:aws:states:::sqs:sendMessage",
                   "Parameters": {"QueueUrl": queue_url, "MessageBody": {"done": True}},
                   "ResultPath": "$.sent", "Next": "Describe"},
        "Describe": {"Type": "Task", "Resource": "arn:aws:states:::aws-sdk:ec2:describeInstances",
                     "Parameters": {"InstanceIds": [instance["InstanceId"]]},
                     "ResultSelector": {"reservations.$": "$.Reservations"},
                     "ResultPath": "$.described", "End": True}}})

    done = run_execution(local_cloud, machine, {})

    assert done["status"] == "SUCCEEDED", done
    output = json.loads(done["output"])
    assert output["child"] == {"output": {"child": "done"}, "status": "SUCCEEDED"}
    assert output["started"]["ExecutionArn"].startswith(child.replace(":stateMachine:", ":execution:"))
    assert "MessageId" in output["sent"]
    [described] = output["described"]["reservations"][0]["Instances"]
    assert described["InstanceId"] == instance["InstanceId"]
    assert datetime.fromisoformat(described["LaunchTime"]).year >= 2024


def test_executions_send_their_status_changes_to_the_default_bus(local_cloud, tmp_path):
    """As Step Functions does for Standard workflows: one event when an execution starts, one
    when it ends, also when it is stopped (where no Catch runs)."""
    record_file = tmp_path / "token.jsonl"
    machine = callback_machine(local_cloud, record_file, heartbeat_s=None, catch=[])
    sink = event_sink(local_cloud, {"source": ["aws.states"],
                                    "detail-type": ["Step Functions Execution Status Change"],
                                    "detail": {"stateMachineArn": [machine]}})
    sfn = local_cloud.client("stepfunctions")
    execution = sfn.start_execution(stateMachineArn=machine, name=unique("stopped"),
                                    input=json.dumps({"run_name": "r1"}))["executionArn"]
    wait_for_token(record_file)
    sfn.stop_execution(executionArn=execution, error="Operator", cause="stopped by hand")
    assert sfn.describe_execution(executionArn=execution)["status"] == "ABORTED", "aborted at once"

    started, stopped = receive(local_cloud, sink, 2)
    assert [started["detail"]["status"], stopped["detail"]["status"]] == ["RUNNING", "ABORTED"]
    assert stopped["source"] == "aws.states" and stopped["resources"] == [execution]
    detail = stopped["detail"]
    assert (detail["executionArn"], detail["stateMachineArn"]) == (execution, machine)
    assert json.loads(detail["input"]) == {"run_name": "r1"}
    assert isinstance(detail["startDate"], int) and detail["stopDate"] >= detail["startDate"]


AWS_TIMESTAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
"""How the context object gives times: 2019-03-26T20:14:13.192Z (Step Functions guide, Context object)."""


def test_context_object_times_are_iso_text_that_states_pass_on(local_cloud):
    machine = create_state_machine(local_cloud, {"StartAt": "Stamp", "States": {
        "Stamp": {"Type": "Pass", "Parameters": {"started.$": "$$.Execution.StartTime",
                                                 "entered.$": "$$.State.EnteredTime"}, "Next": "Context"},
        "Context": {"Type": "Pass", "QueryLanguage": "JSONata",
                    "Output": {"stamped": "{% $states.input %}", "context": "{% $states.context %}"}, "End": True}}})

    done = run_execution(local_cloud, machine, {})

    assert done["status"] == "SUCCEEDED", done
    output = json.loads(done["output"])
    started, entered = output["stamped"]["started"], output["stamped"]["entered"]
    assert re.fullmatch(AWS_TIMESTAMP, started) and re.fullmatch(AWS_TIMESTAMP, entered)
    assert started <= entered
    assert output["context"]["Execution"]["StartTime"] == started
    assert output["context"]["State"]["EnteredTime"] >= entered


def test_error_names_of_the_states_prefix_are_accepted_as_step_functions_accepts_them(local_cloud):
    machine = create_state_machine(local_cloud, {"StartAt": "Try", "States": {
        "Try": {"Type": "Parallel", "Branches": [{"StartAt": "Refuse", "States": {
                    "Refuse": {"Type": "Fail", "Error": "States.MyCustomError", "Cause": "made up"}}}],
                "Retry": [{"ErrorEquals": ["States.TaskFailedId"], "MaxAttempts": 5}],  # misspelt: never matches
                "Catch": [{"ErrorEquals": ["States.MyCustomError"], "ResultPath": "$.caught", "Next": "Caught"}],
                "End": True},
        "Caught": {"Type": "Pass", "End": True}}})

    done = run_execution(local_cloud, machine, {})

    assert done["status"] == "SUCCEEDED", done
    assert json.loads(done["output"])["caught"] == {"Error": "States.MyCustomError", "Cause": "made up"}
    uncaught = create_state_machine(local_cloud, {"StartAt": "Refuse", "States": {
        "Refuse": {"Type": "Fail", "Error": "States.MyCustomError", "Cause": "made up"}}})
    failed = run_execution(local_cloud, uncaught, {})
    assert (failed["status"], failed["error"], failed["cause"]) == ("FAILED", "States.MyCustomError", "made up")


def test_a_definition_refused_in_a_jsonata_scope_leaves_later_definitions_as_they_are(local_cloud):
    """The parser's QueryLanguage scopes were shared by every parse in the process: a refused
    JSONata definition left its scope behind, and every later JSONPath definition with a
    ResultPath was refused; executions started together parsed into each other's scopes."""
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError, match="InvalidDefinition"):
        create_state_machine(local_cloud, {"QueryLanguage": "JSONata", "StartAt": "A", "States": {
            "A": {"Type": "Pass", "ResultPath": "$.x", "End": True}}})  # ResultPath is JSONPath's alone
    machine = create_state_machine(local_cloud, {"StartAt": "A", "States": {
        "A": {"Type": "Pass", "Result": 1, "ResultPath": None, "End": True}}})

    assert run_execution(local_cloud, machine, {"kept": True})["status"] == "SUCCEEDED"


def test_errors_of_parallel_branches_and_map_iterations_keep_name_cause_and_kind(local_cloud):
    """A branch's States.Timeout reaches the Parallel's catchers as States.Timeout, which
    States.TaskFailed does not match; a Map iteration's error keeps its name and cause."""
    sleep = deploy_function(local_cloud, "sleep")
    caught_by = {"States.TaskFailed": "TaskFailed", "States.Timeout": "Timeout"}
    machine = create_state_machine(local_cloud, {"StartAt": "Both", "States": {
        "Both": {"Type": "Parallel", "ResultPath": None, "Branches": [
                     {"StartAt": "Slow", "States": {"Slow": {"Type": "Task", "Resource": sleep, "TimeoutSeconds": 1,
                                                             "End": True}}}],
                 "Catch": [{"ErrorEquals": [error], "ResultPath": "$.parallel", "Next": state}
                           for error, state in caught_by.items()],
                 "End": True},
        "TaskFailed": {"Type": "Fail", "Error": "WrongCatcher"},
        "Timeout": {"Type": "Map", "ItemsPath": "$.items", "ResultPath": None,
                    "ItemProcessor": {"StartAt": "Refuse", "States": {
                        "Refuse": {"Type": "Fail", "Error": "States.Permissions", "Cause": "item refused"}}},
                    "Catch": [{"ErrorEquals": ["States.Permissions"], "ResultPath": "$.map", "Next": "Done"}],
                    "End": True},
        "Done": {"Type": "Succeed"}}})

    done = run_execution(local_cloud, machine, {"seconds": 3, "items": [1]})

    assert done["status"] == "SUCCEEDED", done
    output = json.loads(done["output"])
    assert output["parallel"]["Error"] == "States.Timeout"
    assert output["map"] == {"Error": "States.Permissions", "Cause": "item refused"}


def test_choice_compares_against_a_path_into_the_context_object(local_cloud):
    machine = create_state_machine(local_cloud, {"StartAt": "Same?", "States": {
        "Same?": {"Type": "Choice", "Choices": [
                      {"Variable": "$.seen", "StringEqualsPath": "$$.Execution.Input.expected", "Next": "Same"},
                      {"Variable": "$.count", "NumericGreaterThanPath": "$$.Execution.Input.limit", "Next": "Over"}],
                  "Default": "Different"},
        "Same": {"Type": "Pass", "Result": {"went": "same"}, "End": True},
        "Over": {"Type": "Pass", "Result": {"went": "over"}, "End": True},
        "Different": {"Type": "Pass", "Result": {"went": "different"}, "End": True}}})

    outcomes = [json.loads(run_execution(local_cloud, machine, payload)["output"])["went"] for payload in (
        {"seen": "a", "expected": "a", "count": 0, "limit": 1},
        {"seen": "a", "expected": "b", "count": 2, "limit": 1},
        {"seen": "a", "expected": "b", "count": 1, "limit": 1})]

    assert outcomes == ["same", "over", "different"]


def test_dynamodb_integrations_carry_binary_attribute_values_as_base64_text(local_cloud):
    table = unique("binary")
    dynamodb = local_cloud.client("dynamodb")
    dynamodb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                          KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}],
                          AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}])
    item = {"pk": {"S": "blob"}, "one": {"B": "aGVsbG8="}, "many": {"BS": ["aGk=", "dGhlcmU="]},
            "nested": {"M": {"inner": {"B": "AAE="}, "flags": {"L": [{"BOOL": True}, {"NULL": True}]}}}}
    machine = create_state_machine(local_cloud, {"StartAt": "Put", "States": {
        "Put": {"Type": "Task", "Resource": "arn:aws:states:::dynamodb:putItem",
                "Parameters": {"TableName": table, "Item": item}, "ResultPath": None, "Next": "Get"},
        "Get": {"Type": "Task", "Resource": "arn:aws:states:::dynamodb:getItem",
                "Parameters": {"TableName": table, "Key": {"pk": {"S": "blob"}}}, "ResultPath": "$.optimized",
                "Next": "GetSdk"},
        "GetSdk": {"Type": "Task", "Resource": "arn:aws:states:::aws-sdk:dynamodb:getItem",
                   "Parameters": {"TableName": table, "Key": {"pk": {"S": "blob"}}}, "ResultPath": "$.sdk",
                   "End": True}}})

    done = run_execution(local_cloud, machine, {})

    assert done["status"] == "SUCCEEDED", done
    output = json.loads(done["output"])
    assert output["optimized"]["Item"] == item and output["sdk"]["Item"] == item
    stored = dynamodb.get_item(TableName=table, Key={"pk": {"S": "blob"}})["Item"]
    assert stored["one"]["B"] == b"hello" and sorted(stored["many"]["BS"]) == [b"hi", b"there"]
    assert stored["nested"]["M"]["inner"]["B"] == b"\x00\x01"


def test_execution_history_pages_in_either_order(local_cloud):
    machine = create_state_machine(local_cloud, {"StartAt": "A", "States": {
        "A": {"Type": "Pass", "Next": "B"}, "B": {"Type": "Pass", "End": True}}})
    execution = run_execution(local_cloud, machine, {})["executionArn"]
    sfn = local_cloud.client("stepfunctions")
    everything = [event["id"] for event in sfn.get_execution_history(executionArn=execution)["events"]]

    newest_first, token = [], None
    while True:
        page = sfn.get_execution_history(executionArn=execution, reverseOrder=True, maxResults=2,
                                         **({"nextToken": token} if token else {}))
        assert len(page["events"]) <= 2
        newest_first += [event["id"] for event in page["events"]]
        token = page.get("nextToken")
        if token is None:
            break

    assert everything == list(range(1, 7))
    assert newest_first == everything[::-1]
    first = sfn.get_execution_history(executionArn=execution, maxResults=2)
    with pytest.raises(sfn.exceptions.InvalidToken):
        sfn.get_execution_history(executionArn=execution, reverseOrder=True, nextToken=first["nextToken"])
