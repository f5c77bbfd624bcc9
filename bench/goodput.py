"""Goodput over a month at fleet scale: a discrete-event simulation on simulated time that drives
the real lifecycle decisions.

    .venv/bin/python bench/goodput.py                       # 30 days, 2,048 p5 nodes, Llama 3 failures
    .venv/bin/python bench/goodput.py --nodes 512 --days 7 --interval-min 5 --seeds 1

Nothing here decides what the control plane does. Each failure becomes the event the control
plane would receive (the agent's NodeUnhealthy or TrainerFailed, EC2's status, an AWS Health
event, the Train task's heartbeat timeout) and goes through the real code over plain records
(RunRecord, NodeRecord, FailureReport of trainfleet/core/records.py): classify_event /
classify_task_error, blame_silent_workers (a crash that names no node, with EC2's status checks),
decide_recovery (restart budget, crash loop, backoff, READY spares promoted, replacements and
refills), apply_decision, new_node_records, and the goodput ledger (settle_run_attempt,
unaccounted_seconds). The simulator supplies only time: when failures strike, how long a boot,
a preflight, the agents' looks (trainfleet.core.pace), a rendezvous and a checkpoint take.

An attempt, from the recovery decision at d (as the state machine runs it):
  Recover terminates the blamed nodes, promotes READY spares and launches what is missing at d
  (replacement workers and spare refills together); RecoveryBackoff waits the decision's backoff;
  AwaitNodes answers once every worker confirmed the attempt: a node that was already up confirms
  at its next look at the run record, at the full rate once its trainer stalled (the failure
  stopped the world's steps; trainfleet.core.pace.stalled), a new instance once booted and through
  preflight. Train writes the launch spec, which the agents read at their next
  look (between attempts: at the full rate, pace.poll_interval); then rendezvous and, after a failure,
  the checkpoint load; then the first step. So a READY spare saves the boot and preflight that a
  new instance costs, and nothing else: refills boot in the background. Checkpoints start every
  interval from the first step (async: training blocks for the stall, and waits for the upload
  before the next save when the interval is shorter than the save) and count from their commit,
  a save later. A failure is known `detect_s` after it strikes (a hang: once the agents find the
  world silent past its cadence, trainfleet.core.pace.hung_after, or the hang timeout if sooner),
  Recover decides `control_plane_s` later; training since the last commit is redone.

Failures: a Poisson process per cause, at the rate of the Llama 3 405B report's table of
unexpected interruptions (Llama Team, AI @ Meta, "The Llama 3 Herd of Models", 2024,
arXiv:2407.21783, section 3.3.4, Table 5: 419 interruptions in 54 days on 16,384 H100 GPUs),
scaled by the fleet's GPUs. They strike workers (idle spares are left out: the table counts
interruptions of the training job). How each cause reaches trainfleet is the CAUSES table below.
GPU faults are reported by the failing node's own check (NodeUnhealthy, the class the design
gives them); the agent does not watch for GPU errors while training today (docs/ARCHITECTURE.md,
"Not done"), and what that costs is printed too: such a fault then crashes the trainer, no node
is named, every restart on the same nodes crashes again, and the crash-loop rule gives up.

ETTR is productive training time over wall-clock time, productive as the ledger books it (the
month's end counts as a commit) less the training blocked by checkpoint saves. The last two lines
are `ettr_s3_30min=<with 2% spares, a checkpoint to S3 every 30 minutes>` and `ettr=<with 2% spares>`,
both with the in-memory checkpoints (every step; trainer/memory_checkpoint.py) that Recover
resumes from unless a lost node's buddy was lost with it; the columns "S3 only" are the path
before them.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from enum import Enum
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # this folder would shadow the packages it drives
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainfleet.core.catalogue import instance_facts  # noqa: E402
from trainfleet.core.events import HealthEvent, NodeUnhealthy, TrainerFailed
from trainfleet.core.lifecycle import (apply_decision, blame_silent_workers, classify_event, classify_task_error,
                                       decide_recovery, initial_plan, new_node_records, settle_run_attempt)
from trainfleet.core.lifecycle.goodput import STARTUP, give_up_cause, unaccounted_seconds  # noqa: E402
from trainfleet.core.pace import (CADENCE_STEPS_KNOWN, FULL_RATE_NODES, LAUNCH_SPEC_POLL_S, hung_after,  # noqa: E402
                                  longest_look, stall_after)
from trainfleet.core.records import (CheckpointRef, FailureReport, NodeRecord, NodeRole, NodeState, RecoveryAction,
                                     RecoveryDecision, RunRecord, TaskWait, TrainerFailureKind)
from trainfleet.core.runspec import RecoveryPolicy, RunSpec

INSTANCE_TYPE = "p5.48xlarge"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
REPORT_DAYS = 54
REPORT_GPUS = 16_384


class Seen(Enum):
    """How a failure reaches the control plane: the event it sends, and whether it stays on the node."""

    NODE_CHECK = "the node's agent reports NodeUnhealthy"
    HOST_DOWN = "the trainer crashes; EC2's status check names the instance impaired"
    HEALTH = "an AWS Health event (issue) names the instance"
    CRASH = "the trainer crashes on healthy nodes"
    NAN = "the loss turns NaN"
    HANG = "the world hangs until its agents find it silent past its cadence (TrainerHung)"
    CRASH_STAYS = "the trainer crashes, no node is named, and the fault stays on the node"


@dataclass(frozen=True)
class Cause:
    name: str
    count: int
    """Interruptions in the Llama 3 report's 54 days on 16,384 GPUs."""
    seen: Seen


