"""Tensor parallel and FSDP throughput against one process, on CPU with gloo.

    .venv/bin/python bench/parallel.py                  # one process, tp=2, FSDP dp=2, replicated dp=2
    .venv/bin/python bench/parallel.py --rounds 3       # keep each figure's best round (a busy machine)

The same model (bench/pipeline.py's) and global batch run as one process of one thread, then as
two ranks of one thread each: tensor parallel (tp=2: every matmul split, sequence parallel between
them), FSDP (dp=2, parameters, gradients and optimizer state sharded) and replicated data parallel
(dp=2, dp_shard=1). Each time is the fastest full training step after warm-up, the single process
measured before and after the parallel ones; tokens/s is the global batch over that time. Two ranks
on two cores can at most double the single process (`speedup` 2.0); tensor parallel's collectives
are twice per block per microbatch, FSDP's once per block, so on gloo tensor parallel pays most.
The last line is FSDP's speedup. (Memory is bench/ and `trainfleet plan`'s subject: at this size the
resident memory of a rank is mostly torch itself.)
"""

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline import MODEL, time_steps  # noqa: E402
from trainer.local_ports import free_port  # noqa: E402

from trainer.config import load_config  # noqa: E402

LAYOUTS = {
    "tp=2": ["--parallel.tp=2"],
    "FSDP dp=2": ["--parallel.dp=2"],
    "replicated dp=2": ["--parallel.dp=2", "--parallel.dp_shard=1"],
}


def bench_config(workdir: str, layout: list[str]):
    # 258 rows: the vocabulary splits over tp=2.
    return load_config([*MODEL, "--model.vocab_size=258", "--parallel.microbatches=4", f"--data.shards={workdir}/shards",
                        "--data.corpus=stdlib", "--data.corpus_bytes=300000", f"--training.metrics_file={workdir}/metrics.jsonl", *layout])


def _rank_main(rank: int, port: int, workdir: str, warmup: int, steps: int, results_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    try:
        results = {}
        for name, layout in LAYOUTS.items():
            results[name], _ = time_steps(bench_config(workdir, layout), warmup, steps)
        if rank == 0:
            Path(results_path).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench-parallel-")
    single_cfg = bench_config(workdir, [])
    singles, rounds = [], []
    for round_number in range(args.rounds):
        singles.append(time_steps(single_cfg, args.warmup, args.steps)[0])
        results_path = os.path.join(workdir, f"round-{round_number}.json")
        mp.start_processes(_rank_main, args=(free_port(), workdir, args.warmup, args.steps, results_path),
                           nprocs=2, join=True, start_method="spawn")
        rounds.append(json.loads(Path(results_path).read_text()))
    singles.append(time_steps(single_cfg, args.warmup, args.steps)[0])
    single = min(singles)
    tokens = single_cfg.training.batch_size * single_cfg.model.seq_len
    print(f"model {' '.join(MODEL[:4])}; {tokens} tokens per step; {os.cpu_count()} CPU cores; one thread per rank")
    print(f"{'layout':<16} {'ms/step':>8} {'tokens/s':>9} {'speedup':>8}")
    print(f"{'one process':<16} {single * 1e3:>8.1f} {tokens / single:>9.0f} {1.0:>8.2f}")
    speedups = {}
    for name in LAYOUTS:
        best = min(r[name] for r in rounds)
        speedups[name] = single / best
        print(f"{name:<16} {best * 1e3:>8.1f} {tokens / best:>9.0f} {speedups[name]:>8.2f}")
    print(f"tp2_speedup={speedups['tp=2']:.2f}")
    print(f"fsdp2_speedup={speedups['FSDP dp=2']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
