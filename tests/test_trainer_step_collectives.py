"""What the ranks of a training loop say to each other, two ranks on gloo: each step one
all-reduce and no process group of its own until a checkpoint needs one (a group connects every
rank to every other); a checkpoint request that one rank alone sees is still served by every rank
at the same step."""

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import free_port, spawn_ranks
from trainer import checkpoint_catalog as catalog
from trainer.checkpoint import Checkpointer
from trainer.config import load_config
from trainer.progress import Progress
from trainer.train import environment, train

STEPS = 4


def tiny_config(tmp_path: str, checkpoints: str):
    return load_config([
        "--model.n_layers=2", "--model.d_model=32", "--model.n_heads=2", "--model.seq_len=16",
        "--training.batch_size=4", "--parallel.microbatches=2", "--parallel.dp=2", f"--training.steps={STEPS}",
        "--optim.warmup_steps=2", "--training.threads=1", "--training.device=cpu", f"--training.metrics_file={tmp_path}/metrics.jsonl",
        f"--data.shards={tmp_path}/shards", "--data.corpus=stdlib", "--data.corpus_bytes=20000",
        f"--checkpoint.uri={checkpoints}", "--checkpoint.interval=100"])


class StepProgress(Progress):
    """Progress that calls `on_step(step)` as each step completes (and with the resume step first),
    and `on_work()` for each phase of the start-up and each microbatch's forward or backward."""

    def __init__(self, on_step=lambda step: None, on_work=lambda: None):
        super().__init__(None)
        self.on_step, self.on_work = on_step, on_work

    def reached(self, step: int) -> None:
        super().reached(step)
        self.on_step(step)

    def beat(self) -> None:
        super().beat()
        self.on_work()


def count_collectives(rank: int, world: int, port: int, tmp_path: str, checkpoints: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        cfg = tiny_config(tmp_path, checkpoints)
        env = environment(cfg, torch.device("cpu"))  # the mesh's groups: the training's own
        groups_made, all_reduces, seen = [], [], {}
        real_new_group, real_all_reduce = dist.new_group, dist.all_reduce

        def new_group(*args, **kwargs):
            groups_made.append(progress.step)
            return real_new_group(*args, **kwargs)

        def all_reduce(*args, **kwargs):
            all_reduces.append(progress.step)
            return real_all_reduce(*args, **kwargs)

        progress = StepProgress(on_step=lambda step: seen.setdefault(step, (len(groups_made), len(all_reduces))))
        dist.new_group, dist.all_reduce = new_group, all_reduce
        try:
            train(cfg, env, progress)
        finally:
            dist.new_group, dist.all_reduce = real_new_group, real_all_reduce
        Path(tmp_path, f"counts.{rank}.json").write_text(json.dumps({"groups_made": groups_made, "seen": seen}))
    finally:
        dist.destroy_process_group()


def test_a_training_step_runs_one_all_reduce_and_no_group_is_made_before_the_first_save(tmp_path):
    """With checkpoints every 100 steps, only the last step (always saved) makes a group: DCP's,
    which the asynchronous save plans on in the background."""
    checkpoints = tmp_path / "checkpoints"
    spawn_ranks(count_collectives, (2, free_port(), str(tmp_path), str(checkpoints)), nprocs=2)

    for rank in range(2):
        counts = json.loads(Path(tmp_path, f"counts.{rank}.json").read_text())
        # Counted when each step completed: groups made so far, all-reduces so far.
        seen = {int(step): made for step, made in counts["seen"].items()}
        assert [seen[step][0] for step in range(STEPS + 1)] == [0] * (STEPS + 1), counts
        per_step = [seen[step][1] - seen[step - 1][1] for step in range(1, STEPS + 1)]
        assert per_step == [1] * STEPS, f"rank {rank}: all-reduces per step {per_step}"
        assert counts["groups_made"] == [STEPS], "one group, made by the last step's save"
    assert catalog.latest_committed(str(checkpoints)).step == STEPS


REQUESTED_AT = 2


def request_on_rank_0(rank: int, world: int, port: int, tmp_path: str, checkpoints: str) -> None:
    """Rank 0's node agent asks for a checkpoint while step REQUESTED_AT computes; rank 1's never does."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    request = Path(tmp_path, f"checkpoint-now.{rank}")
    os.environ[catalog.REQUEST_FILE_ENV] = str(request)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        saved = []
        real_maybe_save = Checkpointer.maybe_save

        def maybe_save(self, step, *args, **kwargs):
            started = real_maybe_save(self, step, *args, **kwargs)
            if started:
                saved.append(step)
            return started

        def on_work() -> None:
            if rank == 0 and progress.step == REQUESTED_AT - 1 and not request.exists():
                request.touch()

        Checkpointer.maybe_save = maybe_save
        cfg = tiny_config(tmp_path, checkpoints)
        progress = StepProgress(on_work=on_work)
        train(cfg, environment(cfg, torch.device("cpu")), progress)
        Path(tmp_path, f"saved.{rank}.json").write_text(json.dumps(saved))
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_request_one_rank_sees_is_served_by_every_rank_at_the_same_step(tmp_path):
    """Every rank saves the step during which the request came, as asked, and the last one
    (always saved), and nothing else."""
    checkpoints = tmp_path / "checkpoints"
    spawn_ranks(request_on_rank_0, (2, free_port(), str(tmp_path), str(checkpoints)), nprocs=2)

    saved = [json.loads(Path(tmp_path, f"saved.{rank}.json").read_text()) for rank in range(2)]
    assert saved == [[REQUESTED_AT, STEPS]] * 2
    store = catalog.open_store(str(checkpoints))
    assert catalog.read_manifest(store, REQUESTED_AT).reason is catalog.SaveReason.REQUESTED
