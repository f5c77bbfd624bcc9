"""Lambda glue: handlers run here instead of in Docker.

- Replaces `moto.awslambda.models.LambdaFunction._invoke_lambda`, which starts the function
  in a Docker container (there is no Docker here), with `localcloud.lambda_runtime`: the
  handler named by the function's Handler string runs on the function's Python (in a thread of
  the server, its modules its own, or in a process of another interpreter), with a Lambda-like
  context, the function's environment and timeout, its layers, and the runtime's error
  payloads, and the STS credentials of its execution role (AWS_ACCESS_KEY_ID, ...), as the
  Lambda runtime sets them. Because the server is multi-threaded, a handler can itself call the local
  endpoint with boto3. What the handler prints goes to the function's log group (its
  LoggingConfig's LogGroup if it names one), and EMF metric lines in it become CloudWatch
  metrics (`localcloud.emf`), as CloudWatch Logs extracts them from a Lambda function's output.
- moto created any function. A function that cannot run here (a runtime with no interpreter
  installed, another language, a container image, an unknown layer) is now refused when it is
  created or its configuration updated (InvalidParameterValueException naming the function and
  why), not at its first invocation (`localcloud.lambda_runtimes`). Public layers the local
  cloud maps (AWS Lambda Powertools for Python) are accepted; moto refused every layer ARN of
  another account.
- A synchronous invocation that failed (the handler raised, or timed out) is answered with
  X-Amz-Function-Error `Unhandled`, as Lambda answers; moto said `Handled`.
- `LocalCloud.time_out_invocations(name_part, count)`: the next invocations of a matching
  function run their handler and then report `Sandbox.Timedout`, as a function that ran out
  of time does once its side effects happened (the case a handler's idempotency is for).
- `LambdaFunction.invoke` ran Event (asynchronous) invocations to completion before replying,
  and ran DryRun ones. Now an Event invocation is queued and answered at once (202), and a
  function error is retried twice, one and then two (scaled) minutes later, as Lambda does
  (fewer when the function's EventInvokeConfig sets MaximumRetryAttempts); EventBridge
  targets are invoked the same way. DryRun checks the function exists only.
- LoggingConfig: moto dropped it, and every function logged to /aws/lambda/<name>. A function
  whose LoggingConfig names a LogGroup now logs there, as on AWS, and GetFunction[Configuration]
  answers its LoggingConfig (LogFormat Text unless given).
- moto stored a function's EventInvokeConfig and did nothing with it. When the retries are
  spent, the invocation record (request, response, condition RetriesExhausted) now goes to
  the config's on-failure destination (an SQS queue), as Lambda documents for asynchronous
  invocation, so an event the function could not handle is kept.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from moto.awslambda.exceptions import InvalidParameterValueException
from moto.awslambda.models import LambdaFunction, lambda_backends

from localcloud.emf import metric_data
from localcloud.glue import active_cloud
from localcloud.glue.iam import role_credentials
from localcloud.lambda_runtime import (FunctionSpec, InvocationResult, code_cache_root, invoke_handler,
                                       layer_folders, unpack_code)
from localcloud.lambda_runtimes import (HOST_RUNTIME, PublicLayer, function_problems, import_path,
                                        interpreter_for, public_layer)

log = logging.getLogger(__name__)

_invoke_in_docker = LambdaFunction._invoke_lambda
_moto_invoke = LambdaFunction.invoke

ASYNC_RETRY_DELAYS_S = (60.0, 120.0)
"""Nominal delays before Lambda retries a failed asynchronous invocation (two retries)."""


def function_spec(function: LambdaFunction) -> FunctionSpec:
    """The runtime's view of a moto function, with the variables Lambda itself sets."""
    cloud = active_cloud()
    assert cloud is not None, "function_spec needs a running LocalCloud"
    code_dir = unpack_code(function.code_bytes, getattr(function, "code_sha_256", ""))
    layer_dirs, public_layers = _layers(function)
    interpreter = None if function.run_time == HOST_RUNTIME else interpreter_for(function.run_time)
    search_path = ((code_dir,) if code_dir else ()) + layer_dirs
    if interpreter is not None:
        search_path += (_import_path(function.run_time, public_layers),)
    # As the Lambda runtime does: the execution role's credentials, never the harness's.
    role = role_credentials(function.account_id, function.region, function.role, function.function_name)
    environment = cloud.env() | role | {
        "_HANDLER": function.handler or "",
        "AWS_EXECUTION_ENV": f"AWS_Lambda_{function.run_time}",
        "AWS_LAMBDA_FUNCTION_NAME": function.function_name,
        "AWS_LAMBDA_FUNCTION_VERSION": str(function.version),
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(function.memory_size),
        "AWS_LAMBDA_LOG_GROUP_NAME": function.logs_group_name,
        "LAMBDA_TASK_ROOT": str(code_dir or os.getcwd()),
    }
    environment.update({key: str(value) for key, value in function.environment_vars.items()})
    return FunctionSpec(
        function_name=function.function_name,
        function_arn=function.function_arn,
        version=str(function.version),
        handler=function.handler or "",
        timeout_s=float(function.timeout),
        memory_mb=int(function.memory_size),
        environment=environment,
        code_dir=code_dir,
        search_path=search_path,
        interpreter=interpreter,
    )


