"""The trainer as a process on this node: its config, torchrun's command (or the stand-in's) and
environment, the order into a repaired world, its end, and the failure read out of its output."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, BinaryIO

from node.metadata import Identity
from node.trainer_files import WORLD_CHECKS, AttemptFiles
from trainer import checkpoint_catalog as catalog
from trainer.progress import NODE_NAME_ENV, NODE_RANK_ENV, PROGRESS_FILE_ENV
from trainer.repair_order import REPAIR_ORDER_ENV, RepairOrder
from trainfleet.core.catalogue import instance_facts, nccl_environment
from trainfleet.core.records import LaunchSpec, TrainerFailureKind

RENDEZVOUS_JOIN_TIMEOUT_S = 300
"""How long torchrun waits for all nodes to join the rendezvous before it gives up."""
STOP_GRACE_S = 30.0
"""How long torchrun gets to stop its ranks after SIGTERM before it is killed."""
OUTPUT_TAIL_CHARS = 2000
"""How much of torchrun's output a TrainerFailed event carries (after the exceptions it raised
above that tail: failure_message)."""
RAISED_CHARS = 1000
"""How much of a TrainerFailed message the exceptions above its tail may take."""
EXCEPTION_LINE = re.compile(r"^(?:\[[^\]\n]*\]:?[ \t]*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)\b.*)$",
                            re.MULTILINE)
"""A traceback's last line (a rank's prefix, such as "[rank1]:", allowed): the exception raised."""


def trainer_config(spec: LaunchSpec, files: AttemptFiles, host_memory: Path) -> dict[str, Any]:
    """The spec's trainer config with this attempt's metrics file, the node's host-memory folder
    for the run's in-memory checkpoints, and the spec's resume point."""
    config = json.loads(json.dumps(spec.trainer_config))  # a deep copy
    config.setdefault("training", {})["metrics_file"] = str(files.metrics)
    for check in WORLD_CHECKS.keys() & config.keys():
        config[check]["result_file"] = str(files.check_result(check))
    checkpoint = config.setdefault("checkpoint", {})
    checkpoint["memory_dir"] = str(host_memory / spec.run_name)
    checkpoint["memory_resume"] = spec.restore_from_memory
    if spec.repairable:
        # The control plane ends a trainer it does not repair: the wait is as long as it gives a
        # world to form.
        config.setdefault("parallel", {}).update(repair_file=str(files.repair_order),
                                                 repair_wait_s=spec.startup_timeout_seconds)
    if spec.repair:
        # Where the survivors resume (trainer/train.py _repair): the newest step in memory or S3.
        checkpoint["resume"] = "latest"
    elif spec.resume_step is not None:
        checkpoint["resume"] = str(spec.resume_step)
    elif spec.attempt > 0:
        # A checkpoint may have committed after the control plane chose the resume point (its
        # event still on the way); "none" would refuse that location, "latest" takes it.
        checkpoint["resume"] = "latest"
    return config


def torchrun_command(spec: LaunchSpec, node_rank: int, identity: Identity, files: AttemptFiles) -> list[str]:
    plan = spec.plan
    if spec.repair:
        # A node joining a repaired world: its trainer meets the others at the order's store, and
        # torchrun only supervises this node's processes. (Joining the survivors' rendezvous would
        # restart their workers.)
        return [sys.executable, "-m", "node.torchrun", "--standalone", f"--nproc-per-node={plan.ranks_per_node}",
                "--max-restarts=0", "--monitor-interval=1", "-m", "trainer.worker", "--config", str(files.config)]
    # read_timeout bounds a peer's wait for the host's store to listen (torch's default: 60 s): a
    # host whose torchrun starts late (a replacement still booting its software, a loaded node)
    # must not crash its peers' launches, as late as the join itself may be.
    rendezvous = {"is_host": "true" if node_rank == 0 else "false", "join_timeout": RENDEZVOUS_JOIN_TIMEOUT_S,
                  "read_timeout": RENDEZVOUS_JOIN_TIMEOUT_S}
    return [sys.executable, "-m", "node.torchrun",
            f"--nnodes={plan.nodes}", f"--nproc-per-node={plan.ranks_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={spec.rendezvous_host}:{spec.rendezvous_port}",
            f"--rdzv-id={spec.rendezvous_id}",
            "--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in rendezvous.items()),
            f"--local-addr={identity.private_ip}", "--max-restarts=0", "--monitor-interval=1",
            "-m", "trainer.worker", "--config", str(files.config)]


def standin_command(spec: LaunchSpec, node_rank: int, step_seconds: float, files: AttemptFiles) -> list[str]:
    """The stand-in trainer in torchrun's place (node/standin.py): a thread of the agent."""
    return [sys.executable, "-m", "node.standin", "--config", str(files.config), f"--node-rank={node_rank}",
            f"--nodes={spec.plan.nodes}", f"--step-seconds={step_seconds}",
            f"--rendezvous={spec.rendezvous_host}:{spec.rendezvous_port}",
            f"--join-timeout-s={RENDEZVOUS_JOIN_TIMEOUT_S}"]


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, for torchrun and its ranks
    to inherit; the soft limit now. A gloo group holds a socket to every other rank (4,095 in a
    world of 4,096) beside NCCL's, the data's and the uploads' files, where a service's soft limit
    is 1,024 by default. The node's unit sets both limits (ec2_fleet.node_user_data); started
    otherwise, the agent still takes all its hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def start_process(command: list[str], folder: Path, env: dict[str, str], output: BinaryIO) -> subprocess.Popen:
    # Same process group as the agent: whatever ends the instance ends torchrun too.
    return subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.DEVNULL, stdout=output,
                            stderr=subprocess.STDOUT)


