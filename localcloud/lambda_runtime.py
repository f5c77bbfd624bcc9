"""Run a Lambda function's Python handler here, as the Lambda Python runtime would.

moto runs Lambda code in Docker, which this machine does not have. Here the handler named by
the function's `Handler` string ("package.module.function") is imported from the function's
deployment package and called, with what the real runtime gives it
(`localcloud.lambda_bootstrap`: the context object, error payloads shaped like the runtime's,
`errorType` = exception class name, which Step Functions Retry/Catch match on). Where it runs
depends on the function's Runtime (`localcloud.lambda_runtimes`):

- on the local cloud's own Python, in a thread of this process. Each execution environment has
  its own modules (`localcloud.lambda_isolation`): many functions may each have an `app.py`,
  and module state is per environment, which serves one invocation at a time, as on AWS;
  concurrent invocations each take an idle environment or start a new one. Its environment
  variables are visible to its threads only (several functions with different variables run at
  once in one process). Its timeout: a handler still running when it expires is reported as AWS
  reports it (`Sandbox.Timedout`); its thread cannot be killed, so it is left to finish, its
  result dropped and its environment never used again. What its threads
  print (print, logging to stdout/stderr, Powertools' JSON logs and EMF metrics) is captured
  into the invocation's log lines, as Lambda sends a function's output to CloudWatch Logs.
- on another Python, in processes of that interpreter, one per execution environment, each
  serving one invocation at a time and kept for the next (a warm start); more are started
  while all are busy, as Lambda scales out. The function's environment is the process's, and a
  handler that outlives its timeout is killed with its process, as Lambda resets an
  environment that timed out; the next invocation starts a new one.

Either way the function's Init (its module imported, the code outside the handler run) has 10 s
of its own, as on Lambda: the timeout counts from its end, so a cold start is not a timeout.
An invocation can also be told to report a timeout after its handler ran (chaos testing).
"""

from __future__ import annotations

import atexit
import hashlib
import io
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import boto3
import botocore.credentials

from localcloud import lambda_bootstrap, lambda_isolation
from localcloud.lambda_bootstrap import INIT_LIMIT_S, LambdaContext, error_object, initialise
from localcloud.lambda_isolation import FunctionModules

E = TypeVar("E")

__all__ = ["FunctionSpec", "InvocationResult", "invoke_handler", "unpack_code", "layer_folders",
           "code_cache_root", "close_environments", "install_sandboxes"]


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
    """Where the deployment package is unpacked (the task root); None for a package that is no
    zip, whose handler then comes from this process's own modules."""
    search_path: tuple[Path, ...] = ()
    """Where the function's modules come from, first to last: its package, its layers' Python
    folders, and for another interpreter the SDK and public layers (lambda_runtimes.import_path)."""
    interpreter: str | None = None
    """The executable of the function's Python; None for this process's own."""

    @property
    def environment_key(self) -> tuple[Any, ...]:
        """What identifies the function's execution environments: new code, new layers or another
        Python get new ones, as on AWS."""
        return self.function_arn, self.search_path, self.interpreter


@dataclass(frozen=True)
class InvocationResult:
    """The outcome of one invocation, in the form the Invoke API returns it."""

    payload: str
    """JSON text: the handler's return value, or the runtime's error object."""
    errored: bool
    """True when the payload is an error object (Invoke's X-Amz-Function-Error is set)."""
    log_lines: list[str]
    """What CloudWatch Logs gets: START, the handler's output, the error if any, END, REPORT."""


# --- per-thread sandbox: environment, output, modules --------------------------------------

_handler_thread = threading.local()
"""What the thread serves: `variables` (the function's environment), `output` (its invocation's
log buffer), `modules` (its FunctionModules); None outside handler threads."""


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


def _current_modules() -> FunctionModules | None:
    return getattr(_handler_thread, "modules", None)


def _start_in_sandbox(self: threading.Thread) -> None:
    # A Lambda sandbox is a process: every thread a handler starts (a thread pool, say) sees the
    # function's environment and modules and writes to its log, as the handler's own thread does.
    self._sandbox = (_ThreadEnviron._overlay(), getattr(_handler_thread, "output", None),  # type: ignore[attr-defined]
                     _current_modules())
    _thread_start(self)


def _bootstrap_in_sandbox(self: threading.Thread) -> None:
    _handler_thread.variables, _handler_thread.output, _handler_thread.modules = getattr(
        self, "_sandbox", (None, None, None))
    _thread_bootstrap_inner(self)


def install_sandboxes() -> _ThreadEnviron:
    """Give os.environ its per-thread view and imports their per-function resolution, once per
    process; threads started by a handler thread share its sandbox.

    The environment object itself changes class rather than being replaced: botocore and others
    keep a reference to os.environ taken when their session was created."""
    if not isinstance(os.environ, _ThreadEnviron):
        os.environ.__class__ = _ThreadEnviron
        threading.Thread.start = _start_in_sandbox  # type: ignore[method-assign]
        threading.Thread._bootstrap_inner = _bootstrap_in_sandbox  # type: ignore[attr-defined]
        botocore.credentials.EnvProvider.load = _load_env_credentials
        # boto3's default session keeps the credentials it resolved first: one the harness used
        # before any function ran holds static keys, which a handler's boto3.client() would get.
        boto3.DEFAULT_SESSION = None
        lambda_isolation.install(_current_modules)
    return os.environ  # type: ignore[return-value]