def _layers(function: LambdaFunction) -> tuple[tuple[Path, ...], tuple[PublicLayer, ...]]:
    """The folders of the function's layers of this local cloud, and the public layers it maps.
    Lambda extracts layers into /opt in order, a later one's files over an earlier one's: here
    the later layer's folders come first."""
    folders: list[Path] = []
    public = []
    for layer in reversed(function.layers):
        mapped = public_layer(layer["Arn"])
        if mapped is not None:
            public.append(mapped)
            continue
        version = lambda_backends[function.account_id][function.region].layers_versions_by_arn(layer["Arn"])
        unpacked = unpack_code(version.code_bytes, version.code_sha_256)
        if unpacked is not None:
            folders += layer_folders(unpacked, function.run_time)
    return tuple(folders), tuple(public)


@functools.lru_cache(maxsize=None)
def _import_path(runtime: str, public_layers: tuple[PublicLayer, ...]) -> Path:
    return import_path(runtime, public_layers, code_cache_root())


# --- functions that cannot run here are refused up front ------------------------------------

_moto_function_init = LambdaFunction.__init__
_moto_update_configuration = LambdaFunction.update_configuration
_moto_configuration = LambdaFunction.get_configuration
_moto_layers_data = LambdaFunction._get_layers_data


def refuse_unrunnable(function_name: str, runtime: str | None, package_type: str | None,
                      layers: list[str], account_id: str, region: str) -> None:
    """InvalidParameterValueException naming the function and why, if it cannot run here."""
    backend = lambda_backends[account_id][region]
    problems = function_problems(runtime, package_type, layers,
                                 lambda arn: backend.layers_versions_by_arn(arn) is not None)
    if problems:
        raise InvalidParameterValueException(
            f"function {function_name} cannot run in the local cloud: {'; '.join(problems)}")


def _create_runnable(self: LambdaFunction, account_id: str, spec: dict[str, Any], region: str,
                     version: str | int = 1) -> None:
    if active_cloud() is not None:
        refuse_unrunnable(spec.get("FunctionName", "?"), spec.get("Runtime"), spec.get("PackageType"),
                          spec.get("Layers", []), account_id, region)
    _moto_function_init(self, account_id, spec, region, version)
    # moto drops LoggingConfig: kept here, and its LogGroup is where the function's logs go.
    given = spec.get("LoggingConfig") or {}
    self.logging_config = {"LogFormat": given.get("LogFormat", "Text"),
                           "LogGroup": given.get("LogGroup") or self.logs_group_name,
                           **{key: given[key] for key in ("ApplicationLogLevel", "SystemLogLevel") if key in given}}
    self.logs_group_name = self.logging_config["LogGroup"]


def _update_runnable(self: LambdaFunction, config_updates: dict[str, Any]) -> dict[str, Any]:
    if active_cloud() is not None and ("Runtime" in config_updates or "Layers" in config_updates):
        current = [layer["Arn"] for layer in self.layers]
        refuse_unrunnable(self.function_name, config_updates.get("Runtime", self.run_time), self.package_type,
                          config_updates.get("Layers", current), self.account_id, self.region)
    return _moto_update_configuration(self, config_updates)


def _layers_data(self: LambdaFunction, layer_arns: list[str]) -> list[dict[str, Any]]:
    if active_cloud() is None:
        return _moto_layers_data(self, layer_arns)
    mapped = {arn for arn in layer_arns if public_layer(arn) is not None}
    local = _moto_layers_data(self, [arn for arn in layer_arns if arn not in mapped])
    by_arn = {layer["Arn"]: layer for layer in local} | {arn: {"Arn": arn, "CodeSize": 0} for arn in mapped}
    return [by_arn[arn] for arn in layer_arns]


