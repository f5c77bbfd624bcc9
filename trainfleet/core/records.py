"""The records the control plane keeps and the decisions it stores: run and node states with
their allowed changes, failures, the run and node records (DynamoDB), what a node reads to start.

    RunState, NodeState, NodeRole, FailureClass, TrainerFailureKind   enums
    RUN_TRANSITIONS, NODE_TRANSITIONS, check_run_transition, check_node_transition,
      InvalidTransition          the allowed state changes
    RunRecord, NodeRecord, NodeLiveness, TaskWait, FailureRecord, CheckpointRef, GoodputLedger
      (+ FleetCheckFigures, ScalingCheckFigures)   stored records
    FailureReport, FAILURE_ERROR   a classified failure and the task-failure error name carrying it
    CAPACITY_ERROR               the error name of a task short of instances
    ParallelPlan, RecoveryAction, RecoveryDecision, LateWorkerSwap   what the lifecycle decides
    LaunchSpec                   what every node agent reads to start the trainer
    rendezvous_port(id)          the port of an attempt's c10d rendezvous (one of RENDEZVOUS_PORTS)
    RunRef                       the small reference Step Functions states carry
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, model_validator

from trainfleet.core.pace import HANG_TIMEOUT_MIN_S
from trainfleet.core.runspec import CapacityKind, RunSpec
from trainfleet.core.shapes import Strict

RENDEZVOUS_PORT = 29400
"""torchrun's default c10d rendezvous port: the first of RENDEZVOUS_PORTS."""

RENDEZVOUS_PORTS = range(RENDEZVOUS_PORT, RENDEZVOUS_PORT + 500)
"""Ports an attempt's c10d rendezvous may take on node rank 0 (below Linux's ephemeral range)."""


def rendezvous_port(rendezvous_id: str) -> int:
    """The port of one attempt's rendezvous, drawn from its id: a restarted world never meets the
    store of the world before it on the same host (still closing, or a lingering torchrun), and
    worlds that share one host, as the local cloud's nodes do, rarely collide."""
    digest = hashlib.sha256(rendezvous_id.encode()).digest()
    return RENDEZVOUS_PORTS[int.from_bytes(digest[:4], "big") % len(RENDEZVOUS_PORTS)]



class InvalidTransition(ValueError):
    """A state change the diagram does not allow (names both states)."""


class RunState(StrEnum):
    """Where a run is. Every change is a conditional write on the previous state.

        REQUESTED ─▶ ALLOCATING ─▶ AWAITING_NODES ─▶ TRAINING ─▶ TEARING_DOWN ─▶ SUCCEEDED
                         ▲               │              │             ▲        ├─▶ FAILED
                         │               ▼              ▼             │        └─▶ STOPPED
                         └────────── RECOVERING ◀───────┘             │
           (any state that is not final) ─────────────────────────────┘

    RECOVERING goes back to ALLOCATING (replacements) or straight to AWAITING_NODES (spares
    or a shrink cover it). TEARING_DOWN is on every path: no instance outlives its run.
    STOPPED: someone stopped its execution (StopExecution, `trainfleet run stop`); nothing failed.
    """

    REQUESTED = "REQUESTED"
    ALLOCATING = "ALLOCATING"
    AWAITING_NODES = "AWAITING_NODES"
    TRAINING = "TRAINING"
    RECOVERING = "RECOVERING"
    TEARING_DOWN = "TEARING_DOWN"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def is_final(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED, RunState.STOPPED)


_R = RunState
# TEARING_DOWN is reachable from every state before it: it is the state machine's Catch-all.
RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    _R.REQUESTED: frozenset({_R.ALLOCATING, _R.TEARING_DOWN}),
    _R.ALLOCATING: frozenset({_R.AWAITING_NODES, _R.RECOVERING, _R.TEARING_DOWN}),
    _R.AWAITING_NODES: frozenset({_R.TRAINING, _R.RECOVERING, _R.TEARING_DOWN}),
    _R.TRAINING: frozenset({_R.RECOVERING, _R.TEARING_DOWN}),
    _R.RECOVERING: frozenset({_R.ALLOCATING, _R.AWAITING_NODES, _R.TEARING_DOWN}),
    _R.TEARING_DOWN: frozenset({_R.SUCCEEDED, _R.FAILED, _R.STOPPED}),
    _R.SUCCEEDED: frozenset(),
    _R.FAILED: frozenset(),
    _R.STOPPED: frozenset(),
}


class NodeRole(StrEnum):
    """What a node is for."""

    WORKER = "WORKER"
    """Part of the training world."""
    SPARE = "SPARE"
    """Booted and checked, waiting to replace a worker."""


class NodeState(StrEnum):
    """Where a node (one instance) is.

        LAUNCHED ─▶ REGISTERED ─▶ READY
            │            │          │
            └────────────┴──────────┴─▶ UNHEALTHY ─▶ TERMINATING ─▶ TERMINATED
            (any state that is not final) ────────────▲                  ▲
            (an instance AWS ended on its own) ──────────────────────────┘

    LAUNCHED: CreateFleet returned its id. REGISTERED: its agent reported in. READY: preflight
    passed. UNHEALTHY: a failure was attributed to it. TERMINATING is recorded before the
    TerminateInstances call, TERMINATED when EC2 reports the instance gone.
    """

    LAUNCHED = "LAUNCHED"
    REGISTERED = "REGISTERED"
    READY = "READY"
    UNHEALTHY = "UNHEALTHY"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"

    @property
    def is_final(self) -> bool:
        return self is NodeState.TERMINATED

    @property
    def is_retired(self) -> bool:
        """Blamed or leaving: no longer counted in the run's world."""
        return self in (NodeState.UNHEALTHY, NodeState.TERMINATING, NodeState.TERMINATED)


