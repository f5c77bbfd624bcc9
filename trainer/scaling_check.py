"""The scaling check: does the whole world train as fast as its ranks compute?

The fleet check (trainer/fleet_check.py) measures the network before the first step; this one
times the real model training on the whole fleet, before the fleet is committed for weeks. The
control plane turns it on for a run's worlds until one has passed (RunSpec.scaling_check). After
`warmup_steps` untimed steps, every rank times `steps` steps twice over:

- the step, as the training loop does (wall clock; the same on every rank, since a step ends in
  collectives);
- its own compute: the forward, backward and weight-gradient calls of its pipeline stages, each
  kind apart (`ComputeClock`; CUDA events on a GPU). The schedule waits for a microbatch's
  activations or gradients before it calls them, so the pipeline's hand-offs and bubble are not
  in it; collectives inside a stage (FSDP's gathers, tensor parallel) are, as that stage's own
  work;
- the end of its step: from the end of its last compute to the end of its last optimizer step
  (an optimizer hook), what follows the schedule: the stage's gradient reduction, the gradient
  norm's all-reduce, clipping, the optimizer step (trainer/train.py).

What one rank computes is what it would achieve alone. Ranks that hold the same stages (data and
tensor parallel peers) do the same work, so a stage needs what the fastest rank holding it
computes; the slowest stage sets the pace of the pipeline, stretched by its fill and drain: the
schedule's bubble from one microbatch's forward, backward and weight-gradient time on that stage
(trainer/schedules.py's bubble_seconds, the same that the planner's step-time model uses,
trainfleet/core/step_time.py). The end of the step follows, as the rank that reaches its
all-reduce last measures it (it waits on no one: the least of the ranks' figures). The
efficiency is that expected step over the measured one.

Below `efficiency_floor` the world does not train on, and the result says why:
- a rank computes far longer than the others that hold its stages (`slow_rank_factor` times the
  median of theirs: a throttled GPU, a sick node): its peers wait on it every step. Its node is
  named (`slow_nodes`) and replaced (spares first) as the fleet check's slow nodes are, and the
  new world is checked again;
- otherwise the world is uniformly poor, waiting on hand-offs (a slow fabric, a layout whose
  hand-offs cost more than its compute): the result names the slowest stage with its nodes, and
  the slowest rank, and the run stops (the control plane gives up on POOR_SCALING naming no node).
A world that passed trains on without the clocks.

Global rank 0 writes the result to `result_file`; its node's agent reports it (ScalingChecked,
node/attempt.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from trainer.config import JobConfig, ScalingCheckConfig
from trainer.progress import NODE_NAME_ENV, write_whole
from trainer.schedules import bubble_seconds
from trainer.world_failure import current_world, raise_if_failed

__all__ = ["ComputeClock", "Pipeline", "RankTiming", "ScalingCheckResult", "slow_ranks", "verdict", "ScalingCheck"]

KINDS = ("forward", "backward", "weight")
"""What a stage computes: a microbatch's forward, its backward for the inputs' gradients (the whole
backward where the schedule does not split it) and for the weights' gradients."""


Instant = float | torch.cuda.Event
"""A point in time: the wall clock's on CPU, an event of the GPU's own clock on a GPU."""


class ComputeClock:
    """Adds up the time this rank spends in `timed(kind)` blocks, by kind, until the next `take()`,
    and times the end of the step: from the end of the last block to `end_step()`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.compute_ended: Instant | None = None
        self.step_ended: Instant | None = None

    def _now(self) -> Instant:
        if self.device.type != "cuda":
            return time.perf_counter()
        # Kernels run after the call returns: the GPU's own clock times them.
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        started = self._now()
        yield
        self.compute_ended = self._now()
        if isinstance(started, float):
            self.seconds[kind] += self.compute_ended - started
        else:
            self.events.append((kind, started, self.compute_ended))

    def end_step(self) -> None:
        """The step's last work was issued (its last optimizer step)."""
        self.step_ended = self._now()

    def take(self) -> tuple[dict[str, float], float]:
        """The compute timed since the last take, by kind, and the end of the last step (0 when unseen)."""
        for kind, start, end in self.events:
            end.synchronize()
            self.seconds[kind] += start.elapsed_time(end) / 1000
        finish = 0.0
        if self.compute_ended is not None and self.step_ended is not None:
            if isinstance(self.step_ended, float):
                finish = self.step_ended - self.compute_ended
            else:
                self.step_ended.synchronize()
                finish = self.compute_ended.elapsed_time(self.step_ended) / 1000
        taken, self.seconds, self.events = self.seconds, dict.fromkeys(KINDS, 0.0), []
        self.compute_ended = self.step_ended = None
        return taken, max(0.0, finish)


