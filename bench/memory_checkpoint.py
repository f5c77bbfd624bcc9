"""What the in-memory checkpoints cost a step, and the host memory they take (trainer/memory_checkpoint.py).

    .venv/bin/python bench/memory_checkpoint.py                  # 2 nodes of one rank, 256 MiB of state each
    .venv/bin/python bench/memory_checkpoint.py --state-mib 64 --steps 10

Two ranks, each a "node" of its own (its own host-memory folder, the other its buddy), gloo over
loopback, fp32 on CPU: an MLP and its AdamW state (parameters x 3), as bench/checkpoint.py. Each
rank trains the same steps twice, side by side in one run: without copies, then with a copy every
step (MemoryCheckpoints.maybe_copy after each optimizer step). Figures:
- the step time of each (the step and maybe_copy, as the training loop waits for them), and how
  many of the steps a copy was taken of (a copy still going makes the next step skip its own);
- training blocked per copy (MemoryCheckpoints.blocked_seconds: starting it, waiting for the
  staging at the next optimizer step, waiting for the previous copy) and the copying thread's own
  time per copy (serialise, write, exchange with the buddy);
- a node's tmpfs after the run, against the memory plan's six copies of its share.
On two cores the copying thread takes CPU from the step (on a GPU node it has the host's cores to
itself while the GPUs compute): the ratios are an upper bound.
The last two lines are `copy_step_ratio=<step with copies / step without>` and
`host_memory_per_node_mib=<a node's tmpfs, measured>`.
"""

import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checkpoint import State, train_step  # noqa: E402
from trainer.local_ports import free_port  # noqa: E402
from trainer.memory_checkpoint import MemoryCheckpoints  # noqa: E402
from trainfleet.core.memory_plan import HOST_COPIES  # noqa: E402

WORLD = 2


def rank_main(rank: int, port: int, folder: str, state_mib: int, steps: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    state = State(state_mib)
    plain = timed_steps(state, steps, None)
    config = SimpleNamespace(memory_interval=1, memory_dir=str(Path(folder) / f"node{rank}"))
    memory = MemoryCheckpoints(config, key="bench", ranks_per_node=1, node_rank=rank, timeout=timedelta(minutes=10))
    copying = timed_steps(state, steps, memory)
    memory.close()
    tmpfs = sum(path.stat().st_size for path in Path(config.memory_dir).rglob("*.pt"))
    state_bytes = sum(t.numel() * t.element_size() for t in state.model.parameters()) * 3
    results.put({"rank": rank, "plain_s": plain, "copying_s": copying, "copies": memory.copies,
                 "blocked_s": memory.blocked_seconds, "copy_s": memory.copy_seconds, "tmpfs": tmpfs,
                 "state": state_bytes})
    dist.destroy_process_group()


def timed_steps(state: State, steps: int, memory: MemoryCheckpoints | None) -> float:
    """Mean seconds a step (and its copy) holds the training loop, over `steps` after a warm-up one;
    the copies' votes summed by an all-reduce, as the trainer's step all-reduce sums them."""
    times = []
    for _ in range(steps + 1):
        votes = memory.vote() if memory else torch.zeros(2)
        dist.all_reduce(votes)
        started = time.perf_counter()
        train_step(state)
        if memory:
            memory.maybe_copy(state.step, state, agreed=votes)
        times.append(time.perf_counter() - started)
    return sum(times[1:]) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="memory-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        port = free_port()
        processes = [context.Process(target=rank_main, args=(rank, port, folder, args.state_mib, args.steps, results))
                     for rank in range(WORLD)]
        for process in processes:
            process.start()
        figures = sorted((results.get() for _ in processes), key=lambda figure: figure["rank"])
        for process in processes:
            process.join()
    mean = lambda name: sum(f[name] for f in figures) / len(figures)  # noqa: E731
    plain, copying, copies = mean("plain_s"), mean("copying_s"), mean("copies")
    share_mib = mean("state") / 2**20
    print(f"{WORLD} nodes of one rank, {share_mib:.0f} MiB of state each (fp32 parameters and AdamW's moments), "
          f"{args.steps} steps, CPU")
    print(f"step without copies {plain:.3f} s, with copies {copying:.3f} s; a copy of {copies:.0f} of the "
          f"{args.steps + 1} steps (every {(args.steps + 1) / copies:.1f})")
    print(f"training blocked per copy {mean('blocked_s') / copies:.4f} s; the copying thread {mean('copy_s') / copies:.3f} s "
          f"a copy ({share_mib / (mean('copy_s') / copies):.0f} MiB/s: serialise, write, exchange with the buddy)")
    tmpfs_mib = max(f["tmpfs"] for f in figures) / 2**20
    print(f"a node's tmpfs: {tmpfs_mib:.0f} MiB; the memory plan: {HOST_COPIES} x {share_mib:.0f} MiB = "
          f"{HOST_COPIES * share_mib:.0f} MiB")
    print(f"copy_step_ratio={copying / plain:.3f}")
    print(f"host_memory_per_node_mib={tmpfs_mib:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