_N = NodeState
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _N.LAUNCHED: frozenset({_N.REGISTERED, _N.UNHEALTHY, _N.TERMINATING, _N.TERMINATED}),
    _N.REGISTERED: frozenset({_N.READY, _N.UNHEALTHY, _N.TERMINATING, _N.TERMINATED}),
    _N.READY: frozenset({_N.UNHEALTHY, _N.TERMINATING, _N.TERMINATED}),
    _N.UNHEALTHY: frozenset({_N.TERMINATING, _N.TERMINATED}),
    _N.TERMINATING: frozenset({_N.TERMINATED}),
    _N.TERMINATED: frozenset(),
}


def check_run_transition(old: RunState, new: RunState) -> None:
    """Raise InvalidTransition unless the run diagram allows old -> new."""
    if new not in RUN_TRANSITIONS[old]:
        raise InvalidTransition(f"run state {old.value} -> {new.value} is not allowed")


def check_node_transition(old: NodeState, new: NodeState) -> None:
    """Raise InvalidTransition unless the node diagram allows old -> new."""
    if new not in NODE_TRANSITIONS[old]:
        raise InvalidTransition(f"node state {old.value} -> {new.value} is not allowed")


# ---------------------------------------------------------------------------------------------
# Failures and decisions

class FailureClass(StrEnum):
    """What went wrong, as the recovery decision sees it."""

    INSTANCE_LOST = "INSTANCE_LOST"
    """EC2 reports the instance stopping, stopped, shutting down or terminated."""
    SPOT_INTERRUPTION = "SPOT_INTERRUPTION"
    """A two-minute Spot interruption warning."""
    SPOT_REBALANCE = "SPOT_REBALANCE"
    """A rebalance recommendation: elevated risk of interruption, replace proactively."""
    HEALTH_EVENT = "HEALTH_EVENT"
    """An AWS Health event for the instance (scheduled retirement, hardware degradation)."""
    NODE_UNHEALTHY = "NODE_UNHEALTHY"
    """The agent's own checks failed (preflight, GPU errors, EFA devices, bandwidth)."""
    PROCESS_CRASH = "PROCESS_CRASH"
    """The trainer exited with an error on healthy nodes."""
    HANG = "HANG"
    """No progress for the hang timeout (heartbeat timeout or the agent's watchdog)."""
    NUMERICAL = "NUMERICAL"
    """The loss became NaN or infinite."""
    CONFIG_ERROR = "CONFIG_ERROR"
    """The trainer refused its config: retrying cannot help."""
    BOOT_FAILED = "BOOT_FAILED"
    """A node's software did not install: its user data failed a step every try (BOOT_CHECK). The
    node is replaced as a sick one; several failing at the same step end the run (software that
    does not install fails alike on all)."""
    SETUP_FAILED = "SETUP_FAILED"
    """Not one node the attempt waited for reported in its boot timeout (no agent registered, no
    bootstrap step failed): they could not reach AWS, or never ran their user data. That is the
    run's set-up (its network, its image), not its nodes: no replacement can help."""
    SLOW_NETWORK = "SLOW_NETWORK"
    """The fleet-wide check measured the world's network below the floor (trainer/fleet_check.py)."""
    POOR_SCALING = "POOR_SCALING"
    """The scaling check found the run's world below its efficiency floor
    (trainer/scaling_check.py): with the nodes of ranks far slower than their peers named, those
    are replaced and the new world checked again; uniformly poor, the run stops before the fleet
    is spent on it."""
    CAPACITY = "CAPACITY"
    """Not enough instances could be allocated."""
    CAPACITY_RETURNED = "CAPACITY_RETURNED"
    """A run that shrank has READY spares for the nodes it lacks: the attempt ends at an interval
    checkpoint so that the world grows back to its planned size (lifecycle.growth)."""
    CAPACITY_BLOCK_END = "CAPACITY_BLOCK_END"
    """The run's Capacity Block ends: EC2 terminates its instances (lifecycle.reservation); the
    run checkpoints and stops."""
    UNKNOWN = "UNKNOWN"
    """Anything else (e.g. a States.* error without detail)."""


class TrainerFailureKind(StrEnum):
    """Why the agent says the trainer failed (TrainerFailed.kind)."""

    CRASH = "crash"
    NAN_LOSS = "nan_loss"
    CONFIG = "config"


FAILURE_ERROR = "trainfleet.Failure"
"""Error name of SendTaskFailure for a classified failure; the cause is a FailureReport as JSON."""

CAPACITY_ERROR = "CapacityUnavailable"
"""Error name of a task that could not get the instances it needed (functions.errors raises it)."""