class _CallerCredentials(botocore.credentials.Credentials):
    """Credentials read from the signing thread's environment at each request.

    boto3 is one copy in this process, and so is its default session: whichever thread first
    resolved its credentials (the harness's, or another function's) would sign every later
    function's requests with them, where on AWS each function signs with its own role."""

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

_code_cache: Path | None = None


def code_cache_root() -> Path:
    """One folder per process for unpacked packages and layers, removed at exit. It outlives any
    one LocalCloud because an imported handler module stays imported for the process's life."""
    global _code_cache
    if _code_cache is None:
        _code_cache = Path(tempfile.mkdtemp(prefix="localcloud-lambda-code-"))
        atexit.register(shutil.rmtree, _code_cache, True)
    return _code_cache


_unpacked: dict[str, Path | None] = {}
_unpack_lock = threading.Lock()


def unpack_code(code_zip: bytes, digest: str) -> Path | None:
    """Unpack a deployment package or layer once and return its folder; `digest` (its CodeSha256)
    names it, so an invocation does not rehash the package.

    An empty or non-zip package (moto accepts any bytes) gives None: the handler is then
    imported from this process's own path."""
    with _unpack_lock:
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
    folder = code_cache_root() / hashlib.sha256(code_zip).hexdigest()[:16]
    if not folder.exists():
        staging = folder.with_suffix(".partial")
        archive.extractall(staging)
        staging.rename(folder)
    return folder


def layer_folders(layer_dir: Path, runtime: str) -> list[Path]:
    """A layer's folders on a Python function's path, as Lambda extracts layers to /opt:
    /opt/python/lib/<runtime>/site-packages, then /opt/python."""
    return [folder for folder in (layer_dir / "python" / "lib" / runtime / "site-packages", layer_dir / "python")
            if folder.is_dir()]


# --- invocation ---------------------------------------------------------------------------

def invoke_handler(spec: FunctionSpec, event: Any, time_out: bool = False) -> InvocationResult:
    """Call the function's handler with `event`; never raises for the function's own faults.

    `time_out`: run the handler to its end (its side effects happen) and then report that it
    timed out, as Lambda reports a handler that outlived its timeout."""
    request_id = str(uuid.uuid4())
    started = time.monotonic()
    run = _run_in_this_process if spec.interpreter is None else _run_in_its_process
    outcome, printed = run(spec, event, request_id)
    elapsed_ms = (time.monotonic() - started) * 1000
    if outcome is None or time_out:
        outcome = {"error": error_object(
            "Sandbox.Timedout",
            f"RequestId: {request_id} Error: Task timed out after {spec.timeout_s:.2f} seconds",
            request_id)}
    logs = [f"START RequestId: {request_id} Version: {spec.version}"]
    logs += printed.splitlines()
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


def _invocation_deadline(initialised: Callable[[float], bool], timeout_s: float) -> float | None:
    """When an invocation must end: its timeout counts from the end of its environment's Init
    (`initialised(seconds)` waits that long for it). An Init not done within its own 10 s goes
    on within the timeout, as Lambda retries it at the invocation; None if that runs out too."""
    if initialised(INIT_LIMIT_S):
        return time.monotonic() + timeout_s
    deadline = time.monotonic() + timeout_s
    return deadline if initialised(max(0.0, deadline - time.monotonic())) else None


def _context(spec: FunctionSpec, request_id: str, deadline: float) -> LambdaContext:
    return LambdaContext(spec.function_name, spec.version, spec.function_arn, spec.memory_mb, request_id, deadline)


def _run_in_this_process(spec: FunctionSpec, event: Any, request_id: str) -> tuple[dict[str, Any] | None, str]:
    """The outcome (None if the function outlived its timeout) and what it printed."""
    environ = install_sandboxes()
    install_thread_output()
    modules = _thread_environments.take(spec)
    initialised = threading.Event()
    outcome: dict[str, Any] = {}
    output: list[str] = []

    def run() -> None:
        environ.set_overlay(dict(spec.environment))
        _handler_thread.output, _handler_thread.modules = output, modules
        try:
            invocation = initialise(spec.handler, modules.import_module)  # cached modules once warm
            initialised.set()
            outcome.update(invocation(event, _context(spec, request_id, time.monotonic() + spec.timeout_s)))
        finally:
            environ.set_overlay(None)
            _handler_thread.output = _handler_thread.modules = None

    worker = threading.Thread(target=run, name=f"lambda-{spec.function_name}", daemon=True)
    worker.start()
    deadline = _invocation_deadline(initialised.wait, spec.timeout_s)
    if deadline is not None:
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
    if worker.is_alive():  # timed out: Lambda resets the environment, the next one starts cold
        _thread_environments.forget(modules)
        return None, "".join(output)
    _thread_environments.give_back(spec, modules)
    return outcome, "".join(output)


