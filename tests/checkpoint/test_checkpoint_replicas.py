"""Two ranks on gloo: replicated tensors are stored once, not per rank; the checkpoint collectives' timeout."""

import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import free_port, spawn_ranks
from trainer import checkpoint_catalog as catalog
from trainer.checkpoint import Checkpointer
from trainer.config import CheckpointConfig

PARAMETERS = 2**20  # 4 MiB of fp32 per tensor


def settings(uri: str) -> CheckpointConfig:
    return CheckpointConfig(uri=uri, interval=1, keep_last=2)


class Replica:
    """What every data-parallel rank holds: the same weights and the same optimizer moments."""

    def __init__(self):
        torch.manual_seed(0)
        self.tensors = {name: torch.randn(PARAMETERS) for name in ("w", "exp_avg", "exp_avg_sq")}

    def state_dict(self):
        return {"model": {"w": self.tensors["w"]},
                "optimizer": {"exp_avg": self.tensors["exp_avg"], "exp_avg_sq": self.tensors["exp_avg_sq"]}}

    def load_state_dict(self, state):
        self.tensors = {"w": state["model"]["w"], **state["optimizer"]}


def save_as_replica(rank: int, world: int, port: int, uri: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        checkpointer = Checkpointer(settings(uri), layout={"pp": 1, "dp": world}, request_signal=None)
        checkpointer.maybe_save(1, Replica())
        checkpointer.close()
    finally:
        dist.destroy_process_group()


def test_replicated_tensors_are_written_once_across_data_parallel_ranks(tmp_path: Path):
    uri = str(tmp_path / "checkpoints")
    spawn_ranks(save_as_replica, (2, free_port(), uri), nprocs=2)

    manifest = catalog.latest_committed(uri)
    one_copy = 3 * PARAMETERS * 4
    shard_bytes = sum(f.size for f in manifest.files if f.name.endswith(".distcp"))
    assert one_copy <= shard_bytes < 1.1 * one_copy, f"{shard_bytes} bytes of shards for {one_copy} of state"


def wait_for_a_peer_that_never_comes(rank: int, world: int, port: int, uri: str, elapsed_file: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(minutes=5))
    checkpointer = Checkpointer(settings(uri), request_signal=None, timeout=timedelta(seconds=3))
    if rank == 1:  # alive, but never joins the checkpoint's collectives
        deadline = time.monotonic() + 20
        while not Path(elapsed_file).exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        return
    started = time.monotonic()
    try:
        checkpointer.maybe_save(1, Replica())
    except Exception:
        Path(elapsed_file).write_text(str(time.monotonic() - started))


def test_the_checkpoint_collectives_wait_for_a_peer_as_long_as_their_own_timeout(tmp_path: Path):
    """The Checkpointer's timeout, not the process group's (5 minutes here), bounds its waits."""
    elapsed = tmp_path / "elapsed"
    spawn_ranks(wait_for_a_peer_that_never_comes, (2, free_port(), str(tmp_path / "checkpoints"), str(elapsed)),
                nprocs=2)

    assert 2.5 < float(elapsed.read_text()) < 15
