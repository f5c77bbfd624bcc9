"""Lambda in the local cloud: handlers run in-process, reached through the HTTP endpoint."""

import io
import json
import os
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

from localcloud_helpers import HANDLERS_MODULE, deploy_function, lambda_role, receive, records, unique


def invoke(cloud, function_arn, payload):
    response = cloud.client("lambda").invoke(FunctionName=function_arn, Payload=json.dumps(payload))
    return response.get("FunctionError"), json.loads(response["Payload"].read())


def test_handler_gets_event_context_and_its_own_environment(local_cloud, tmp_path):
    record_file = tmp_path / "echo.jsonl"
    arn = deploy_function(local_cloud, "echo", record_file, timeout=7, COLOR="teal")

    error, payload = invoke(local_cloud, arn, {"step": 1})

    assert error is None and payload == {"step": 1}
    [seen] = records(record_file)
    assert seen["event"] == {"step": 1}
    assert seen["function_name"] == arn.rsplit(":", 1)[1]
    assert seen["arn"] == arn
    assert seen["color"] == "teal"
    assert 0 < seen["remaining_ms"] <= 7000
    assert len(seen["request_id"]) == 36


def test_concurrent_functions_see_only_their_own_variables(local_cloud, tmp_path):
    functions = {color: deploy_function(local_cloud, "echo", tmp_path / f"{color}.jsonl", COLOR=color)
                 for color in ("red", "green", "blue")}
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda item: invoke(local_cloud, item[1], {}),
                      list(functions.items()) * 2))
    for color in functions:
        assert [entry["color"] for entry in records(tmp_path / f"{color}.jsonl")] == [color, color]


def test_threads_a_handler_starts_see_its_functions_environment(local_cloud, tmp_path, monkeypatch):
    """A Lambda sandbox is one process: a thread pool in a handler sees the function's variables
    (its role's credentials among them), never the harness's."""
    monkeypatch.delenv("COLOR", raising=False)
    arn = deploy_function(local_cloud, "echo_from_a_thread_pool", COLOR="amber")

    error, payload = invoke(local_cloud, arn, {"variables": ["COLOR", "AWS_ACCESS_KEY_ID"]})

    assert error is None
    color, access_key = payload
    assert color == "amber"
    assert access_key and access_key != os.environ.get("AWS_ACCESS_KEY_ID")


def test_exception_becomes_error_payload_named_by_its_class(local_cloud, tmp_path):
    arn = deploy_function(local_cloud, "always_fail")

    error, payload = invoke(local_cloud, arn, {})

    assert error == "Unhandled"
    assert payload["errorType"] == "CapacityError"
    assert payload["errorMessage"] == "never any capacity"
    assert any("always_fail" in line for line in payload["stackTrace"])


def test_timeout_is_reported_as_lambda_reports_it(local_cloud):
    arn = deploy_function(local_cloud, "sleep", timeout=1)

    error, payload = invoke(local_cloud, arn, {"seconds": 3})

    assert error == "Unhandled"
    assert payload["errorType"] == "Sandbox.Timedout"
    assert "Task timed out after 1.00 seconds" in payload["errorMessage"]


def test_handler_can_call_the_local_endpoint(local_cloud):
    prefix = unique("from-handler")
    local_cloud.client("sqs").create_queue(QueueName=f"{prefix}-q")
    arn = deploy_function(local_cloud, "list_queues")

    error, payload = invoke(local_cloud, arn, {"prefix": prefix})

    assert error is None
    assert [url.rsplit("/", 1)[1] for url in payload] == [f"{prefix}-q"]


def test_bad_handlers_fail_with_the_runtime_error_types(local_cloud):
    arn = deploy_function(local_cloud, "unserializable")
    assert invoke(local_cloud, arn, {})[1]["errorType"] == "Runtime.MarshalError"

    arn = deploy_function(local_cloud, "no_such_handler")
    assert invoke(local_cloud, arn, {})[1]["errorType"] == "Runtime.HandlerNotFound"


def test_invocations_are_logged_to_cloudwatch(local_cloud):
    arn = deploy_function(local_cloud, "double")
    invoke(local_cloud, arn, {"value": 2})

    logs = local_cloud.client("logs")
    group = f"/aws/lambda/{arn.rsplit(':', 1)[1]}"
    messages = [event["message"] for event in logs.filter_log_events(logGroupName=group)["events"]]
    assert any(message.startswith("START RequestId") for message in messages)
    assert any(message.startswith("REPORT RequestId") for message in messages)


