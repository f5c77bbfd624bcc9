"""Lambda glue: handlers run in this process instead of in Docker.

Replaces `moto.awslambda.models.LambdaFunction._invoke_lambda`, which starts the function in
a Docker container (there is no Docker here), with `localcloud.lambda_runtime`: the handler
named by the function's Handler string runs in a thread of the server, with a Lambda-like
context, the function's environment and timeout, and the runtime's error payloads. Because the
server is multi-threaded, a handler can itself call the local endpoint with boto3.
"""

from __future__ import annotations

import os
from typing import Any

from moto.awslambda.models import LambdaFunction

from localcloud.glue import active_cloud
from localcloud.lambda_runtime import FunctionSpec, InvocationResult, invoke_handler, unpack_code

_invoke_in_docker = LambdaFunction._invoke_lambda


def function_spec(function: LambdaFunction) -> FunctionSpec:
    """The runtime's view of a moto function, with the variables Lambda itself sets."""
    cloud = active_cloud()
    assert cloud is not None, "function_spec needs a running LocalCloud"
    code_dir = unpack_code(function.code_bytes, getattr(function, "code_sha_256", ""))
    environment = cloud.env() | {
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
    """Run one invocation and write its log lines to the function's CloudWatch log group."""
    result = invoke_handler(function_spec(function), event)
    function.logs_backend.ensure_log_group(function.logs_group_name)
    function.save_logs("\n".join(result.log_lines))
    return result


def _invoke_in_process(self: LambdaFunction, event: Any = None) -> tuple[str, bool, str]:
    if active_cloud() is None:
        return _invoke_in_docker(self, event)
    result = invoke_function(self, {} if event is None else event)
    return result.payload, result.errored, "\n".join(result.log_lines)


def apply() -> None:
    LambdaFunction._invoke_lambda = _invoke_in_process