@dataclass(frozen=True)
class RankTiming:
    """One rank's medians over the timed steps."""

    rank: int
    node: str
    stages: tuple[int, ...]
    forward_seconds: float
    backward_seconds: float
    weight_seconds: float
    finish_seconds: float
    """The end of its step, after the schedule (waits on slower ranks included)."""
    step_seconds: float

    @property
    def compute_seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds + self.weight_seconds


@dataclass(frozen=True)
class ScalingCheckResult:
    passed: bool
    efficiency: float
    efficiency_floor: float
    step_seconds: float
    """The measured step (median)."""
    expected_step_seconds: float
    """What the slowest stage's compute predicts, bubble and the end of the step included."""
    finish_seconds: float
    """The end of the step in it: the least of the ranks' (the last to reach it waits on no one)."""
    tokens_per_second: float
    expected_tokens_per_second: float
    steps: int
    """Steps timed."""
    slowest_stages: list[int]
    slowest_stage_seconds: float
    """Their compute a step on the fastest rank holding them."""
    slowest_stage_nodes: list[str]
    slowest_rank: int
    slowest_rank_node: str
    slowest_rank_seconds: float
    slow_nodes: list[str]
    """The nodes of ranks far slower than their peers, to replace; empty when the world passed or
    is uniformly poor."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def describe(self) -> str:
        return (f"efficiency {self.efficiency:.2f} (floor {self.efficiency_floor:.2f}): {self.step_seconds:.3f} s a "
                f"step, {self.expected_step_seconds:.3f} s expected; {self.tokens_per_second:,.0f} tokens/s, "
                f"{self.expected_tokens_per_second:,.0f} expected; slowest stage "
                f"{', '.join(map(str, self.slowest_stages))} ({self.slowest_stage_seconds:.3f} s on "
                f"{', '.join(self.slowest_stage_nodes)}); slowest rank {self.slowest_rank} "
                f"({self.slowest_rank_seconds:.3f} s on {self.slowest_rank_node})"
                + (f"; slow: {', '.join(self.slow_nodes)}" if self.slow_nodes else ""))


class Pipeline(NamedTuple):
    """The pipeline a world runs: its schedule over pp ranks, microbatches a step, stages a rank."""

    schedule: str
    pp: int
    microbatches: int
    stages_per_rank: int

    def bubble(self, timing: RankTiming) -> float:
        """The fill and drain of a step whose slowest stage computes as `timing` (its rank's
        totals over a step, spread over microbatches x stages)."""
        chunks = self.microbatches * self.stages_per_rank
        return bubble_seconds(self.schedule, self.pp, self.stages_per_rank, self.microbatches,
                              timing.forward_seconds / chunks, timing.backward_seconds / chunks,
                              timing.weight_seconds / chunks)


def _by_stages(timings: list[RankTiming]) -> dict[tuple[int, ...], list[RankTiming]]:
    peers: dict[tuple[int, ...], list[RankTiming]] = {}
    for timing in timings:
        peers.setdefault(timing.stages, []).append(timing)
    return peers


def slow_ranks(timings: list[RankTiming], factor: float) -> list[RankTiming]:
    """The ranks whose compute is over `factor` times the median of the other ranks holding the
    same stages (a rank with no such peer has none to be compared with)."""
    slow = []
    for group in _by_stages(timings).values():
        for timing in group:
            others = [peer.compute_seconds for peer in group if peer is not timing]
            if others and timing.compute_seconds > factor * statistics.median(others):
                slow.append(timing)
    return sorted(slow, key=lambda t: t.rank)


def verdict(timings: list[RankTiming], pipeline: Pipeline, floor: float, slow_rank_factor: float,
            tokens_per_step: int, steps: int) -> ScalingCheckResult:
    """Pass or fail, the nodes to replace, and the slowest stage and rank (see the module docstring)."""
    peers = _by_stages(timings)
    fastest = {stages: min(group, key=lambda t: t.compute_seconds) for stages, group in peers.items()}
    needs = {stages: t.compute_seconds for stages, t in fastest.items()}
    slowest_stages = max(needs, key=needs.__getitem__)
    step = statistics.median(t.step_seconds for t in timings)
    finish = min(t.finish_seconds for t in timings)
    expected = needs[slowest_stages] + pipeline.bubble(fastest[slowest_stages]) + finish
    efficiency = expected / step if step > 0 else 1.0
    passed = efficiency >= floor
    slowest_rank = max(timings, key=lambda t: t.compute_seconds)
    slow_nodes = [] if passed else sorted({t.node for t in slow_ranks(timings, slow_rank_factor)})
    return ScalingCheckResult(
        passed=passed, efficiency=efficiency, efficiency_floor=floor, step_seconds=step,
        expected_step_seconds=expected, finish_seconds=finish,
        tokens_per_second=tokens_per_step / step if step > 0 else 0.0,
        expected_tokens_per_second=tokens_per_step / expected if expected > 0 else 0.0, steps=steps,
        slowest_stages=list(slowest_stages), slowest_stage_seconds=needs[slowest_stages],
        slowest_stage_nodes=sorted({t.node for t in peers[slowest_stages]}), slowest_rank=slowest_rank.rank,
        slowest_rank_node=slowest_rank.node, slowest_rank_seconds=slowest_rank.compute_seconds,
        slow_nodes=slow_nodes)


@dataclass
class ScalingCheck:
    """Follows an attempt's first steps (`observe` after each) and judges them."""

    config: JobConfig
    clock: ComputeClock
    """Times the forward and backward compute of this rank's stages (attached to its pipeline)."""
    stages: list[int]
    observed: int = 0
    compute: list[dict[str, float]] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    step: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # After every optimizer step of this process (one per model part): the last ends the step.
        self._step_hook = register_optimizer_step_post_hook(lambda *_: self.clock.end_step())

    @property
    def check(self) -> ScalingCheckConfig:
        return self.config.scaling_check

    def observe(self, metrics: dict) -> bool:
        """After each step: True once the check is done and passed (a world that failed waits
        here to be stopped)."""
        compute, finish = self.clock.take()
        if self.observed >= self.check.warmup_steps:
            self.compute.append(compute)
            self.finish.append(finish)
            self.step.append(metrics["step_time_s"])
        self.observed += 1
        if len(self.step) < self.check.steps:
            return False
        self._step_hook.remove()
        self.gate()
        return True

    def gate(self) -> None:
        """Gather every rank's timings, judge on rank 0, act alike on every rank."""
        rank = dist.get_rank()
        compute = {kind: statistics.median(step[kind] for step in self.compute) for kind in KINDS}
        mine = RankTiming(rank, os.environ.get(NODE_NAME_ENV) or socket.gethostname(), tuple(self.stages),
                          compute["forward"], compute["backward"], compute["weight"], statistics.median(self.finish),
                          statistics.median(self.step))
        timings: list[RankTiming | None] = [None] * dist.get_world_size()
        dist.all_gather_object(timings, mine)
        raise_if_failed(current_world(), "the scaling check's gather")
        p, c = self.config.parallel, self.config
        judged = [verdict(timings, Pipeline(p.schedule, p.pp, p.microbatches, p.resolved_stages_per_rank()),
                          self.check.efficiency_floor, self.check.slow_rank_factor,
                          c.training.batch_size * c.model.seq_len, len(self.step))]
        dist.broadcast_object_list(judged, src=0)  # rank 0's verdict, so every rank acts alike
        raise_if_failed(current_world(), "the scaling check's verdict")
        result = judged[0]
        if rank == 0:
            if self.check.result_file:
                write_whole(Path(self.check.result_file), result.to_json())
            print(f"scaling check {'passed' if result.passed else 'FAILED'}: {result.describe()}", flush=True)
        if not result.passed:
            threading.Event().wait()  # until torchrun stops the world: the control plane replaces or gives up
