"""A stand-in trainer: the real trainer's signals on a schedule, without torch.

    python -m node.standin --config trainer.yaml --node-rank 0 --nodes 512 --step-seconds 0.5 \
        --rendezvous 127.77.0.1:29500 --join-timeout-s 300

The node agent runs it in place of torchrun and the trainer when TRAINFLEET_STANDIN_STEP_S is set
(node/attempt.py), so that the control plane can be driven by fleets this machine could never
train (the local cloud's 512-node runs: localcloud/scale.py). The agent runs it as a thread of its
own (`start_thread`, a handle like subprocess.Popen's), so a node is one process, not two. It reads the config file the agent
writes for the real trainer and gives what the agent and the control plane read of the real one:

- progress: each node's progress file (TRAINFLEET_PROGRESS_FILE) holds the resume step once the
  node "joined", then every step; node rank 0 stands for global rank 0 and appends one metrics
  record per step with the real trainer's fields (training.metrics_file), or the `finished`
  record when resumed at the last step;
- checkpoints: on the interval, when asked (the request file, TRAINFLEET_CHECKPOINT_REQUEST_FILE)
  and after the final step, node rank 0 writes DCP's `.metadata` and one tiny part per node where
  the real layout puts shards, then the commit marker with its manifest, then applies retention:
  the commit protocol of trainer/checkpoint_catalog.py, so the control plane's checks and resume
  logic run unchanged;
- rendezvous: no node steps before every node of the world has joined, as with torchrun's c10d
  rendezvous: node rank 0 listens on the attempt's endpoint, the others connect and wait for its
  word; a world still incomplete after the join timeout ends each node that waited with exit 1,
  as torchrun's RendezvousTimeoutError does;
- resume: node rank 0 chooses the resume point as the real trainer does
  (checkpoint_catalog.resume_point), under checkpoint.resume_uri where the config names the run it
  resumes; the other nodes take the step the config names;
- exits: 0 after the final step; 2 with `config error:` for a config it cannot run; on SIGTERM
  it stops within a step and exits 1, as torchrun does (its SignalException ends it with 1).

Past the rendezvous the world is not synchronous: a node that stops does not stall the others (a real world would
hang or fail in its next collective). Node losses, Spot notices and crashes reach the control
plane as they do from a real world (EC2's events, the checkpoint request, the failing node's
exit); a hang of one rank is not what this stand-in can show, nor a world repaired in place
(trainer/repair.py): the local stacks that run it switch repairs off (localcloud/stack.py).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import yaml

from trainer import checkpoint_catalog as catalog
from trainer.progress import PROGRESS_FILE_ENV, Progress

__all__ = ["StandIn", "StandInThread", "run", "start_thread", "main"]

EXIT_SIGNALLED = 1
"""torchrun's exit status when SIGTERM stopped it."""
EXIT_CONFIG = 2
"""The trainer's exit status for a config it refuses (trainer/train.py)."""
EXIT_KILLED = -signal.SIGKILL
"""What Popen reports for a trainer killed outright."""
EXIT_RENDEZVOUS = 1
"""torchrun's exit status when the rendezvous timed out."""
PART_WRITERS = 8
"""Parts written at once: one per node, a 512-node checkpoint is 512 PUTs."""
RENDEZVOUS_POLL_S = 0.25
"""How often a node waiting at the rendezvous looks whether it was stopped or has waited too long."""
GO = b"go\n"


class RendezvousTimeout(RuntimeError):
    """The world did not gather within the join timeout."""


def rendezvous(endpoint: tuple[str, int], node_rank: int, nodes: int, timeout_s: float,
               stop: threading.Event) -> bool:
    """Wait until every node of the world has joined; False when stopped first. Node rank 0
    listens on `endpoint` and answers every node once all have connected."""
    deadline = time.monotonic() + timeout_s
    if node_rank == 0:
        return _host_rendezvous(endpoint, nodes, deadline, stop)
    while True:
        try:
            with socket.create_connection(endpoint, timeout=RENDEZVOUS_POLL_S) as peer:
                peer.sendall(f"{node_rank}\n".encode())
                return _await_word(peer, deadline, stop)
        except (ConnectionRefusedError, ConnectionResetError, socket.timeout):
            pass  # node rank 0 is not listening yet, or went away: try again
        if stop.wait(RENDEZVOUS_POLL_S):
            return False
        if time.monotonic() > deadline:
            raise RendezvousTimeout(f"node rank {node_rank}: no rendezvous at {endpoint[0]}:{endpoint[1]} "
                                    f"within {timeout_s:.0f} s")


