"""Train the GPT with pipeline x data (FSDP2) x tensor parallelism.

    python -m trainer.train --config trainer/configs/small.toml --parallel.pp=1     # one process
    torchrun --nproc-per-node 2 -m trainer.train --config trainer/configs/small.toml --parallel.pp=2
    torchrun --nproc-per-node 4 -m trainer.train --config trainer/configs/small.toml \\
        --parallel.pp=2 --parallel.dp=2 --parallel.schedule=interleaved-1f1b
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m trainer.train --config FILE --parallel.pp=4 --parallel.dp=2 --parallel.tp=4

Precedence: command line > config file > defaults (trainer/config.py). Use `--section.field=value`
for overrides: a bare prefix of a torchrun option (e.g. `--d`) is taken by torchrun.
"""

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from trainer import checkpoint_catalog, fleet_check, repair, repair_order
from trainer.scaling_check import ComputeClock, ScalingCheck
from trainer.checkpoint import Checkpointer
from trainer.config import ConfigError, JobConfig, OptimConfig, check_world_size, load_config
from trainer.data import DataLoader, checked_index, load_tokens
from trainer.memory_checkpoint import MemoryCheckpoints
from trainer.parallel_dims import RankPosition, schedule_class
from trainer.parallelize import local_part
from trainer.pipeline_parallel import Pipeline, build_pipeline
from trainer.progress import NODE_RANK_ENV, Progress
from trainer.shards import ShardSetError
from trainer.tokenizer import TokenizerError
from trainer.world_failure import current_world, raise_if_failed

_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; training stops before the optimizer
    would write it into the weights."""


class StepsDisagree(RuntimeError):
    """The world's ranks hold different steps after a restore: they would train different batches
    and stop at different steps, the first to finish waiting for the others for ever."""


@dataclass
class DistributedEnv:
    """This process's place in the job and the mesh it talks over (None when alone)."""

    rank: int
    world_size: int
    device: torch.device
    position: RankPosition
    mesh: DeviceMesh | None
    """Dimensions pp, dp_replicate, dp_shard, tp, outermost first."""
    generation: int = 0
    """Repairs in place of this launch's world so far (trainer/repair.py)."""
    world: dist.ProcessGroup | None = None
    """The default group this world formed with: a collective's values are used only while it
    has not failed (trainer/world_failure.py)."""


