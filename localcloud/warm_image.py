"""Instances that boot from a warm image: hundreds of node agents, and trainers, on one machine.

An instance process started from scratch (`python -m localcloud.node_boot ... -m node.agent`)
costs about a second of imports and tens of MB; 512 of them do not fit on a small machine, and
each preflight, torchrun and rank it starts imports torch again (seconds each). A warm image is
one process that has imported what an instance runs (the node boot, the agent, boto3 with its
service models; the trainer and torch where it trains) and forks a child for each instance that
boots; what that child starts with the same interpreter runs in place as well, a fork of its
starter (localcloud/in_place.py). The child is the instance's process, as the command would have
been: a process group of its own, the instance's folder, environment and console, `python -m
MODULE ARGS` (or `-c CODE ARGS`) run in it as the interpreter runs it, and the image's memory
shared until it is written. The fleet signals, freezes, stops and watches it as any instance
process, so every fault acts on it unchanged.

    image = WarmImage.start(["localcloud.node_boot", "node.agent"])
    cloud.fleet.image = image      # instances whose boot command is `python -m ...` fork from it
    ...
    image.stop()

The image speaks JSON lines: on its stdin a fork request {"token", "argv", "cwd", "env",
"console"}; on its stdout {"token", "pid"} once the child exists and {"pid", "status"} once it
exited (reaped at once; the fleet signals a pid only until it learns of the exit). Its own errors
go to its stderr.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from localcloud import in_place
from localcloud.procfs import cpu_seconds
from localcloud.waiting import until

__all__ = ["WarmImage", "ForkedProcess", "forked_from_image", "PRELOADED_SERVICES"]

PRELOADED_SERVICES = ("s3", "dynamodb", "events", "stepfunctions", "sts")
"""The AWS services whose models the image loads before it forks: those a node agent calls."""
_IN_IMAGE_CHILD = False


def forked_from_image() -> bool:
    """Whether this process is an instance forked from a warm image: `exec python -m X` is then
    better run in place (localcloud/node_boot.py), the image having X loaded already."""
    return _IN_IMAGE_CHILD


class ForkedProcess:
    """A process forked by the image: the part of subprocess.Popen the fleet and the tests use."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._exited = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # the image reaps it at once: its pid is not ours after that
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def exited(self, status: int) -> None:
        self.returncode = status
        self._exited.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"instance process {self.pid}", timeout)
        return self.returncode


class WarmImage:
    """The fleet's side of a warm image process."""

    def __init__(self, process: subprocess.Popen):
        self._process = process
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._forking: dict[int, tuple[threading.Event, list[ForkedProcess]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._argv: dict[int, list[str]] = {}
        self._reader = threading.Thread(target=self._read, name="warm-image", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, modules: list[str], path: list[str] = ()) -> WarmImage:
        """An image process with `modules` imported (and the services' models loaded), found on
        `path` too."""
        repo = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(filter(None, [repo, *path, os.environ.get("PYTHONPATH")]))
        process = subprocess.Popen([sys.executable, "-m", "localcloud.warm_image", *modules],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                   env=os.environ | {"PYTHONPATH": path}, start_new_session=True)
        return cls(process)

    def serves(self, argv: list[str]) -> bool:
        """Whether `argv` is a command the image can run in a child: `python -m MODULE ...` or
        `python -c CODE ...`."""
        return in_place.runnable(argv)

    def fork(self, argv: list[str], cwd: Path, env: dict[str, str], console: Path) -> ForkedProcess:
        """A child of the image running `argv` (see `serves`) in `cwd` with `env`, its output
        appended to `console`."""
        token = next(self._tokens)
        ready, forked = threading.Event(), []
        with self._lock:
            self._forking[token] = (ready, forked)
            self._argv[token] = argv
            request = {"token": token, "argv": argv[1:], "cwd": str(cwd), "env": env, "console": str(console)}
            self._process.stdin.write((json.dumps(request) + "\n").encode())
        # The first request waits for the image's imports: a minute or more on a loaded machine.
        until(lambda: ready.wait(0.5), lambda: cpu_seconds(self._process.pid),
              what=f"the warm image to fork {argv[1:3]} (its CPU time is its progress)", poll_s=0)
        if not forked:
            raise RuntimeError("the warm image stopped before it forked")
        # the child itself, not a lookup by pid: one that exits at once is gone from _children
        return forked[0]

    def stop(self) -> None:
        """End the image (its children, the instances, are the fleet's to end)."""
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._reader.join(timeout=5)

    def _read(self) -> None:
        for line in self._process.stdout:
            message = json.loads(line)
            with self._lock:
                if "token" in message:
                    child = ForkedProcess(message["pid"], self._argv.pop(message["token"]))
                    self._children[child.pid] = child
                    ready, forked = self._forking.pop(message["token"])
                    forked.append(child)
                    ready.set()
                else:  # the image reports a child's exit after its fork, never before
                    self._children.pop(message["pid"]).exited(message["status"])
        with self._lock:  # the image ended: no request is answered any more
            for ready, _ in self._forking.values():
                ready.set()


# --- the image process ---------------------------------------------------------------------

def _warm(modules: list[str]) -> None:
    """Import the modules and have botocore load the services' models, into one loader that every
    botocore session of a child then shares (each would load its own otherwise: megabytes each)."""
    import importlib

    import botocore.loaders
    import botocore.session

    for module in modules:
        importlib.import_module(module)
    loader = botocore.loaders.create_loader()
    botocore.session.create_loader = lambda *_: loader
    session = botocore.session.get_session()
    for service in PRELOADED_SERVICES:
        # Explicit credentials: the image must not look for any (the chain ends at the metadata
        # service, which the image has none of).
        session.create_client(service, region_name="us-east-1", aws_access_key_id="warm",
                              aws_secret_access_key="warm")
        session.get_paginator_model(service)


def _become(request: dict[str, Any], control_fds: tuple[int, int]) -> None:
    """In the child: be the instance's process, run its command in place, exit with its status."""
    global _IN_IMAGE_CHILD
    _IN_IMAGE_CHILD = True
    os.setsid()
    console = os.open(request["console"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(console, 1)
    os.dup2(console, 2)
    for fd in {console, devnull, *control_fds} - {0, 1, 2}:  # the image's pipes are 0 and 1: replaced
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # every child would draw the image's sequence: the same jitter fleet-wide
    in_place.install()  # what the instance starts with this interpreter runs in place too
    in_place.exec_in_place([sys.executable, *request["argv"]])


def serve(modules: list[str]) -> None:
    """The image's loop: fork on each request, report each child's exit. It ends with its stdin:
    the fleet ends its instances before that, so children still alive then were left behind by
    a harness that died, and go with it."""
    _warm(modules)
    gc.collect()
    gc.freeze()  # the collector would otherwise write to every shared page in every child
    requests, replies = sys.stdin.fileno(), sys.stdout.fileno()
    pending = b""
    children: set[int] = set()
    while True:
        if select.select([requests], [], [], 0.1)[0]:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _become(request, (requests, replies))
                children.add(pid)
                os.write(replies, (json.dumps({"token": request["token"], "pid": pid}) + "\n").encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            os.write(replies, (json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
    for pid in children:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    # Run as the imported module, not as __main__: a child's `forked_from_image()` reads the
    # module the rest of the code imports.
    from localcloud import warm_image

    warm_image.serve(sys.argv[1:])
