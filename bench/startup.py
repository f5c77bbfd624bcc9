"""Process start to first step at tp=2 x dp=2, the weights' initial values drawn whole or by shard.

    .venv/bin/python bench/startup.py                 # the default model (537M parameters), one round
    .venv/bin/python bench/startup.py --rounds 2      # each variant's best of two (a busy machine)
    .venv/bin/python bench/startup.py --d-model 1024 --layers 4   # a smaller model

Four ranks of trainer.train (one thread each, gloo) start as torchrun starts them, build the model on
the meta device, allocate their shards (FSDP over dp=2, tensor parallel over tp=2) and train one
step. They differ in how each rank fills its shards:
  whole    each parameter's full initial value drawn on the host, this rank's shard kept: how the
           trainer started before (every rank drew the whole model: tp x dp times its share);
  sharded  each rank draws only its shards' values, by position (trainer/model.py initial_values).
Figures per variant: start_to_first_step_s (the launcher's clock before the ranks start to rank
0's metrics record of step 1), and initialise_s (the slowest rank's time filling its shards). The
last line is the ratio of the two variants' start-to-first-step times. Memory: each rank holds a
quarter of the parameters, gradients and AdamW moments (16 bytes a parameter over 4), about 2.2
GiB at the default size; the largest that leaves this shared 24 GiB machine room for others.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("whole", "sharded")
RANKS = 4


def whole_then_sliced(name, shape, seed, n_layers, region=None, device="cpu"):
    """The trainer's former initial values: a parameter drawn whole from one generator seeded by
    (seed, name), then this rank's region kept."""
    import torch

    from trainer import model

    if name.endswith("norm.weight") or name.endswith("bias"):
        return model.initial_values(name, shape, seed, n_layers, region, device)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    std = model.INIT_STD / (2 * n_layers) ** 0.5 if name.endswith("proj.weight") else model.INIT_STD
    full = torch.randn(tuple(shape), generator=generator) * std
    if region is not None:
        offset, size = region
        full = full[tuple(slice(o, o + n) for o, n in zip(offset, size))]
    return full.to(device)


def rank_main(variant: str, timings: Path, trainer_args: list[str]) -> int:
    """One rank: the trainer, its initialisation timed (and drawn whole for `whole`)."""
    from trainer import parallelize, pipeline_parallel, train

    if variant == "whole":
        parallelize.initial_values = whole_then_sliced
    fill = pipeline_parallel.Pipeline.initialise

    def timed_fill(self, seed, n_layers):
        started = time.perf_counter()
        fill(self, seed, n_layers)
        timings.write_text(json.dumps({"initialise_s": time.perf_counter() - started}))

    pipeline_parallel.Pipeline.initialise = timed_fill
    return train.main(trainer_args)


def trainer_args(workdir: Path, args: argparse.Namespace) -> list[str]:
    return [f"--model.d_model={args.d_model}", f"--model.n_layers={args.layers}", f"--model.n_heads={args.heads}",
            f"--model.vocab_size={args.vocab}", f"--model.seq_len={args.seq_len}", "--parallel.tp=2",
            "--parallel.dp=2", "--parallel.microbatches=1", "--training.batch_size=2", "--training.steps=1",
            "--optim.warmup_steps=0", "--fleet_check.enabled=false", "--scaling_check.enabled=false",
            "--training.threads=1", "--training.device=cpu", "--parallel.timeout_s=1800",
            f"--data.shards={workdir / 'shards'}", "--data.corpus=stdlib", "--data.corpus_bytes=200000",
            f"--training.metrics_file={workdir / 'metrics.jsonl'}"]


def start_once(variant: str, workdir: Path, args: argparse.Namespace, port: int) -> dict:
    """Start the four ranks with `variant`'s initialisation; its figures."""
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    started = time.time()
    procs = []
    for rank in range(RANKS):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS),
                   LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "rank", variant, str(workdir / f"timing-{rank}.json"),
                                       "--", *trainer_args(workdir, args)], env=env, cwd=REPO))
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"{variant}: ranks exited {codes}")
    first_step = json.loads(metrics.read_text().splitlines()[0])["time"]
    fills = [json.loads((workdir / f"timing-{rank}.json").read_text())["initialise_s"] for rank in range(RANKS)]
    return {"start_to_first_step_s": round(first_step - started, 2), "initialise_s": round(max(fills), 2)}


def main() -> int:
    if sys.argv[1:2] == ["rank"]:
        variant, timings, separator, *rest = sys.argv[2:]
        return rank_main(variant, Path(timings), rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    from trainfleet.core.memory_plan import ModelShape, parameter_count

    parameters = parameter_count(ModelShape(n_layers=args.layers, d_model=args.d_model, n_heads=args.heads,
                                            vocab_size=args.vocab, seq_len=args.seq_len))
    print(f"model: {parameters / 1e6:.0f}M parameters (d_model {args.d_model}, {args.layers} layers, vocab "
          f"{args.vocab}), tp=2 x dp=2 (FSDP), {RANKS} ranks of one thread on CPU", flush=True)
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="startup-") as folder:
        for round_ in range(args.rounds):
            for index, variant in enumerate(VARIANTS):
                figures = start_once(variant, Path(folder), args, 29400 + 10 * round_ + index)
                print(f"round {round_ + 1} {variant}: {json.dumps(figures)}", flush=True)
                if variant not in best or figures["start_to_first_step_s"] < best[variant]["start_to_first_step_s"]:
                    best[variant] = figures
    for variant in VARIANTS:
        print(f"{variant}: {json.dumps(best[variant])}")
    ratio = best["whole"]["start_to_first_step_s"] / best["sharded"]["start_to_first_step_s"]
    print(f"start_to_first_step_whole_over_sharded={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
