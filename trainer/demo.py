"""The demo: train the small GPT with pp=2 on this machine for a couple of minutes, loss falling.

    trainfleet demo --trainer-only
    trainfleet demo --trainer-only -- --training.steps=100 --parallel.schedule=zbv-zero-bubble  # trainer overrides
    trainfleet demo --trainer-only -- --config trainer/configs/llama-tiny.toml --parallel.pp=2  # another config

It launches two ranks with torchrun (c10d rendezvous on 127.0.0.1, gloo) exactly as an instance
would, streams the per-step log, then summarises the loss curve from the metrics file.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer.local_ports import free_port

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "trainer" / "configs" / "small.toml"
DEFAULT_METRICS = REPO / "runs" / "demo" / "metrics.jsonl"
TIMEOUT_S = 900


def metrics_path(overrides: list[str]) -> Path:
    """Where the trainer writes metrics: the last --training.metrics_file= override, else the demo's own file."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("--training.metrics_file=")]
    return REPO / given[-1] if given else DEFAULT_METRICS


def config_given(overrides: list[str]) -> bool:
    return any(o == "--config" or o.startswith("--config=") for o in overrides)


def torchrun_command(overrides: list[str], metrics: Path, port: int) -> list[str]:
    """Two ranks of the trainer on the small GPT's config, or on the one the overrides name."""
    config = [] if config_given(overrides) else ["--config", str(CONFIG)]
    return [sys.executable, "-m", "node.torchrun", "--nnodes=1", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0",
            "-m", "trainer.train", *config, f"--training.metrics_file={metrics}", *overrides]


def summarise(records: list[dict]) -> str:
    """Loss at the start and end (means over the first and last tenth of the steps) and throughput."""
    tenth = max(1, len(records) // 10)
    first = sum(r["loss"] for r in records[:tenth]) / tenth
    last = sum(r["loss"] for r in records[-tenth:]) / tenth
    tokens_per_s = sorted(r["tokens_per_s"] for r in records)[len(records) // 2]
    return (f"{len(records)} steps: loss {first:.3f} -> {last:.3f} (mean of first and last {tenth}), "
            f"median {tokens_per_s:.0f} tokens/s")


def main(argv: list[str]) -> int:
    overrides = argv[1:] if argv[:1] == ["--"] else argv
    metrics = metrics_path(overrides)
    metrics.unlink(missing_ok=True)
    command = torchrun_command(overrides, metrics, free_port())
    what = "the config given" if config_given(overrides) else "the small GPT with pp=2"
    print(f"training {what} on two processes (gloo):\n  " + " ".join(command[1:]), flush=True)
    # The rendezvous store is not shared with the ranks' process group: restarts with gloo then work.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
    try:
        returncode = process.wait(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
    if returncode != 0:
        print(f"training failed with exit code {returncode}", file=sys.stderr)
        return returncode
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    print(f"done in {time.monotonic() - started:.0f} s. {summarise(records)}; metrics in {metrics}")
    return 0
