"""The GPU check: one CUDA device, bf16 training of a ~1B-parameter GPT, run unattended.

    timeout 900 .venv/bin/python bench/gpu.py             # on a GPU machine (about 5 minutes)
    .venv/bin/python bench/gpu.py --tiny --device cpu      # the same checks on a tiny model, anywhere

What it prints, in order:
1. The software and the NCCL/EFA environment: torch, CUDA, NCCL versions, the device, and the
   FI_*, NCCL_* and LD_LIBRARY_PATH variables torchrun would pass on.
2. Training: the trainer's own build and step (FSDP2 on a one-rank mesh, bf16 parameters and
   fp32 gradient reduction), warm-up, then the timed steps: ms/step, tokens/s and MFU, the
   model FLOPs (6 N per token for the matmuls + 12 L T d for attention scores) over the
   device's dense bf16 peak (PEAK_BF16_TFLOPS, the vendors' datasheet figures).
3. Peak memory: torch.cuda.max_memory_allocated against the memory plan's figure for this
   model and layout (trainfleet.memory_plan, whose figure includes an allowance for the CUDA
   context and fragmentation that max_memory_allocated does not see), as a ratio.
4. Async checkpoint staging: a checkpoint saved asynchronously right after an optimizer step
   must hold exactly the post-step parameters and optimizer state (the staging copy must wait for
   the optimizer's kernels); it is loaded back and compared bit for bit.
The last line is `gpu_check=ok ...` with the figures, or `gpu_check=failed: <why>` (exit 1).
"""

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.checkpoint import Checkpointer, storage_reader  # noqa: E402
from trainer.checkpoint_catalog import step_dir_name  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.train import build, distributed, train_step  # noqa: E402
from trainfleet import memory_plan  # noqa: E402

# Dense bf16 tensor-core peak per device, TFLOP/s (NVIDIA datasheets; SXM parts).
PEAK_BF16_TFLOPS = {"A100": 312.0, "H100": 989.0, "H200": 989.0, "B200": 2250.0}

MODEL_1B = ["--model.n_layers=16", "--model.d_model=2048", "--model.n_heads=16", "--model.seq_len=2048",
            "--model.vocab_size=32768", "--training.batch_size=8", "--parallel.microbatches=4"]
MODEL_TINY = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--model.seq_len=64",
              "--training.batch_size=4", "--parallel.microbatches=2", "--data.corpus_bytes=100000"]


def environment_report() -> list[str]:
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        lines.append(f"device {torch.cuda.get_device_name()}, NCCL {nccl}, {torch.cuda.device_count()} visible")
    for name in sorted(os.environ):
        if name.startswith(("FI_", "NCCL_")) or name == "LD_LIBRARY_PATH":
            lines.append(f"  {name}={os.environ[name]}")
    return lines


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for model, peak in PEAK_BF16_TFLOPS.items() if model in name), None)


def model_flops_per_token(cfg) -> float:
    m = cfg.model
    params = sum(p.numel() for p in _meta_model(cfg).parameters())
    return 6 * params + 12 * m.n_layers * m.seq_len * m.d_model


def _meta_model(cfg):
    from trainer.model import GPT

    with torch.device("meta"):
        return GPT(cfg.model)


def planned_peak_bytes(cfg) -> int:
    """The memory plan's per-GPU figure for this config (bf16 mixed precision, its allowance included)."""
    return memory_plan.fullest_rank(memory_plan.Workload.from_sections(asdict(cfg), mixed_precision=True)).total


def staged_checkpoint_matches(run, workdir: str) -> str | None:
    """Save asynchronously right after a step and compare what was written with the post-step
    state; None when identical, else the first differing entry."""
    cfg = run.config.checkpoint
    cfg.uri, cfg.interval, cfg.async_save = str(Path(workdir) / "checkpoints"), 1, True
    checkpointer = Checkpointer(cfg, layout={"pp": 1, "dp": 1, "tp": 1})
    train_step(run)
    expected = {key: value.detach().clone() if torch.is_tensor(value) else value
                for key, value in _flat(run.state.state_dict())}
    checkpointer.maybe_save(run.state.step, run.state)
    checkpointer.close()
    loaded = run.state.state_dict()
    dcp.load(loaded, storage_reader=storage_reader(cfg.uri, step_dir_name(run.state.step)))
    for key, value in _flat(loaded):
        want = expected[key]
        if torch.is_tensor(value) and not torch.equal(_plain(value).cpu(), _plain(want).cpu()):
            return key
    return None


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _flat(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the script, not the GPU")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check=failed: no CUDA device")
        return 1
    for line in environment_report():
        print(line, flush=True)
    workdir = tempfile.mkdtemp(prefix="bench-gpu-")
    cfg = load_config([*(MODEL_TINY if args.tiny else MODEL_1B), f"--training.device={args.device}",
                       f"--data.shards={workdir}/shards", f"--training.metrics_file={workdir}/metrics.jsonl",
                       f"--training.steps={args.warmup + args.steps + 1}", "--optim.warmup_steps=1"])
    with distributed(cfg) as env:
        run = build(cfg, env)
        for _ in range(args.warmup):
            train_step(run)
        if env.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        losses = [train_step(run)["loss"] for _ in range(args.steps)]  # each step ends in .tolist(): synchronised
        seconds = (time.perf_counter() - started) / args.steps
        tokens_per_s = cfg.training.batch_size * cfg.model.seq_len / seconds
        peak = peak_tflops(env.device)
        mfu = tokens_per_s * model_flops_per_token(cfg) / (peak * 1e12) if peak else None
        utilisation = f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a (no peak figure for this device)"
        print(f"training: {seconds * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, {utilisation}", flush=True)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
        memory = ""
        if env.device.type == "cuda":
            measured = torch.cuda.max_memory_allocated(env.device)
            planned = planned_peak_bytes(cfg)
            memory = f" peak_gib={measured / 2**30:.2f} plan_gib={planned / 2**30:.2f} measured_vs_plan={measured / planned:.2f}"
            print(f"peak memory: {measured / 2**30:.2f} GiB measured, {planned / 2**30:.2f} GiB planned", flush=True)
        mismatch = staged_checkpoint_matches(run, workdir)
    if mismatch is not None:
        print(f"gpu_check=failed: the asynchronously staged checkpoint differs from the post-step state at {mismatch}")
        return 1
    print("async checkpoint staging: the saved state equals the post-step state", flush=True)
    print(f"gpu_check=ok tokens_per_s={tokens_per_s:.0f} mfu={f'{mfu:.3f}' if mfu is not None else 'n/a'}{memory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