def torchrun_env(files: AttemptFiles, identity: Identity, node_rank: int) -> dict[str, str]:
    """The agent's environment, plus what NCCL needs on this node's type (its error handling; EFA
    as preflight proved NCCL selects it, but for NCCL's log: warnings only), the attempt's files,
    the node's name and its rank in the launch spec (where its in-memory checkpoints' buddy is:
    trainer/memory_checkpoint.py)."""
    return {**os.environ,
            **nccl_environment(instance_facts(identity.instance_type), os.environ),
            # The rendezvous store is not shared with the ranks' process group: with gloo, a
            # shared one made the first restart fail on stale peer addresses (DESIGN.md, 7).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            catalog.REQUEST_FILE_ENV: str(files.checkpoint_request),
            PROGRESS_FILE_ENV: str(files.progress),
            NODE_NAME_ENV: identity.instance_id,
            NODE_RANK_ENV: str(node_rank),
            REPAIR_ORDER_ENV: str(files.repair_order)}


def failure_message(output: str) -> str:
    """What a TrainerFailed event says of torchrun's output: its tail, led by the exceptions
    raised above it. The error that ends torchrun is the last of a chain whose first names the
    cause (the store that could not listen, the rank that crashed), often further up than a tail
    reaches."""
    tail = output[-OUTPUT_TAIL_CHARS:]
    raised = [line for line in dict.fromkeys(EXCEPTION_LINE.findall(output[:-OUTPUT_TAIL_CHARS]))
              if line not in tail]
    if not raised:
        return tail
    lead = "raised above: " + " | ".join(raised)
    if len(lead) > RAISED_CHARS:
        lead = lead[:RAISED_CHARS - 3] + "..."
    return f"{lead}\n...\n{tail}"


def failure_kind(output: str) -> TrainerFailureKind:
    """Why the trainer failed, from its output (torchrun's own exit code is 1 for all of them)."""
    if "config error:" in output:
        return TrainerFailureKind.CONFIG
    if "NonFiniteLossError" in output:
        return TrainerFailureKind.NAN_LOSS
    return TrainerFailureKind.CRASH


def repair_order(spec: LaunchSpec, launch_nodes_gone: int = 0) -> RepairOrder:
    """The order into the world `spec` repairs: its store on node rank 0, at the attempt's port;
    `launch_nodes_gone`: RepairOrder's (a joining node's torchrun met no other)."""
    return RepairOrder(generation=spec.repair.generation, store_host=spec.rendezvous_host,
                       store_port=spec.rendezvous_port, host_node_rank=0, nodes=spec.plan.nodes,
                       launch_nodes_gone=launch_nodes_gone)


def stop(process: Any) -> None:
    """End torchrun: SIGTERM (it stops its ranks), then SIGKILL (its ranks die with it)."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=STOP_GRACE_S)