class FailureReport(Strict):
    """A classified failure: what the event handler sends with SendTaskFailure (as the cause)."""

    failure_class: FailureClass
    """What went wrong."""
    attempt: int = Field(ge=0)
    """The attempt it happened in."""
    instance_ids: list[str] = Field(default_factory=list)
    """Nodes blamed; empty when the nodes are fine (crash, hang, NaN)."""
    message: str = ""
    """For people: the event or error it came from."""
    observed_at: datetime | None = None
    """The failure's first sign: when AWS or an agent observed it (the event's time); None when
    only its consequence was seen (a task timeout)."""
    first_silent: str | None = None
    """A hang's node whose trainer fell silent clearly first (lifecycle.first_silent), if one did."""


class ParallelPlan(Strict):
    """A world layout: nodes x ranks per node = pp x dp x tp."""

    nodes: int = Field(ge=1)
    """Worker nodes in the world."""
    ranks_per_node: int = Field(ge=1)
    """Trainer processes per node (torchrun --nproc-per-node)."""
    pp: int = Field(ge=1)
    """Pipeline-parallel degree."""
    dp: int = Field(ge=1)
    """Data-parallel degree."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree (the RunSpec's; a re-plan keeps it)."""

    @model_validator(mode="after")
    def _fills_world(self) -> ParallelPlan:
        if self.pp * self.dp * self.tp != self.nodes * self.ranks_per_node:
            raise ValueError(f"pp x dp x tp = {self.pp} x {self.dp} x {self.tp} does not fill "
                             f"{self.nodes} nodes x {self.ranks_per_node} ranks")
        return self

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp


class RecoveryAction(StrEnum):
    """What the Recover state does next (the state machine's Choice branches on it)."""

    RESTART = "restart"
    """Same nodes, resume from the latest committed checkpoint."""
    REPLACE = "replace"
    """Swap the bad nodes for spares and/or new instances, same layout."""
    SHRINK = "shrink"
    """Continue on fewer nodes with a re-planned pp x dp."""
    GROW = "grow"
    """Continue on more nodes (spares that came after a shrink) with a re-planned pp x dp."""
    GIVE_UP = "give_up"
    """Stop: the run fails (after teardown)."""


class WorldRepair(Strict):
    """How an attempt's world is formed when it is repaired in place (trainer/repair.py): the
    surviving workers' trainers keep their processes, and the lost nodes' replacements start
    trainers that join them."""

    generation: int = Field(ge=1)
    """Repairs of the world since its torchrun launch: the repair order's generation."""
    launched_attempt: int = Field(ge=0)
    """The attempt whose launch started the survivors' torchrun (their files are its)."""
    survivor_ids: list[str] = Field(min_length=1)
    """Workers whose trainers keep their processes and their node ranks."""


class RecoveryDecision(Strict):
    """The outcome of lifecycle.decide_recovery; small enough for a Step Functions payload."""

    action: RecoveryAction
    """What to do."""
    failure_class: FailureClass
    """The classified failure that led here."""
    reason: str
    """One sentence for people (execution history, run report)."""
    terminate_instance_ids: list[str] = Field(default_factory=list)
    """Nodes to terminate (the bad ones; all of them when giving up is left to Teardown)."""
    promote_spare_ids: list[str] = Field(default_factory=list)
    """Spares that become workers."""
    demote_worker_ids: list[str] = Field(default_factory=list)
    """Workers a smaller layout leaves out; they become spares."""
    allocate_workers: int = Field(default=0, ge=0)
    """New instances the next attempt waits for (workers no spare could cover)."""
    allocate_spares: int = Field(default=0, ge=0)
    """New instances that refill the spare pool; the next attempt does not wait for them."""
    plan: ParallelPlan | None = None
    """The layout to resume with; None when giving up."""
    backoff_seconds: float = Field(default=0.0, ge=0)
    """Wait before acting (a Wait state reads it)."""
    restore_from_memory: bool = False
    """The next attempt resumes from the nodes' in-memory checkpoints, S3 only for a shard none
    holds (lifecycle.memory_restore says why or why not, in `reason`)."""
    repair: WorldRepair | None = None
    """The next attempt's world is the failed one repaired in place (lifecycle.repair_in_place);
    None: every node's trainer starts anew."""


class LateWorkerSwap(Strict):
    """What lifecycle.swap_late_workers decided once AwaitNodes' late-worker deadline passed:
    READY spares take the places of workers that have not confirmed for the attempt."""

    promote_spare_ids: list[str] = Field(default_factory=list)
    """Spares, confirmed for the attempt, that become workers."""
    demote_worker_ids: list[str] = Field(default_factory=list)
    """Late workers still booting or in preflight: they become spares and go on booting."""
    release_instance_ids: list[str] = Field(default_factory=list)
    """Late workers that passed preflight before and did not confirm this attempt (their agent
    went silent): terminated."""