# Table 5 of the Llama 3 report, with how each cause would reach trainfleet on EC2.
CAUSES = (
    Cause("faulty GPU", 148, Seen.NODE_CHECK),
    Cause("GPU HBM3 memory", 72, Seen.NODE_CHECK),
    Cause("software bug", 54, Seen.CRASH),
    Cause("network switch/cable", 35, Seen.HANG),  # the collectives stall; no node stops answering
    Cause("host maintenance", 32, Seen.HEALTH),  # unplanned: no notice to checkpoint in
    Cause("GPU SRAM memory", 19, Seen.NODE_CHECK),
    Cause("GPU system processor", 17, Seen.NODE_CHECK),
    Cause("NIC", 7, Seen.HOST_DOWN),
    Cause("NCCL watchdog timeouts", 7, Seen.HANG),
    Cause("silent data corruption", 6, Seen.NAN),  # seen only where it spoils the loss
    Cause("GPU thermal interface + sensor", 6, Seen.NODE_CHECK),
    Cause("SSD", 3, Seen.HOST_DOWN),
    Cause("power supply", 3, Seen.HOST_DOWN),
    Cause("server chassis", 2, Seen.HOST_DOWN),
    Cause("IO expansion board", 2, Seen.HOST_DOWN),
    Cause("dependency", 2, Seen.CRASH),
    Cause("CPU", 2, Seen.HOST_DOWN),
    Cause("system memory", 2, Seen.HOST_DOWN),
)


NO_FAILURE = Cause("no failure", 0, Seen.CRASH)
"""What strikes after the month when nothing fails at all (its time is past the horizon)."""


def gpu_faults_unnamed(causes: tuple[Cause, ...]) -> tuple[Cause, ...]:
    """The causes as today's agent sees them: a GPU fault crashes the trainer and names no node."""
    return tuple(replace(cause, seen=Seen.CRASH_STAYS) if cause.seen is Seen.NODE_CHECK else cause
                 for cause in causes)


# Checkpoint figures: our measurements (bench/checkpoint.py, docs/ARCHITECTURE.md "Checkpoints")
# as ratios, applied to a real model's state at an assumed S3 throughput per node.
MODEL_PARAMETERS = 405e9
"""Llama 3 405B: the run whose failures these are, on the same 16,384 GPUs."""
STATE_BYTES_PER_PARAMETER = 12
"""fp32 parameters and AdamW's two moments, what the trainer's checkpoint holds (bench/checkpoint.py)."""
NODE_S3_BYTES_PER_S = 2.5e9
"""Raw S3 PUT and GET throughput of one p5 node: an assumption (20 Gbit/s of its ENA bandwidth),
not measured here."""
SAVE_VS_RAW_PUT = 0.47
"""Save throughput over raw PUTs of the same files (bench/checkpoint.py, 64 MiB parts)."""
LOAD_VS_RAW_GET = 0.23
"""Load throughput over raw GETs (bench/checkpoint.py; against moto, which reads a whole object
for each ranged GET: a pessimistic figure for S3)."""
STALL_VS_SYNC_SAVE = 0.0047
"""Training blocked by an async save over a sync save of the same state (bench/checkpoint.py),
measured for 252 MiB on one rank: a p5 rank holds about 300 MB of a 405B model's state."""
NODE_PEER_BYTES_PER_S = 5e9
"""A replaced node receiving its share of the state from its buddy's host memory, over gloo's TCP
on the instance's primary network interface: an assumption (half of 100 Gbit/s), not measured here."""
PROGRESS_EVERY_S = 10.0
"""How often node rank 0's agent reports steps (node/attempt.py PROGRESS_EVERY_S): an attempt
resumed from memory keeps its training up to the last report (lifecycle.settle_run_attempt)."""


@dataclass(frozen=True)
class Timings:
    """Seconds. Boot, preflight and rendezvous are assumptions for p5 at this scale: locally an
    instance is a process and a world two CPU nodes (a kill to the new attempt's first commit
    takes about 20 s there, docs/ARCHITECTURE.md "Demo"), which says nothing about them."""

    boot_s: float = 300.0
    """CreateFleet to the agent up: p5 launch, OS and driver start, the wheelhouse install."""
    preflight_s: float = 60.0
    """node.health on a p5: device and EFA checks, the one-rank NCCL probe."""
    rendezvous_s: float = 120.0
    """A world started anew: every node's trainer processes start (imports, CUDA contexts, the
    model built), torchrun's c10d rendezvous and NCCL communicators for 16,384 ranks."""
    trainer_start_s: float = 30.0
    """One node's trainer started on its own, up to joining a world: process start, imports, CUDA
    contexts, its part of the model built. In a repair it is the replacement's alone."""
    repair_s: float = 15.0
    """A world repaired in place (trainer/repair.py): the ranks leave the failed world, meet at the
    order's store and create their NCCL communicators again, in the processes they have. An
    assumption for 16,384 ranks: the measured 0.3-0.6 s of six CPU ranks says nothing of NCCL at
    that scale."""
    detect_s: float = 2.0
    """A failure with an event (EC2, Health, the agent's report) to Recover starting: EventBridge's
    half second and the agent's one-second wait for EC2's word on a lost peer."""
    control_plane_s: float = 5.0
    """Recover's Lambda and transitions (bench/recovery.py estimates a few seconds on AWS)."""
    step_s: float = 6.0
    """A training step: Llama 3 405B's 16M-token batch (405e9 x 6 x 16M FLOP) on 16,384 H100s at
    the 40% of 989 TFLOP/s the report gives."""
    save_s: float = 0.0
    """Upload of one checkpoint, until committed (0: from the model's state, see checkpoint_timings)."""
    load_s: float = 0.0
    """Load of the checkpoint at resume (0: from the model's state)."""
    peer_load_s: float = 0.0
    """Restore of the state from the nodes' host memory, a replaced node's share from its buddy
    (0: from the model's state)."""
    stall_s: float = 0.0
    """Training blocked by one async save (0: from the model's state)."""


