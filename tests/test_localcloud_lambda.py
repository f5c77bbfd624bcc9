"""Lambda in the local cloud: handlers run in-process, reached through the HTTP endpoint."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest
from botocore.exceptions import ClientError

from localcloud import lambda_runtimes
from localcloud.lambda_runtimes import public_layer
from localcloud_helpers import create_function, deploy_function, lambda_role, receive, records, unique, zip_of


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


APP = """
from utils import NAME

calls = 0


def lambda_handler(event, context):
    global calls
    calls += 1
    return {"name": NAME, "calls": calls}
"""


def test_functions_each_have_their_own_modules_and_module_state(local_cloud):
    """The common SAM layout: a folder per function, each with app.py and its helpers, handler
    app.lambda_handler; each function imports its own, and its module state is its own."""
    functions = {name: create_function(local_cloud, {"app.py": APP, "utils.py": f"NAME = {name!r}\n"})
                 for name in ("orders", "payments", "shipping")}

    answers = [(name, invoke(local_cloud, arn, {})) for _ in range(2) for name, arn in functions.items()]

    assert answers == [(name, (None, {"name": name, "calls": calls}))
                       for calls in (1, 2) for name in functions]


RENDEZVOUS_APP = """
import os
import time
from pathlib import Path

serving = None
calls = 0


def lambda_handler(event, context):
    global serving, calls
    serving, calls = event["name"], calls + 1
    folder = Path(event["folder"])
    (folder / event["name"]).touch()
    while len(os.listdir(folder)) < event["together"]:  # every invocation of the burst is running
        time.sleep(0.01)
    return {"serving": serving, "calls": calls}
