"""Run a Lambda function's Python handler in this process, as the Lambda Python runtime would.

moto runs Lambda code in Docker, which this machine does not have. Here the handler named by
the function's `Handler` string ("package.module.function") is imported from the function's
deployment package and called in a thread of its own, with:

- a context object carrying what the real runtime's does (function_name, function_version,
  invoked_function_arn, memory_limit_in_mb, aws_request_id, log_group_name, log_stream_name,
  get_remaining_time_in_millis());
- the function's configured environment variables, visible to that thread only (several
  functions with different variables run at the same time in one process);
- the function's timeout: a handler still running when it expires is reported as AWS reports
  it (`Sandbox.Timedout`); its thread cannot be killed, so it is left to finish and its result
  is dropped (an invocation can also be told to report a timeout after its handler ran);
- error payloads shaped like the runtime's (`errorType` = exception class name,
  `errorMessage`, `stackTrace`), which is what Step Functions Retry/Catch match on;
- what the handler's thread prints (print, logging to stdout/stderr, Powertools' JSON logs
  and EMF metrics) captured into the invocation's log lines, as Lambda sends a function's
  output to CloudWatch Logs; threads the handler starts itself are not captured.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import botocore.credentials

__all__ = ["FunctionSpec", "InvocationResult", "LambdaContext", "invoke_handler",
           "unpack_code", "install_thread_environ"]


@dataclass(frozen=True)
class FunctionSpec:
    """What the runtime needs to know about one function (copied from its configuration)."""

    function_name: str
    """The function's name."""
    function_arn: str
    """The unqualified function ARN, given to the handler as `invoked_function_arn`."""
    version: str
    """Published version, "$LATEST" for the unpublished one."""
    handler: str
    """The Handler string: module path, a dot, then the function's name in that module."""
    timeout_s: float
    """Configured timeout in seconds (Lambda's default is 3)."""
    memory_mb: int
    """Configured memory, reported through the context only."""
    environment: dict[str, str] = field(default_factory=dict)
    """Environment variables of the function plus those the runtime itself sets."""
    code_dir: Path | None = None
    """Where the deployment package is unpacked; searched before this process's own path."""


@dataclass(frozen=True)
class InvocationResult:
    """The outcome of one invocation, in the form the Invoke API returns it."""

    payload: str
    """JSON text: the handler's return value, or the runtime's error object."""
    errored: bool
    """True when the payload is an error object (Invoke's X-Amz-Function-Error is set)."""
    log_lines: list[str]
    """What CloudWatch Logs gets: START, the handler's output, the error if any, END, REPORT."""


class LambdaContext:
    """The context object handed to a handler: the attributes the Python runtime documents."""

    def __init__(self, spec: FunctionSpec, request_id: str, deadline: float):
        self.function_name = spec.function_name
        self.function_version = spec.version
        self.invoked_function_arn = spec.function_arn
        self.memory_limit_in_mb = spec.memory_mb
        self.aws_request_id = request_id
        self.log_group_name = f"/aws/lambda/{spec.function_name}"
        self.log_stream_name = f"{time.strftime('%Y/%m/%d')}/[{spec.version}]{request_id[:32]}"
        self.identity = None
        self.client_context = None
        self._deadline = deadline

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.monotonic()) * 1000))


# --- per-thread environment ---------------------------------------------------------------

_handler_thread = threading.local()


class _ThreadEnviron(os._Environ):  # type: ignore[name-defined,misc]
    """os.environ with a per-thread overlay: a handler sees its function's variables while
    other threads (other functions, the server itself) keep seeing the process environment.
    Inside a handler thread, writes go to the overlay; elsewhere to the real environment."""

    @staticmethod
    def _overlay() -> dict[str, str] | None:
        return getattr(_handler_thread, "variables", None)

    @staticmethod
    def set_overlay(variables: dict[str, str] | None) -> None:
        _handler_thread.variables = variables

    def __getitem__(self, key: str) -> str:
        overlay = self._overlay()
        if overlay is not None and key in overlay:
            return overlay[key]
        return super().__getitem__(key)

    def __setitem__(self, key: str, value: str) -> None:
        overlay = self._overlay()
        if overlay is not None:
            overlay[key] = value
        else:
            super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        overlay = self._overlay()
        if overlay is not None and key in overlay:
            del overlay[key]
        else:
            super().__delitem__(key)

    def __iter__(self) -> Iterator[str]:
        overlay = self._overlay() or {}
        yield from overlay
        yield from (key for key in super().__iter__() if key not in overlay)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def copy(self) -> dict[str, str]:
        return dict(self)


_thread_start = threading.Thread.start
_thread_bootstrap_inner = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]


def _start_in_sandbox(self: threading.Thread) -> None:
    # A Lambda sandbox is a process: every thread a handler starts (a thread pool, say) sees the
    # function's environment and writes to its log, as the handler's own thread does.
    self._sandbox = (_ThreadEnviron._overlay(), getattr(_handler_thread, "output", None))  # type: ignore[attr-defined]
    _thread_start(self)