class StateRestoredFigures(Strict):
    """Where one attempt's trainer took the state it resumed from (trainer/train.py restore)."""

    attempt: int = Field(ge=0)
    step: int = Field(ge=0)
    """The step the world resumed at (0: from scratch)."""
    source: Literal["memory", "s3", "none"]
    """memory: every shard from some node's host memory; s3: from the S3 checkpoint; none: nothing to resume."""
    shards: int = Field(ge=1)
    """Shards of the world (one per rank)."""
    own_memory: int = Field(default=0, ge=0)
    """Shards loaded from their own node's memory."""
    peers: int = Field(default=0, ge=0)
    """Shards received from the buddy node holding their copy (a replaced node's)."""
    peer_bytes: int = Field(default=0, ge=0)
    """Bytes those shards took on the network."""
    seconds: float = Field(ge=0)
    """How long the restore took, as rank 0 timed it."""
    fallback: str | None = None
    """Why a restore asked to come from memory came from S3."""

    def describe(self) -> str:
        if self.source == "memory":
            return (f"step {self.step} from host memory: {self.own_memory} of {self.shards} shards on their own node, "
                    f"{self.peers} from a buddy ({self.peer_bytes / 2**20:.1f} MiB), {self.seconds:.1f} s")
        told = f"step {self.step} from S3" if self.source == "s3" else "from scratch"
        return f"{told}, {self.seconds:.1f} s" + (f" ({self.fallback})" if self.fallback else "")


class RecoveryKind(StrEnum):
    """How a failed world came back."""

    REPAIRED = "repaired in place"
    """The survivors' trainers kept their processes and formed the next world with the replacements."""
    RESTARTED = "restarted"
    """Every node's trainer started anew."""
    GAVE_UP = "gave up"
    """The run ended."""


class FailureRecord(Strict):
    """One handled failure, for the restart budget, the crash-loop rule and the run report."""

    failure_class: FailureClass
    """What went wrong."""
    resume_step: int | None
    """Latest committed step when it happened: equal steps in a row mean no progress."""
    at: datetime
    """When the recovery decision was taken."""
    attempt: int | None = Field(default=None, ge=0)
    """The attempt it ended (None on records from before it was kept)."""
    onset_at: datetime | None = None
    """Its first sign: the observing event's time, or for a hang the world's last step."""
    last_step: int | None = Field(default=None, ge=0)
    """The last step the attempt reported."""
    restored: StateRestoredFigures | None = None
    """Where the attempt after it took its state from (its StateRestored): the nodes' memory or S3."""
    kept_on_memory_seconds: float = Field(default=0.0, ge=0)
    """Training after the last commit that Recover booked productive because the next attempt was
    to resume from the nodes' memory; taken back (booked redone) if it resumed from S3 after all."""
    instance_ids: list[str] = Field(default_factory=list)
    """The nodes blamed: the first IDS_KEPT of them (lifecycle.recovery), so a record of many
    failures naming many nodes stays within DynamoDB's item (a Capacity Block's end names every
    worker)."""
    instances_blamed: int | None = Field(default=None, ge=0)
    """How many nodes it blamed, kept or not (None on records from before it was kept)."""
    first_silent: str | None = None
    """A hang's node whose trainer fell silent clearly first: named a second time, it is blamed."""
    message: str = ""
    """For people: what was seen."""
    recovery: RecoveryKind | None = None
    """How the world came back, if it did (None on records from before it was kept)."""
    decision: str = ""
    """For people: Recover's decision, and why."""

    @property
    def detection_seconds(self) -> float | None:
        """From the first sign to the decision: how long the fleet waited on a failure before the
        control plane acted on it."""
        return None if self.onset_at is None else max(0.0, (self.at - self.onset_at).total_seconds())


class CheckpointRef(Strict):
    """A committed checkpoint as the control plane knows it."""

    step: int = Field(ge=0)
    """Training step the checkpoint was taken after."""
    uri: str
    """s3://.../step-NNNNNNNNN (the folder the trainer resumes from)."""
    committed_at: datetime | None = None
    """Commit time from the marker."""


class GoodputLedger(Strict):
    """Where the run's wall-clock and money went (lifecycle.settle_attempt keeps it).

    Every second from the run's creation to `booked_until` is either productive or lost to one
    cause (lifecycle.unaccounted_seconds checks it). The causes:

        startup              attempt 0, creation to its first step (or all of it, without one)
        restart:<CLASS>      attempt k>0, the recovery decision to its first step (or all of it);
                             CLASS is the failure that ended attempt k-1
        redone:<CLASS>       training of a failed attempt after its last committed checkpoint;
                             CLASS is the failure that ended it (UNKNOWN when the run failed on
                             an error no recovery classified)
        give_up:<CLASS>      the decision to give up on a CLASS failure to Teardown
        finishing            a completed run, from its final checkpoint or last reported step,
                             whichever is later, to Teardown (the trainer's exit, the completion
                             event)
        unattributed         lost time of a record booked before causes were kept
    """

    productive_seconds: float = 0.0
    """Training time whose progress survived (reached a committed checkpoint or the end)."""
    lost_seconds: float = 0.0
    """All lost time: the sum of lost_by_cause."""
    lost_by_cause: dict[str, float] = Field(default_factory=dict)
    """Lost seconds by cause (see the class's list)."""
    booked_until: datetime | None = None
    """Where the last booked attempt ended: the ledger accounts for the run's time up to here."""
    node_seconds: float = 0.0
    """Instance time paid for (all nodes, spares included)."""
    cost_usd: float = 0.0
    """node_seconds priced at the catalogue's on-demand rate."""

    @property
    def goodput(self) -> float:
        """Productive share of the run's wall-clock, 0..1 (1.0 before anything happened)."""
        total = self.productive_seconds + self.lost_seconds
        return self.productive_seconds / total if total else 1.0

    @model_validator(mode="before")
    @classmethod
    def _causes_of_an_older_record(cls, data: Any) -> Any:
        """A record booked before causes were kept has lost time and no causes: it is read with
        that time under one cause, so its books still add up."""
        if isinstance(data, dict) and not data.get("lost_by_cause") and data.get("lost_seconds"):
            return {**data, "lost_by_cause": {"unattributed": data["lost_seconds"]}}
        return data

    @model_validator(mode="after")
    def _lost_is_the_sum_of_its_causes(self) -> GoodputLedger:
        if any(seconds < 0 for seconds in self.lost_by_cause.values()):
            raise ValueError(f"lost_by_cause has negative time: {self.lost_by_cause}")
        by_cause = sum(self.lost_by_cause.values())
        if not math.isclose(self.lost_seconds, by_cause, rel_tol=1e-9, abs_tol=1e-6):
            raise ValueError(f"lost_seconds {self.lost_seconds} is not the sum of lost_by_cause ({by_cause})")
        return self