"""


def test_concurrent_invocations_of_one_function_each_run_in_an_environment_of_their_own(local_cloud, tmp_path):
    """An execution environment serves one invocation at a time: module state (a Powertools
    BatchProcessor's records, a cache) is never shared by two running invocations. An idle
    environment serves the next one warm. (On another Python an environment is a process of its
    own, serving one invocation at a time: test_a_timed_out_environment_on_another_python_is_replaced.)"""
    arn = create_function(local_cloud, {"app.py": RENDEZVOUS_APP}, Timeout=60)
    names = ["first", "second", "third"]
    with ThreadPoolExecutor(len(names)) as pool:
        burst = list(pool.map(lambda name: invoke(local_cloud, arn, {"name": name, "folder": str(tmp_path),
                                                                      "together": len(names)}), names))

    assert burst == [(None, {"serving": name, "calls": 1}) for name in names]
    assert invoke(local_cloud, arn, {"name": "later", "folder": str(tmp_path), "together": 0}) == (
        None, {"serving": "later", "calls": 2})


SHOP_APP = """
import importlib
from concurrent.futures import ThreadPoolExecutor

import shop.words
from .words import WORD


def lambda_handler(event, context):
    with ThreadPoolExecutor(1) as pool:  # a thread the handler starts imports as the function does
        by_name = pool.submit(lambda: importlib.import_module("shop.words").WORD).result()
    return [WORD, shop.words.WORD, by_name]
"""


def test_packages_and_relative_imports_resolve_inside_the_functions_own_package(local_cloud):
    def package(word):
        return {"shop/__init__.py": "", "shop/words.py": f"WORD = {word!r}\n", "shop/app.py": SHOP_APP}

    first = create_function(local_cloud, package("first"), handler="shop.app.lambda_handler")
    second = create_function(local_cloud, package("second"), handler="shop.app.lambda_handler")

    assert invoke(local_cloud, first, {}) == (None, ["first"] * 3)
    assert invoke(local_cloud, second, {}) == (None, ["second"] * 3)


def test_layers_follow_the_package_and_a_later_layer_wins(local_cloud):
    lam = local_cloud.client("lambda")
    first, second = (lam.publish_layer_version(LayerName=unique("shared"), Content={"ZipFile": zip_of(files)})[
        "LayerVersionArn"] for files in ({"python/shared.py": "SOURCE = 'first layer'\n", "python/extra.py": "X = 1\n"},
                                         {"python/shared.py": "SOURCE = 'second layer'\n"}))
    arn = create_function(local_cloud, {"app.py": "import extra, shared\n\n"
                                                  "def lambda_handler(event, context):\n    return shared.SOURCE\n"},
                          Layers=[first, second])

    assert invoke(local_cloud, arn, {}) == (None, "second layer")


POWERTOOLS_V3 = "arn:aws:lambda:us-east-1:017000801446:layer:AWSLambdaPowertoolsPythonV3-{python}-x86_64:7"


def test_the_powertools_public_layer_maps_to_the_installed_package(local_cloud):
    layer = POWERTOOLS_V3.format(python="python311")
    arn = create_function(local_cloud, {"app.py": "from aws_lambda_powertools import Logger\n\nlogger = Logger()\n\n"
                                                  "def lambda_handler(event, context):\n"
                                                  "    logger.info('hello')\n    return 'logged'\n"},
                          Layers=[layer])

    assert invoke(local_cloud, arn, {}) == (None, "logged")
    configuration = local_cloud.client("lambda").get_function_configuration(FunctionName=arn)
    assert [entry["Arn"] for entry in configuration["Layers"]] == [layer]


@pytest.mark.parametrize("runtime, layers, reason", [
    ("nodejs20.x", [], "runtime nodejs20.x is not Python"),
    ("python3.99", [], "no python3.99 interpreter is installed here"),
    ("python3.11", ["arn:aws:lambda:us-east-1:999999999999:layer:somebody-elses:3"],
     "layer arn:aws:lambda:us-east-1:999999999999:layer:somebody-elses:3 is unknown here"),
    ("python3.11", [POWERTOOLS_V3.format(python="python312")], "is built for python3.12, the function runs python3.11"),
    ("python3.11", ["arn:aws:lambda:eu-west-1:017000801446:layer:AWSLambdaPowertoolsPythonV2:79"],
     "carries aws-lambda-powertools 2.x"),
])
def test_a_function_that_cannot_run_here_is_refused_when_created(local_cloud, runtime, layers, reason):
    name = unique("unrunnable")
    with pytest.raises(ClientError) as refused:
        local_cloud.client("lambda").create_function(
            FunctionName=name, Runtime=runtime, Role=lambda_role(local_cloud), Handler="app.lambda_handler",
            Code={"ZipFile": zip_of({"app.py": ""})}, Layers=layers)
    assert refused.value.response["Error"]["Code"] == "InvalidParameterValueException"
    assert f"function {name} cannot run in the local cloud" in str(refused.value) and reason in str(refused.value)


def test_public_layer_arns_name_what_they_carry():
    v3 = public_layer("arn:aws:lambda:eu-west-1:017000801446:layer:AWSLambdaPowertoolsPythonV3-python313-arm64:12")
    assert (v3.distribution, v3.major, v3.runtime) == ("aws-lambda-powertools", 3, "python3.13")
    v2 = public_layer("arn:aws:lambda:us-east-1:017000801446:layer:AWSLambdaPowertoolsPythonV2-Arm64:79")
    assert (v2.major, v2.runtime) == (2, None)
    assert public_layer("arn:aws-cn:lambda:cn-north-1:498634801083:layer:AWSLambdaPowertoolsPython:3").major == 1
    assert public_layer("arn:aws:lambda:us-east-1:123456789012:layer:AWSLambdaPowertoolsPythonV3-python312-x86_64:7") is None


def test_a_public_layer_with_parts_built_for_this_python_is_refused_for_another(monkeypatch):
    """pydantic-core, which the Powertools layer bundles (its parser), is compiled for the local
    cloud's Python: a function on another Python gets it only where that Python has it installed."""
    layer = public_layer(POWERTOOLS_V3.format(python="python312"))
    monkeypatch.setattr(lambda_runtimes, "installed_for", lambda executable: frozenset())
    monkeypatch.setattr(lambda_runtimes, "interpreter_for", lambda runtime: f"/usr/bin/{runtime}")
    problems = lambda_runtimes.public_layer_problems(layer, "python3.12")
    assert any("needs pydantic-core" in problem and "install it for python3.12" in problem for problem in problems)

    compiled = frozenset(lambda_runtimes.foreign_distributions(layer, "python3.12"))
    monkeypatch.setattr(lambda_runtimes, "installed_for", lambda executable: compiled)
    assert lambda_runtimes.public_layer_problems(layer, "python3.12") == []


OTHER_PYTHON_APP = """
import os
import sys

import boto3

type Calls = int  # syntax of Python 3.12 and later
calls: Calls = 0
print("initialising on", sys.version_info[:2])


def lambda_handler(event, context):
    global calls
    calls += 1
    if "sleep" in event:
        import time
        time.sleep(event["sleep"])
    if "import" in event:
        __import__(event["import"])
    queues = boto3.client("sqs").list_queues(QueueNamePrefix=event.get("prefix", "none"))
    return {"python": list(sys.version_info[:2]), "calls": calls, "colour": os.environ["COLOUR"],
            "queues": len(queues.get("QueueUrls", []))}
"""


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["python3.12", "python3.13"])
def test_a_function_on_another_python_runs_on_that_python_with_only_what_aws_gives_it(local_cloud, runtime):
    prefix = unique("seen-from")
    local_cloud.client("sqs").create_queue(QueueName=f"{prefix}-q")
    arn = create_function(local_cloud, {"app.py": OTHER_PYTHON_APP}, runtime=runtime, Timeout=20,
                          Environment={"Variables": {"COLOUR": "teal"}})
    python = [int(part) for part in runtime.removeprefix("python").split(".")]

    first, second = (invoke(local_cloud, arn, {"prefix": prefix}) for _ in range(2))
    error, host_package = invoke(local_cloud, arn, {"import": "moto"})

    assert first == (None, {"python": python, "calls": 1, "colour": "teal", "queues": 1})
    assert second[1]["calls"] == 2, "a warm environment keeps its module state"
    assert (error, host_package["errorType"]) == ("Unhandled", "ModuleNotFoundError"), host_package
    group = f"/aws/lambda/{arn.rsplit(':', 1)[1]}"
    messages = [event["message"] for event in local_cloud.client("logs").filter_log_events(logGroupName=group)["events"]]
    assert f"initialising on ({python[0]}, {python[1]})" in messages