def _bootstrap_in_sandbox(self: threading.Thread) -> None:
    _handler_thread.variables, _handler_thread.output = getattr(self, "_sandbox", (None, None))
    _thread_bootstrap_inner(self)


def install_thread_environ() -> _ThreadEnviron:
    """Give os.environ its per-thread view, once per process; threads started by a handler
    thread share its view.

    The object itself changes class rather than being replaced: botocore and others keep a
    reference to os.environ taken when their session was created."""
    if not isinstance(os.environ, _ThreadEnviron):
        os.environ.__class__ = _ThreadEnviron
        threading.Thread.start = _start_in_sandbox  # type: ignore[method-assign]
        threading.Thread._bootstrap_inner = _bootstrap_in_sandbox  # type: ignore[attr-defined]
        botocore.credentials.EnvProvider.load = _load_env_credentials
        # boto3's default session keeps the credentials it resolved first: one the harness used
        # before any function ran holds static keys, which a handler's boto3.client() would get.
        boto3.DEFAULT_SESSION = None
    return os.environ  # type: ignore[return-value]


class _CallerCredentials(botocore.credentials.Credentials):
    """Credentials read from the signing thread's environment at each request.

    Handler modules, and the clients they keep at module level, are shared by every function
    of the process, while on AWS each function has its own sandbox with its own role: a client
    made in one function's thread signs, in another's, with that one's role."""

    def __init__(self) -> None:
        self.method = "env"
        self.account_id = None

    @property
    def access_key(self) -> str:  # type: ignore[override]
        return os.environ["AWS_ACCESS_KEY_ID"]

    @property
    def secret_key(self) -> str:  # type: ignore[override]
        return os.environ["AWS_SECRET_ACCESS_KEY"]

    @property
    def token(self) -> str | None:  # type: ignore[override]
        return os.environ.get("AWS_SESSION_TOKEN")

    def get_frozen_credentials(self) -> botocore.credentials.ReadOnlyCredentials:
        return botocore.credentials.ReadOnlyCredentials(self.access_key, self.secret_key, self.token)


_env_provider_load = botocore.credentials.EnvProvider.load


def _load_env_credentials(self: botocore.credentials.EnvProvider) -> Any:
    # Caller credentials wherever the session is made: a session first used by the harness's
    # thread keeps what it resolved, and must still sign a handler thread's requests with that
    # function's role.
    loaded = _env_provider_load(self)
    return None if loaded is None else _CallerCredentials()


# --- per-thread output --------------------------------------------------------------------

class _ThreadCapture(io.TextIOBase):
    """sys.stdout / sys.stderr that hands a handler thread's writes to its invocation's
    buffer and everything else to the stream it replaced."""

    def __init__(self, replaced: Any):
        self.replaced = replaced

    def write(self, text: str) -> int:
        buffer = getattr(_handler_thread, "output", None)
        if buffer is None:
            return self.replaced.write(text)
        buffer.append(text)
        return len(text)

    def flush(self) -> None:
        if getattr(_handler_thread, "output", None) is None:
            self.replaced.flush()

    def isatty(self) -> bool:
        return False


def install_thread_output() -> None:
    """Put the capturing streams in place (again, if something swapped sys.stdout since)."""
    if not isinstance(sys.stdout, _ThreadCapture):
        sys.stdout = _ThreadCapture(sys.stdout)
    if not isinstance(sys.stderr, _ThreadCapture):
        sys.stderr = _ThreadCapture(sys.stderr)


# --- code ---------------------------------------------------------------------------------

_import_lock = threading.Lock()


_code_cache: Path | None = None


def _code_cache_root() -> Path:
    """One folder per process for unpacked packages, removed at exit. It outlives any one
    LocalCloud because an imported handler module stays imported for the process's life."""
    global _code_cache
    if _code_cache is None:
        _code_cache = Path(tempfile.mkdtemp(prefix="localcloud-lambda-code-"))
        atexit.register(shutil.rmtree, _code_cache, True)
    return _code_cache


_unpacked: dict[str, Path | None] = {}


def unpack_code(code_zip: bytes, digest: str) -> Path | None:
    """Unpack a deployment package once and return its folder; `digest` (the function's
    CodeSha256) names it, so an invocation does not rehash the package.

    An empty or non-zip package (moto accepts any bytes) gives None: the handler is then
    imported from this process's own path, which is how a function whose code is this
    project itself runs."""
    with _import_lock:
        if digest not in _unpacked:
            _unpacked[digest] = _extract(code_zip)
        return _unpacked[digest]


def _extract(code_zip: bytes) -> Path | None:
    if not code_zip:
        return None
    try:
        archive = zipfile.ZipFile(io.BytesIO(code_zip))
    except zipfile.BadZipFile:
        return None
    folder = _code_cache_root() / hashlib.sha256(code_zip).hexdigest()[:16]
    if not folder.exists():
        staging = folder.with_suffix(".partial")
        archive.extractall(staging)
        staging.rename(folder)
    return folder