def _await_word(peer: socket.socket, deadline: float, stop: threading.Event) -> bool:
    peer.settimeout(RENDEZVOUS_POLL_S)
    while not stop.is_set():
        try:
            word = peer.recv(len(GO))
        except socket.timeout:
            if time.monotonic() > deadline:
                raise RendezvousTimeout("the world did not gather within the join timeout") from None
            continue
        if word != GO:
            raise ConnectionResetError("node rank 0 left the rendezvous")
        return True
    return False


def _host_rendezvous(endpoint: tuple[str, int], nodes: int, deadline: float, stop: threading.Event) -> bool:
    joined: dict[int, socket.socket] = {}
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(endpoint)
        listener.listen(nodes)
        listener.settimeout(RENDEZVOUS_POLL_S)
        try:
            while len(joined) < nodes - 1:
                if stop.is_set():
                    return False
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, nodes)) - set(joined))
                    raise RendezvousTimeout(f"{len(joined) + 1} of {nodes} nodes joined; missing node ranks "
                                            f"{missing[:10]}{' ...' if len(missing) > 10 else ''}")
                try:
                    peer, _ = listener.accept()
                except socket.timeout:
                    continue
                peer.settimeout(RENDEZVOUS_POLL_S)
                try:
                    rank = int(peer.recv(16).decode())
                except (socket.timeout, ValueError):
                    peer.close()
                    continue
                if rank in joined:  # a node that came back: its new connection counts
                    joined.pop(rank).close()
                joined[rank] = peer
            for peer in joined.values():
                peer.sendall(GO)
            return True
        finally:
            for peer in joined.values():
                peer.close()


class ConfigError(ValueError):
    """A config the stand-in cannot run."""


