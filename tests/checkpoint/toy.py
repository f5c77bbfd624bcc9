"""A tiny pipeline-parallel training run used to test checkpoints end to end.

The model is a stack of linear layers in a ModuleDict keyed by global layer index, so each
pipeline rank keeps the full model's parameter names for its layer range. Activations and their
gradients travel between ranks with plain send/recv (gloo). Every rank draws the same random
noise each step, so the RNG state is replicated and one saved copy serves any layout.

Run one rank: RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python toy.py --uri ... 
`launch()` starts all ranks as subprocesses; a single process needs no torch.distributed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainer import checkpoint  # noqa: E402

LAYERS, WIDTH, BATCH = 8, 32, 16
# Optimizer state flattened to one key per parameter and setting, so that every pipeline rank's
# keys are its own and a checkpoint loads into any other split.
FLAT_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class CheckpointSettings:
    """What the trainer's CheckpointConfig carries (fields as agreed)."""

    uri: str = ""
    interval: int = 5
    keep_last: int = 2
    resume: str = "none"
    async_save: bool = True


def build_stage(pp_rank: int, pp: int) -> nn.Module:
    """The layers of one pipeline rank; the same seed for every layout, so weights agree."""
    torch.manual_seed(0)
    full = nn.Module()
    full.layers = nn.ModuleDict({str(i): nn.Linear(WIDTH, WIDTH) for i in range(LAYERS)})
    per_rank = LAYERS // pp
    for i in range(LAYERS):
        if not pp_rank * per_rank <= i < (pp_rank + 1) * per_rank:
            del full.layers[str(i)]
    return full


def run_stage(stage: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in stage.layers.values():  # x: (BATCH, WIDTH)
        x = torch.tanh(layer(x))
    return x


def batch_at(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch the sampler yields at `position`: a pure function of it."""
    gen = torch.Generator().manual_seed(1000 + position)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


class TrainState:
    """Everything a resumed run needs: model, optimizer, scheduler, sampler position, RNG, step."""

    def __init__(self, pp_rank: int, pp: int):
        self.model = build_stage(pp_rank, pp)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0 / (1 + 0.1 * s))
        self.step = 0
        self.data_position = 0

    def state_dict(self):
        return {
            "model": get_model_state_dict(self.model),
            "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FLAT_OPTIM),
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "data_position": self.data_position,
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state):
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=FLAT_OPTIM)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.data_position = state["data_position"]
        torch.set_rng_state(state["rng"])


def train_step(state: TrainState, pp_rank: int, pp: int) -> float:
    """One pipeline step (one microbatch): forward rank to rank, backward back; the loss."""
    inputs, target = batch_at(state.data_position)
    inputs = inputs + 0.01 * torch.randn(BATCH, WIDTH)  # the global RNG, so resume must restore it
    state.data_position += 1
    if pp_rank > 0:
        inputs = torch.empty(BATCH, WIDTH)
        dist.recv(inputs, src=pp_rank - 1)
    inputs.requires_grad_(pp_rank > 0)
    out = run_stage(state.model, inputs)
    loss = torch.zeros(())
    if pp_rank == pp - 1:
        loss = nn.functional.mse_loss(out, target)
        loss.backward()
    else:
        dist.send(out.detach(), dst=pp_rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=pp_rank + 1)
        out.backward(grad)
    if pp_rank > 0:
        dist.send(inputs.grad, dst=pp_rank - 1)
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.scheduler.step()
    state.step += 1
    if pp > 1:
        loss = loss.detach().clone()
        dist.broadcast(loss, src=pp - 1)
    return loss.item()


def train(settings: CheckpointSettings, steps: int, losses_file: Path | None, reached_file: Path | None = None,
          hang_after: int | None = None) -> TrainState:
    """Train to `steps`, checkpointing as configured; append {step, loss} lines to losses_file."""
    distributed = dist.is_initialized()
    pp = dist.get_world_size() if distributed else 1
    pp_rank = dist.get_rank() if distributed else 0
    state = TrainState(pp_rank, pp)
    checkpointer = checkpoint.Checkpointer(settings, layout={"pp": pp, "dp": 1})
    start = checkpointer.resume(state) or 0
    for step in range(start + 1, steps + 1):
        loss = train_step(state, pp_rank, pp)
        if losses_file and pp_rank == 0:
            with losses_file.open("a") as out:
                out.write(json.dumps({"step": step, "loss": loss}) + "\n")
        checkpointer.maybe_save(step, state)
        if step == hang_after:
            reached_file.with_suffix(f".{pp_rank}").touch()
            threading.Event().wait()  # until killed
    checkpointer.close()
    return state


def block_writes(step: int, rank: int, signal_file: Path) -> None:
    """Make `rank`'s shard write of `step` announce itself in signal_file and never finish."""
    real_writer = checkpoint.storage_writer

    def writer(step_uri: str):
        inner = real_writer(step_uri)
        if step_uri.endswith(f"step-{step:09d}") and dist.get_rank() == rank:
            def write_data(plan, planner):
                signal_file.touch()
                threading.Event().wait()  # until killed

            inner.write_data = write_data
        return inner

    checkpoint.storage_writer = writer


def launch(world: int, args: list[str], port: int, log_dir: Path) -> list[subprocess.Popen]:
    """Start `world` ranks of this script; stderr of rank r goes to log_dir/rank{r}.log."""
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        with (log_dir / f"rank{rank}.log").open("w") as log:
            procs.append(subprocess.Popen([sys.executable, __file__, *args], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    return procs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--resume", default="none")
    parser.add_argument("--losses", type=Path)
    parser.add_argument("--hang-after", type=int)
    parser.add_argument("--reached", type=Path)
    parser.add_argument("--block-write", type=int, nargs=2, metavar=("STEP", "RANK"))
    parser.add_argument("--blocked-signal", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if args.block_write:
        block_writes(*args.block_write, args.blocked_signal)
    settings = CheckpointSettings(uri=args.uri, interval=args.interval, resume=args.resume)
    train(settings, args.steps, args.losses, args.reached, args.hang_after)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