def _run_in_its_process(spec: FunctionSpec, event: Any, request_id: str) -> tuple[dict[str, Any] | None, str]:
    environment = _process_environments.take(spec)
    deadline = _invocation_deadline(environment.initialised, spec.timeout_s)
    if deadline is None:
        environment.close()
        return None, ""
    context = {"function_name": spec.function_name, "function_version": spec.version,
               "invoked_function_arn": spec.function_arn, "memory_limit_in_mb": spec.memory_mb,
               "aws_request_id": request_id, "remaining_ms": int((deadline - time.monotonic()) * 1000)}
    answer = environment.invoke(event, context, deadline)
    if answer is None:
        return None, ""
    _process_environments.give_back(spec, environment)
    return answer, answer.pop("output")


class _EnvironmentProcess:
    """One execution environment of a function on another Python: a process of its interpreter
    running lambda_bootstrap, which does its Init as it starts and then answers one invocation
    at a time over two pipes."""

    def __init__(self, spec: FunctionSpec):
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        self.process = subprocess.Popen(
            [spec.interpreter, "-I", lambda_bootstrap.__file__, str(requests_read), str(replies_write)],
            pass_fds=(requests_read, replies_write), stdin=subprocess.DEVNULL, cwd=spec.code_dir,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **spec.environment})
        os.close(requests_read)
        os.close(replies_write)
        self.requests = os.fdopen(requests_write, "w", encoding="utf-8")
        self.replies = os.fdopen(replies_read, "r", encoding="utf-8")
        self._init_output: str | None = None
        """What Init printed, until the first invocation's log takes it; None while Init runs."""
        self._send({"init": {"handler": spec.handler, "path": [str(folder) for folder in spec.search_path]}})

    def _send(self, message: dict[str, Any]) -> None:
        self.requests.write(json.dumps(message) + "\n")
        self.requests.flush()

    def _reply(self, deadline: float) -> str | None:
        """The next line the environment writes; "" if it ended, None if the deadline came first."""
        ready, _, _ = select.select([self.replies], [], [], max(0.0, deadline - time.monotonic()))
        return self.replies.readline() if ready else None

    def initialised(self, wait_s: float) -> bool:
        """Whether Init is over, waiting up to `wait_s` for it."""
        if self._init_output is None:
            line = self._reply(time.monotonic() + wait_s)
            if line is None:
                return False
            self._init_output = json.loads(line)["output"] if line else ""
        return True

    def invoke(self, event: Any, context: dict[str, Any], deadline: float) -> dict[str, Any] | None:
        """The environment's answer, its "output" led by what Init printed; None when the deadline
        passed first (the process is then killed: Lambda resets an environment that timed out)."""
        try:
            self._send({"invoke": {"event": event, "context": context}})
            line = self._reply(deadline)
        except OSError:  # the pipe broke: the process is gone
            line = ""
        if line is None:
            self.close()
            return None
        if not line:
            status = self.process.wait()
            self.close()
            return {"error": error_object("Runtime.ExitError", f"RequestId: {context['aws_request_id']} "
                                          f"Error: Runtime exited with error: exit status {status}",
                                          context["aws_request_id"]), "output": ""}
        answer = json.loads(line)
        answer["output"] = (self._init_output or "") + answer["output"]
        self._init_output = ""  # in this invocation's log now
        return answer

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.requests, self.replies):
            try:
                pipe.close()
            except OSError:
                pass
        _process_environments.forget(self)


class _EnvironmentPool(Generic[E]):
    """The idle execution environments of functions, by environment key. An invocation takes one
    (a cold start makes a new one with `make`), serves alone in it and gives it back, as Lambda
    sends each environment one invocation at a time and scales out with more of them."""

    def __init__(self, make: Callable[[FunctionSpec], E]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._idle: dict[tuple[Any, ...], list[E]] = {}
        self._living: set[E] = set()

    def take(self, spec: FunctionSpec) -> E:
        with self._lock:
            idle = self._idle.get(spec.environment_key)
            if idle:
                return idle.pop()
        environment = self._make(spec)  # a cold start, outside the lock
        with self._lock:
            self._living.add(environment)
        return environment

    def give_back(self, spec: FunctionSpec, environment: E) -> None:
        with self._lock:
            if environment in self._living:
                self._idle.setdefault(spec.environment_key, []).append(environment)

    def forget(self, environment: E) -> None:
        with self._lock:
            self._living.discard(environment)
            for idle in self._idle.values():
                if environment in idle:
                    idle.remove(environment)

    def living(self) -> list[E]:
        with self._lock:
            return list(self._living)


_thread_environments: _EnvironmentPool[FunctionModules] = _EnvironmentPool(
    lambda spec: lambda_isolation.new_modules(spec.function_name, spec.search_path))
"""Environments in this process: each its own modules. Kept across local clouds, as the modules
stay imported for the process's life."""
_process_environments: _EnvironmentPool[_EnvironmentProcess] = _EnvironmentPool(_EnvironmentProcess)


def close_environments() -> None:
    """End every process environment: their variables name a local cloud that is stopping."""
    for environment in _process_environments.living():
        environment.close()


atexit.register(close_environments)