class StandIn:
    """One node's stand-in trainer for one attempt."""

    def __init__(self, config: dict[str, Any], node_rank: int, nodes: int, step_seconds: float,
                 environ: Any, stop: threading.Event, out: TextIO, endpoint: tuple[str, int],
                 join_timeout_s: float):
        training, checkpoint = config.get("training", {}), config.get("checkpoint", {})
        try:
            self.steps = int(training["steps"])
            self.batch_tokens = int(training.get("batch_size", 1)) * int(config.get("model", {}).get("seq_len", 1))
            self.target = catalog.resume_target(checkpoint.get("resume", "none"))
            self.uri, self.interval = checkpoint.get("uri", ""), int(checkpoint.get("interval", 0))
            self.resume_uri = checkpoint.get("resume_uri", "")
            self.keep_last = int(checkpoint.get("keep_last", 0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{type(exc).__name__}: {exc}") from exc
        if not 0 <= node_rank < nodes or step_seconds <= 0:
            raise ConfigError(f"node rank {node_rank} of {nodes} nodes, {step_seconds} s a step")
        self.node_rank, self.nodes, self.step_seconds, self.stop = node_rank, nodes, step_seconds, stop
        self.endpoint, self.join_timeout_s = endpoint, join_timeout_s
        self.out = out
        self.layout = {key: int(value) for key, value in config.get("parallel", {}).items()
                       if key in ("pp", "dp", "tp")}
        self.config_hash = catalog.config_hash(config)
        self.metrics = Path(training["metrics_file"]) if node_rank == 0 and training.get("metrics_file") else None
        self.progress = Progress(Path(environ[PROGRESS_FILE_ENV]) if environ.get(PROGRESS_FILE_ENV) else None)
        self.requests = catalog.SaveRequests(environ.get(catalog.REQUEST_FILE_ENV), None)
        self.store = catalog.open_store(self.uri) if self.uri and node_rank == 0 else None

    def run(self) -> int:
        try:
            gathered = rendezvous(self.endpoint, self.node_rank, self.nodes, self.join_timeout_s, self.stop)
        except (RendezvousTimeout, OSError) as exc:
            print(f"stand-in trainer: rendezvous failed (as torchrun: RendezvousTimeoutError): {exc}", file=self.out,
                  flush=True)
            return EXIT_RENDEZVOUS
        if not gathered:
            print("stand-in trainer: got SIGTERM at the rendezvous", file=self.out, flush=True)
            return EXIT_SIGNALLED
        step = self.resume_step()
        self.progress.reached(step)
        if step >= self.steps:
            print(f"nothing to train: resumed at step {step}, training.steps is {self.steps}", file=self.out, flush=True)
            self.record({"step": step, "finished": True})
            return 0
        while step < self.steps:
            if self.stop.wait(self.step_seconds):
                print("stand-in trainer: got SIGTERM, stopping (as torchrun: SignalException)", file=self.out, flush=True)
                return EXIT_SIGNALLED
            step += 1
            self.record({"step": step, "loss": 2.0 + 8.0 * math.exp(-step / 200), "grad_norm": 1.0, "lr": 1e-3,
                         "step_time_s": self.step_seconds, "tokens_per_s": self.batch_tokens / self.step_seconds})
            self.progress.reached(step)
            self.maybe_save(step)
        return 0

    def resume_step(self) -> int:
        if self.store is not None:
            resumed = catalog.open_store(self.resume_uri) if self.resume_uri else self.store
            manifest = catalog.resume_point(resumed, self.target, saves=self.store)
            return manifest.step if manifest else 0
        if isinstance(self.target, int):
            return self.target
        if self.target == "latest" and self.uri:  # a later attempt whose resume point was not named
            manifest = catalog.latest_committed(self.resume_uri or self.uri)
            return manifest.step if manifest else 0
        return 0

    def record(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            with self.metrics.open("a") as out:
                out.write(json.dumps(record | {"time": time.time()}) + "\n")

    def maybe_save(self, step: int) -> None:
        if self.store is None:
            return
        reason = catalog.save_reason(step, self.interval, requested=self.requests.pending(), final=step == self.steps)
        if reason is None:
            return
        self.requests.honoured()
        step_dir = catalog.step_dir_name(step)
        parts = [(step_dir, ".metadata")] + [
            (f"{catalog.shard_folder(node)}/{step_dir}", f"__{node}_0.distcp") for node in range(self.nodes)]
        body = json.dumps({"step": step, "stand_in": True}).encode()
        with ThreadPoolExecutor(PART_WRITERS) as writers:
            list(writers.map(lambda part: self.store.create(*part, body), parts))
        files = tuple(sorted(catalog.step_files(self.store, step).values(), key=lambda stored: stored.name))
        manifest = catalog.Manifest(step=step, layout=self.layout, files=files, config_hash=self.config_hash,
                                    reason=reason)
        self.store.create(step_dir, catalog.MARKER_NAME, manifest.to_json())
        print(f"checkpoint committed: {self.store.step_uri(step_dir)} ({reason}, {len(files)} files)", file=self.out,
              flush=True)
        catalog.prune(self.store, self.keep_last)


def endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    return host, int(port)


def run(argv: list[str], environ: Any, stop: threading.Event, out: TextIO) -> int:
    """The stand-in for one node: its exit status. Its lines go to `out`."""
    parser = argparse.ArgumentParser(prog="python -m node.standin")
    parser.add_argument("--config", required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--step-seconds", type=float, required=True)
    parser.add_argument("--rendezvous", type=endpoint, required=True, help="HOST:PORT of node rank 0")
    parser.add_argument("--join-timeout-s", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        config = yaml.safe_load(Path(args.config).read_text())
        standin = StandIn(config, args.node_rank, args.nodes, args.step_seconds, environ, stop, out,
                          args.rendezvous, args.join_timeout_s)
    except (OSError, yaml.YAMLError, ConfigError) as exc:
        print(f"config error: {exc}", file=out, flush=True)
        return EXIT_CONFIG
    return standin.run()


class StandInThread:
    """The stand-in run on a thread of the agent, behind subprocess.Popen's poll, returncode,
    send_signal, wait and kill: SIGTERM stops it within a step, as torchrun; a kill ends it at once
    for the agent (the thread winds down at its next step, writing nothing more)."""

    def __init__(self, argv: list[str], environ: dict[str, str], output: BinaryIO):
        self.returncode: int | None = None
        self.pid = os.getpid()  # the process it runs in
        self._stop = threading.Event()
        self._done = threading.Event()
        self._out = io.TextIOWrapper(os.fdopen(os.dup(output.fileno()), "ab"), write_through=True)
        self._thread = threading.Thread(target=self._run, args=(argv, environ), name="stand-in trainer", daemon=True)
        self._thread.start()

    def _run(self, argv: list[str], environ: dict[str, str]) -> None:
        try:
            code = run(argv, environ, self._stop, self._out)
        except SystemExit as exc:  # argparse refusing the command line
            code = exc.code if isinstance(exc.code, int) else EXIT_CONFIG
        except Exception:  # a crash of the trainer, as torchrun would report it
            traceback.print_exc(file=self._out)
            code = 1
        finally:
            self._out.close()
        if self.returncode is None:
            self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if signum == signal.SIGKILL:
            self.kill()
        else:
            self._stop.set()

    def kill(self) -> None:
        self._stop.set()
        if self.returncode is None:
            self.returncode = EXIT_KILLED
        self._done.set()

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("node.standin", timeout)
        return self.returncode


def start_thread(command: list[str], folder: Path, env: dict[str, str], output: BinaryIO) -> StandInThread:
    """The agent's launch for `python -m node.standin ARGS` (node/trainer_process.py standin_command):
    the stand-in on a thread. `folder` is unused: every path the stand-in reads is absolute."""
    if command[1:3] != ["-m", "node.standin"]:
        raise ValueError(f"not a stand-in command: {command[:3]}")
    return StandInThread(command[3:], env, output)


def main() -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    return run(sys.argv[1:], os.environ, stop, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