class TaskWait(Strict):
    """A Step Functions task token the run is parked on (AwaitNodes or Train)."""

    purpose: Literal["await_nodes", "train"]
    """Which task waits: AwaitNodes (all workers ready) or Train (completion, heartbeats)."""
    attempt: int = Field(ge=0)
    """The attempt the task belongs to; events of other attempts must not answer it."""
    token: str = Field(min_length=1)
    """The Step Functions task token."""


class FleetCheckFigures(Strict):
    """What the fleet-wide check of one attempt measured (trainer/fleet_check.py)."""

    attempt: int = Field(ge=0)
    """The attempt whose world was measured."""
    passed: bool
    busbw_gbytes_per_s: float = Field(ge=0)
    """The world's all-reduce bus bandwidth."""
    floor_gbytes_per_s: float = Field(ge=0)
    """What it had to reach."""
    slowest_link_gbytes_per_s: float | None = Field(default=None, ge=0)
    """The slowest node-to-node link, one direction."""
    slowest_link: list[str] = Field(default_factory=list)
    """Its two ends, sender first (instance ids)."""
    slow_instance_ids: list[str] = Field(default_factory=list)
    """The nodes to replace: none when the world passed, or when every node was slow."""
    seconds: float = Field(ge=0)
    """How long the check took."""

    def clauses(self) -> list[str]:
        """What it measured, clause by clause (a view wraps between them)."""
        link = ([f"slowest link {self.slowest_link_gbytes_per_s:.3f} GB/s, {' -> '.join(self.slowest_link)}"]
                if self.slowest_link_gbytes_per_s is not None else [])
        blamed = [f"slow: {', '.join(self.slow_instance_ids)}"] if self.slow_instance_ids else []
        return [f"fleet all-reduce {self.busbw_gbytes_per_s:.3f} GB/s, floor {self.floor_gbytes_per_s:.3f} GB/s",
                *link, *blamed]

    def describe(self) -> str:
        return "; ".join(self.clauses())


class ScalingCheckFigures(Strict):
    """What the scaling check of one attempt measured (trainer/scaling_check.py)."""

    attempt: int = Field(ge=0)
    """The attempt whose first steps were timed."""
    passed: bool
    efficiency: float = Field(ge=0)
    """Expected over measured step time."""
    efficiency_floor: float = Field(gt=0, le=1)
    step_seconds: float = Field(ge=0)
    """The measured step (median of the timed steps)."""
    expected_step_seconds: float = Field(ge=0)
    """What the ranks' own compute predicts, pipeline bubble included."""
    tokens_per_second: float = Field(ge=0)
    expected_tokens_per_second: float = Field(ge=0)
    steps: int = Field(ge=1)
    """Steps timed."""
    slowest_stages: list[int] = Field(default_factory=list)
    """The pipeline stages whose compute sets the expected step."""
    slowest_stage_seconds: float = Field(ge=0)
    """Their compute a step, on the fastest rank that holds them."""
    slowest_stage_instance_ids: list[str] = Field(default_factory=list)
    """The nodes that hold them."""
    slowest_rank: int = Field(ge=0)
    """The rank that computed longest."""
    slowest_rank_instance_id: str
    """Its node."""
    slowest_rank_seconds: float = Field(ge=0)
    """Its compute a step."""
    slow_instance_ids: list[str] = Field(default_factory=list)
    """The nodes to replace (a rank far slower than its peers): none when the world passed, or
    when it is uniformly poor (the run stops)."""

    def clauses(self) -> list[str]:
        """What it measured, clause by clause (a view wraps between them)."""
        blamed = [f"slow: {', '.join(self.slow_instance_ids)}"] if self.slow_instance_ids else []
        return [f"scaling efficiency {self.efficiency:.2f} (floor {self.efficiency_floor:.2f}): "
                f"{self.step_seconds:.3f} s a step against {self.expected_step_seconds:.3f} s expected, "
                f"{self.tokens_per_second:,.0f} tokens/s against {self.expected_tokens_per_second:,.0f}",
                f"slowest stage {', '.join(map(str, self.slowest_stages))} ({self.slowest_stage_seconds:.3f} s "
                f"of compute a step, on {', '.join(self.slowest_stage_instance_ids)})",
                f"slowest rank {self.slowest_rank} ({self.slowest_rank_seconds:.3f} s, on "
                f"{self.slowest_rank_instance_id})", *blamed]

    def describe(self) -> str:
        return "; ".join(self.clauses())