class TrainState(Stateful):
    """Everything a resumed run needs, as a state dict keyed by the full model's parameter names.

    model:        {"layers.3.mlp.fc.weight": tensor, ...} for the parts this rank holds
    optimizer:    flattened AdamW state, {"state.layers.3.mlp.fc.weight.exp_avg": tensor,
                  "param_groups.layers.3.mlp.fc.weight.lr": 0.003, ...}
    lr_scheduler, sampler, step: identical on every rank, so any world size can load them
    rng:          the torch RNG state; every rank seeds and draws alike, so it too is identical
    With these names torch.distributed.checkpoint saves at one pp x dp and loads at another.
    """

    def __init__(self, pipeline: Pipeline, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[LambdaLR],
                 loader: DataLoader):
        self.pipeline, self.optimizers, self.lr_schedulers, self.loader = pipeline, optimizers, lr_schedulers, loader
        self.step = 0
        """Optimizer steps taken so far."""

    def state_dict(self) -> dict:
        model, optimizer = {}, {}
        for part, opt in zip(self.pipeline.model_parts, self.optimizers):
            part_model, part_optimizer = get_state_dict(part, opt, options=_STATE_DICT_OPTIONS)
            model.update(part_model)
            optimizer.update(part_optimizer)
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        return {"model": model, "optimizer": optimizer, "lr_scheduler": self.lr_schedulers[0].state_dict(),
                "sampler": self.loader.sampler.state_dict(), "rng": rng, "step": self.step}

    def model_state_dict(self) -> dict:
        """The weights alone (what an imported step holds: trainer/hf_import.py)."""
        return {key: value for part in self.pipeline.model_parts
                for key, value in get_model_state_dict(part, options=_STATE_DICT_OPTIONS).items()}

    def load_model_state_dict(self, model: dict) -> None:
        for part in self.pipeline.model_parts:
            own_keys = get_model_state_dict(part).keys()
            set_model_state_dict(part, {k: model[k] for k in own_keys}, options=_STATE_DICT_OPTIONS)

    def load_state_dict(self, state: dict) -> None:
        self.load_model_state_dict(state["model"])
        for part, opt in zip(self.pipeline.model_parts, self.optimizers):
            # Entries of other parts are ignored: the optimizer looks up its own parameters by name.
            set_optimizer_state_dict(part, opt, state["optimizer"], options=_STATE_DICT_OPTIONS)
        for scheduler in self.lr_schedulers:
            scheduler.load_state_dict(state["lr_scheduler"])
        self.loader.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
        self.step = int(state["step"])


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of optim.lr at a 0-based step: linear warmup to 1, then cosine down to min_lr_ratio
    at optim.decay_steps (or the last step), then flat."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_end = cfg.decay_steps or total_steps
    progress = (step - cfg.warmup_steps) / max(1, decay_end - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(part: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    # Matrices decay; biases, norms and embeddings do not (embeddings are lookups, not projections).
    decay = [p for n, p in part.named_parameters() if p.dim() >= 2 and "emb" not in n]
    no_decay = [p for n, p in part.named_parameters() if not (p.dim() >= 2 and "emb" not in n)]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # The fused kernel (CPU and CUDA) is about 3x faster than the per-parameter loop on CPU.
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, fused=True)


@contextlib.contextmanager
def distributed(cfg: JobConfig):
    """Start the process group for a torchrun launch and tear it down after.

    One process on CPU runs without one. On CUDA even one process gets a one-rank group: FSDP2,
    whose mixed precision policy gives the bf16 compute, needs a mesh. A replacement node's
    processes, started with a repair order already there, join the world it names.
    """
    order = _standing_order(cfg)
    world_size = _world_size(order)
    check_world_size(cfg, world_size)
    device = _device(cfg)
    grouped = world_size > 1 or device.type == "cuda"
    if grouped:
        timeout = timedelta(seconds=cfg.parallel.timeout_s)
        options = _group_options(device)
        if order:
            repair.join_order(order, rank_by_node(), _ranks_per_node(), _backend(device), timeout, **options)
        else:
            if world_size == 1:
                options.update(store=dist.HashStore(), rank=0, world_size=1)
            elif NODE_RANK_ENV in os.environ:
                options.update(store=_launch_store(world_size, timeout), rank=rank_by_node(), world_size=world_size)
            dist.init_process_group(_backend(device), timeout=timeout, **options)
    try:
        yield replace(environment(cfg, device), generation=order.generation if order else 0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _standing_order(cfg: JobConfig) -> repair_order.RepairOrder | None:
    """The repair order this process starts with: there only on a replacement node."""
    return repair_order.read_order(Path(cfg.parallel.repair_file)) if cfg.parallel.repair_file else None


def _world_size(order: repair_order.RepairOrder | None) -> int:
    """Ranks in the world to form: torchrun's, or the order's (a replacement's torchrun knows only its node)."""
    return order.world_size(_ranks_per_node()) if order else int(os.environ.get("WORLD_SIZE", "1"))


def _group_options(device: torch.device) -> dict:
    # device_id binds NCCL's communicator to this rank's GPU at once (no guessing, eager init).
    return {"device_id": device} if device.type == "cuda" else {}


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _ranks_per_node() -> int:
    return int(os.environ["LOCAL_WORLD_SIZE"])


def rank_by_node() -> int:
    """This process's rank with the nodes in the launch spec's order (NODE_RANK_ENV), not the
    order torchrun's rendezvous gave them (by address, another in every attempt): a node keeps
    its ranks across attempts, and with them the shards its host memory holds
    (trainer/memory_checkpoint.py)."""
    return int(os.environ[NODE_RANK_ENV]) * _ranks_per_node() + int(os.environ["LOCAL_RANK"])


def _launch_store(world_size: int, timeout: timedelta) -> dist.Store:
    """The store torchrun's environment names for the world to meet at (MASTER_ADDR and
    MASTER_PORT), as env:// would open it: hosted by the agent, or by torchrun's rank 0, which is
    on MASTER_ADDR's node whatever rank it takes here."""
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=not hosted_by_agent and os.environ["RANK"] == "0", timeout=timeout,
                         multi_tenant=True)


def _device(cfg: JobConfig) -> torch.device:
    wanted = cfg.training.device
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def environment(cfg: JobConfig, device: torch.device) -> DistributedEnv:
    """Groups for cfg's layout over the already started process group (or none for one process)."""
    if not dist.is_initialized():
        return DistributedEnv(0, 1, device, RankPosition(0, 0, 0), None)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    check_world_size(cfg, world_size)
    p = cfg.parallel
    shard = p.resolved_dp_shard()
    mesh = init_device_mesh(device.type, (p.pp, p.dp // shard, shard, p.tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    return DistributedEnv(rank, world_size, device, RankPosition.of(rank, p.dp, p.tp), mesh, world=current_world())


def clip_gradients(parts: list[torch.nn.Module], max_norm: float, norm: float) -> None:
    """Scale all gradients so that their global norm (given, over every stage) is at most max_norm."""
    if max_norm > 0 and norm > max_norm:
        torch._foreach_mul_([local_part(p.grad) for part in parts for p in part.parameters()], max_norm / (norm + 1e-6))


@dataclass
class Run:
    """What one rank trains with."""

    config: JobConfig
    env: DistributedEnv
    pipeline: Pipeline
    state: TrainState

    def log(self, metrics: dict) -> None:
        if self.env.rank != 0:
            return
        print(f"step {metrics['step']:5d} | loss {metrics['loss']:.4f} | {metrics['tokens_per_s']:8.0f} tok/s | "
              f"{metrics['step_time_s']:.3f} s/step | lr {metrics['lr']:.2e}", flush=True)
        self._record(metrics)

    def log_nothing_left(self) -> None:
        """A resumed run already at its last step: say so, and leave a metrics record without a
        loss (`finished`), so whoever follows the metrics file learns the run is complete."""
        if self.env.rank != 0:
            return
        print(f"nothing to train: resumed at step {self.state.step}, training.steps is {self.config.training.steps}",
              flush=True)
        self._record({"step": self.state.step, "finished": True})

    def _record(self, record: dict) -> None:
        path = Path(self.config.training.metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as out:  # stamped with the wall clock: when a step ended, across nodes
            out.write(json.dumps(record | {"time": time.time()}) + "\n")


def build(cfg: JobConfig, env: DistributedEnv, index: dict | None = None, initialised: bool = True) -> Run:
    """What this rank trains with; its weights unfilled unless `initialised` (a restore follows);
    `index`: the shard set's, where the caller has read it already."""
    torch.manual_seed(cfg.training.seed)
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    pipeline = build_pipeline(cfg, env.device, env.position.pp_index, env.mesh, initialised)
    optimizers = [build_optimizer(part, cfg.optim) for part in pipeline.model_parts]
    schedulers = [LambdaLR(opt, lambda step: lr_factor(step, cfg.optim, cfg.training.steps)) for opt in optimizers]
    loader = DataLoader(load_tokens(cfg.data, index), cfg.model.seq_len, cfg.training.batch_size, cfg.parallel.dp,
                        env.position.dp_index, cfg.training.seed, device=env.device)
    return Run(cfg, env, pipeline, TrainState(pipeline, optimizers, schedulers, loader))


@dataclass
class StepVotes:
    """Flags each rank raises for every rank to act on after a step (Checkpointer.vote: a save
    failed, a save is asked for; MemoryCheckpoints.vote: its last copy is done, it failed), summed over all ranks by the step's all-reduce of the loss and
    the gradient norm: a collective of their own every step would cost a round trip of the whole
    world (on gloo, a ring of 4,096 hops) for two numbers."""

    cast: Callable[[], torch.Tensor]
    """This rank's flags, asked for just before the all-reduce: a request that comes while the
    step computes is acted on after this step, not the next."""
    sums: torch.Tensor | None = None
    """Their sums over all ranks, once the step is done."""


def train_step(run: Run, votes: StepVotes | None = None) -> dict:
    """One optimizer step over one global batch; every rank returns the same metrics (and has
    the same `votes.sums`)."""
    cfg, env, state = run.config, run.env, run.state
    started = time.perf_counter()
    inputs, targets = state.loader.next_batch()  # already on the device
    for opt in state.optimizers:
        opt.zero_grad()
    loss = run.pipeline.forward_backward(inputs, targets)  # gradients come out averaged over dp (FSDP)
    _place_gradients_like_parameters(run.pipeline.model_parts)
    loss, grad_norm = _loss_and_grad_norm(loss, run.pipeline.model_parts, env, cfg.parallel.dp * cfg.parallel.tp,
                                          votes)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLossError(f"step {state.step + 1}: loss is {loss}, gradient norm is {grad_norm}; stopping "
                                 f"before the optimizer applies it. Lower optim.lr or check the data.")
    clip_gradients(run.pipeline.model_parts, cfg.optim.grad_clip, grad_norm)
    lr = state.lr_schedulers[0].get_last_lr()[0]
    for opt, scheduler in zip(state.optimizers, state.lr_schedulers):
        opt.step()
        scheduler.step()
    state.step += 1
    step_time = time.perf_counter() - started
    tokens = cfg.training.batch_size * cfg.model.seq_len
    return {"step": state.step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time_s": step_time,
            "tokens_per_s": tokens / step_time}


def _place_gradients_like_parameters(parts: list[torch.nn.Module]) -> None:
    """Tensor parallel leaves the gradients of replicated norm weights as per-rank partial sums and
    those of row-split embeddings whole; the norm, the clipping and the optimizer work on this
    rank's part of each gradient, so it must be the shard that matches its parameter."""
    for part in parts:
        for p in part.parameters():
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _loss_and_grad_norm(loss: torch.Tensor | None, parts: list[torch.nn.Module], env: DistributedEnv,
                        ranks_per_stage: int, votes: StepVotes | None = None) -> tuple[float, float]:
    """The batch loss and the global gradient norm, the same on every rank, from one all-reduce
    (which also sums `votes`).

    Each of a stage's dp x tp ranks holds its shard of every gradient (FSDP and tensor parallel
    split them; a plain or replicated one is held whole by all of them). A rank contributes its
    shards' squared sum times the number of distinct shards over ranks_per_stage, so that the
    sum over all ranks counts every element once. Likewise the last stage's ranks contribute
    their replica's loss over dp x tp (tp ranks compute the same loss). One collective per step
    instead of one for each: it is on the critical path.
    """
    shares = [local_part(p.grad).float().pow(2).sum() * _distinct_shards(p.grad) for part in parts
              for p in part.parameters()]
    own_loss = loss.to(torch.float32) if loss is not None else torch.zeros((), device=env.device)
    scalars = torch.stack([own_loss, torch.stack(shares).sum()]) / ranks_per_stage
    if votes is not None:
        scalars = torch.cat([scalars, votes.cast().to(scalars.device, torch.float32)])
    if env.world_size > 1:
        dist.all_reduce(scalars)
    mean_loss, squared_norm, *vote_sums = scalars.tolist()
    raise_if_failed(env.world, "the step's all-reduce")  # else a lost peer's partial sums would be used
    if votes is not None:
        votes.sums = torch.tensor(vote_sums)
    return mean_loss, squared_norm ** 0.5


def _distinct_shards(tensor: torch.Tensor) -> int:
    # Every placement but Replicate splits (FSDP over tensor parallel shows as _StridedShard,
    # which is_shard() does not count); gradients are never Partial here.
    if not isinstance(tensor, DTensor):
        return 1
    return math.prod(tensor.device_mesh.size(dim) for dim, placement in enumerate(tensor.placements)
                     if not placement.is_replicate())


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def train(cfg: JobConfig, env: DistributedEnv, progress: Progress | None = None,
          index: dict | None = None) -> list[dict]:
    """Build, train cfg.training.steps steps, return each step's metrics (a step redone after a
    repair in place twice); `progress` hears of every phase, microbatch and step
    (trainer/progress.py); `index`: the shard set's, read already."""
    progress = progress or Progress(None)
    run = build(cfg, env, index, initialised=False)  # filled only if no restore does (_train_generation)
    run.pipeline.report_work(progress.beat)
    progress.beat()
    history: list[dict] = []
    while True:
        watcher = repair.OrderWatcher(Path(cfg.parallel.repair_file), run.env.generation) \
            if cfg.parallel.repair_file else None
        try:
            _train_generation(run, progress, history)
            break
        except (NonFiniteLossError, repair.RepairError, StepsDisagree):
            raise  # no repair in place can help: the process ends, and the control plane restarts the world
        except Exception as exc:
            if watcher is None:
                raise
            failure = exc
        finally:
            if watcher:
                watcher.stop()
        _repair(run, failure, progress)
    _report_peak_memory(run)
    return history


def _train_generation(run: Run, progress: Progress, history: list[dict]) -> None:
    """Restore, then train to the last step, with this world of processes; if it fails and the
    world is to be repaired, what it started (the copies and saves in flight) is abandoned."""
    cfg = run.config
    checkpointer = _checkpointer(cfg) if cfg.checkpoint.uri else None
    memory = _memory_checkpoints(cfg, run.env) if checkpointer and cfg.checkpoint.memory_interval else None
    try:
        loaded = False
        if checkpointer:
            with progress.alive_during():
                loaded = restore(run, checkpointer, memory)
        if not loaded and run.env.generation == 0:  # a repaired world restores, or raises
            run.pipeline.initialise(cfg.training.seed, cfg.model.n_layers)
        progress.reached(run.state.step)  # this node joined the world
        if run.state.step >= cfg.training.steps:
            run.log_nothing_left()
        scaling = _scaling_check(run)
        while run.state.step < cfg.training.steps:
            votes = StepVotes(lambda: torch.cat([checkpointer.vote(), *([memory.vote()] if memory else [])])
                              ) if checkpointer else None
            metrics = train_step(run, votes)
            run.log(metrics)
            history.append(metrics)
            progress.reached(run.state.step)
            if checkpointer:
                # The last step is always saved, so a finished run's final state is stored.
                with progress.alive_during():
                    checkpointer.maybe_save(run.state.step, run.state, final=run.state.step == cfg.training.steps,
                                            agreed=votes.sums[:2])
            if memory:
                memory.maybe_copy(run.state.step, run.state, agreed=votes.sums[2:])
            if scaling and scaling.observe(metrics):
                run.pipeline.attach(None)
                scaling = None
        if checkpointer:
            with progress.alive_during():
                checkpointer.close()
                if memory:
                    memory.close()
    except BaseException:
        run.pipeline.attach(None)
        if cfg.parallel.repair_file:  # the world will be repaired (else the process ends, its threads' work with it)
            for owner in (memory, checkpointer):
                if owner:
                    owner.abandon()
        raise


def _repair(run: Run, failure: Exception, progress: Progress) -> None:
    """Leave the failed world, wait for the node agent's order and form the next one with the same
    model (trainer/repair.py); the next generation resumes from host memory, S3's newest
    commit where the memory lacks a shard."""
    cfg, env = run.config, run.env
    path, timeout = Path(cfg.parallel.repair_file), timedelta(seconds=cfg.parallel.timeout_s)
    started = time.perf_counter()
    run.pipeline.unstage()
    repair.abandon_step(run.pipeline.model_parts, env.mesh, failure)
    left = time.perf_counter()
    repair_order.say_failed(path, env.generation, f"{type(failure).__name__}: {failure}")
    order = repair.await_order(path, env.generation, timedelta(seconds=cfg.parallel.repair_wait_s), progress.beat,
                               failure)
    ordered = time.perf_counter()
    repair.join_order(order, env.rank, _ranks_per_node(), _backend(env.device), timeout, **_group_options(env.device))
    fresh = environment(cfg, env.device)
    repair.rebind(env.mesh, fresh.mesh, run.pipeline.model_parts)
    if cfg.parallel.pp > 1:
        run.pipeline.restage(cfg.parallel.schedule, env.device, env.mesh.get_group("pp"))
    run.env = replace(fresh, mesh=env.mesh, generation=order.generation)
    run.config = replace(cfg, checkpoint=replace(cfg.checkpoint, resume="latest", memory_resume=True))
    log.warning("world repaired: generation %d in %.2f s (leaving the failed one %.2f s, waiting for the order "
                "%.2f s, forming the new one %.2f s)", order.generation, time.perf_counter() - started,
                left - started, ordered - left, time.perf_counter() - ordered)


def _scaling_check(run: Run) -> ScalingCheck | None:
    """The attempt's scaling check, its clock attached, when it is on, the world has more than one
    rank and enough steps are left to time (trainer/scaling_check.py)."""
    cfg = run.config
    check = cfg.scaling_check
    left = cfg.training.steps - run.state.step
    if not check.enabled or run.env.world_size == 1 or left < check.warmup_steps + check.steps:
        return None
    clock = ComputeClock(run.env.device)
    run.pipeline.attach(clock)
    return ScalingCheck(cfg, clock, run.pipeline.stage_ids)


def restore(run: Run, checkpointer: Checkpointer, memory: MemoryCheckpoints | None) -> bool:
    """Resume the state from host memory when the launch asks for it and every shard has a copy
    newer than S3's newest commit, else from S3 as `checkpoint.resume` says; rank 0 writes where
    it came from to `checkpoint.result_file`. The world then agrees on the step (StepsDisagree);
    a repaired world that found nothing to restore raises RepairError. Whether a state was loaded."""
    cfg, state = run.config.checkpoint, run.state
    started = time.perf_counter()
    restored, resumed, fallback = None, None, None
    if memory and cfg.memory_resume:
        found = memory.newest_whole()
        newer = checkpointer.adopt(found.step) if found else []
        if found is None:
            fallback = memory.unavailable
        elif newer:  # S3 holds a newer state than any whole in-memory copy: resume from it
            fallback = f"S3 holds step {newer[0]}, newer than every in-memory copy"
        else:
            restored = memory.restore(state, found)
    resumed = None
    if restored is None:
        resumed = checkpointer.resume(state)
    if memory:  # copies of another timeline than the one resumed must never be loaded
        memory.forget_after(restored.step if restored else None)
    if run.env.generation and restored is None and resumed is None:
        # The survivors would keep their step and weights, the replacement start from step 0.
        raise repair.RepairError(f"the repaired world (generation {run.env.generation}) has nothing to restore: "
                                 f"{fallback or 'no in-memory copy was asked for'}, and S3 holds no commit; it "
                                 "cannot train on, and the world restarts")
    _agree_on_step(run)
    if run.env.rank == 0 and cfg.result_file:
        source = "memory" if restored else "s3" if resumed is not None else "none"
        result = {"step": state.step, "source": source, "seconds": time.perf_counter() - started,
                  "shards": run.env.world_size, "fallback": fallback}
        if restored:
            result |= {"own_memory": restored.own_memory, "peers": restored.peers, "peer_bytes": restored.peer_bytes}
        Path(cfg.result_file).write_text(json.dumps(result))
    return restored is not None or resumed is not None


def _agree_on_step(run: Run) -> None:
    """StepsDisagree unless every rank holds the same step (the highest and the lowest, from one
    all-reduce)."""
    if run.env.world_size == 1:
        return
    extremes = torch.tensor([run.state.step, -run.state.step], device=run.env.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    highest, negated_lowest = extremes.tolist()
    lowest = -negated_lowest
    raise_if_failed(run.env.world, "the restored step's all-reduce")
    if highest != lowest:
        raise StepsDisagree(f"after the restore the world's ranks hold steps {lowest} to {highest} (this rank "
                            f"{run.state.step}): they would train different batches; the world restarts")


def _memory_checkpoints(cfg: JobConfig, env: DistributedEnv) -> MemoryCheckpoints:
    p = cfg.parallel
    model = checkpoint_catalog.config_hash(asdict(cfg.model))[:12]
    key = f"w{env.world_size}-pp{p.pp}-dp{p.dp}x{p.resolved_dp_shard()}-tp{p.tp}-{model}"
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    return MemoryCheckpoints(cfg.checkpoint, key=key, timeout=timedelta(seconds=cfg.checkpoint.timeout_s),
                             ranks_per_node=ranks_per_node,
                             node_rank=int(os.environ.get(NODE_RANK_ENV, env.rank // ranks_per_node)))


def _checkpointer(cfg: JobConfig) -> Checkpointer:
    p = cfg.parallel
    return Checkpointer(cfg.checkpoint, layout={"pp": p.pp, "dp": p.dp, "dp_shard": p.resolved_dp_shard(), "tp": p.tp},
                        config_hash=checkpoint_catalog.config_hash(asdict(cfg)), model=asdict(cfg.model),
                        tokenizer=cfg.data.tokenizer, init_from=cfg.training.init_from,
                        request_file=os.environ.get(checkpoint_catalog.REQUEST_FILE_ENV),
                        timeout=timedelta(seconds=cfg.checkpoint.timeout_s))


def _report_peak_memory(run: Run) -> None:
    peak = peak_memory_mib(run.env.device)
    peaks = [peak]
    if run.env.world_size > 1:
        peaks = [None] * run.env.world_size
        dist.all_gather_object(peaks, peak)
        raise_if_failed(run.env.world, "the peak memory's gather")
    if run.env.rank == 0:
        print("peak memory per rank (MiB): " + ", ".join(f"{r}: {m:.0f}" for r, m in enumerate(peaks)), flush=True)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        check_world_size(cfg, _world_size(_standing_order(cfg)))
        schedule_class(cfg.parallel.schedule)  # a schedule this torch lacks is a config error too
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    try:
        # Before the world forms and anything is allocated: a missing shard set, a model smaller than
        # the shards' vocabulary or another tokenizer than theirs would fail deep in the first step.
        index = checked_index(cfg.data, cfg.model.vocab_size)
    except (ShardSetError, TokenizerError) as exc:
        print(f"data error: {exc}", file=sys.stderr)
        return 2
    progress = Progress.of_this_process()
    progress.beat()  # the trainer is up (its imports took seconds); the world forms next
    with distributed(cfg) as env:
        progress.beat()  # the world formed
        # A replacement joining a repaired world does not check it: the others are training.
        if cfg.fleet_check.enabled and env.world_size > 1 and env.generation == 0:
            fleet_check.gate(cfg.fleet_check, env.device, progress.beat)
            progress.beat()
        train(cfg, env, progress, index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
