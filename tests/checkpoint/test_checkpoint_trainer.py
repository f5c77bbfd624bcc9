"""Checkpoints of the real trainer, end to end: every rank a process, S3 a moto server over HTTP.

Each run is launched the way torchrun starts ranks (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
environment) through trainer_rank.py, whose hooks pause or block a run at a chosen point so that
the kills land where they are meant to, without sleeps.
"""

import json
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import torch

from checkpoint_fixtures import Ranks, bucket, processes, rank_image, s3  # noqa: F401 (fixtures)

from conftest import free_port
from localcloud.waiting import sizes, until
from trainer import checkpoint_catalog as catalog
from trainer.config import load_config
from trainer.model import GPT

pytestmark = pytest.mark.slow

STEPS = 20


def trainer_args(tmp_path: Path, uri: str, metrics: str, *overrides: str) -> list[str]:
    return [
        "--model.n_layers=4", "--model.d_model=32", "--model.n_heads=2", "--model.seq_len=32",
        "--training.batch_size=8", "--parallel.microbatches=4", f"--training.steps={STEPS}",
        "--optim.warmup_steps=2", "--training.threads=1", "--training.device=cpu",
        "--parallel.timeout_s=30", f"--training.metrics_file={tmp_path / metrics}",
        f"--data.shards={tmp_path / 'shards'}", "--data.corpus=stdlib", "--data.corpus_bytes=40000",
        f"--checkpoint.uri={uri}", "--checkpoint.interval=5", "--checkpoint.keep_last=2", *overrides,
    ]


def written(log_dir: Path):
    """What the ranks wrote to their logs and markers: they advance while it grows."""
    return lambda: sizes(sorted(log_dir.iterdir()))


def exit_code(proc, log_dir: Path) -> int:
    """The rank's exit status, waited for while the ranks write (localcloud.waiting)."""
    until(lambda: proc.poll() is not None, written(log_dir), what=f"rank {proc.args} to exit", poll_s=0.05)
    return proc.returncode


def run_to_end(procs, log_dir: Path) -> None:
    for rank, proc in enumerate(procs):
        code = exit_code(proc, log_dir)
        assert code == 0, f"rank {rank} exited {code}:\n{(log_dir / f'rank{rank}.log').read_text()[-3000:]}"


def wait_for(condition, what: str, procs, log_dir: Path) -> None:
    def reached() -> bool:
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead, f"a rank exited while waiting for {what}"
        return condition()
    until(reached, written(log_dir), what=what, poll_s=0.05)


def losses(tmp_path: Path, metrics: str) -> dict[int, float]:
    lines = (tmp_path / metrics).read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines)}


def train(tmp_path, processes, uri, metrics, world=1, hooks=(), layout=(), resume="none", name=None):
    log_dir = tmp_path / (name or metrics.removesuffix(".jsonl"))
    log_dir.mkdir()
    args = trainer_args(tmp_path, uri, metrics, f"--checkpoint.resume={resume}", *layout)
    return processes.launch(world, free_port(), args, log_dir, list(hooks)), log_dir


@dataclass
class Straight:
    losses: dict[int, float]
    uri: str


def uninterrupted(tmp_path_factory, rank_image, launch) -> tuple[Path, str]:
    """A reference run in a bucket of its own: `launch(tmp_path, ranks, uri)` starts its ranks and
    returns them and their log folder; run to the end. Its folder and checkpoint location."""
    tmp_path = tmp_path_factory.mktemp("straight")
    uri = f"s3://straight-{uuid.uuid4().hex[:12]}/runs/straight/checkpoints"
    boto3.client("s3").create_bucket(Bucket=catalog.open_store(uri).bucket)
    ranks = Ranks(rank_image)
    try:
        run_to_end(*launch(tmp_path, ranks, uri))
    finally:
        ranks.end()
    return tmp_path, uri


@pytest.fixture(scope="module")
def straight(tmp_path_factory, moto_endpoint, rank_image):
    """20 uninterrupted steps at pp=2, checkpointed every 5 (15 and 20 are kept): the reference."""
    tmp_path, uri = uninterrupted(tmp_path_factory, rank_image, lambda tmp_path, ranks, uri: train(
        tmp_path, ranks, uri, "straight.jsonl", world=2, layout=["--parallel.pp=2"]))
    return Straight(losses(tmp_path, "straight.jsonl"), uri)


def kill(procs) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def train_until(step: int, tmp_path, processes, uri, metrics, world, layout, resume) -> None:
    """Train with a checkpoint committed at `step`, then kill -9 every rank."""
    procs, log_dir = train(tmp_path, processes, uri, metrics, world=world, layout=layout, resume=resume,
                           hooks=["--hang-after", str(step)])
    wait_for(lambda: all((log_dir / f"reached.{r}").exists() for r in range(world)), f"step {step} committed", procs,
             log_dir)
    kill(procs)
    assert catalog.latest_committed(uri).step == step


def test_kill_every_rank_then_resume_gives_identical_losses(tmp_path, processes, bucket, straight):
    uri = f"s3://{bucket}/runs/interrupted/checkpoints"
    train_until(10, tmp_path, processes, uri, "interrupted.jsonl", 2, ["--parallel.pp=2"], "none")

    procs, log_dir = train(tmp_path, processes, uri, "resumed.jsonl", world=2, layout=["--parallel.pp=2"],
                           resume="latest")
    run_to_end(procs, log_dir)

    assert losses(tmp_path, "interrupted.jsonl") == {s: straight.losses[s] for s in range(1, 11)}
    assert losses(tmp_path, "resumed.jsonl") == {s: straight.losses[s] for s in range(11, STEPS + 1)}


