"""Fixtures for the checkpoint tests (imported by name: a conftest here would shadow tests/conftest.py)."""

import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest

from localcloud.warm_image import WarmImage


@pytest.fixture
def s3(moto_endpoint):
    return boto3.client("s3", endpoint_url=moto_endpoint)


@pytest.fixture
def bucket(s3):
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def run_uri(bucket):
    return f"s3://{bucket}/runs/test-run/checkpoints"


class Ranks:
    """Trainer ranks (tests/checkpoint/trainer_rank.py), each a process forked from a warm image
    that imported torch and the trainer once (a rank started afresh spends about five seconds of
    CPU importing them); `end` kills any still running."""

    def __init__(self, image: WarmImage):
        self.image, self.started = image, []

    def launch(self, world: int, port: int, trainer_args: list[str], log_dir: Path, hooks: list[str] = (),
               ranks_per_node: int | None = None, node_args: Callable[[int], list[str]] = lambda node: [],
               node_env: Callable[[int], dict[str, str]] = lambda node: {}, nodes: list[int] | None = None) -> list:
        """Start `world` ranks as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
        MASTER_ADDR/PORT), `ranks_per_node` to a node (all on one by default), each node's with
        `node_args(node)` after `trainer_args` and `node_env(node)` in its environment; rank r's
        output goes to log_dir/rank{r}.log. `nodes`: start only these nodes' ranks."""
        procs = []
        per_node = ranks_per_node or world
        for rank in range(world):
            if nodes is not None and rank // per_node not in nodes:
                continue
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", **node_env(rank // per_node))
            procs.append(self.image.fork([sys.executable, "-m", "trainer_rank", "--signals", str(log_dir), *hooks, "--",
                                          *trainer_args, *node_args(rank // per_node)], log_dir, env,
                                         log_dir / f"rank{rank}.log"))
        self.started += procs
        return procs

    def end(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.fixture(scope="module")
def rank_image():
    """A warm image of trainer ranks (localcloud.warm_image)."""
    image = WarmImage.start(["trainer_rank"], path=[str(Path(__file__).resolve().parent)])
    yield image
    image.stop()


@pytest.fixture
def processes(rank_image):
    """Ranks a test starts; any still running at the end are killed."""
    ranks = Ranks(rank_image)
    yield ranks
    ranks.end()
