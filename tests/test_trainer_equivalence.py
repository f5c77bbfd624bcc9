"""The core correctness check: pipeline-parallel training gives the single-process losses.

Same seed and data, 10 steps, fp32 on CPU: one process, pp=2 and pp=4 with every schedule the
installed torch offers, and pp=2 x dp=2, must agree step by step within 1e-4 relative, in the loss
and in the gradient norm before clipping (AdamW and clipping would hide a wrongly scaled gradient
from the loss alone). Each world
size is started once (gloo, one thread per rank) and trains every layout in turn.
"""

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from conftest import free_port
from trainer.config import load_config
from trainer.parallel_dims import SCHEDULES
from trainer.train import environment, train

STEPS = 10
RESUME_AT = 5


def tiny_config(tmp_path, *overrides: str):
    return load_config([
        "--model.n_layers=8", "--model.d_model=32", "--model.n_heads=2", "--model.seq_len=32",
        "--training.batch_size=16", "--parallel.microbatches=8", f"--training.steps={STEPS}",
        "--optim.warmup_steps=2", "--training.threads=1", "--training.device=cpu",
        f"--training.metrics_file={tmp_path}/metrics.jsonl",
        f"--data.shards={tmp_path}/shards", "--data.corpus_bytes=60000", *overrides,
    ])


def layouts_for(world_size: int) -> dict[str, list[str]]:
    pp = world_size
    layouts = {f"pp={pp} {name}": [f"--parallel.pp={pp}", f"--parallel.schedule={name}"] for name in SCHEDULES}
    layouts[f"pp={pp} 1f1b without early p2p"] = [f"--parallel.pp={pp}", "--parallel.schedule=1f1b",
                                                  "--parallel.early_p2p=false"]
    if world_size == 4:
        layouts["pp=2 x dp=2 1f1b"] = ["--parallel.pp=2", "--parallel.dp=2", "--parallel.schedule=1f1b"]
        layouts["pp=2 x dp=2 zbv-zero-bubble"] = ["--parallel.pp=2", "--parallel.dp=2",
                                                  "--parallel.schedule=zbv-zero-bubble"]
    return layouts


def _worker(rank: int, world_size: int, port: int, tmp_path, results_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        losses = {}
        for name, overrides in layouts_for(world_size).items():
            cfg = tiny_config(tmp_path, *overrides)
            losses[name] = curves(train(cfg, environment(cfg, torch.device("cpu"))))
        if world_size == 2:
            losses["checkpoint"] = _save_midway(tmp_path)
        if rank == 0:
            with open(results_path, "w") as out:
                json.dump(losses, out)
    finally:
        dist.destroy_process_group()


def _save_midway(tmp_path) -> str:
    """Train pp=2 for RESUME_AT steps and save the TrainState with torch.distributed.checkpoint."""
    from trainer.train import build, train_step

    cfg = tiny_config(tmp_path, "--parallel.pp=2", "--parallel.schedule=interleaved-1f1b")
    run = build(cfg, environment(cfg, torch.device("cpu")))
    for _ in range(RESUME_AT):
        train_step(run)
    path = str(tmp_path / "pp2-checkpoint")
    dcp.save({"train": run.state}, checkpoint_id=path)
    return path


def curves(history: list[dict]) -> list[list[float]]:
    return [[m["loss"], m["grad_norm"]] for m in history]


def run_world(world_size: int, tmp_path) -> dict[str, list[float]]:
    results = tmp_path / f"losses-{world_size}.json"
    mp.start_processes(_worker, args=(world_size, free_port(), tmp_path, str(results)), nprocs=world_size,
                       join=True, start_method="spawn")
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("equivalence")


@pytest.fixture(scope="module")
def reference(workdir) -> list[list[float]]:
    cfg = tiny_config(workdir)
    return curves(train(cfg, environment(cfg, torch.device("cpu"))))


def assert_same_curves(expected: list[list[float]], actual: list[list[float]], what: str) -> None:
    assert len(actual) == len(expected), what
    for step, (e, a) in enumerate(zip(expected, actual), start=1):
        for quantity, e_value, a_value in zip(("loss", "grad norm"), e, a):
            assert abs(a_value - e_value) <= 1e-4 * abs(e_value), \
                f"{what}: step {step} {quantity} {a_value} != single-process {e_value}"


def test_reference_loss_falls(reference):
    assert reference[-1][0] < reference[0][0] - 0.5


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_matches_single_process(world_size, workdir, reference):
    results = run_world(world_size, workdir)
    layouts = layouts_for(world_size)
    assert set(layouts) <= set(results)
    for name in layouts:
        assert_same_curves(reference, results[name], name)
    if world_size == 2:
        _check_resume_in_one_process(results["checkpoint"], workdir, reference)


def _check_resume_in_one_process(path: str, workdir, reference: list[list[float]]) -> None:
    """The pp=2 checkpoint loads into one process and continues exactly like the uninterrupted run."""
    from trainer.train import build, train_step

    cfg = tiny_config(workdir)
    run = build(cfg, environment(cfg, torch.device("cpu")))
    dcp.load({"train": run.state}, checkpoint_id=path, no_dist=True)
    assert run.state.step == RESUME_AT
    resumed = curves([train_step(run) for _ in range(STEPS - RESUME_AT)])
    assert_same_curves(reference[RESUME_AT:], resumed, "pp=2 checkpoint resumed in one process")
