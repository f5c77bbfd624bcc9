"""Pipeline-parallel throughput against the bound the bubble allows, on CPU with gloo.

    .venv/bin/python bench/pipeline.py                       # pp=2 and pp=4, every schedule, m = 4, 8, 16
    .venv/bin/python bench/pipeline.py --pp 2 --microbatches 8 --schedules 1f1b

For each microbatch count m it first times one process, one thread, accumulating the same m
microbatches (T_single). Then for each pp it starts pp ranks of one thread each and times every
schedule, and finally times the single process again. The bubble alone allows
T_bound = T_single / pp * (m + pp - 1) / m; the figure of merit is pp_bound_ratio = T_bound / T_pp
(1.0 = no overhead beyond the bubble). Each time is the fastest of the timed steps (each a full
training step: forward, backward, gradient clipping, AdamW), over --rounds repetitions, and
T_single the fastest of its measurements before, between and after: on a machine shared with
other work the least disturbed step is the truest, and both sides are measured the same way.
`busy` is CPU time / wall time, averaged over ranks: the bubble allows m / (m + pp - 1); a
single process below 1.0 means other work took the core.
All figures come from this one run, side by side. The last line is the 1F1B, pp=2, m=8 ratio.
pp ranks beyond the machine's cores share them, which the bound does not allow for.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import ConfigError, load_config  # noqa: E402
from trainer.local_ports import free_port  # noqa: E402
from trainer.parallel_dims import SCHEDULES  # noqa: E402
from trainer.train import build, environment, peak_memory_mib, train_step  # noqa: E402

MODEL = ["--model.n_layers=8", "--model.d_model=128", "--model.n_heads=4", "--model.seq_len=128",
         "--training.batch_size=16", "--training.threads=1", "--training.device=cpu", "--training.steps=1000"]


def bench_config(workdir: str, pp: int, schedule: str, microbatches: int):
    """The benchmark model at this layout."""
    return load_config([*MODEL, f"--data.shards={workdir}/shards", "--data.corpus=stdlib", "--data.corpus_bytes=300000",
                        f"--training.metrics_file={workdir}/metrics.jsonl", f"--parallel.pp={pp}",
                        f"--parallel.schedule={schedule}",
                        f"--parallel.microbatches={microbatches}"])


def time_steps(cfg, warmup: int, steps: int) -> tuple[float, float]:
    """(fastest step in seconds, CPU time / wall time) after warm-up (the first steps also infer stage shapes)."""
    run = build(cfg, environment(cfg, torch.device("cpu")))
    for _ in range(warmup):
        train_step(run)
    if dist.is_initialized():
        dist.barrier()
    times = []
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    for _ in range(steps):
        started = time.perf_counter()
        train_step(run)  # ends in an all-reduce of the loss, so every rank finishes the step together
        times.append(time.perf_counter() - started)
    busy = (time.process_time() - cpu_started) / (time.perf_counter() - wall_started)
    if dist.is_initialized():
        busy_all = torch.tensor(busy)
        dist.all_reduce(busy_all)
        busy = busy_all.item() / dist.get_world_size()
    return min(times), busy


def _rank_main(rank: int, pp: int, port: int, workdir: str, plan: list, warmup: int, steps: int,
               results_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=pp, timeout=timedelta(seconds=300))
    try:
        results = {}
        for schedule, microbatches in plan:
            cfg = bench_config(workdir, pp, schedule, microbatches)
            results[f"{schedule} {microbatches}"] = time_steps(cfg, warmup, steps)
        peaks = [None] * pp
        dist.all_gather_object(peaks, peak_memory_mib(torch.device("cpu")))
        if rank == 0:
            Path(results_path).write_text(json.dumps({"times": results, "peak_mib": peaks}))
    finally:
        dist.destroy_process_group()


def runnable(workdir: str, pp: int, schedule: str, microbatches: int) -> str | None:
    """None if this layout can run, else the config's reason."""
    try:
        bench_config(workdir, pp, schedule, microbatches)
    except ConfigError as error:
        return str(error)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=sorted(SCHEDULES), choices=sorted(SCHEDULES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole measurement and keep each figure's best round (for a busy machine)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench-pipeline-")

    def time_single() -> dict[int, tuple[float, float]]:
        return {m: time_steps(bench_config(workdir, 1, "1f1b", m), args.warmup, args.steps)
                for m in args.microbatches}

    singles, sweeps = [], []
    for _ in range(args.rounds):
        singles.append(time_single())
        sweeps.append({pp: sweep(workdir, pp, args) for pp in args.pp})
    singles.append(time_single())
    single = {m: min(s[m][0] for s in singles) for m in args.microbatches}
    measured_by_pp = {pp: best_of([s[pp] for s in sweeps]) for pp in args.pp}

    shape = bench_config(workdir, 1, "1f1b", args.microbatches[0])
    tokens = shape.training.batch_size * shape.model.seq_len
    print(f"model {' '.join(MODEL[:4])}; {tokens} tokens per step; {os.cpu_count()} CPU cores; one thread per rank")
    for m in args.microbatches:
        print(f"single process, m={m:2d}: {single[m] * 1e3:7.1f} ms/step  {tokens / single[m]:8.0f} tokens/s  "
              f"busy " + ", ".join(f"{s[m][1]:.2f}" for s in singles) + " (each measurement)")
    ratios = {}
    print(f"{'pp':>2} {'schedule':<24} {'m':>3} {'tokens/s':>9} {'single':>9} {'T_pp ms':>8} {'T_bound ms':>10} "
          f"{'busy':>5} {'pp_bound_ratio':>14}")
    for pp, (measured, skipped) in measured_by_pp.items():
        for schedule in args.schedules:
            for m in args.microbatches:
                if (schedule, m) in skipped:
                    print(f"{pp:>2} {schedule:<24} {m:>3}  not runnable: {skipped[(schedule, m)]}")
                    continue
                t_pp, busy = measured["times"][f"{schedule} {m}"]
                t_bound = single[m] / pp * (m + pp - 1) / m
                ratios[(pp, schedule, m)] = t_bound / t_pp
                print(f"{pp:>2} {schedule:<24} {m:>3} {tokens / t_pp:>9.0f} {tokens / single[m]:>9.0f} "
                      f"{t_pp * 1e3:>8.1f} {t_bound * 1e3:>10.1f} {busy:>5.2f} {t_bound / t_pp:>14.3f}")
        print(f"peak RSS per rank over the pp={pp} sweep (MiB): "
              + ", ".join(f"{rank}: {mib:.0f}" for rank, mib in enumerate(measured["peak_mib"])))
    headline = ratios.get((2, "1f1b", 8))
    print(f"pp_bound_ratio={headline:.3f}" if headline is not None else "pp_bound_ratio=n/a (1f1b pp=2 m=8 not run)")
    return 0


def best_of(rounds: list[tuple[dict, dict]]) -> tuple[dict, dict]:
    """Per layout, the round with the fastest step (and that round's busy figure)."""
    measured, skipped = rounds[0]
    times = {key: min((r[0]["times"][key] for r in rounds), key=lambda t: t[0]) for key in measured["times"]}
    peaks = [max(r[0]["peak_mib"][rank] for r in rounds) for rank in range(len(measured["peak_mib"]))]
    return {"times": times, "peak_mib": peaks}, skipped


def sweep(workdir: str, pp: int, args) -> tuple[dict, dict]:
    """Time every runnable (schedule, m) at this pp in one set of pp ranks; also return the skipped ones."""
    plan, skipped = [], {}
    for schedule in args.schedules:
        for m in args.microbatches:
            reason = runnable(workdir, pp, schedule, m)
            if reason:
                skipped[(schedule, m)] = reason
            else:
                plan.append((schedule, m))
    results_path = os.path.join(workdir, f"pp{pp}.json")
    mp.start_processes(_rank_main, args=(pp, free_port(), workdir, plan, args.warmup, args.steps, results_path),
                       nprocs=pp, join=True, start_method="spawn")
    return json.loads(Path(results_path).read_text()), skipped


if __name__ == "__main__":
    sys.exit(main())
