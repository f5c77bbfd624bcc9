"""The part of the local Lambda runtime that runs beside the function's code: the context object,
the call of the handler and the runtime's error payloads.

It is used two ways, with the same code:

- imported by `localcloud.lambda_runtime`, for functions on the local cloud's own Python, whose
  handlers run in threads of this process;
- run as a script by another interpreter (`python3.12 lambda_bootstrap.py IN OUT`) for a function
  on that runtime: one process is one execution environment, serving one invocation at a time
  over two pipes, as Lambda's runtime interface client serves its runtime API.

So it imports nothing but the standard library and runs on every Python Lambda offers.

Messages on the pipes are JSON, one per line. The host sends `{"init": {"handler": ...,
"path": [...]}}` once, answered `{"initialised": true}` when Init is done, then
`{"invoke": {"event": ..., "context": {...}}}` for each invocation, answered `{"payload": "<json>"}`
or `{"error": {...}}`. Each answer carries `"output"`: what the function printed meanwhile.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import threading
import time
import traceback
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional

__all__ = ["LambdaContext", "Invocation", "INIT_LIMIT_S", "error_object", "initialise", "serve"]


class LambdaContext:
    """The context object handed to a handler: the attributes the Python runtime documents."""

    def __init__(self, function_name: str, function_version: str, invoked_function_arn: str,
                 memory_limit_in_mb: int, aws_request_id: str, deadline: float):
        self.function_name = function_name
        self.function_version = function_version
        self.invoked_function_arn = invoked_function_arn
        self.memory_limit_in_mb = memory_limit_in_mb
        self.aws_request_id = aws_request_id
        self.log_group_name = f"/aws/lambda/{function_name}"
        self.log_stream_name = f"{time.strftime('%Y/%m/%d')}/[{function_version}]{aws_request_id[:32]}"
        self.identity = None
        self.client_context = None
        self._deadline = deadline

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


class HandlerImportError(Exception):
    """The Handler string does not name an importable function (errorType from the runtime)."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


def error_object(error_type: str, message: str, request_id: str,
                 stack: Optional[List[str]] = None) -> Dict[str, Any]:
    """The runtime's error payload; Step Functions' Retry and Catch match its errorType."""
    return {"errorMessage": message, "errorType": error_type, "requestId": request_id,
            "stackTrace": stack or []}


INIT_LIMIT_S = 10.0
"""Lambda's Init phase (the handler's module imported, its code outside the handler run) has
10 s of its own; an Init that takes longer is retried at the first invocation, within the
function's timeout (Lambda developer guide, execution environment lifecycle)."""

Invocation = Callable[[Any, LambdaContext], Dict[str, Any]]
"""What answers an invocation once Init is done: `{"payload": json}` with what the handler
returned, or `{"error": ...}` with the runtime's error object. It never raises."""


def initialise(handler: str, import_module: Callable[[str], ModuleType]) -> Invocation:
    """Init: import the module a Handler string ("module.function") names and find the function
    in it. If that fails, every invocation answers with the error, as Lambda's runtime does."""
    try:
        function = load_handler(handler, import_module)
    except HandlerImportError as exc:
        error_type, message, stack = exc.error_type, str(exc), []
    except Exception as exc:  # the module's own code raised
        error_type, message, stack = type(exc).__name__, str(exc), _stack(exc)
    else:
        return lambda event, context: _call(function, event, context)
    return lambda event, context: {"error": error_object(error_type, message, context.aws_request_id, stack)}


def load_handler(handler: str, import_module: Callable[[str], ModuleType]) -> Callable[..., Any]:
    """The function a Handler string ("module.function", the module a dotted path) names."""
    module_name, _, function_name = handler.rpartition(".")
    if not module_name or not function_name:
        raise HandlerImportError("Runtime.MalformedHandlerName",
                                 f"Bad handler '{handler}': expected 'module.function'")
    try:
        module = import_module(module_name)
    except ImportError as exc:
        raise HandlerImportError("Runtime.ImportModuleError",
                                 f"Unable to import module '{module_name}': {exc}") from exc
    except SyntaxError as exc:
        raise HandlerImportError("Runtime.UserCodeSyntaxError",
                                 f"Syntax error in module '{module_name}': {exc}") from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise HandlerImportError("Runtime.HandlerNotFound",
                                 f"Handler '{function_name}' missing on module '{module_name}'")
    return function


def _call(function: Callable[..., Any], event: Any, context: LambdaContext) -> Dict[str, Any]:
    try:
        result = function(event, context)
    except Exception as exc:  # the runtime reports any exception the handler raises
        return {"error": error_object(type(exc).__name__, str(exc), context.aws_request_id, _stack(exc))}
    try:
        return {"payload": json.dumps(result)}
    except (TypeError, ValueError) as exc:
        return {"error": error_object("Runtime.MarshalError", f"Unable to marshal response: {exc}",
                                      context.aws_request_id)}


def _stack(exc: BaseException) -> List[str]:
    """The exception's trace in the function's code: AWS's starts there, without the runtime's
    own frames or the import machinery's."""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if frame.filename != __file__ and not frame.filename.startswith("<frozen importlib")]
    return traceback.format_list(frames)


# --- an execution environment of its own (another interpreter) -----------------------------

class _Capture(io.TextIOBase):
    """sys.stdout / sys.stderr of an environment: what the function prints during an invocation
    goes to that invocation's log; anything else to the stream it replaced."""

    def __init__(self, replaced: Any):
        self.replaced = replaced
        self.buffer_of_invocation: Optional[List[str]] = None
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            if self.buffer_of_invocation is None:
                return self.replaced.write(text)
            self.buffer_of_invocation.append(text)
            return len(text)

    def flush(self) -> None:
        if self.buffer_of_invocation is None:
            self.replaced.flush()

    def isatty(self) -> bool:
        return False


def serve(requests: Any, replies: Any) -> None:
    """Answer the host's messages read from `requests` on `replies` until it closes the pipe."""
    outputs = [_Capture(sys.stdout), _Capture(sys.stderr)]
    sys.stdout, sys.stderr = outputs

    @contextlib.contextmanager
    def answering() -> Iterator[Dict[str, Any]]:
        """The reply to one message, sent with what the function printed while it was made."""
        printed: List[str] = []
        for output in outputs:
            output.buffer_of_invocation = printed
        reply: Dict[str, Any] = {}
        try:
            yield reply
        finally:
            for output in outputs:
                output.buffer_of_invocation = None
        reply["output"] = "".join(printed)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()

    invocation: Optional[Invocation] = None
    for line in requests:
        message = json.loads(line)
        with answering() as reply:
            if "init" in message:
                sys.path[:0] = message["init"]["path"]
                invocation = initialise(message["init"]["handler"], importlib.import_module)
                reply["initialised"] = True
                continue
            fields = message["invoke"]["context"]
            context = LambdaContext(fields["function_name"], fields["function_version"],
                                    fields["invoked_function_arn"], fields["memory_limit_in_mb"],
                                    fields["aws_request_id"], time.monotonic() + fields["remaining_ms"] / 1000)
            reply.update(invocation(message["invoke"]["event"], context))


if __name__ == "__main__":
    # Started with -I: neither this script's folder nor any PYTHON* variable shapes sys.path.
    with os.fdopen(int(sys.argv[1]), "r", encoding="utf-8") as requests_pipe, \
            os.fdopen(int(sys.argv[2]), "w", encoding="utf-8") as replies_pipe:
        serve(requests_pipe, replies_pipe)