SLOW_INIT_APP = """
import time

time.sleep(1.5)  # the code outside the handler: Lambda's Init phase


def lambda_handler(event, context):
    return context.get_remaining_time_in_millis()
"""


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["python3.11", "python3.12"])
def test_init_has_time_of_its_own_and_the_timeout_counts_from_its_end(local_cloud, runtime):
    arn = create_function(local_cloud, {"app.py": SLOW_INIT_APP}, runtime=runtime, Timeout=1)

    error, remaining_ms = invoke(local_cloud, arn, {})

    assert error is None, remaining_ms
    assert 500 < remaining_ms <= 1000


@pytest.mark.slow
def test_a_timed_out_environment_on_another_python_is_replaced(local_cloud):
    arn = create_function(local_cloud, {"app.py": OTHER_PYTHON_APP}, runtime="python3.12", Timeout=2,
                          Environment={"Variables": {"COLOUR": "teal"}})
    invoke(local_cloud, arn, {})

    error, payload = invoke(local_cloud, arn, {"sleep": 10})
    after = invoke(local_cloud, arn, {})

    assert (error, payload["errorType"]) == ("Unhandled", "Sandbox.Timedout")
    assert after == (None, {"python": [3, 12], "calls": 1, "colour": "teal", "queues": 0}), "a new environment"


def test_event_invocation_is_queued_and_dry_run_runs_nothing(local_cloud, tmp_path):
    record_file = tmp_path / "async.jsonl"
    arn = deploy_function(local_cloud, "echo", record_file)
    lambda_client = local_cloud.client("lambda")

    dry = lambda_client.invoke(FunctionName=arn, InvocationType="DryRun", Payload=b'{"dry": 1}')
    queued = lambda_client.invoke(FunctionName=arn, InvocationType="Event", Payload=b'{"queued": 1}')

    assert dry["StatusCode"] == 204 and queued["StatusCode"] == 202
    local_cloud.wait_until(lambda: records(record_file), "the queued invocation")
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

    local_cloud.wait_until(lambda: records(record_file), "the first attempt")
    time.sleep(local_cloud.scaled(200))
    assert len(records(record_file)) == 1, "retried although MaximumRetryAttempts is 0"
