"""Lambda glue: handlers run in this process instead of in Docker.

- Replaces `moto.awslambda.models.LambdaFunction._invoke_lambda`, which starts the function
  in a Docker container (there is no Docker here), with `localcloud.lambda_runtime`: the
  handler named by the function's Handler string runs in a thread of the server, with a
  Lambda-like context, the function's environment and timeout, and the runtime's error
  payloads, and the STS credentials of its execution role (AWS_ACCESS_KEY_ID, ...), as the
  Lambda runtime sets them. Because the server is multi-threaded, a handler can itself call the local
  endpoint with boto3. What the handler prints goes to the function's log group, and EMF
  metric lines in it become CloudWatch metrics (`localcloud.emf`), as CloudWatch Logs
  extracts them from a Lambda function's output.
- `LambdaFunction.invoke` ran Event (asynchronous) invocations to completion before replying,
  and ran DryRun ones. Now an Event invocation is queued and answered at once (202), and a
  function error is retried twice, one and then two (scaled) minutes later, as Lambda does;
  EventBridge targets are invoked the same way. DryRun checks the function exists only.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import timezone
from typing import Any

from moto.awslambda.models import LambdaFunction

from localcloud.emf import metric_data
from localcloud.glue import active_cloud
from localcloud.glue.iam import role_credentials
from localcloud.lambda_runtime import FunctionSpec, InvocationResult, invoke_handler, unpack_code

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
    )


def invoke_function(function: LambdaFunction, event: Any) -> InvocationResult:
    """Run one invocation; its log lines go to the function's CloudWatch log group and the
    EMF metrics in them to CloudWatch."""
    from moto.cloudwatch.models import cloudwatch_backends

    result = invoke_handler(function_spec(function), event)
    function.logs_backend.ensure_log_group(function.logs_group_name)
    function.save_logs("\n".join(result.log_lines))
    cloudwatch = cloudwatch_backends[function.account_id][function.region]
    for line in result.log_lines:
        for namespace, entries in metric_data(line):
            for entry in entries:  # moto's CloudWatch compares naive UTC datetimes
                entry["Timestamp"] = entry["Timestamp"].astimezone(timezone.utc).replace(tzinfo=None)
            cloudwatch.put_metric_data(namespace, entries)
    return result


def invoke_event(function: LambdaFunction, event: Any, attempt: int = 0) -> None:
    """One asynchronous invocation, run in the calling thread; a failure is retried later."""
    result = invoke_function(function, event)
    if not result.errored:
        return
    log.warning("Lambda %s failed an asynchronous invocation (attempt %d): %s",
                function.function_name, attempt + 1, result.payload)
    cloud = active_cloud()
    if cloud is not None and attempt < len(ASYNC_RETRY_DELAYS_S):
        cloud.submit_later(f"retry {function.function_name}", ASYNC_RETRY_DELAYS_S[attempt],
                           lambda: invoke_event(function, event, attempt + 1))


def _invoke(self: LambdaFunction, body: str, request_headers: Any, response_headers: Any) -> str | bytes:
    cloud = active_cloud()
    invocation_type = request_headers.get("x-amz-invocation-type", "RequestResponse")
    if cloud is None or invocation_type == "RequestResponse":
        return _moto_invoke(self, body, request_headers, response_headers)
    if invocation_type == "Event":
        event = json.loads(body) if body else {}
        cloud.submit(f"invoke {self.function_name}", lambda: invoke_event(self, event))
    return b""


def _invoke_in_process(self: LambdaFunction, event: Any = None) -> tuple[str, bool, str]:
    if active_cloud() is None:
        return _invoke_in_docker(self, event)
    result = invoke_function(self, {} if event is None else event)
    return result.payload, result.errored, "\n".join(result.log_lines)


def apply() -> None:
    LambdaFunction._invoke_lambda = _invoke_in_process
    LambdaFunction.invoke = _invoke