class RunRecord(Strict):
    """The run's row in DynamoDB. `version` increments on every write (optimistic locking)."""

    run_name: str
    """Key of the run (RunSpec.run_name)."""
    spec: RunSpec
    """The validated input, as started."""
    state: RunState = RunState.REQUESTED
    """Where the run is (see RunState's diagram)."""
    attempt: int = Field(default=0, ge=0)
    """Incremented by every recovery; events of older attempts are ignored."""
    restarts: int = Field(default=0, ge=0)
    """Recoveries so far (the restart budget counts these)."""
    failures: list[FailureRecord] = Field(default_factory=list)
    """Handled failures, oldest first: the newest, and those the recovery rules still count
    (lifecycle.kept_failures); a run record is one DynamoDB item, at most 400 KB."""
    earlier_failures: int = Field(default=0, ge=0)
    """Handled failures no longer kept in `failures` (Recover logs each decision)."""
    plan: ParallelPlan | None = None
    """Current world layout."""
    execution_arn: str | None = None
    """The Step Functions execution driving the run."""
    availability_zone: str | None = None
    """Zone the fleet landed in; replacements go there (one cluster placement group)."""
    subnet_id: str | None = None
    """Subnet of that zone, the only one replacements are requested in."""
    placement_group: str | None = None
    """Cluster placement group of the fleet (the reservation's own, or none, on reserved capacity)."""
    grow_tried_at: datetime | None = None
    """When the run, shrunk, last asked EC2 for the nodes it lacks (lifecycle.growth)."""
    capacity_stop_by: datetime | None = None
    """On a Capacity Block: when EC2 begins terminating its instances, by which the run stops
    (lifecycle.reservation)."""
    launch_template_id: str | None = None
    """The run's launch template."""
    fleet_requests_unfilled: int = Field(default=0, ge=0)
    """CreateFleet rounds that launched too few and raised CapacityUnavailable. Part of the
    fleet's ClientToken: EC2 answers a repeated token with the first answer, so the state
    machine's capacity retry must send a new one, while a retry after a launch that did succeed
    must send the old one and get the same fleet back."""
    latest_checkpoint: CheckpointRef | None = None
    """Newest committed checkpoint known: where the next attempt resumes."""
    waiting: TaskWait | None = None
    """The token to answer when the awaited event comes; cleared when answered."""
    attempt_failure: FailureReport | None = None
    """The first failure of the current attempt that touched its world (cleared by the next
    attempt). A wait of the attempt that parks after it fails with it at once: a worker lost while
    no token was parked (between Recover and AwaitNodes, or AwaitNodes and Train) is not missed."""
    attempt_started_at: datetime | None = None
    """When the current attempt began (allocation or recovery)."""
    nodes_launched_at: datetime | None = None
    """When the current attempt's nodes were in hand: Allocate recorded the fleet, or Recover
    decided. The boot timeout counts from here, not from Validate: a fleet that took capacity
    retries to launch is not late for them."""
    first_step_at: datetime | None = None
    """First training step of the current attempt (ends its start-up time)."""
    checkpoint_requested_at: datetime | None = None
    """Set when a training worker's departure was announced: every agent asks its trainer for a
    checkpoint now (agents read the run record at each look); a new attempt clears it."""
    departure_noticed_at: datetime | None = None
    """When the first node of the current attempt was announced leaving (its
    NodeRecord.departure_noticed_at); a new attempt clears it. Progress and checkpoint events
    judge on it whether the wait for the departure's checkpoint may be over
    (lifecycle.departure_wait_may_end), so they read the run record alone, not every node."""
    departure_due_at: datetime | None = None
    """The earliest time a leaving node of the current attempt goes, where AWS named one (the
    nodes' departure_due_at); the emergency checkpoint is asked for DEFERRED_LEAD before it
    (lifecycle.emergency_checkpoint_now). A new attempt clears it."""
    last_step: int | None = None
    """Latest step trained, as the control plane knows it: reported by progress events, never
    below the latest checkpoint (a committed step was trained)."""
    restore_from_memory: bool = False
    """Whether the current attempt resumes from the nodes' in-memory checkpoints (Recover's
    RecoveryDecision.restore_from_memory): the launch spec's restore_from_memory."""
    repair: WorldRepair | None = None
    """Whether the current attempt's world is the last one repaired in place (Recover's
    RecoveryDecision.repair): the launch spec's repair, and what the survivors' agents read to
    keep their trainers running into the new attempt."""
    restored: StateRestoredFigures | None = None
    """Where the latest attempt that resumed took its state from."""
    fleet_check: FleetCheckFigures | None = None
    """The latest fleet-wide check's figures."""
    scaling_check: ScalingCheckFigures | None = None
    """The latest scaling check's figures."""
    last_progress_at: datetime | None = None
    """When that step was reported."""
    ledger: GoodputLedger = Field(default_factory=GoodputLedger)
    """Productive and lost time, node time and cost so far."""
    error: str | None = None
    """Why the run failed (set before TEARING_DOWN on the failure path)."""
    created_at: datetime | None = None
    """Set by the run store on creation."""
    updated_at: datetime | None = None
    """Set by the run store on every write."""
    version: int = Field(default=0, ge=0)
    """Optimistic lock: every write is conditioned on the version it read."""

    def knowing(self, checkpoint: CheckpointRef | None) -> "RunRecord":
        """The record with `checkpoint` as its latest, unless it knows one as new already. A
        committed step was trained: the last step is at least it (progress is reported every few
        seconds, a commit as soon as an agent looks)."""
        if checkpoint is None or (self.latest_checkpoint and self.latest_checkpoint.step >= checkpoint.step):
            return self
        return self.model_copy(update={"latest_checkpoint": checkpoint,
                                       "last_step": max(self.last_step or 0, checkpoint.step)})

    def control(self) -> "RunControl":
        """What the agents read of the run at their looks."""
        return RunControl(
            state=self.state, attempt=self.attempt, nodes=self.spec.node_count + self.spec.spare_count,
            hang_timeout_seconds=self.spec.recovery.hang_timeout_seconds,
            checkpoint_requested_at=self.checkpoint_requested_at,
            checkpoint_committed_at=self.latest_checkpoint.committed_at if self.latest_checkpoint else None,
            failed_attempt=self.attempt_failure.attempt if self.attempt_failure else None,
            repair=RepairNotice(generation=self.repair.generation, launched_attempt=self.repair.launched_attempt)
            if self.repair else None)