class HandlerImportError(Exception):
    """The Handler string does not name an importable function (errorType from the runtime)."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type


def load_handler(handler: str, code_dir: Path | None) -> Callable[[Any, LambdaContext], Any]:
    module_name, _, function_name = handler.rpartition(".")
    if not module_name or not function_name:
        raise HandlerImportError("Runtime.MalformedHandlerName",
                                 f"Bad handler '{handler}': expected 'module.function'")
    with _import_lock:
        if code_dir is not None and str(code_dir) not in sys.path:
            sys.path.insert(0, str(code_dir))
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise HandlerImportError("Runtime.ImportModuleError",
                                     f"Unable to import module '{module_name}': {exc}") from exc
    if code_dir is not None:
        _refuse_foreign_module(module, module_name, code_dir)
    function = getattr(module, function_name, None)
    if not callable(function):
        raise HandlerImportError("Runtime.HandlerNotFound",
                                 f"Handler '{function_name}' missing on module '{module_name}'")
    return function


def _refuse_foreign_module(module: Any, module_name: str, code_dir: Path) -> None:
    """Two packages with different code under one module name cannot share a process; the
    same code loaded from elsewhere (this project's own tree, an identical package) can."""
    own_file = code_dir.joinpath(*module_name.split("."))
    packaged = next((path for path in (own_file.with_suffix(".py"), own_file / "__init__.py")
                     if path.exists()), None)
    loaded_from = Path(getattr(module, "__file__", "") or "")
    if packaged is None or loaded_from == packaged:
        return
    if loaded_from.is_file() and loaded_from.read_bytes() == packaged.read_bytes():
        return
    raise HandlerImportError(
        "Runtime.ImportModuleError",
        f"Module '{module_name}' is already loaded from {loaded_from}; this function's "
        f"package has different code in {packaged} (give it a distinct module name)")


# --- invocation ---------------------------------------------------------------------------

def _error_object(error_type: str, message: str, request_id: str,
                  stack: list[str] | None = None) -> dict[str, Any]:
    return {"errorMessage": message, "errorType": error_type, "requestId": request_id,
            "stackTrace": stack or []}


def invoke_handler(spec: FunctionSpec, event: Any, time_out: bool = False) -> InvocationResult:
    """Call the function's handler with `event`; never raises for the handler's own faults.

    `time_out`: run the handler to its end (its side effects happen) and then report that it
    timed out, as Lambda reports a handler that outlived its timeout."""
    environ = install_thread_environ()
    install_thread_output()
    request_id = str(uuid.uuid4())
    started = time.monotonic()
    deadline = started + spec.timeout_s
    outcome: dict[str, Any] = {}
    output: list[str] = []

    def run() -> None:
        environ.set_overlay(dict(spec.environment))
        _handler_thread.output = output
        try:
            handler = load_handler(spec.handler, spec.code_dir)
            result = handler(event, LambdaContext(spec, request_id, deadline))
            try:
                outcome["payload"] = json.dumps(result)
            except (TypeError, ValueError) as exc:
                outcome["error"] = _error_object(
                    "Runtime.MarshalError", f"Unable to marshal response: {exc}", request_id)
        except HandlerImportError as exc:
            outcome["error"] = _error_object(exc.error_type, str(exc), request_id)
        except Exception as exc:  # the runtime reports any exception the handler raises
            stack = traceback.format_list(traceback.extract_tb(exc.__traceback__))
            outcome["error"] = _error_object(type(exc).__name__, str(exc), request_id, stack)
        finally:
            environ.set_overlay(None)
            _handler_thread.output = None

    worker = threading.Thread(target=run, name=f"lambda-{spec.function_name}", daemon=True)
    worker.start()
    worker.join(timeout=spec.timeout_s)
    elapsed_ms = (time.monotonic() - started) * 1000
    if worker.is_alive() or time_out:
        outcome = {"error": _error_object(
            "Sandbox.Timedout",
            f"RequestId: {request_id} Error: Task timed out after {spec.timeout_s:.2f} seconds",
            request_id)}
    logs = [f"START RequestId: {request_id} Version: {spec.version}"]
    logs += "".join(output).splitlines()
    if "error" in outcome:
        error = outcome["error"]
        logs.append(f"[ERROR] {error['errorType']}: {error['errorMessage']}")
        logs.extend(line.rstrip() for line in error["stackTrace"])
    logs += [f"END RequestId: {request_id}",
             f"REPORT RequestId: {request_id}\tDuration: {elapsed_ms:.2f} ms\t"
             f"Memory Size: {spec.memory_mb} MB"]
    if "error" in outcome:
        return InvocationResult(json.dumps(outcome["error"]), True, logs)
    return InvocationResult(outcome["payload"], False, logs)