def checkpoint_timings(timings: Timings, nodes: int) -> Timings:
    """Save, load and stall of MODEL_PARAMETERS' state spread over `nodes`, where not given."""
    per_node = MODEL_PARAMETERS * STATE_BYTES_PER_PARAMETER / nodes
    save = timings.save_s or per_node / (NODE_S3_BYTES_PER_S * SAVE_VS_RAW_PUT)
    return replace(timings, save_s=save, load_s=timings.load_s or per_node / (NODE_S3_BYTES_PER_S * LOAD_VS_RAW_GET),
                   peer_load_s=timings.peer_load_s or per_node / NODE_PEER_BYTES_PER_S,
                   stall_s=timings.stall_s or save * STALL_VS_SYNC_SAVE)


@dataclass(frozen=True)
class Scenario:
    nodes: int = 2048
    spares: int = 0
    days: float = 30.0
    interval_s: float = 60.0
    """Checkpoint interval: a minute (an async save blocks training for 10 ms of it; the sweep
    shows the others)."""
    seed: int = 0
    max_restarts: int = 1000
    """RecoveryPolicy.max_restarts: a month at this scale has hundreds of failures."""
    hang_timeout_s: int = 300
    """Five minutes, what a run this large would ask for: the RunSpec's default (ten) suits small
    runs, and trainfleet.core.pace allows as little as about 250 s at 2,089 nodes."""
    causes: tuple[Cause, ...] = CAUSES
    memory_copies: bool = True
    """In-memory checkpoints every step (RunSpec checkpoint.memory_interval_steps=1, the default):
    Recover resumes from them unless a lost node's buddy was lost too; False: S3 alone."""
    repairs: bool = True
    """Worlds repaired in place where Recover can (RecoveryPolicy.repair_in_place, the default,
    with the in-memory checkpoints); False: every recovery restarts every trainer."""


def run_spec(scenario: Scenario) -> RunSpec:
    """A RunSpec for the fleet: tp=8 inside a node, data parallel across (the layout matters to no
    decision here: the run never shrinks)."""
    n = scenario.nodes
    return RunSpec.model_validate({
        "run_name": "month", "instance_type": INSTANCE_TYPE, "node_count": n, "spare_count": scenario.spares,
        "capacity": {"subnet_ids": ["subnet-0123456789abcdef0"], "security_group_ids": ["sg-0123456789abcdef0"]},
        "image_id": "ami-0123456789abcdef0",
        "trainer": {"model": {"n_layers": 126}, "training": {"batch_size": n},
                    "parallel": {"pp": 1, "dp": n, "tp": 8, "schedule": "1f1b", "microbatches": 1}},
        "checkpoint": {"s3_uri": "s3://bucket/runs/month/checkpoints",
                       "memory_interval_steps": 1 if scenario.memory_copies else 0},
        "recovery": {"max_restarts": scenario.max_restarts, "hang_timeout_seconds": scenario.hang_timeout_s,
                     "repair_in_place": scenario.repairs},
    })


class Fleet:
    """The run's node records, the live workers among them, and when the booting ones become READY."""

    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.nodes: dict[str, NodeRecord] = {}
        self.worker_ids: list[str] = []
        """Live workers (kept beside the records: the simulation asks for them at every failure)."""
        self.ready_at: dict[str, datetime] = {}
        self.launched = 0

    def launch(self, attempt: int, workers: int, spares: int, at: datetime, boot: timedelta,
               free_ranks: list[int] = ()) -> None:
        """New instances; the workers among them take `free_ranks` (the first launch: 0, 1, ...)."""
        ids = [f"i-{self.launched + index:017x}" for index in range(workers + spares)]
        ranks = list(free_ranks) or list(range(workers))
        self.launched += len(ids)
        for node in new_node_records(self.spec, attempt, ids, workers, "us-east-1a", "subnet-0123456789abcdef0"):
            rank = ranks.pop(0) if node.role is NodeRole.WORKER else None
            self.nodes[node.instance_id] = node.model_copy(update={"launched_at": at, "node_rank": rank})
            self.ready_at[node.instance_id] = at + boot
        self.worker_ids += ids[:workers]

    def settle(self, now: datetime) -> None:
        """Nodes whose boot and preflight ended by `now` are READY (their NodeReady confirms the
        attempt they were launched in)."""
        for instance_id, ready in list(self.ready_at.items()):
            if ready <= now:
                node = self.nodes[instance_id]
                self.nodes[instance_id] = node.model_copy(update={"state": NodeState.READY, "ready_attempt": node.attempt,
                                                                  "ready_at": ready})
                del self.ready_at[instance_id]

    def workers(self) -> list[NodeRecord]:
        return [self.nodes[instance_id] for instance_id in self.worker_ids]

    def act(self, decision: RecoveryDecision, attempt: int, now: datetime, boot: timedelta) -> None:
        """What Recover does with a decision: the blamed nodes go, spares step in, new instances
        launch; the newcomers take the node ranks of the workers gone (lifecycle.assign_ranks)."""
        free = sorted(self.nodes[i].node_rank for i in decision.terminate_instance_ids if i in self.worker_ids)
        for instance_id in decision.terminate_instance_ids:
            self.nodes[instance_id] = self.nodes[instance_id].model_copy(
                update={"state": NodeState.TERMINATED, "updated_at": now})
            self.ready_at.pop(instance_id, None)
        for instance_id in decision.promote_spare_ids:
            self.nodes[instance_id] = self.nodes[instance_id].model_copy(
                update={"role": NodeRole.WORKER, "node_rank": free.pop(0)})
        gone = set(decision.terminate_instance_ids)
        self.worker_ids = [i for i in self.worker_ids if i not in gone] + decision.promote_spare_ids
        self.launch(attempt, decision.allocate_workers, decision.allocate_spares, now, boot, free)