def invoke_function(function: LambdaFunction, event: Any) -> InvocationResult:
    """Run one invocation; its log lines go to the function's CloudWatch log group and the
    EMF metrics in them to CloudWatch."""
    from moto.cloudwatch.models import cloudwatch_backends

    cloud = active_cloud()
    time_out = False
    if cloud is not None:
        cloud.count(cloud.lambda_invocations, function.function_name)
        time_out = cloud.take_invocation_timeout(function.function_name)
    result = invoke_handler(function_spec(function), event, time_out=time_out)
    function.logs_backend.ensure_log_group(function.logs_group_name)
    function.save_logs("\n".join(result.log_lines))
    cloudwatch = cloudwatch_backends[function.account_id][function.region]
    for line in result.log_lines:
        for namespace, entries in metric_data(line):
            for entry in entries:  # moto's CloudWatch compares naive UTC datetimes
                entry["Timestamp"] = entry["Timestamp"].astimezone(timezone.utc).replace(tzinfo=None)
            cloudwatch.put_metric_data(namespace, entries)
    return result


def _event_invoke_config(function: LambdaFunction) -> dict[str, Any]:
    return function.event_invoke_config[0].config if function.event_invoke_config else {}


def invoke_event(function: LambdaFunction, event: Any, attempt: int = 0) -> None:
    """One asynchronous invocation, run in the calling thread; a failure is retried later,
    and once the retries are spent it goes to the on-failure destination, if there is one."""
    result = invoke_function(function, event)
    if not result.errored:
        return
    log.warning("Lambda %s failed an asynchronous invocation (attempt %d): %s",
                function.function_name, attempt + 1, result.payload)
    cloud = active_cloud()
    config = _event_invoke_config(function)
    retries = min(int(config.get("MaximumRetryAttempts", len(ASYNC_RETRY_DELAYS_S))), len(ASYNC_RETRY_DELAYS_S))
    if cloud is not None and attempt < retries:
        cloud.submit_later(f"retry {function.function_name}", ASYNC_RETRY_DELAYS_S[attempt],
                           lambda: invoke_event(function, event, attempt + 1))
        return
    destination = ((config.get("DestinationConfig") or {}).get("OnFailure") or {}).get("Destination")
    if destination:
        _send_to_destination(destination, invocation_record(function, event, result, attempt + 1))


def invocation_record(function: LambdaFunction, event: Any, result: InvocationResult,
                      invocations: int) -> dict[str, Any]:
    """What Lambda sends an on-failure destination: the request, the function's error, and
    why it gave up."""
    error = json.loads(result.payload)
    return {
        "version": "1.0",
        "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z",
        "requestContext": {"requestId": error.get("requestId"),
                           "functionArn": f"{function.function_arn}:{function.version}",
                           "condition": "RetriesExhausted", "approximateInvokeCount": invocations},
        "requestPayload": event,
        "responseContext": {"statusCode": 200, "executedVersion": str(function.version),
                            "functionError": "Unhandled"},
        "responsePayload": error,
    }


def _send_to_destination(arn: str, record: dict[str, Any]) -> None:
    from moto.sqs.models import sqs_backends

    _, _, service, region, account, resource = arn.split(":", 5)
    if service != "sqs":
        log.error("on-failure destination %s: only SQS queues are delivered to here", arn)
        return
    sqs_backends[account][region].send_message(queue_name=resource, message_body=json.dumps(record))


def _invoke(self: LambdaFunction, body: str, request_headers: Any, response_headers: Any) -> str | bytes:
    cloud = active_cloud()
    invocation_type = request_headers.get("x-amz-invocation-type", "RequestResponse")
    if cloud is None:
        return _moto_invoke(self, body, request_headers, response_headers)
    if invocation_type == "RequestResponse":
        payload = _moto_invoke(self, body, request_headers, response_headers)
        if "x-amz-function-error" in response_headers:
            # What Lambda answers for an exception the Python handler did not catch, and for a
            # timeout: moto says "Handled", a value only Node.js callback(error) ever produced.
            response_headers["x-amz-function-error"] = "Unhandled"
        return payload
    if invocation_type == "Event":
        event = json.loads(body) if body else {}
        cloud.submit(f"invoke {self.function_name}", lambda: invoke_event(self, event))
    return b""


def _invoke_in_process(self: LambdaFunction, event: Any = None) -> tuple[str, bool, str]:
    if active_cloud() is None:
        return _invoke_in_docker(self, event)
    result = invoke_function(self, {} if event is None else event)
    return result.payload, result.errored, "\n".join(result.log_lines)


def _configuration(self: LambdaFunction, on_create: bool = False) -> dict[str, Any]:
    return _moto_configuration(self, on_create) | {"LoggingConfig": self.logging_config}


def apply() -> None:
    LambdaFunction._invoke_lambda = _invoke_in_process
    LambdaFunction.invoke = _invoke
    LambdaFunction.__init__ = _create_runnable
    LambdaFunction.update_configuration = _update_runnable
    LambdaFunction.get_configuration = _configuration
    LambdaFunction._get_layers_data = _layers_data