class RepairNotice(Strict):
    """What an agent reads of a world repaired in place (WorldRepair) at its looks: whether its
    own world is the one repaired. The launch spec, which it then reads, names the survivors."""

    generation: int = Field(ge=1)
    """WorldRepair.generation."""
    launched_attempt: int = Field(ge=0)
    """WorldRepair.launched_attempt."""


class RunControl(Strict):
    """The run as its agents read it at every look (RunRecord.control): a few hundred bytes in an
    item of its own, however many failures, nodes and survivors the run record holds (2,048
    agents read it about 273 times a second while a run starts or recovers)."""

    state: RunState
    """RunRecord.state."""
    attempt: int = Field(ge=0)
    """RunRecord.attempt."""
    nodes: int = Field(ge=1)
    """The RunSpec's workers and spares: the pace of the looks."""
    hang_timeout_seconds: int = Field(ge=1)
    """The RunSpec's hang timeout: the pace of the looks too."""
    checkpoint_requested_at: datetime | None = None
    """RunRecord.checkpoint_requested_at."""
    checkpoint_committed_at: datetime | None = None
    """When the latest checkpoint the run knows committed."""
    failed_attempt: int | None = None
    """The attempt whose failure the run recorded (RunRecord.attempt_failure), if any."""
    repair: RepairNotice | None = None
    """RunRecord.repair, without its survivors (thousands of ids in a large world)."""


class NodeRecord(Strict):
    """One instance of a run, a DynamoDB item beside the run's."""

    run_name: str
    """The run it belongs to."""
    instance_id: str
    """EC2 instance id (the by-instance index key)."""
    state: NodeState = NodeState.LAUNCHED
    """Where the node is (see NodeState's diagram)."""
    role: NodeRole = NodeRole.WORKER
    """Worker in the world, or spare."""
    attempt: int = Field(default=0, ge=0)
    """Attempt in which the node was launched."""
    node_rank: int | None = None
    """Rank in the current launch spec; None for spares and unassigned nodes."""
    availability_zone: str | None = None
    """Zone it runs in."""
    subnet_id: str | None = None
    """Subnet of its primary interface."""
    private_ip: str | None = None
    """Its private IP, from NodeRegistered (node rank 0's is the rendezvous host)."""
    ready_attempt: int | None = Field(default=None, ge=0)
    """The latest attempt its agent confirmed it ready for (NodeReady of that attempt). A node
    READY in attempt k counts toward the world of attempt k+1 only once it confirms again: a
    node that froze or lost its network cannot."""
    market: CapacityKind = CapacityKind.ON_DEMAND
    """How it was bought: a Spot node can get interruption warnings."""
    failure_class: FailureClass | None = None
    """Why it was marked UNHEALTHY."""
    reason: str | None = None
    """For people: the event or check that marked it."""
    departure_noticed_at: datetime | None = None
    """When AWS announced it would leave while it trained (a Spot interruption warning, a
    rebalance recommendation, a scheduled retirement): the run trains on until a checkpoint
    commits (the emergency one, or the next interval one when the departure is not due yet),
    then replaces it (lifecycle.spot)."""
    departure_class: FailureClass | None = None
    """Which announcement: SPOT_INTERRUPTION, SPOT_REBALANCE or HEALTH_EVENT."""
    departure_due_at: datetime | None = None
    """When it goes, where AWS said (lifecycle.departure_due_at); None for a rebalance
    recommendation."""
    launched_at: datetime | None = None
    """Set by the run store when first recorded."""
    ready_at: datetime | None = None
    """When its agent first confirmed it READY: from launched_at, how long this run's nodes take
    to boot and pass preflight (lifecycle.predicted_boot_seconds)."""
    updated_at: datetime | None = None
    """Set by the run store on every write."""
    version: int = Field(default=0, ge=0)
    """Optimistic lock, as on RunRecord."""