def report_of(seen: Seen, run: RunRecord, fleet: Fleet, instance_id: str, now: datetime) -> FailureReport:
    """The FailureReport the control plane makes of a failure on `instance_id`, through the real
    classification (and, for a crash naming no node, Recover's look at EC2's status checks)."""
    ids = {"run_name": run.run_name, "attempt": run.attempt, "instance_id": instance_id}
    crash = TrainerFailed(**ids, kind=TrainerFailureKind.CRASH, message="the world lost a rank")
    match seen:
        case Seen.NODE_CHECK:
            failure = classify_event(NodeUnhealthy(**ids, reason="GPU error"), run.attempt)
        case Seen.HEALTH:
            failure = classify_event(HealthEvent.model_validate({
                "eventArn": "arn:aws:health:us-east-1::event/EC2/x", "service": "EC2",
                "eventTypeCode": "AWS_EC2_INSTANCE_HARDWARE_DEGRADED", "eventTypeCategory": "issue",
                "affectedEntities": [{"entityValue": instance_id}]}), run.attempt)
        case Seen.HANG:
            failure = classify_task_error("States.HeartbeatTimeout", None,
                                          TaskWait(purpose="train", attempt=run.attempt, token="t"))
        case Seen.NAN:
            failure = classify_event(TrainerFailed(**ids, kind=TrainerFailureKind.NAN_LOSS), run.attempt)
        case _:
            failure = classify_event(crash, run.attempt)
    # Every agent answers its looks (liveness): only EC2's status checks can name a node.
    troubles = {instance_id: "impaired"} if seen is Seen.HOST_DOWN else {}
    return blame_silent_workers(failure, fleet.workers(), [], now, run.spec.recovery.hang_timeout_seconds, troubles)


@dataclass(frozen=True)
class Pace:
    """The simulation's durations, as timedeltas, for one scenario."""

    boot: timedelta
    """Launch to READY: boot and preflight."""
    stalled: timedelta
    """A trainer's time without a step before its agent looks at the full rate (trainfleet.core.pace)."""
    between_look: timedelta
    """The last of the run's agents to look at the run record after it changed, at the full rate."""
    rendezvous: timedelta
    trainer_start: timedelta
    repair: timedelta
    load: timedelta
    peer_load: timedelta
    save: timedelta
    cadence: timedelta
    """Between two checkpoint starts: the interval, or the save when that is longer (a save
    waits for the previous upload)."""
    stall: float
    """Seconds of training one checkpoint blocks."""
    copy_stall: float
    """Seconds of training an in-memory copy blocks a step: the same staging to host memory as an
    S3 save's (trainer/checkpoint.py host_stager); the rest is off the training thread."""
    step: timedelta
    detect: timedelta
    hang: timedelta
    control_plane: timedelta

    @classmethod
    def of(cls, scenario: Scenario, timings: Timings) -> Pace:
        t = checkpoint_timings(timings, scenario.nodes)
        s = lambda seconds: timedelta(seconds=seconds)  # noqa: E731
        return cls(boot=s(t.boot_s + t.preflight_s),
                   stalled=s(stall_after(t.step_s)),
                   between_look=s(longest_look(min(scenario.nodes + scenario.spares, FULL_RATE_NODES),
                                               scenario.hang_timeout_s)),
                   rendezvous=s(t.rendezvous_s), trainer_start=s(t.trainer_start_s), repair=s(t.repair_s),
                   load=s(t.load_s), peer_load=s(t.peer_load_s), save=s(t.save_s),
                   cadence=s(max(scenario.interval_s, t.save_s)),
                   stall=t.stall_s + max(0.0, t.save_s - scenario.interval_s),
                   copy_stall=t.stall_s if scenario.memory_copies else 0.0, step=s(t.step_s),
                   detect=s(t.detect_s), control_plane=s(t.control_plane_s),
                   hang=s(min(scenario.hang_timeout_s, hung_after([t.step_s] * CADENCE_STEPS_KNOWN,
                                                                  RecoveryPolicy().stall_floor_seconds))))