def test_a_rank_killed_while_writing_leaves_no_checkpoint_and_nothing_hangs(tmp_path, processes, s3, bucket,
                                                                            straight):
    uri = f"s3://{bucket}/runs/killed-mid-write/checkpoints"
    procs, log_dir = train(tmp_path, processes, uri, "first.jsonl", world=2, layout=["--parallel.pp=2"],
                           hooks=["--block-write", "10", "1"])
    wait_for(lambda: (log_dir / "writing").exists(), "rank 1 writing step 10", procs, log_dir)

    store = catalog.open_store(uri)
    shard = f"{store.prefix}{catalog.shard_folder(1)}/{catalog.step_dir_name(10)}/__1_0.distcp"
    uploads = s3.list_multipart_uploads(Bucket=bucket, Prefix=shard).get("Uploads", [])
    assert [upload["Key"] for upload in uploads] == [shard], "rank 1 should be in the middle of its shard"

    procs[1].send_signal(signal.SIGKILL)

    assert exit_code(procs[0], log_dir) != 0, "rank 0 must fail, not finish, when its peer dies"
    assert not catalog.is_committed(store, 10)
    assert catalog.latest_committed(uri).step == 5

    procs, log_dir = train(tmp_path, processes, uri, "resumed.jsonl", world=2, layout=["--parallel.pp=2"],
                           resume="latest")
    run_to_end(procs, log_dir)
    assert losses(tmp_path, "resumed.jsonl") == {s: straight.losses[s] for s in range(6, STEPS + 1)}
    assert catalog.latest_committed(uri).step == 20


def assert_close(got: dict[int, float], expected: dict[int, float]) -> None:
    assert got.keys() == expected.keys()
    for step, loss in got.items():
        assert loss == pytest.approx(expected[step], rel=1e-4), f"step {step}"


def test_reshard_pp4_to_pp2_to_pp2xdp2_to_one_process(tmp_path, processes, bucket, straight):
    uri = f"s3://{bucket}/runs/reshard/checkpoints"
    segments = [(5, 4, ["--parallel.pp=4"]), (10, 2, ["--parallel.pp=2"]),
                (15, 4, ["--parallel.pp=2", "--parallel.dp=2"])]
    resume = "none"
    for until, world, layout in segments:
        train_until(until, tmp_path, processes, uri, f"until-{until}.jsonl", world, layout, resume)
        resume = "latest"
    procs, log_dir = train(tmp_path, processes, uri, "one-process.jsonl", resume="latest")
    run_to_end(procs, log_dir)

    assert_close(losses(tmp_path, "until-5.jsonl"), {s: straight.losses[s] for s in range(1, 6)})
    assert_close(losses(tmp_path, "until-10.jsonl"), {s: straight.losses[s] for s in range(6, 11)})
    assert_close(losses(tmp_path, "until-15.jsonl"), {s: straight.losses[s] for s in range(11, 16)})
    assert_close(losses(tmp_path, "one-process.jsonl"), {s: straight.losses[s] for s in range(16, 21)})


def copy_checkpoints(s3, source_uri: str, target_uri: str) -> None:
    source, target = catalog.open_store(source_uri), catalog.open_store(target_uri)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=source.prefix):
        for obj in page.get("Contents", []):
            s3.copy_object(Bucket=target.bucket, Key=target.prefix + obj["Key"][len(source.prefix):],
                           CopySource={"Bucket": source.bucket, "Key": obj["Key"]})


def test_a_truncated_shard_is_refused_by_name_and_resume_falls_back(tmp_path, processes, s3, bucket, straight):
    """An explicit resume of the step names the file; latest falls back to the step before.

    A missing shard takes the same path (test_checkpoint_catalog.py).
    """
    uri = f"s3://{bucket}/runs/damaged/checkpoints"
    copy_checkpoints(s3, straight.uri, uri)
    shard_name = f"{catalog.shard_folder(1)}/{catalog.step_dir_name(20)}/__1_0.distcp"
    shard_key = f"runs/damaged/checkpoints/{shard_name}"
    body = s3.get_object(Bucket=bucket, Key=shard_key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=shard_key, Body=body[: len(body) // 2])

    procs, log_dir = train(tmp_path, processes, uri, "refused.jsonl", resume="20")
    assert exit_code(procs[0], log_dir) != 0
    refusal = (log_dir / "rank0.log").read_text()
    assert "cannot resume from step 20" in refusal
    assert f"file {shard_name} has {len(body) // 2} bytes, manifest says {len(body)}" in refusal

    procs, log_dir = train(tmp_path, processes, uri, "fallback.jsonl", resume="latest")
    run_to_end(procs, log_dir)
    assert "skipping checkpoint" in (log_dir / "rank0.log").read_text()
    assert_close(losses(tmp_path, "fallback.jsonl"), {s: straight.losses[s] for s in range(16, 21)})


def test_stock_dcp_reads_our_checkpoint(tmp_path, s3, straight):
    """Plain DCP plus a marker: torch's own converter turns a downloaded step into a torch.save file.

    Downloaded as the manifest lists its files (paths relative to the location), with DCP's
    metadata at the top, where the stock reader looks for it.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    store = catalog.open_store(straight.uri)
    local = tmp_path / "step-20"
    for stored in catalog.verified_manifest(store, 20).files:
        target = local / stored.name
        if stored.name.endswith("/.metadata"):
            target = local / ".metadata"
        target.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(store.bucket, store.prefix + stored.name, str(target))

    dcp_to_torch_save(local, tmp_path / "step-20.pt")
    saved = torch.load(tmp_path / "step-20.pt", weights_only=False)

    cfg = load_config(trainer_args(tmp_path, "", "unused.jsonl"))
    full_model = GPT(cfg.model)
    assert saved["step"] == 20
    assert {k: v.shape for k, v in saved["model"].items()} == {k: v.shape for k, v in full_model.state_dict().items()}