class NodeLiveness(Strict):
    """What a node's agent last said about itself: written by the agent to its item of the
    liveness table at every look at the control plane while its trainer runs
    (adapters.liveness). Recover reads them to name the nodes behind a crash or a
    hang that no event pinned on a node (lifecycle.liveness)."""

    instance_id: str
    """The node."""
    attempt: int = Field(ge=0)
    """The attempt its trainer runs in."""
    step: int | None = Field(default=None, ge=0)
    """The last step its trainer completed in that attempt (the resume step once it joined the
    rendezvous); None while it has not joined."""
    step_at: datetime | None = None
    """When `step` last changed."""
    alive_at: datetime | None = None
    """When its trainer last gave a sign of life (a step, a microbatch, a phase of its start-up or
    its repair), as the agent saw it: in a hung world the rank that stopped falls silent first,
    its peers at their next exchange with it (lifecycle.first_silent)."""
    trainer_running: bool = True
    """Whether its torchrun runs. False in the report its agent writes the moment torchrun exits
    (no trainer of this node can take a repair order: lifecycle.trainers_alive) and in an idle
    agent's reports while the run trains (a READY spare, alive to step in at once:
    lifecycle.spares_alive)."""
    reported_at: datetime
    """When the agent wrote this: an agent that stops writing has stopped answering."""


class LaunchSpec(Strict):
    """What every node agent of an attempt reads to start torchrun."""

    run_name: str
    """The run."""
    attempt: int = Field(ge=0)
    """The attempt this world belongs to; an agent of another attempt must not join."""
    plan: ParallelPlan
    """Nodes, ranks per node, pp and dp."""
    node_ranks: dict[str, int]
    """instance id -> torchrun node rank; node rank 0 hosts the rendezvous."""
    rendezvous_host: str
    """Private IP of node rank 0."""
    rendezvous_port: int = RENDEZVOUS_PORT
    """c10d rendezvous port on node rank 0 (the launch draws it with rendezvous_port())."""
    rendezvous_id: str
    """Unique per attempt, so a restarted world never joins a stale rendezvous."""
    trainer_config: dict[str, Any]
    """The trainer's full config (pp, dp and the checkpoint section filled in)."""
    resume_step: int | None = None
    """Committed step to resume from; None starts from scratch."""
    restore_from_memory: bool = False
    """Resume from the in-memory checkpoints the nodes hold (a replaced node's shards from its
    buddy), S3 only for a shard that has none: Recover's choice (RecoveryDecision.restore)."""
    repairable: bool = False
    """The trainers wait for a repair order when a step fails instead of exiting (their config's
    parallel.repair_file): the run repairs lost nodes in place (RecoveryPolicy.repair_in_place)."""
    repair: WorldRepair | None = None
    """This attempt repairs the last world in place: the survivors' agents order their running
    trainers into generation `repair.generation`, met at rendezvous_host:rendezvous_port (node
    rank 0 survives), and the other nodes start trainers that join it."""
    heartbeat_task_token: str | None = None
    """Token rank 0's agent sends SendTaskHeartbeat / success with as training advances."""
    hang_timeout_seconds: int = Field(ge=HANG_TIMEOUT_MIN_S)
    """The run's RecoveryPolicy.hang_timeout_seconds: the Train task's HeartbeatSeconds, which
    sets the pace of the heartbeats (trainfleet.core.pace.heartbeat_pace)."""
    startup_timeout_seconds: int = Field(ge=HANG_TIMEOUT_MIN_S)
    """The run's RecoveryPolicy.startup_timeout_seconds: how long after torchrun's start node
    rank 0's agent heartbeats before the first step."""
    stall_floor_seconds: int = Field(ge=HANG_TIMEOUT_MIN_S)
    """The run's RecoveryPolicy.stall_floor_seconds: the least silence an agent calls a hang of
    a world that was stepping (trainfleet.core.pace.hung_after)."""

    @model_validator(mode="after")
    def _ranks(self) -> LaunchSpec:
        if sorted(self.node_ranks.values()) != list(range(self.plan.nodes)):
            raise ValueError(f"node_ranks must number the plan's {self.plan.nodes} nodes "
                             f"0..{self.plan.nodes - 1}, got {sorted(self.node_ranks.values())}")
        if self.repair:
            host = next(instance for instance, rank in self.node_ranks.items() if rank == 0)
            if host not in self.repair.survivor_ids or not set(self.repair.survivor_ids) <= self.node_ranks.keys():
                raise ValueError(f"a repaired world keeps node rank 0 ({host}) and its survivors "
                                 f"{self.repair.survivor_ids} among its nodes {sorted(self.node_ranks)}")
        return self


class RunRef(Strict):
    """What Step Functions states pass along: a reference, the fleet lives in DynamoDB."""

    run_name: str
    """The run."""
    attempt: int = Field(default=0, ge=0)
    """Its current attempt."""


