"""Pipeline parallelism: this rank's stages of the model and the schedule that drives them.

Each rank builds only its own stages (a contiguous layer range each; the embedding on stage 0,
norm + head + loss on the last) straight from the config, parallelizes each
(trainer/parallelize.py: tensor parallel, FSDP2, activation checkpointing), and hands them to a
torch.distributed.pipelining schedule chosen by name. With pp=1 the same interface runs the
microbatches one after another, which in one process is the reference every layout must match.
"""

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor

from trainer.config import JobConfig, ModelConfig
from trainer.model import build, cross_entropy_loss
from trainer.parallel_dims import SCHEDULES, layer_ranges, schedule_class, split_layers, stage_ids
from trainer.parallelize import allocate, initialise, loss_context, parallelize, tensor_parallel
from trainer.scaling_check import ComputeClock

__all__ = ["Pipeline", "build_pipeline", "v_schedule_problem"]


@dataclass
class Pipeline:
    """This rank's model parts and how to run forward + backward over one batch."""

    model_parts: list[nn.Module]
    """The stages this rank holds, in stage order (the whole model when pp=1)."""
    stage_ids: list[int]
    """Global index of each part's stage."""
    n_stages: int
    """Stages in the whole pipeline."""
    microbatches: int
    """Microbatches per step."""
    schedule: PipelineScheduleSingle | PipelineScheduleMulti | None
    """The torch.distributed.pipelining schedule; None when pp=1."""
    loss_context: Callable[[], contextlib.AbstractContextManager]
    """What the loss and its backward run under (loss_parallel with tensor parallel)."""
    stages: list["_TimedStage"] = field(default_factory=list)
    """The schedule's stages of this rank (none when pp=1)."""
    clock: ComputeClock | None = None
    """Times this rank's compute while attached (the scaling check)."""
    on_work: Callable[[], None] | None = None
    """Called after each microbatch's forward or backward on this rank (its progress file's
    signs of life: trainer/progress.py)."""

    def attach(self, clock: ComputeClock | None) -> None:
        """Time this rank's forward and backward compute on `clock` from now on (None: stop)."""
        self.clock = clock
        for stage in self.stages:
            stage.clock = clock

    def restage(self, schedule: str, device: torch.device, pp_group: dist.ProcessGroup) -> None:
        """New stages around this rank's model parts, talking over `pp_group`, and a new schedule
        named `schedule` over them: the pipeline's start, and its restart in a repaired world,
        where every stage must infer its neighbours' shapes again with the replacement's."""
        self.stages = [_TimedStage(part, s, self.n_stages, device, group=pp_group)
                       for part, s in zip(self.model_parts, self.stage_ids)]
        driven = self.stages[0] if SCHEDULES[schedule].placement == "single" else self.stages
        self.schedule = schedule_class(schedule)(driven, self.microbatches, loss_fn=cross_entropy_loss)
        self.attach(self.clock)
        if self.on_work:
            self.report_work(self.on_work)

    def initialise(self, seed: int, n_layers: int) -> None:
        """Fill this rank's parameters with the model's initial values (trainer/parallelize.py)."""
        for part in self.model_parts:
            initialise(part, seed, n_layers)

    def unstage(self) -> None:
        """Drop the stages and the schedule (a failed world's: they hold its pipeline group)."""
        self.stages, self.schedule = [], None

    def report_work(self, on_work: Callable[[], None]) -> None:
        """Call `on_work` after each microbatch's forward or backward from now on."""
        self.on_work = on_work
        for stage in self.stages:
            stage.on_work = on_work

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Accumulate gradients of the mean loss over the batch; return that loss where this rank computes it.

        Gradients come out as those of the batch mean: each microbatch's mean loss contributes 1/m.
        """
        with self.loss_context():
            if self.schedule is None:
                # One stage: no bubble, so its compute need not be told apart by kind.
                with self.clock.timed("forward") if self.clock else contextlib.nullcontext():
                    return self._accumulate_locally(inputs, targets)
            losses: list[torch.Tensor] = []
            # A stage checks each microbatch against the strides it inferred (torch 2.11 does): the
            # loader's inputs are a view of its windows, one token wider than a row.
            args = (inputs.contiguous(),) if self.has_first_stage else ()
            if self.has_last_stage:
                self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
                return _plain(torch.stack(losses).mean().detach())
            self.schedule.step(*args, return_outputs=False)
            return None

    def _accumulate_locally(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        (model,) = self.model_parts
        losses = []
        for i, (x, y) in enumerate(zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches))):
            if isinstance(model, FSDPModule):
                # Each microbatch's gradients are reduce-scattered as its backward makes them (FSDP2's
                # default): kept unsharded until the last one, every unit's would stay on the GPU in
                # fp32, 4 bytes a parameter. Only the all-reduce across dp_replicate waits for the
                # last microbatch (a sharded partial sum is kept meanwhile).
                model.set_requires_all_reduce(i == self.microbatches - 1)
            loss = cross_entropy_loss(model(x), y)
            (loss / self.microbatches).backward()
            losses.append(loss.detach())
            if self.on_work:
                self.on_work()
        return _plain(torch.stack(losses).mean())


def _plain(loss: torch.Tensor) -> torch.Tensor:
    # Under loss_parallel the loss is a replicated DTensor; the step's bookkeeping wants a tensor.
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class _TimedStage(PipelineStage):
    """A PipelineStage whose forward, backward and weight-gradient compute is timed, each kind
    apart, on `clock` when one is attached, and reported to `on_work` when set. The schedule waits
    for a microbatch's data before it calls these, so what is timed is this rank's own work."""

    clock: ComputeClock | None = None
    on_work: Callable[[], None] | None = None

    @contextlib.contextmanager
    def _timed(self, kind: str):
        with self.clock.timed(kind) if self.clock else contextlib.nullcontext():
            yield
        if self.on_work:
            self.on_work()

    def forward_one_chunk(self, *args, **kwargs):
        with self._timed("forward"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self._timed("backward"):
            return super().backward_one_chunk(*args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        with self._timed("weight"):
            return super().backward_weight_one_chunk(*args, **kwargs)


def _layers_per_stage(cfg: ModelConfig, n_stages: int, override: list[int]) -> list[int]:
    if override:
        return override
    with torch.device("meta"):
        block_params, embed_params, head_params = (
            sum(p.numel() for p in build(cfg, layers, first=first, last=last).parameters())
            for layers, first, last in ((range(1), False, False), (range(0), True, False), (range(0), False, True)))
    return split_layers(block_params, cfg.n_layers, embed_params, head_params, n_stages)


def _build_part(cfg: JobConfig, layers: range, first: bool, last: bool, device: torch.device,
                mesh: DeviceMesh | None) -> nn.Module:
    # Built on the meta device and split before it is allocated, so no rank ever allocates
    # layers it does not own, nor more of a matrix than its tensor-parallel and FSDP shard.
    with torch.device("meta"):
        part = build(cfg.model, layers, first=first, last=last)
    if cfg.parallel.tp > 1:
        tensor_parallel(part, mesh["tp"])
    parallelize(part, cfg, mesh, device)
    allocate(part, device)
    return part


SELF_SEND_FREE_TORCH = (2, 13)
"""The first torch whose runtime schedules hand activations between a rank's own two stages of a V
without a send to itself. Before it they send to self, which gloo refuses ("Pair is not
connected"); NCCL allows it."""


def v_schedule_problem(torch_version: str, backend: str, placement: str, schedule: str) -> str | None:
    """Why this torch cannot run a V schedule on this backend, else None."""
    release = tuple(int(part) for part in re.findall(r"\d+", torch_version)[:2])
    if placement == "v" and backend == "gloo" and release < SELF_SEND_FREE_TORCH:
        return (f"parallel.schedule={schedule!r} on gloo needs torch {'.'.join(map(str, SELF_SEND_FREE_TORCH))} or "
                f"later (torch {torch_version} sends between a rank's own stages, which gloo cannot); "
                f"choose a schedule of one stage per rank, or a newer torch")
    return None


def build_pipeline(cfg: JobConfig, device: torch.device, pp_rank: int = 0, mesh: DeviceMesh | None = None,
                   initialised: bool = True) -> Pipeline:
    """This rank's stages and schedule for cfg.parallel (the whole model, unscheduled, when pp=1),
    its parameters filled with their initial values unless not `initialised` (a restore follows:
    Pipeline.initialise if none did).

    `mesh` is the (pp, dp_replicate, dp_shard, tp) device mesh; None in a process of its own.
    """
    pipeline = _build(cfg, device, pp_rank, mesh)
    if initialised:
        pipeline.initialise(cfg.training.seed, cfg.model.n_layers)
    return pipeline


def _build(cfg: JobConfig, device: torch.device, pp_rank: int, mesh: DeviceMesh | None) -> Pipeline:
    p = cfg.parallel
    if p.pp == 1:
        model = _build_part(cfg, range(cfg.model.n_layers), True, True, device, mesh)
        return Pipeline([model], [0], 1, p.microbatches, schedule=None, loss_context=partial(loss_context, cfg))

    spec = SCHEDULES[p.schedule]
    pp_group = mesh.get_group("pp")
    problem = v_schedule_problem(torch.__version__, dist.get_backend(pp_group), spec.placement, p.schedule)
    if problem:
        raise ValueError(problem)
    n_stages = p.n_stages()
    ranges = layer_ranges(_layers_per_stage(cfg.model, n_stages, p.layers_per_stage))
    ids = stage_ids(pp_rank, p.pp, p.resolved_stages_per_rank(), spec.placement)
    parts = [_build_part(cfg, ranges[s], s == 0, s == n_stages - 1, device, mesh) for s in ids]
    pipeline = Pipeline(parts, ids, n_stages, p.microbatches, None, loss_context=partial(loss_context, cfg))
    pipeline.restage(p.schedule, device, pp_group)
    return pipeline