@dataclass
class Outcome:
    """What one simulated month came to."""

    run: RunRecord
    """The run record at the end, its ledger booked to the horizon."""
    horizon_s: float
    workers: int
    spares: int
    gpus_per_node: int
    stall_s: float = 0.0
    """Training the ledger counts productive that checkpoint saves blocked."""
    failures: Counter = field(default_factory=Counter)
    """Root cause -> failures that reached Recover."""
    lost_s: defaultdict = field(default_factory=lambda: defaultdict(float))
    """Root cause (or start-up, give-up) -> lost wall-clock seconds."""
    recoveries_s: list[float] = field(default_factory=list)
    """Failure -> the next attempt's first step, per recovery whose attempt reached one."""
    boot_waits: int = 0
    """Recoveries that waited for new instances to boot."""
    repairs: int = 0
    """Recoveries that repaired the world in place."""
    gave_up_at_s: float | None = None

    @property
    def ettr(self) -> float:
        """Effective training time ratio: productive training over wall-clock."""
        return (self.run.ledger.productive_seconds - self.stall_s) / self.horizon_s

    def gpu_hours(self, seconds: float, nodes: int | None = None) -> float:
        return seconds * (self.workers if nodes is None else nodes) * self.gpus_per_node / 3600


class Month:
    """One run on simulated time: failures strike, the real decisions answer them."""

    def __init__(self, scenario: Scenario, timings: Timings):
        self.scenario = scenario
        self.pace = Pace.of(scenario, timings)
        self.strikes = random.Random(scenario.seed)  # failure times and causes: the same for every variant
        self.draws = random.Random(scenario.seed + 1)  # victims and backoff jitter
        spec = run_spec(scenario)
        self.horizon = T0 + timedelta(days=scenario.days)
        gpus = instance_facts(INSTANCE_TYPE).accelerator_count
        self.rate = sum(c.count for c in scenario.causes) / (REPORT_DAYS * 86400) * scenario.nodes * gpus / REPORT_GPUS
        self.fleet = Fleet(spec)
        self.fleet.launch(0, scenario.nodes, scenario.spares, T0, self.pace.boot)
        self.outcome = Outcome(
            run=RunRecord(run_name=spec.run_name, spec=spec, plan=initial_plan(spec, scenario.nodes), created_at=T0,
                          attempt_started_at=T0),
            horizon_s=(self.horizon - T0).total_seconds(), workers=scenario.nodes, spares=scenario.spares,
            gpus_per_node=gpus)
        self.stays: dict[str, Cause] = {}
        """Nodes with a fault a restart does not cure, and its cause."""
        self.restore = timedelta()
        """How long the current attempt's state takes to restore before its first step."""
        self.formed = self.pace.rendezvous
        """How long the current attempt's world takes to form: started anew, or repaired in place."""

    def next_strike(self, after: datetime) -> tuple[datetime, Cause]:
        if not self.rate:  # no failures at all: the next one comes after the month
            return self.horizon + timedelta(days=1), NO_FAILURE
        wait = self.strikes.expovariate(self.rate)
        cause = self.strikes.choices(self.scenario.causes, [c.count for c in self.scenario.causes])[0]
        return after + timedelta(seconds=wait), cause

    def simulate(self) -> Outcome:
        pace, outcome = self.pace, self.outcome
        run = outcome.run
        first_step = T0 + pace.boot + pace.between_look + pace.rendezvous  # allocate, boot, preflight, launch spec
        started_by = STARTUP
        recovering_since: datetime | None = None
        strike_at, strike_cause = self.next_strike(T0)
        while True:
            # The attempt ends at the next strike, or at its start on a node with a fault that stayed.
            torchrun_at = first_step - self.formed - self.restore
            stuck = next((instance_id for instance_id in self.fleet.worker_ids if instance_id in self.stays), None)
            if stuck is not None and torchrun_at < strike_at:
                failed_at, cause, victim = torchrun_at, self.stays[stuck], stuck
            else:
                failed_at, cause = max(strike_at, run.attempt_started_at), strike_cause
                victim = self.draws.choice(self.fleet.worker_ids)
                strike_at, strike_cause = self.next_strike(strike_at)
            end = min(failed_at, self.horizon)
            run = self.trained(run, first_step, end)
            if run.first_step_at is not None and recovering_since is not None:
                outcome.recoveries_s.append((run.first_step_at - recovering_since).total_seconds())
                recovering_since = None
            if failed_at >= self.horizon:
                run = run.model_copy(update={"last_progress_at": self.horizon if run.first_step_at else None})
                run = self.book(run, self.horizon, started_by, None, None, False)
                break
            if cause.seen is Seen.CRASH_STAYS:
                self.stays[victim] = cause
            decided = min(failed_at + (pace.hang if cause.seen is Seen.HANG else pace.detect) + pace.control_plane,
                          self.horizon)
            self.fleet.settle(decided)
            failure = report_of(cause.seen, run, self.fleet, victim, decided)
            outcome.failures[cause.name] += 1
            if decided >= self.horizon:  # known only as the month ends
                run = self.book(run, decided, started_by, cause.name, failure, False)
                break
            # As Recover does: decided with the attempt on the books (the cost ceiling), booked by
            # where the next attempt resumes from.
            preview = run.model_copy(update={"ledger": settle_run_attempt(run, decided, False, failure.failure_class)})
            # Every worker's trainer is alive at the decision but the victim's (its agent reports).
            alive = frozenset(self.fleet.worker_ids) - {victim} if self.scenario.repairs else frozenset()
            decision = decide_recovery(preview, list(self.fleet.nodes.values()), failure,
                                       jitter_draw=self.draws.random(), now=decided, trainers_alive=alive)
            run = self.book(run, decided, started_by, cause.name, failure, decision.restore_from_memory)
            run = apply_decision(run, failure, decision, decided).model_copy(update={
                "attempt_started_at": decided, "first_step_at": None})
            if decision.action is RecoveryAction.GIVE_UP:
                outcome.gave_up_at_s = (decided - T0).total_seconds()
                run = self.book(run, self.horizon, give_up_cause(failure.failure_class), None, None, False)
                break
            self.fleet.act(decision, run.attempt, decided, pace.boot)
            for instance_id in decision.terminate_instance_ids:
                self.stays.pop(instance_id, None)
            outcome.boot_waits += decision.allocate_workers > 0
            outcome.repairs += decision.repair is not None
            started_by = cause.name
            first_step = self.first_step(run, failed_at, decided, decision)
            recovering_since = recovering_since or failed_at
        outcome.run = run
        return outcome

    def first_step(self, run: RunRecord, failed_at: datetime, decided: datetime, decision: RecoveryDecision) -> datetime:
        """When the attempt decided at `decided` on a failure at `failed_at` trains, if nothing
        fails first: every worker confirmed (one that was up at its next look after the decision,
        at the full rate once its trainer stalled, unless Recover confirmed it as a repair's
        survivor or a READY spare stepping in; a new one once through preflight), the backoff
        waited, the launch spec read at the agents' next look (the full rate), the world started
        (rendezvous) or repaired in place (the replacements' trainers start, the world forms), the
        state restored: from the nodes' memory where Recover chose it, else S3's checkpoint."""
        pace = self.pace
        booting = [ready for instance_id, ready in self.fleet.ready_at.items()
                   if self.fleet.nodes[instance_id].role is NodeRole.WORKER]
        # A repair's survivors and the READY spares stepping in are confirmed by Recover, and read
        # the launch spec every LAUNCH_SPEC_POLL_S; the others at their next looks.
        confirmed = decided if decision.repair else max(decided, failed_at + pace.stalled) + pace.between_look
        awaited = max(decided + timedelta(seconds=decision.backoff_seconds), confirmed, *booting)
        self.restore = (pace.peer_load if decision.restore_from_memory else pace.load if run.latest_checkpoint
                        else timedelta())
        self.formed = pace.trainer_start + pace.repair if decision.repair else pace.rendezvous
        read = timedelta(seconds=LAUNCH_SPEC_POLL_S) if decision.repair else pace.between_look
        return awaited + read + self.formed + self.restore

    def trained(self, run: RunRecord, first_step: datetime, end: datetime) -> RunRecord:
        """The run record at `end`: the attempt's first step if reached, its latest commit."""
        if first_step > end:
            return run
        pace = self.pace
        commits = int(max(timedelta(), end - first_step - pace.save) / pace.cadence)
        # The last report of steps before `end` (every PROGRESS_EVERY_S, half of it on average).
        reported = end - timedelta(seconds=PROGRESS_EVERY_S / 2)
        update: dict = {"first_step_at": first_step, "last_progress_at": reported if reported > first_step else None,
                        "last_step": (run.last_step or 0) + int((end - first_step) / pace.step)}
        if commits:
            step = (run.latest_checkpoint.step if run.latest_checkpoint else 0) + int((commits * pace.cadence).total_seconds())
            update["latest_checkpoint"] = CheckpointRef(step=step, uri=f"s3://bucket/runs/month/checkpoints/step-{step:09d}",
                                                        committed_at=first_step + commits * pace.cadence + pace.save)
        return run.model_copy(update=update)

    def book(self, run: RunRecord, ended_at: datetime, started_by: str, ended_by: str | None,
             failure: FailureReport | None, resumed_from_memory: bool) -> RunRecord:
        """The attempt on the ledger (as Recover and Teardown book it), its losses by root cause:
        the start-up to what started the attempt, the redone training to what ended it."""
        before = run.ledger
        ledger = settle_run_attempt(run, ended_at, completed=failure is None and run.error is None,
                                    failure_class=failure.failure_class if failure else None,
                                    resumed_from_memory=resumed_from_memory)
        for cause, seconds in ledger.lost_by_cause.items():
            added = seconds - before.lost_by_cause.get(cause, 0.0)
            if added:
                self.outcome.lost_s[ended_by if cause.startswith("redone:") else started_by] += added
        kept = ledger.productive_seconds - before.productive_seconds
        self.outcome.stall_s += int(kept // self.pace.cadence.total_seconds()) * self.pace.stall
        self.outcome.stall_s += int(kept // self.pace.step.total_seconds()) * self.pace.copy_stall
        return run.model_copy(update={"ledger": ledger})


def failure_to_training(scenario: Scenario, timings: Timings) -> dict[str, float]:
    """Seconds from a node lost (an event names it) to the world training again, by part, with a
    READY spare stepping in and the state restored from the nodes' memory, the world repaired in
    place where the scenario repairs: Month.first_step's path for one such failure."""
    pace = Pace.of(scenario, timings)
    seconds = lambda delta: delta.total_seconds()  # noqa: E731
    decided = seconds(pace.detect + pace.control_plane)
    formed = ({"the replacement's trainer starts": seconds(pace.trainer_start),
               "the world repaired (store, communicators)": seconds(pace.repair)} if scenario.repairs
              else {"every trainer started, rendezvous and communicators": seconds(pace.rendezvous)})
    confirmed = ({"launch spec read (every second)": LAUNCH_SPEC_POLL_S} if scenario.repairs else
                 {"survivors confirm (stalled, next look)": max(decided, seconds(pace.stalled))
                  + seconds(pace.between_look) - decided, "launch spec read (next look)": seconds(pace.between_look)})
    return {"detection": seconds(pace.detect), "control plane": seconds(pace.control_plane), **confirmed,
            **formed, "state from memory": seconds(pace.peer_load), "the first step": seconds(pace.step)}


def simulate(scenario: Scenario, timings: Timings) -> Outcome:
    return Month(scenario, timings).simulate()


def mean_outcome(outcomes: list[Outcome]) -> dict:
    """The figures printed, averaged over seeds."""
    lost = defaultdict(float)
    for outcome in outcomes:
        for cause, seconds in outcome.lost_s.items():
            lost[cause] += outcome.gpu_hours(seconds) / len(outcomes)
    recoveries = [seconds for outcome in outcomes for seconds in outcome.recoveries_s]
    return {
        "ettr": statistics.fmean(o.ettr for o in outcomes),
        "failures": statistics.fmean(sum(o.failures.values()) for o in outcomes),
        "boot_waits": statistics.fmean(o.boot_waits for o in outcomes),
        "repairs": statistics.fmean(o.repairs for o in outcomes),
        "recovery_min": statistics.fmean(recoveries) / 60 if recoveries else math.nan,
        "lost_gpu_h": lost,
        "stall_gpu_h": statistics.fmean(o.gpu_hours(o.stall_s) for o in outcomes),
        "spare_gpu_h": statistics.fmean(o.gpu_hours(o.horizon_s, o.spares) for o in outcomes),
        "unaccounted_s": max(abs(unaccounted_seconds(o.run)) for o in outcomes),
        "gave_up_h": [o.gave_up_at_s / 3600 for o in outcomes if o.gave_up_at_s is not None],
    }


def month(scenario: Scenario, timings: Timings, seeds: int) -> dict:
    return mean_outcome([simulate(replace(scenario, seed=seed), timings) for seed in range(seeds)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=2048, help="workers (p5.48xlarge, 8 GPUs each)")
    parser.add_argument("--spare-fraction", type=float, default=0.02, help="spares as a fraction of the workers")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--interval-min", type=float, default=Scenario.interval_s / 60, help="checkpoint interval")
    parser.add_argument("--seeds", type=int, default=3, help="months simulated per figure (averaged)")
    parser.add_argument("--max-restarts", type=int, default=Scenario.max_restarts)
    parser.add_argument("--hang-timeout-s", type=int, default=Scenario.hang_timeout_s)
    defaults = Timings()
    for name in Timings.__dataclass_fields__:
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    for cause in CAUSES:
        parser.add_argument(f"--rate-{cause.name.replace(' ', '-').replace('/', '-').replace('+-', '')}", type=int,
                            default=cause.count, dest=f"rate_{cause.name}", metavar="N",
                            help=f"{cause.name}: interruptions per 54 days on 16,384 GPUs (default {cause.count})")
    args = parser.parse_args()
    causes = tuple(replace(cause, count=getattr(args, f"rate_{cause.name}")) for cause in CAUSES)
    timings = Timings(**{name: getattr(args, name) for name in Timings.__dataclass_fields__})
    spares = math.ceil(args.nodes * args.spare_fraction)
    base = Scenario(nodes=args.nodes, days=args.days, interval_s=args.interval_min * 60, max_restarts=args.max_restarts,
                    hang_timeout_s=args.hang_timeout_s, causes=causes)
    with_spares = replace(base, spares=spares)
    pace, t = Pace.of(with_spares, timings), checkpoint_timings(timings, args.nodes)
    gpus = instance_facts(INSTANCE_TYPE).accelerator_count
    rate = sum(c.count for c in causes) / (REPORT_DAYS * 86400) * args.nodes * gpus / REPORT_GPUS
    mtbf_s = 1 / rate if rate else math.inf

    print(f"failures: Llama 3 405B report (arXiv:2407.21783, Table 5), {sum(c.count for c in causes)} interruptions "
          f"in {REPORT_DAYS} days on {REPORT_GPUS:,} GPUs, scaled to the fleet")
    print(f"fleet: {args.nodes:,} x {INSTANCE_TYPE} ({args.nodes * gpus:,} GPUs), {args.days:g} days, job MTBF "
          f"{mtbf_s / 3600:.2f} h ({args.days * 86400 / mtbf_s:.0f} failures expected), mean of {args.seeds} seed(s)")
    print(f"timings (s): boot {t.boot_s:g} + preflight {t.preflight_s:g}; step {t.step_s:g}, stalled after "
          f"{pace.stalled.total_seconds():g}, then agents' look <= {pace.between_look.total_seconds():.1f} "
          f"(trainfleet.core.pace); rendezvous {t.rendezvous_s:g}; detection {t.detect_s:g} "
          f"(a hang: {pace.hang.total_seconds():g}, its cadence's; the hang timeout {args.hang_timeout_s}); "
          f"control plane {t.control_plane_s:g}")
    print(f"checkpoint every {args.interval_min:g} min: save {t.save_s:.2f} s, load {t.load_s:.2f} s, stall "
          f"{t.stall_s:.4f} s ({MODEL_PARAMETERS / 1e9:.0f}B parameters x {STATE_BYTES_PER_PARAMETER} bytes over "
          f"{args.nodes:,} nodes)")

    s3_only = replace(with_spares, memory_copies=False, repairs=False)
    restarts = replace(with_spares, repairs=False)
    figures = {"no spares": month(base, timings, args.seeds), f"{spares} spares": month(with_spares, timings, args.seeds),
               f"{spares} sp., restart": month(restarts, timings, args.seeds),
               f"{spares} sp., S3 only": month(s3_only, timings, args.seeds)}
    columns = list(figures)
    print(f"in-memory checkpoints every step (the first three columns): restore {t.peer_load_s:.2f} s from the nodes' "
          f"memory, training blocked {t.stall_s:.4f} s a step; the first two repair the world in place where Recover "
          f"can (the replacement's trainer starts {t.trainer_start_s:g} s, the world forms {t.repair_s:g} s), "
          f"'restart' restarts every trainer; 'S3 only' is the path before both")
    print(f"\n{'':40}" + "".join(f"{column:>16}" for column in columns))

    def row(label: str, values: list, fmt: str) -> None:
        print(f"{label:40}" + "".join(f"{value:>16{fmt}}" for value in values))

    row("ETTR", [f["ettr"] for f in figures.values()], ".4f")
    row("failures", [f["failures"] for f in figures.values()], ".1f")
    row("recoveries waiting for a boot", [f["boot_waits"] for f in figures.values()], ".1f")
    row("recoveries repaired in place", [f["repairs"] for f in figures.values()], ".1f")
    row("failure -> next first step (min, mean)", [f["recovery_min"] for f in figures.values()], ".2f")
    print("lost GPU-hours by cause")
    causes_seen = sorted({c for f in figures.values() for c in f["lost_gpu_h"]},
                         key=lambda c: -max(f["lost_gpu_h"].get(c, 0) for f in figures.values()))
    for cause in causes_seen:
        row(f"  {cause}", [f["lost_gpu_h"].get(cause, 0.0) for f in figures.values()], ",.0f")
    row("  checkpoint saves, copies (blocked)", [f["stall_gpu_h"] for f in figures.values()], ",.0f")
    row("  total", [sum(f["lost_gpu_h"].values()) + f["stall_gpu_h"] for f in figures.values()], ",.0f")
    row("idle spare GPU-hours", [f["spare_gpu_h"] for f in figures.values()], ",.0f")
    row("ledger: seconds not accounted (max)", [f["unaccounted_s"] for f in figures.values()], ".2g")

    intervals_min = [0.5, 1, 2, 5, 10, 20, 30, 60]
    print(f"\nS3 checkpoint interval sweep ({spares} spares, mean of {args.seeds} seed(s))")
    print(f"{'interval (min)':>16}{'ETTR':>10}{'restart':>10}{'S3 only':>10}")
    sweep, restarted, before = {}, {}, {}
    for minutes in intervals_min:
        sweep[minutes] = month(replace(with_spares, interval_s=minutes * 60), timings, args.seeds)["ettr"]
        restarted[minutes] = month(replace(restarts, interval_s=minutes * 60), timings, args.seeds)["ettr"]
        before[minutes] = month(replace(s3_only, interval_s=minutes * 60), timings, args.seeds)["ettr"]
        print(f"{minutes:>16g}{sweep[minutes]:>10.4f}{restarted[minutes]:>10.4f}{before[minutes]:>10.4f}")
    best = max(before, key=before.get)
    young_daly_s = math.sqrt(2 * mtbf_s * t.stall_s)
    print(f"S3 only: best interval {best:g} min (ETTR {before[best]:.4f}); Young/Daly sqrt(2 x MTBF x checkpoint cost) = "
          f"{young_daly_s:.1f} s with MTBF {mtbf_s:,.0f} s and cost = the stall, {t.stall_s:.4f} s (an async save "
          f"blocks training that long; its commit comes {t.save_s:.2f} s later, and the next save waits for it)")

    today = month(replace(with_spares, causes=gpu_faults_unnamed(causes)), timings, args.seeds)
    gave_up = today["gave_up_h"]
    print("\ntoday's agent (a GPU fault crashes the trainer and names no node; restarts crash again): "
          + (f"the run gives up after {statistics.fmean(gave_up):.1f} h (crash loop) in {len(gave_up)} of "
             f"{args.seeds} month(s)" if gave_up else "the run never gives up")
          + f", ETTR {today['ettr']:.4f}")
    for scenario, how in ((with_spares, "the world repaired in place"), (restarts, "every trainer restarted")):
        parts = failure_to_training(scenario, timings)
        print(f"\na node lost, a READY spare in its place, the state from memory, {how}: {sum(parts.values()):.1f} s "
              "to training again (" + ", ".join(f"{name} {value:.1f}" for name, value in parts.items()) + ")")
    print(f"ettr_s3_30min={sweep[30]:.4f}")
    print(f"ettr={figures[columns[1]]['ettr']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