def test_different_code_under_a_loaded_module_name_is_refused(local_cloud):
    invoke(local_cloud, deploy_function(local_cloud, "double"), {"value": 1})  # loads the module
    package = io.BytesIO()
    with zipfile.ZipFile(package, "w") as archive:
        archive.writestr(f"{HANDLERS_MODULE}.py", "def double(event, context):\n    return 0\n")
    impostor = local_cloud.client("lambda").create_function(
        FunctionName=unique("impostor"), Runtime="python3.11", Role=lambda_role(local_cloud),
        Handler=f"{HANDLERS_MODULE}.double", Code={"ZipFile": package.getvalue()})["FunctionArn"]

    error, payload = invoke(local_cloud, impostor, {"value": 1})

    assert error == "Unhandled"
    assert payload["errorType"] == "Runtime.ImportModuleError"
    assert "different code" in payload["errorMessage"]


def test_event_invocation_is_queued_and_dry_run_runs_nothing(local_cloud, tmp_path):
    record_file = tmp_path / "async.jsonl"
    arn = deploy_function(local_cloud, "echo", record_file)
    lambda_client = local_cloud.client("lambda")

    dry = lambda_client.invoke(FunctionName=arn, InvocationType="DryRun", Payload=b'{"dry": 1}')
    queued = lambda_client.invoke(FunctionName=arn, InvocationType="Event", Payload=b'{"queued": 1}')

    assert dry["StatusCode"] == 204 and queued["StatusCode"] == 202
    local_cloud.wait_until(lambda: records(record_file), 10, "the queued invocation")
    assert [entry["event"] for entry in records(record_file)] == [{"queued": 1}]


def test_output_goes_to_the_log_group_and_emf_lines_become_metrics(local_cloud):
    arn = deploy_function(local_cloud, "report_progress")
    namespace = unique("trainfleet-test")

    error, _ = invoke(local_cloud, arn, {"step": 7, "loss": 2.5, "namespace": namespace})

    assert error is None
    group = f"/aws/lambda/{arn.rsplit(':', 1)[1]}"
    messages = [event["message"] for event in
                local_cloud.client("logs").filter_log_events(logGroupName=group)["events"]]
    assert "step 7 done" in messages
    cloudwatch = local_cloud.client("cloudwatch")
    [metric] = cloudwatch.list_metrics(Namespace=namespace)["Metrics"]
    assert metric["MetricName"] == "Loss"
    assert metric["Dimensions"] == [{"Name": "RunName", "Value": "run-1"}]
    points = cloudwatch.get_metric_statistics(
        Namespace=namespace, MetricName="Loss", Dimensions=metric["Dimensions"],
        StartTime=datetime.now(timezone.utc) - timedelta(minutes=5),
        EndTime=datetime.now(timezone.utc) + timedelta(minutes=1), Period=60,
        Statistics=["Maximum"])["Datapoints"]
    assert [point["Maximum"] for point in points] == [2.5]


def test_an_event_invocation_that_keeps_failing_goes_to_its_on_failure_destination(local_cloud, tmp_path):
    """After its two retries, Lambda sends the invocation record to the function's on-failure
    destination (EventInvokeConfig), so the event is not lost."""
    record_file = tmp_path / "attempts.jsonl"
    arn = deploy_function(local_cloud, "fail_until", record_file)
    sqs = local_cloud.client("sqs")
    queue_url = sqs.create_queue(QueueName=unique("on-failure"))["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    lambda_client = local_cloud.client("lambda")
    lambda_client.put_function_event_invoke_config(
        FunctionName=arn, MaximumRetryAttempts=2,
        DestinationConfig={"OnFailure": {"Destination": queue_arn}})

    lambda_client.invoke(FunctionName=arn, InvocationType="Event", Payload=json.dumps({"succeed_on": 99}))

    (record,) = receive(local_cloud, queue_url, 1)
    assert len(records(record_file)) == 3, "the first attempt and two retries"
    assert record["requestContext"]["condition"] == "RetriesExhausted"
    assert record["requestContext"]["approximateInvokeCount"] == 3
    assert record["requestContext"]["functionArn"] == f"{arn}:$LATEST"
    assert record["requestPayload"] == {"succeed_on": 99}
    assert record["responseContext"]["functionError"] == "Unhandled"
    assert record["responsePayload"]["errorType"] == "CapacityError"


def test_retries_of_an_event_invocation_follow_its_maximum_retry_attempts(local_cloud, tmp_path):
    record_file = tmp_path / "attempts.jsonl"
    arn = deploy_function(local_cloud, "fail_until", record_file)
    lambda_client = local_cloud.client("lambda")
    lambda_client.put_function_event_invoke_config(FunctionName=arn, MaximumRetryAttempts=0)

    lambda_client.invoke(FunctionName=arn, InvocationType="Event", Payload=json.dumps({"succeed_on": 2}))

    local_cloud.wait_until(lambda: records(record_file), 10, "the first attempt")
    time.sleep(local_cloud.scaled(200))
    assert len(records(record_file)) == 1, "retried although MaximumRetryAttempts is 0"
