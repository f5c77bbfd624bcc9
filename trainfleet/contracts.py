"""Contracts: every data shape that crosses a boundary of the control plane, as pydantic v2 models.

The Lambda handlers, the state machine's payloads and the node agent all speak these shapes. The
module imports pydantic and the instance catalogue only (no boto3, no torch), so the agent on an
instance and a Lambda import the same definitions.

Offers:
    RunSpec                      what a user starts a run with (the Step Functions input)
      CapacitySpec, CheckpointPolicy, RecoveryPolicy, PreflightPolicy, ScalingCheckPolicy,
      TrainerConfig (+ TrainerParallel,
      TrainerModel, TrainerTraining)
    RunState, NodeState, NodeRole, CapacityKind, FailureClass, TrainerFailureKind   enums
    RUN_TRANSITIONS, NODE_TRANSITIONS, check_run_transition, check_node_transition,
      InvalidTransition         the allowed state changes
    RunRecord, NodeRecord, TaskWait, FailureRecord, CheckpointRef, GoodputLedger   stored records
      (+ FleetCheckFigures, ScalingCheckFigures)
    FailureReport, FAILURE_ERROR   a classified failure and the task-failure error name carrying it
    CAPACITY_ERROR              the error name of a task short of instances
    ParallelPlan, RecoveryAction, RecoveryDecision   what the lifecycle decides
    LaunchSpec                  what every node agent reads to start the trainer
    rendezvous_port(id)         the port of an attempt's c10d rendezvous (one of RENDEZVOUS_PORTS)
    RunRef                      the small reference Step Functions states carry
    Event details: Ec2InstanceStateChange (LOST_STATES: its states of an instance leaving), Ec2SpotInterruptionWarning,
      Ec2RebalanceRecommendation, HealthEvent (AWS shapes); NodeRegistered, NodeReady,
      NodeUnhealthy, CheckpointCommitted, TrainerFailed, TrainerHung, TrainingCompleted,
      TrainingProgress (its ProgressSample steps), FleetChecked, ScalingChecked (source
      "trainfleet/SENDER-INSTANCE-ARN")
    DetailType, EVENT_SOURCE, EventEnvelope (.sender), parse_event, put_events_entry,
      instance_arn, node_event_source, event_sender
    validation_message(error)   a ValidationError as "field.path: problem" lines, for people
    NODE_READ_PREFIXES, NODE_WRITE_PREFIXES, node_access_problems   what the nodes may touch in
      the stack's bucket (template.yaml's NodePolicy grants exactly these, the run's own folder under runs/) and the RunSpec's URIs
      that fall outside it
    SCHEDULES, schedule_problem  the pipeline schedules and their rules (torch-free)

Bad input raises pydantic.ValidationError; every message names the field (`loc`) and the value.
"""

from __future__ import annotations

import email.utils
import hashlib
import math
import re
from collections.abc import Callable
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from trainfleet.catalogue import InstanceFacts, UnknownInstanceType, instance_facts
from trainfleet.pace import HANG_TIMEOUT_MIN_S, hang_timeout_problem

EVENT_SOURCE = "trainfleet"
"""The family of the EventBridge `source` of every event a node sends: `trainfleet/INSTANCE-ARN`
(node_event_source), the sender's own ARN, which the node role lets it put and nothing else."""


def instance_arn(partition: str, region: str, account_id: str, instance_id: str) -> str:
    """An EC2 instance's ARN: what `ec2:SourceInstanceARN` holds in its profile's requests."""
    return f"arn:{partition}:ec2:{region}:{account_id}:instance/{instance_id}"


def node_event_source(sender_arn: str) -> str:
    """The `source` of an event sent by the instance `sender_arn`."""
    return f"{EVENT_SOURCE}/{sender_arn}"


def node_log_group(stack_name: str) -> str:
    """The CloudWatch Logs group of the stack's nodes (template.yaml's NodeLogGroup)."""
    return f"/trainfleet/{stack_name}/nodes"


def node_log_stream(run_name: str, instance_id: str) -> str:
    """A node's stream in node_log_group: under its run's name, the prefix its role may write."""
    return f"{run_name}/{instance_id}"


def event_sender(source: str) -> str | None:
    """The instance id of the node that sent an event with this `source`; None for any other."""
    family, _, sender_arn = source.partition("/")
    resource = sender_arn.rsplit(":", 1)[-1]
    if family != EVENT_SOURCE or not resource.startswith("instance/i-"):
        return None
    return resource.removeprefix("instance/")

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


class _Strict(BaseModel):
    """Our own shapes: unknown fields are an error (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """Shapes owned by others (AWS, the trainer): they add fields over time, so unknown ones are
    kept and passed on, never refused."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


def validation_message(error: ValidationError) -> str:
    """One line per problem, `field.path: message (got value)`, for an execution's error cause."""
    lines = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(part) for part in problem["loc"]) or "(input)"
        message = problem["msg"].removeprefix("Value error, ")
        got = problem.get("input")
        shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
        lines.append(f"{where}: {message}{shown}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Pipeline schedules and the layouts each can run: the one copy of these rules. The trainer
# (trainer/schedules.py) checks its config with them and maps each name to a torch class; the
# control plane validates and re-plans layouts with them.

Placement = Literal["single", "loop", "v"]


class ScheduleRule(NamedTuple):
    placement: Placement
    """single: one stage per rank; loop: stage s on rank s % pp; v: rank r holds r and 2pp-1-r."""
    stages_per_rank: int
    """Stages per rank when the config leaves parallel.stages_per_rank at 0."""
    needs_microbatches_ge_stages: bool
    """Fewer microbatches than stages starve the warm-up."""
    needs_whole_rounds: bool
    """Looped schedules run microbatches in rounds of pp."""


SCHEDULES: dict[str, ScheduleRule] = {
    "gpipe": ScheduleRule("single", 1, False, False),
    "1f1b": ScheduleRule("single", 1, True, False),
    "interleaved-1f1b": ScheduleRule("loop", 2, False, True),
    "looped-bfs": ScheduleRule("loop", 2, False, False),
    "interleaved-zero-bubble": ScheduleRule("loop", 2, False, True),
    "zbv-zero-bubble": ScheduleRule("v", 2, True, False),
    "dualpipev": ScheduleRule("v", 2, True, False),
}


def schedule_problem(name: str, pp: int, stages_per_rank: int, microbatches: int) -> str | None:
    """Why `name` cannot run pp ranks x stages_per_rank (0 = the schedule's default), else None."""
    rule = SCHEDULES[name]
    per_rank = stages_per_rank or rule.stages_per_rank
    stages = pp * per_rank
    if rule.placement == "single" and per_rank != 1:
        return f"schedule {name!r} runs exactly one stage per rank, got parallel.stages_per_rank={per_rank}"
    if rule.placement == "v" and per_rank != 2:
        return (f"schedule {name!r} needs exactly two stages per rank (a V), "
                f"got parallel.stages_per_rank={per_rank}")
    if rule.needs_microbatches_ge_stages and microbatches < stages:
        return (f"schedule {name!r} needs parallel.microbatches >= number of stages ({stages}), "
                f"got {microbatches}")
    rounds = max(1, microbatches // pp)
    if rule.needs_whole_rounds and microbatches % rounds != 0:
        return (f"schedule {name!r} runs microbatches in rounds of parallel.pp={pp}: "
                f"parallel.microbatches={microbatches} must be below pp or a multiple of it")
    return None


# ---------------------------------------------------------------------------------------------
# RunSpec

class CapacityKind(StrEnum):
    """Where instances come from."""

    ON_DEMAND = "on-demand"
    SPOT = "spot"
    CAPACITY_RESERVATION = "capacity-reservation"
    """An On-Demand Capacity Reservation (ODCR) named by id."""
    CAPACITY_BLOCK = "capacity-block"
    """An EC2 Capacity Block for ML (a reservation id, used as market type capacity-block)."""


_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_SECURITY_GROUP = re.compile(r"^sg-[0-9a-f]{8,17}$")
_RESERVATION = re.compile(r"^cr-[0-9a-f]{8,17}$")
_IMAGE = re.compile(r"^(ami-[0-9a-f]{8,17}|resolve:ssm:/?[A-Za-z0-9_./-]+(:[0-9]+)?)$")
_RUN_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,47}$")
# The launch template makes instance tags readable from instance metadata (the agent learns its
# run there), and EC2 then refuses an instance tag key outside these characters (no spaces, no
# `/`: the key is a path segment of the metadata), or one that is only `.`, `..` or `_index`.
_METADATA_TAG_KEY = re.compile(r"^[A-Za-z0-9+\-=.,_:@]{1,128}$")
_METADATA_TAG_KEYS_REFUSED = frozenset({".", "..", "_index"})
_TAG_VALUE_LIMIT = 256
_S3_URI = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")


def _check_all(values: list[str], pattern: re.Pattern, what: str) -> list[str]:
    for value in values:
        if not pattern.match(value):
            raise ValueError(f"{value!r} is not a {what} id")
    if len(set(values)) != len(values):
        raise ValueError(f"{what} ids must not repeat, got {values}")
    return values


class CapacitySpec(_Strict):
    """Where and how to get instances."""

    kind: CapacityKind = CapacityKind.ON_DEMAND
    """on-demand, spot, capacity-reservation (ODCR) or capacity-block (Capacity Block for ML)."""
    reservation_id: str | None = None
    """cr-... id; required for capacity-reservation and capacity-block, refused otherwise."""
    subnet_ids: list[str] = Field(min_length=1)
    """Subnets in order of preference, one per Availability Zone to try; the whole fleet lands in
    one of them (a cluster placement group cannot span zones). A reservation lives in one zone,
    so give the subnet of that zone."""
    security_group_ids: list[str] = Field(min_length=1)
    """Security groups of every interface; one must allow all traffic to and from itself (EFA)."""

    @field_validator("subnet_ids")
    @classmethod
    def _subnets(cls, value: list[str]) -> list[str]:
        return _check_all(value, _SUBNET, "subnet")

    @field_validator("security_group_ids")
    @classmethod
    def _groups(cls, value: list[str]) -> list[str]:
        return _check_all(value, _SECURITY_GROUP, "security group")

    @model_validator(mode="after")
    def _reservation_matches_kind(self) -> CapacitySpec:
        reserved = self.kind in (CapacityKind.CAPACITY_RESERVATION, CapacityKind.CAPACITY_BLOCK)
        if reserved and self.reservation_id is None:
            raise ValueError(f"capacity.kind={self.kind.value} needs capacity.reservation_id")
        if not reserved and self.reservation_id is not None:
            raise ValueError(f"capacity.reservation_id is only used with capacity-reservation or "
                             f"capacity-block, not capacity.kind={self.kind.value}")
        if self.reservation_id is not None and not _RESERVATION.match(self.reservation_id):
            raise ValueError(f"capacity.reservation_id={self.reservation_id!r} is not a cr-... id")
        return self


class CheckpointPolicy(_Strict):
    """Where and how often the trainer checkpoints (fills the trainer's checkpoint section)."""

    s3_uri: str
    """s3://BUCKET/PREFIX under which `step-NNNNNNNNN/` folders are written."""
    interval_steps: int = Field(default=100, ge=1)
    """Steps between checkpoints."""
    keep_last: int = Field(default=3, ge=2)
    """Committed checkpoints kept. At least 2: with asynchronous saves the only committed
    checkpoint could otherwise be pruned while the next one is still being written."""

    @field_validator("s3_uri")
    @classmethod
    def _s3(cls, value: str) -> str:
        if not _S3_URI.match(value):
            raise ValueError(f"{value!r} is not an s3://BUCKET/PREFIX uri")
        return value.rstrip("/")


LATE_WORKER_DEFAULT_S = 600
"""A GPU instance boots and passes preflight in minutes; one ten minutes late is more likely
stuck than slow."""


class PreflightPolicy(_Strict):
    """The fleet-wide check at the start of every attempt (trainer/fleet_check.py)."""

    fleet_check: bool = True
    """Measure the world's network before it trains (an all-reduce, then every node-to-node link)
    in every attempt of more than one node; a world below the floor has its slow nodes replaced
    (spares first) before a step is trained."""
    busbw_floor_gbytes_per_s: float | None = Field(default=None, gt=0)
    """The all-reduce bus bandwidth a healthy world reaches; None: the instance type's
    (catalogue busbw_floor_gbytes_per_s)."""
    size_mib: float | None = Field(default=None, gt=0, le=4096)
    """The buffer each rank all-reduces and exchanges with its partners; None: 1 GiB on types with
    accelerators (where NCCL's all-reduce reaches its bandwidth plateau), 16 MiB on CPU types."""
    iterations: int = Field(default=5, ge=1, le=100)
    """Timed repetitions of each measurement."""


class ScalingCheckPolicy(_Strict):
    """The judgement of every attempt's first steps on the whole fleet (trainer/scaling_check.py)."""

    enabled: bool | None = None
    """Time the real model's first steps on the whole world against what its ranks compute alone;
    a world below the floor does not train on. None: on for instance types with accelerators,
    off for CPU types (whose timings say little about a GPU fleet)."""
    warmup_steps: int = Field(default=2, ge=0, le=1000)
    """Steps of each attempt left untimed first (allocator, NCCL set-up, the first compilation)."""
    steps: int = Field(default=5, ge=1, le=1000)
    """Steps timed after them."""
    efficiency_floor: float = Field(default=0.7, gt=0, le=1)
    """Step time the ranks' own compute predicts (pipeline bubble included) over the step time
    measured, below which the run does not go on."""

    def enabled_for(self, facts: InstanceFacts) -> bool:
        """Whether the check runs on this instance type."""
        return self.enabled if self.enabled is not None else facts.accelerator != "none"


class RecoveryPolicy(_Strict):
    """How hard the run tries before it gives up."""

    max_restarts: int = Field(default=10, ge=0)
    """Recoveries allowed within any restart_window_hours; one more failure gives up. Only
    failures the job may cause count: what AWS announces (Spot, rebalance, Health events) and a
    shortfall of capacity never do (a three-week run on 512 p5 sees one to three interruptions
    a day)."""
    restart_window_hours: float = Field(default=24.0, gt=0)
    """The window max_restarts counts in."""
    crash_loop_repeats: int = Field(default=3, ge=2)
    """Give up after this many failures of the same class in a row with no checkpoint committed
    in between, each blaming the same nodes or none (different nodes failing one after another,
    each replaced, are no loop; announced AWS events and capacity shortfalls never are)."""
    capacity_wait_hours: float = Field(default=6.0, gt=0)
    """How long the run keeps its fleet and waits, with backoff, for capacity it lacks (a
    replacement EC2 cannot launch, with no min_nodes to shrink to) before it gives up."""
    backoff_base_seconds: float = Field(default=30.0, ge=0)
    """Wait before the first retry of a failure streak on the same nodes (a first failure whose
    blamed nodes are replaced retries at once)."""
    backoff_multiplier: float = Field(default=2.0, ge=1)
    """Growth of the wait with each further failure in the same streak."""
    backoff_max_seconds: float = Field(default=900.0, ge=0)
    """Upper bound of any wait."""
    backoff_jitter: float = Field(default=0.2, ge=0, le=1)
    """Fraction of the wait drawn at random, so that many runs do not retry in lockstep."""
    hang_timeout_seconds: int = Field(default=600, ge=HANG_TIMEOUT_MIN_S)
    """No training progress for this long means hung (the Train task's HeartbeatSeconds). The
    default is NCCL's own collective timeout: a world that waits longer on a peer has lost it.
    The agents look at the control plane often enough to tell a silent node within it, so a
    large run's read rate bounds it from below (trainfleet.pace)."""
    startup_timeout_seconds: int = Field(default=1800, ge=HANG_TIMEOUT_MIN_S)
    """Longest time from torchrun's start to the attempt's first step (rendezvous, NCCL set-up,
    checkpoint load): rank 0's agent heartbeats the Train task that long before a step, then a
    hang is declared hang_timeout_seconds later. At least hang_timeout_seconds."""
    boot_timeout_seconds: int = Field(default=1800, ge=60)
    """Longest wait for the nodes to boot and pass preflight (AwaitNodes and its late-worker rounds)."""
    late_worker_seconds: int | None = Field(default=None, ge=1)
    """With spares: how long AwaitNodes waits for every worker before a READY spare takes the
    place of one that has not confirmed (lifecycle.swap_late_workers). The late worker becomes
    a spare (or is released, if it had passed preflight before and went silent); the wait goes
    on in rounds of this length until boot_timeout_seconds, its bound. None:
    LATE_WORKER_DEFAULT_S, or the boot timeout when that is shorter (late_worker_deadline)."""

    @property
    def late_worker_deadline(self) -> int:
        """The late-worker deadline in force: late_worker_seconds, or its default."""
        return self.late_worker_seconds or min(LATE_WORKER_DEFAULT_S, self.boot_timeout_seconds)

    @model_validator(mode="after")
    def _bounds(self) -> RecoveryPolicy:
        if self.backoff_max_seconds < self.backoff_base_seconds:
            raise ValueError(f"recovery.backoff_max_seconds={self.backoff_max_seconds} is below "
                             f"recovery.backoff_base_seconds={self.backoff_base_seconds}")
        if self.late_worker_seconds is not None and self.late_worker_seconds > self.boot_timeout_seconds:
            raise ValueError(f"recovery.late_worker_seconds={self.late_worker_seconds} exceeds "
                             f"recovery.boot_timeout_seconds={self.boot_timeout_seconds}: the boot bounds the wait")
        if self.startup_timeout_seconds < self.hang_timeout_seconds:
            raise ValueError(f"recovery.startup_timeout_seconds={self.startup_timeout_seconds} is below "
                             f"recovery.hang_timeout_seconds={self.hang_timeout_seconds}: starting an attempt "
                             "takes longer than a steady step")
        return self


class TrainerParallel(_Open):
    """The trainer's `parallel` section; these fields are typed, others pass through."""

    pp: int = Field(ge=1)
    """Pipeline-parallel degree."""
    dp: int = Field(ge=1)
    """Data-parallel degree; pp x dp x tp = nodes x ranks per node."""
    dp_shard: int = Field(default=0, ge=0)
    """Data-parallel ranks sharing one sharded copy of the state; 0 = all of dp."""
    tp: int = Field(default=1, ge=1)
    """Tensor-parallel degree; stays inside a node, so a re-plan keeps it."""
    schedule: str
    """Pipeline schedule, one of SCHEDULES."""
    microbatches: int = Field(ge=1)
    """Microbatches per step per replica."""
    stages_per_rank: int = Field(default=0, ge=0)
    """Stages per pipeline rank; 0 = what the schedule needs."""
    layers_per_stage: list[int] = Field(default_factory=list)
    """Explicit layer split; pins the number of stages, so a re-plan keeps pp."""

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        if value not in SCHEDULES:
            raise ValueError(f"schedule {value!r} is unknown; choose one of {sorted(SCHEDULES)}")
        return value


class TrainerModel(_Open):
    """The trainer's `model` section; these fields are typed, others pass through."""

    n_layers: int = Field(ge=1)
    """Transformer blocks; every pipeline stage needs at least one."""
    tie_embeddings: bool = False
    """A tied embedding and head need pp = 1."""


class TrainerTraining(_Open):
    """The trainer's `training` section; these fields are typed, others pass through."""

    batch_size: int = Field(ge=1)
    """Global batch in sequences; kept fixed by a re-plan, so it must divide by dp."""


# The sections and fields of trainer/config.py's JobConfig that a RunSpec may set (the
# checkpoint section is the control plane's). A misspelt field is refused here, before any
# instance is paid for, instead of by the trainer on the nodes. tests/test_contracts.py checks
# this list against JobConfig.
FILLED_SECTIONS = {"checkpoint": "checkpoint", "fleet_check": "preflight", "scaling_check": "scaling_check"}
"""Trainer config sections the control plane fills from the RunSpec's own sections."""
TRAINER_FIELDS: dict[str, frozenset[str]] = {
    "model": frozenset({"n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "mlp_ratio",
                        "tie_embeddings"}),
    "parallel": frozenset({"pp", "dp", "dp_shard", "tp", "reshard_after_forward", "schedule", "microbatches",
                           "stages_per_rank", "layers_per_stage", "timeout_s"}),
    "data": frozenset({"shards", "cache_dir", "cache_bytes", "corpus_bytes", "shard_tokens"}),
    "optim": frozenset({"lr", "min_lr_ratio", "warmup_steps", "decay_steps", "weight_decay", "beta1", "beta2",
                        "eps", "grad_clip"}),
    "training": frozenset({"steps", "batch_size", "seed", "device", "activation_checkpoint", "compile", "threads",
                           "metrics_file"}),
}


class TrainerConfig(_Open):
    """The trainer's config (trainer/config.py JobConfig) as a mapping of sections.

    The control plane types what it plans with (model.n_layers, parallel.*, training.batch_size)
    and carries the other fields to the trainer as given; their names are checked against
    TRAINER_FIELDS, their values by the trainer's own checks, which Validate runs on
    RunSpec.trainer_mapping before anything is allocated. The `checkpoint` section is filled
    from RunSpec.checkpoint, so setting it here is an error.
    """

    model: TrainerModel
    parallel: TrainerParallel
    training: TrainerTraining

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        for section, fields in raw.items():
            if section in FILLED_SECTIONS:
                raise ValueError(f"trainer.{section} is filled from RunSpec.{FILLED_SECTIONS[section]}; set it there")
            if section not in TRAINER_FIELDS:
                raise ValueError(f"trainer.{section} is not a section of the trainer config; "
                                 f"known: {', '.join(sorted(TRAINER_FIELDS))}")
            if not isinstance(fields, dict):
                raise ValueError(f"trainer.{section} must be a mapping of fields, got {fields!r}")
            unknown = sorted(set(fields) - TRAINER_FIELDS[section])
            if unknown:
                raise ValueError(f"trainer.{section}.{unknown[0]} is not a field of the trainer config; "
                                 f"known: {', '.join(sorted(TRAINER_FIELDS[section]))}")
        return raw

    @model_validator(mode="after")
    def _layout_runs(self) -> TrainerConfig:
        problem = layout_problem(self, self.parallel.pp, self.parallel.dp)
        if problem:
            raise ValueError(problem)
        return self

    def as_trainer_mapping(self, pp: int, dp: int, filled: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The full config for the trainer, with the planned layout and the sections the
        control plane fills (FILLED_SECTIONS)."""
        unknown = set(filled) - set(FILLED_SECTIONS)
        if unknown:
            raise ValueError(f"sections {sorted(unknown)} are not filled by the control plane")
        doc = self.model_dump(mode="json")
        doc["parallel"].update(pp=pp, dp=dp)
        return doc | filled


def layout_problem(config: TrainerConfig, pp: int, dp: int) -> str | None:
    """Why the trainer cannot run `config` at pp x dp, else None (the rules of JobConfig.validate)."""
    par, model = config.parallel, config.model
    return pipeline_layout_problem(n_layers=model.n_layers, tie_embeddings=model.tie_embeddings,
                                   batch_size=config.training.batch_size, pp=pp, dp=dp, schedule=par.schedule,
                                   stages_per_rank=par.stages_per_rank, layers_per_stage=par.layers_per_stage,
                                   microbatches=par.microbatches, dp_shard=par.dp_shard)


def pipeline_layout_problem(*, n_layers: int, tie_embeddings: bool, batch_size: int, pp: int, dp: int, schedule: str,
                            stages_per_rank: int, layers_per_stage: list[int] | tuple[int, ...], microbatches: int,
                            dp_shard: int) -> str | None:
    """layout_problem over plain values, for callers that try many layouts (the memory planner)."""
    per_rank = stages_per_rank or SCHEDULES[schedule].stages_per_rank
    stages = pp * per_rank if pp > 1 else 1
    if stages > n_layers:
        return f"{stages} pipeline stages need at least as many layers, but model.n_layers={n_layers}"
    if layers_per_stage and len(layers_per_stage) != stages:
        return f"parallel.layers_per_stage lists {len(layers_per_stage)} stages, the layout has {stages}"
    if batch_size % dp:
        return f"training.batch_size={batch_size} must be divisible by parallel.dp={dp}"
    if dp_shard and dp % dp_shard:
        return f"parallel.dp_shard={dp_shard} must divide parallel.dp={dp}"
    if (batch_size // dp) % microbatches:
        return (f"parallel.microbatches={microbatches} must divide the per-replica batch "
                f"(training.batch_size / parallel.dp = {batch_size // dp})")
    if pp > 1 and tie_embeddings:
        return "model.tie_embeddings=true needs parallel.pp=1"
    if pp > 1:
        return schedule_problem(schedule, pp, stages_per_rank, microbatches)
    return None


class RunSpec(_Strict):
    """A training run as the user asks for it: the input of a Step Functions execution."""

    run_name: str
    """Lower-case letters, digits and dashes, at most 48; names the run everywhere (S3, tags)."""
    instance_type: str
    """An EC2 instance type from the catalogue (trainfleet.catalogue.CATALOGUE)."""
    node_count: int = Field(ge=1)
    """Nodes the training world needs."""
    spare_count: int = Field(default=0, ge=0)
    """Extra nodes kept booted and healthy, swapped in when a node fails."""
    min_nodes: int | None = Field(default=None, ge=1)
    """Fewest nodes the run may shrink to (re-planning pp x dp); None = never shrink."""
    capacity: CapacitySpec
    """Where instances come from and which subnets to try."""
    image_id: str
    """AMI id (ami-...) or an SSM parameter as `resolve:ssm:/path` (resolved at launch)."""
    trainer: TrainerConfig
    """The trainer's config; parallel.pp x parallel.dp must fill node_count nodes."""
    checkpoint: CheckpointPolicy
    """Checkpoint location and cadence."""
    recovery: RecoveryPolicy = Field(default_factory=RecoveryPolicy)
    """Restart budget, crash-loop rule, backoff, hang and boot timeouts."""
    preflight: PreflightPolicy = Field(default_factory=PreflightPolicy)
    """The fleet-wide network check before each attempt trains."""
    scaling_check: ScalingCheckPolicy = Field(default_factory=ScalingCheckPolicy)
    """The judgement of each attempt's first steps on the whole fleet."""
    cost_ceiling_usd: float | None = Field(default=None, gt=0)
    """Stop the run once its instance cost reaches this; None = no ceiling."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Extra tags on every instance (besides the trainfleet ones)."""

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        if not _RUN_NAME.match(value):
            raise ValueError(f"{value!r} must be 1-48 lower-case letters, digits or dashes, "
                             "starting with a letter or digit")
        return value

    @field_validator("instance_type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        try:
            instance_facts(value)
        except UnknownInstanceType as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("image_id")
    @classmethod
    def _image(cls, value: str) -> str:
        if not _IMAGE.match(value):
            raise ValueError(f"{value!r} is neither an ami-... id nor resolve:ssm:/parameter")
        return value

    @field_validator("tags")
    @classmethod
    def _tags(cls, value: dict[str, str]) -> dict[str, str]:
        reserved = [key for key in value if key.lower().startswith(("trainfleet:", "aws:"))]
        if reserved:
            raise ValueError(f"tag keys {reserved} are reserved (trainfleet:, aws:)")
        for key, tag_value in value.items():
            if not _METADATA_TAG_KEY.match(key) or key in _METADATA_TAG_KEYS_REFUSED:
                raise ValueError(f"tag key {key!r}: instances expose their tags in instance metadata, where EC2 "
                                 "allows only 1-128 letters, digits and + - = . , _ : @ (no spaces or /), "
                                 "and not '.', '..' or '_index'")
            if len(tag_value) > _TAG_VALUE_LIMIT:
                raise ValueError(f"tag {key!r}: values take at most {_TAG_VALUE_LIMIT} characters, "
                                 f"got {len(tag_value)}")
        return value

    @model_validator(mode="after")
    def _fits(self) -> RunSpec:
        if self.min_nodes is not None and self.min_nodes > self.node_count:
            raise ValueError(f"min_nodes={self.min_nodes} exceeds node_count={self.node_count}")
        ranks_per_node = self.facts.ranks_per_node
        ranks = self.node_count * ranks_per_node
        par = self.trainer.parallel
        if ranks_per_node % par.tp:
            raise ValueError(f"trainer.parallel.tp={par.tp} must divide the {ranks_per_node} ranks per "
                             f"{self.instance_type}: tensor parallelism stays inside a node")
        if par.pp * par.dp * par.tp != ranks:
            raise ValueError(
                f"trainer.parallel.pp x dp x tp = {par.pp} x {par.dp} x {par.tp} = {par.pp * par.dp * par.tp} "
                f"ranks, but node_count={self.node_count} x {ranks_per_node} ranks per "
                f"{self.instance_type} = {ranks}")
        if problem := hang_timeout_problem(self.node_count + self.spare_count, self.recovery.hang_timeout_seconds):
            raise ValueError(problem)
        return self

    @property
    def facts(self) -> InstanceFacts:
        """The catalogue entry of the instance type."""
        return instance_facts(self.instance_type)

    @property
    def shrink_floor(self) -> int:
        """Fewest nodes the run may continue with."""
        return self.min_nodes or self.node_count

    def trainer_mapping(self, pp: int, dp: int, resume_step: int | None, scaling_check_due: bool = True) -> dict[str, Any]:
        """The trainer's full config at pp x dp: the trainer section with the checkpoint section
        made from `checkpoint`, resuming from `resume_step` (None: from scratch), and the world
        checks; the scaling check only while it is due (no world of the run has passed it)."""
        policy, preflight, scaling = self.checkpoint, self.preflight, self.scaling_check
        nodes = pp * dp * self.trainer.parallel.tp // self.facts.ranks_per_node
        return self.trainer.as_trainer_mapping(pp, dp, {
            "checkpoint": {"uri": policy.s3_uri, "interval": policy.interval_steps, "keep_last": policy.keep_last,
                           "resume": "none" if resume_step is None else str(resume_step)},
            "fleet_check": {"enabled": preflight.fleet_check and nodes > 1,
                            "size_mib": preflight.size_mib or (1024.0 if self.facts.accelerator != "none" else 16.0),
                            "iterations": preflight.iterations,
                            "busbw_floor_gbytes_per_s": (preflight.busbw_floor_gbytes_per_s
                                                         or self.facts.busbw_floor_gbytes_per_s)},
            "scaling_check": {"enabled": scaling_check_due and scaling.enabled_for(self.facts),
                              "warmup_steps": scaling.warmup_steps,
                              "steps": scaling.steps, "efficiency_floor": scaling.efficiency_floor}})


# ---------------------------------------------------------------------------------------------
# What the nodes may touch in the stack's bucket. template.yaml's NodePolicy grants exactly these
# prefixes (tests/test_iam_policies.py checks both agree): a RunSpec naming an S3 URI outside
# them would fail on the nodes with AccessDenied after the fleet was paid for.

NODE_READ_PREFIXES = ("runs/", "data/", "artifacts/")
"""Readable by the nodes: their run's folder under runs/ (launch spec, checkpoints), token
shards, and the wheelhouse the user data installs."""
NODE_WRITE_PREFIXES = ("runs/",)
"""Writable (and deletable) by the nodes: their run's folder under runs/ (checkpoints and what
else a run writes)."""


class DefaultNetwork(NamedTuple):
    """The account's default VPC in the region: its default subnet of each zone and its default
    security group (which allows all traffic among its members: what EFA needs)."""

    subnet_ids: list[str]
    security_group_ids: list[str]


def with_stack_defaults(document: Any, bucket: str, default_network: Callable[[], DefaultNetwork]) -> Any:
    """The RunSpec document with what its author may leave to the stack filled in, as given
    otherwise: `checkpoint.s3_uri`, the stack's bucket under runs/RUN/checkpoints; the capacity's
    subnets and security groups when it names neither, the account's default VPC's
    (`default_network()`, asked only then), as EC2 launches into them when a request names none.
    A document that is not a RunSpec is returned as it is: validation names its problems."""
    if not isinstance(document, dict) or not isinstance(document.get("run_name"), str):
        return document
    filled = dict(document)
    checkpoint = filled.get("checkpoint", {})
    if isinstance(checkpoint, dict) and "s3_uri" not in checkpoint:
        filled["checkpoint"] = {**checkpoint, "s3_uri": f"s3://{bucket}/runs/{document['run_name']}/checkpoints"}
    capacity = filled.get("capacity", {})
    if isinstance(capacity, dict) and "subnet_ids" not in capacity and "security_group_ids" not in capacity:
        network = default_network()
        filled["capacity"] = {"subnet_ids": network.subnet_ids, "security_group_ids": network.security_group_ids,
                              **capacity}
    return filled


def node_access_problems(spec: RunSpec, bucket: str) -> list[str]:
    """`field: problem` for each S3 URI of the RunSpec the nodes could not use in `bucket`."""

    def outside(uri: str, prefixes: tuple[str, ...]) -> bool:
        return not any(uri.startswith(f"s3://{bucket}/{prefix}") for prefix in prefixes)

    def allowed(prefixes: tuple[str, ...]) -> str:
        return ", ".join(f"s3://{bucket}/{prefix}" for prefix in prefixes)

    problems = []
    own = f"s3://{bucket}/runs/{spec.run_name}/"
    if outside(spec.checkpoint.s3_uri + "/", NODE_WRITE_PREFIXES):
        problems.append(f"checkpoint.s3_uri: the nodes write checkpoints only under "
                        f"{allowed(NODE_WRITE_PREFIXES)} (this stack's bucket, NodePolicy) "
                        f"(got {spec.checkpoint.s3_uri!r})")
    elif not (spec.checkpoint.s3_uri + "/").startswith(own):
        # A RunSpec copied under a new name must not resume, prune or retain another run's steps.
        problems.append(f"checkpoint.s3_uri: a run's checkpoints are its own, under {own} "
                        f"(got {spec.checkpoint.s3_uri!r})")
    shards = (spec.trainer.model_extra or {}).get("data", {}).get("shards", "")
    if str(shards).startswith("s3://") and outside(str(shards).rstrip("/") + "/", NODE_READ_PREFIXES):
        problems.append(f"trainer.data.shards: the nodes read only under "
                        f"{allowed(NODE_READ_PREFIXES)} (this stack's bucket, NodePolicy) (got {shards!r})")
    elif str(shards).startswith(f"s3://{bucket}/runs/") and not (str(shards).rstrip("/") + "/").startswith(own):
        problems.append(f"trainer.data.shards: under runs/ a run's nodes read their own run's folder alone, "
                        f"{own} (got {shards!r})")
    return problems


# ---------------------------------------------------------------------------------------------
# States

class InvalidTransition(ValueError):
    """A state change the diagram does not allow (names both states)."""


class RunState(StrEnum):
    """Where a run is. Every change is a conditional write on the previous state.

        REQUESTED ─▶ ALLOCATING ─▶ AWAITING_NODES ─▶ TRAINING ─▶ TEARING_DOWN ─▶ SUCCEEDED
                         ▲               │              │             ▲        └─▶ FAILED
                         │               ▼              ▼             │
                         └────────── RECOVERING ◀───────┘             │
           (any state that is not final) ─────────────────────────────┘

    RECOVERING goes back to ALLOCATING (replacements) or straight to AWAITING_NODES (spares
    or a shrink cover it). TEARING_DOWN is on every path: no instance outlives its run.
    """

    REQUESTED = "REQUESTED"
    ALLOCATING = "ALLOCATING"
    AWAITING_NODES = "AWAITING_NODES"
    TRAINING = "TRAINING"
    RECOVERING = "RECOVERING"
    TEARING_DOWN = "TEARING_DOWN"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @property
    def is_final(self) -> bool:
        return self in (RunState.SUCCEEDED, RunState.FAILED)


_R = RunState
# TEARING_DOWN is reachable from every state before it: it is the state machine's Catch-all.
RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    _R.REQUESTED: frozenset({_R.ALLOCATING, _R.TEARING_DOWN}),
    _R.ALLOCATING: frozenset({_R.AWAITING_NODES, _R.RECOVERING, _R.TEARING_DOWN}),
    _R.AWAITING_NODES: frozenset({_R.TRAINING, _R.RECOVERING, _R.TEARING_DOWN}),
    _R.TRAINING: frozenset({_R.RECOVERING, _R.TEARING_DOWN}),
    _R.RECOVERING: frozenset({_R.ALLOCATING, _R.AWAITING_NODES, _R.TEARING_DOWN}),
    _R.TEARING_DOWN: frozenset({_R.SUCCEEDED, _R.FAILED}),
    _R.SUCCEEDED: frozenset(),
    _R.FAILED: frozenset(),
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
    """A node's software did not install (its user data failed a step, BOOT_CHECK): the same on
    every node, so no replacement can help."""
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


class FailureReport(_Strict):
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


class ParallelPlan(_Strict):
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


class RecoveryDecision(_Strict):
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


class LateWorkerSwap(_Strict):
    """What lifecycle.swap_late_workers decided once AwaitNodes' late-worker deadline passed:
    READY spares take the places of workers that have not confirmed for the attempt."""

    promote_spare_ids: list[str] = Field(default_factory=list)
    """Spares, confirmed for the attempt, that become workers."""
    demote_worker_ids: list[str] = Field(default_factory=list)
    """Late workers still booting or in preflight: they become spares and go on booting."""
    release_instance_ids: list[str] = Field(default_factory=list)
    """Late workers that passed preflight before and did not confirm this attempt (their agent
    went silent): terminated."""


class FailureRecord(_Strict):
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
    instance_ids: list[str] = Field(default_factory=list)
    """The nodes blamed."""
    message: str = ""
    """For people: what was seen."""

    @property
    def detection_seconds(self) -> float | None:
        """From the first sign to the decision: how long the fleet waited on a failure before the
        control plane acted on it."""
        return None if self.onset_at is None else max(0.0, (self.at - self.onset_at).total_seconds())


class CheckpointRef(_Strict):
    """A committed checkpoint as the control plane knows it."""

    step: int = Field(ge=0)
    """Training step the checkpoint was taken after."""
    uri: str
    """s3://.../step-NNNNNNNNN (the folder the trainer resumes from)."""
    committed_at: datetime | None = None
    """Commit time from the marker."""


class GoodputLedger(_Strict):
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


class TaskWait(_Strict):
    """A Step Functions task token the run is parked on (AwaitNodes or Train)."""

    purpose: Literal["await_nodes", "train"]
    """Which task waits: AwaitNodes (all workers ready) or Train (completion, heartbeats)."""
    attempt: int = Field(ge=0)
    """The attempt the task belongs to; events of other attempts must not answer it."""
    token: str = Field(min_length=1)
    """The Step Functions task token."""


class FleetCheckFigures(_Strict):
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


class ScalingCheckFigures(_Strict):
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


class RunRecord(_Strict):
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
    """Latest step reported by progress events."""
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
        """The record with `checkpoint` as its latest, unless it knows one as new already."""
        if checkpoint is None or (self.latest_checkpoint and self.latest_checkpoint.step >= checkpoint.step):
            return self
        return self.model_copy(update={"latest_checkpoint": checkpoint})


class NodeRecord(_Strict):
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
    updated_at: datetime | None = None
    """Set by the run store on every write."""
    version: int = Field(default=0, ge=0)
    """Optimistic lock, as on RunRecord."""


class NodeLiveness(_Strict):
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
    reported_at: datetime
    """When the agent wrote this: an agent that stops writing has stopped answering."""


class LaunchSpec(_Strict):
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
    heartbeat_task_token: str | None = None
    """Token rank 0's agent sends SendTaskHeartbeat / success with as training advances."""
    hang_timeout_seconds: int = Field(ge=HANG_TIMEOUT_MIN_S)
    """The run's RecoveryPolicy.hang_timeout_seconds: the Train task's HeartbeatSeconds, which
    sets the pace of the heartbeats (trainfleet.pace.heartbeat_pace)."""
    startup_timeout_seconds: int = Field(ge=HANG_TIMEOUT_MIN_S)
    """The run's RecoveryPolicy.startup_timeout_seconds: how long after torchrun's start node
    rank 0's agent heartbeats before the first step."""

    @model_validator(mode="after")
    def _ranks(self) -> LaunchSpec:
        if sorted(self.node_ranks.values()) != list(range(self.plan.nodes)):
            raise ValueError(f"node_ranks must number the plan's {self.plan.nodes} nodes "
                             f"0..{self.plan.nodes - 1}, got {sorted(self.node_ranks.values())}")
        return self


class RunRef(_Strict):
    """What Step Functions states pass along: a reference, the fleet lives in DynamoDB."""

    run_name: str
    """The run."""
    attempt: int = Field(default=0, ge=0)
    """Its current attempt."""


# ---------------------------------------------------------------------------------------------
# Events

class DetailType(StrEnum):
    """EventBridge detail-type of every event the control plane handles."""

    EC2_STATE_CHANGE = "EC2 Instance State-change Notification"
    EC2_SPOT_INTERRUPTION = "EC2 Spot Instance Interruption Warning"
    EC2_REBALANCE = "EC2 Instance Rebalance Recommendation"
    HEALTH = "AWS Health Event"
    NODE_REGISTERED = "NodeRegistered"
    NODE_READY = "NodeReady"
    NODE_UNHEALTHY = "NodeUnhealthy"
    CHECKPOINT_COMMITTED = "CheckpointCommitted"
    TRAINER_FAILED = "TrainerFailed"
    TRAINER_HUNG = "TrainerHung"
    TRAINING_COMPLETED = "TrainingCompleted"
    TRAINING_PROGRESS = "TrainingProgress"
    FLEET_CHECKED = "FleetChecked"
    SCALING_CHECKED = "ScalingChecked"


class Ec2InstanceStateChange(_Open):
    """aws.ec2 "EC2 Instance State-change Notification" detail."""

    SOURCE: ClassVar[str] = "aws.ec2"
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.EC2_STATE_CHANGE

    instance_id: str = Field(alias="instance-id")
    state: Literal["pending", "running", "stopping", "stopped", "shutting-down", "terminated"]


LOST_STATES = frozenset({"stopping", "stopped", "shutting-down", "terminated"})
"""EC2 instance states in which an instance is leaving for good (or at least leaving the world)."""


class Ec2SpotInterruptionWarning(_Open):
    """aws.ec2 "EC2 Spot Instance Interruption Warning" detail (two minutes ahead)."""

    SOURCE: ClassVar[str] = "aws.ec2"
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.EC2_SPOT_INTERRUPTION

    instance_id: str = Field(alias="instance-id")
    instance_action: Literal["terminate", "stop", "hibernate"] = Field(alias="instance-action")


class Ec2RebalanceRecommendation(_Open):
    """aws.ec2 "EC2 Instance Rebalance Recommendation" detail."""

    SOURCE: ClassVar[str] = "aws.ec2"
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.EC2_REBALANCE

    instance_id: str = Field(alias="instance-id")


class HealthEventDescription(_Open):
    language: str
    latest_description: str = Field(alias="latestDescription")


class HealthAffectedEntity(_Open):
    entity_value: str = Field(alias="entityValue")
    """For EC2 events, an instance id."""


class HealthEvent(_Open):
    """aws.health "AWS Health Event" detail (only service EC2 concerns a run)."""

    SOURCE: ClassVar[str] = "aws.health"
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.HEALTH

    event_arn: str = Field(alias="eventArn")
    service: str
    event_type_code: str = Field(alias="eventTypeCode")
    """e.g. AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED."""
    event_type_category: str = Field(alias="eventTypeCategory")
    """issue, accountNotification, scheduledChange or investigation."""
    start_time: str | None = Field(default=None, alias="startTime")
    """When it happens, as AWS Health writes it: "Mon, 6 Feb 2023 00:00:00 GMT" (RFC 1123)."""
    end_time: str | None = Field(default=None, alias="endTime")
    event_description: list[HealthEventDescription] = Field(default_factory=list, alias="eventDescription")
    affected_entities: list[HealthAffectedEntity] = Field(default_factory=list, alias="affectedEntities")

    @property
    def starts_at(self) -> datetime | None:
        """start_time as a datetime; None when absent or unreadable (RFC 1123 or ISO 8601)."""
        if not self.start_time:
            return None
        for parse in (email.utils.parsedate_to_datetime, datetime.fromisoformat):
            try:
                parsed = parse(self.start_time)
            except (TypeError, ValueError):
                continue
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)
        return None

    @property
    def instance_ids(self) -> list[str]:
        return [entity.entity_value for entity in self.affected_entities
                if entity.entity_value.startswith("i-")]


class AgentEvent(_Strict):
    """Common part of every event a node agent sends (source "trainfleet/SENDER-INSTANCE-ARN")."""

    SOURCE: ClassVar[str] = EVENT_SOURCE
    DETAIL_TYPE: ClassVar[DetailType]

    run_name: str
    """The run the sender belongs to."""
    attempt: int = Field(ge=0)
    """The attempt the sender belongs to: events of an older attempt are ignored, except the
    node-lifecycle ones (NodeRegistered, NodeReady, NodeUnhealthy), which the node's record
    judges: a node still booting when the run moved on is still the run's node."""
    instance_id: str | None = None
    """Sending instance; None for run-wide events sent on behalf of the world."""


class HealthCheckResult(_Strict):
    """One preflight or runtime check on a node."""

    name: str
    """e.g. gpu_count, efa_devices, gpu_errors, allreduce_busbw."""
    passed: bool
    """Whether the check ran and the node passed it."""
    skipped: bool = False
    """The check does not apply or cannot run on this node (detail says why): it neither passes
    nor fails the node, and is never reported as passed."""
    measured: float | None = None
    """The figure checked (count, GB/s), when there is one."""
    expected: float | None = None
    """The figure required (the catalogue's, e.g. busbw_floor_gbytes_per_s)."""
    detail: str = ""
    """For people: what was seen."""

    @model_validator(mode="after")
    def _skipped_is_not_passed(self) -> HealthCheckResult:
        if self.skipped and self.passed:
            raise ValueError(f"check {self.name}: a skipped check cannot have passed")
        return self

    @property
    def failed(self) -> bool:
        """Ran and did not pass: the node must not train."""
        return not self.passed and not self.skipped


class NodeRegistered(AgentEvent):
    """The agent is up on its instance."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.NODE_REGISTERED

    instance_id: str
    """The instance (from IMDSv2)."""
    private_ip: str
    """Its private IP, where node rank 0 hosts the rendezvous."""
    availability_zone: str | None = None
    """Its zone (from IMDSv2)."""


class NodeReady(AgentEvent):
    """Preflight passed and the agent answers: the node may join the world of `attempt`.

    The agent sends it after preflight and again for every later attempt it sees the run move to
    (the readiness confirmation): `attempt` is the run's attempt it confirms, not the one that
    launched the node."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.NODE_READY

    instance_id: str
    """The instance."""
    checks: list[HealthCheckResult] = Field(default_factory=list)
    """The checks, none failed (some may be skipped, saying why)."""


class NodeUnhealthy(AgentEvent):
    """A check failed, in preflight or while training: replace this node."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.NODE_UNHEALTHY

    instance_id: str
    """The instance."""
    reason: str
    """For people: which check failed and how."""
    checks: list[HealthCheckResult] = Field(default_factory=list)
    """The checks run, the failed ones among them."""


BOOT_CHECK = "bootstrap"
"""The check a node's user data reports failed (NodeUnhealthy) when a step of its bootstrap fails:
its detail names the step and ends with its output."""


class CheckpointReason(StrEnum):
    """Why the trainer saved a checkpoint (the `reason` of its commit marker)."""

    INTERVAL = "interval"
    """On the checkpoint interval."""
    REQUESTED = "requested"
    """Asked for: the agent's answer to a Spot interruption notice."""
    FINAL = "final"
    """The run's last step."""
    UNKNOWN = "unknown"
    """Not known: a marker or an agent from before the reason was recorded."""


class CheckpointCommitted(AgentEvent):
    """Rank 0 wrote the commit marker of a checkpoint."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.CHECKPOINT_COMMITTED

    step: int = Field(ge=0)
    """Training step of the checkpoint."""
    uri: str
    """The step folder, s3://.../step-NNNNNNNNN."""
    stall_seconds: float = Field(default=0.0, ge=0)
    """How long training was blocked by the save."""
    reason: CheckpointReason = CheckpointReason.UNKNOWN
    """Why it was saved, from its marker; UNKNOWN (never taken for a requested save) when an
    older agent sent the event."""


class TrainerFailed(AgentEvent):
    """The trainer exited with an error or diverged."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.TRAINER_FAILED

    kind: TrainerFailureKind
    """crash, nan_loss or config (config errors are not retried)."""
    exit_code: int | None = None
    """torchrun's exit code, when it exited."""
    message: str = ""
    """For people: the end of the error output."""
    last_step: int | None = None
    """Last step completed."""


class TrainerHung(AgentEvent):
    """The agent's watchdog saw no step for too long."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.TRAINER_HUNG

    last_step: int | None = None
    """Last step completed."""
    seconds_since_progress: float = Field(ge=0)
    """How long since it completed."""


class TrainingCompleted(AgentEvent):
    """The trainer ran all its steps."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.TRAINING_COMPLETED

    final_step: int = Field(ge=0)
    """The last step."""
    checkpoint_uri: str | None = None
    """The final checkpoint's folder, if one was saved."""


class ProgressSample(_Strict):
    """One training step as global rank 0's trainer recorded it."""

    # JSON has no NaN: a diverged loss travels as the string "NaN" (plain JSON turns it into
    # null, which no float field takes back), and reads back as NaN.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")

    step: int = Field(ge=0)
    """The step completed."""
    loss: float
    """Its training loss (may be NaN: that is reported, not refused)."""
    tokens_per_second: float = Field(ge=0)
    """Throughput of the whole world."""
    step_seconds: float = Field(ge=0)
    """Wall-clock time of the step."""
    at: datetime
    """When it ended."""


PROGRESS_SAMPLES_MAX = 500
"""Most steps one TrainingProgress carries: about 70 KB (a step is about 135 bytes of JSON),
within EventBridge's 256 KB an event and DynamoDB's 400 KB an item; more steps since the last
report go in several events."""


class TrainingProgress(AgentEvent):
    """Progress from global rank 0's agent: every step since the last, sent every few seconds."""

    model_config = ProgressSample.model_config
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.TRAINING_PROGRESS

    step: int = Field(ge=0)
    """Step just completed."""
    loss: float
    """Its training loss (may be NaN: that is reported, not refused)."""
    tokens_per_second: float = Field(ge=0)
    """Throughput of the whole world."""
    step_seconds: float = Field(ge=0)
    """Wall-clock time of the step."""
    samples: list[ProgressSample] = Field(default_factory=list, max_length=PROGRESS_SAMPLES_MAX)
    """Every step since the previous TrainingProgress (up to PROGRESS_SAMPLES_MAX; the next event
    carries the rest), the last one this step: the run's history (the run report's curves)."""


class FleetChecked(AgentEvent):
    """Node rank 0's agent: the fleet-wide check of the attempt's world is done."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.FLEET_CHECKED

    figures: FleetCheckFigures


class ScalingChecked(AgentEvent):
    """The agent of global rank 0's node: the scaling check of the attempt's first steps is done."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.SCALING_CHECKED

    figures: ScalingCheckFigures


AnyDetail = (Ec2InstanceStateChange | Ec2SpotInterruptionWarning | Ec2RebalanceRecommendation
             | HealthEvent | NodeRegistered | NodeReady | NodeUnhealthy | CheckpointCommitted
             | TrainerFailed | TrainerHung | TrainingCompleted | TrainingProgress | FleetChecked | ScalingChecked)

DETAIL_MODELS: dict[tuple[str, DetailType], type[BaseModel]] = {
    (model.SOURCE, model.DETAIL_TYPE): model
    for model in (Ec2InstanceStateChange, Ec2SpotInterruptionWarning, Ec2RebalanceRecommendation,
                  HealthEvent, NodeRegistered, NodeReady, NodeUnhealthy, CheckpointCommitted,
                  TrainerFailed, TrainerHung, TrainingCompleted, TrainingProgress, FleetChecked, ScalingChecked)
}


class EventEnvelope(_Open):
    """An EventBridge event as a rule target receives it, its detail parsed by (source, type)."""

    id: str
    source: str
    detail_type: DetailType = Field(alias="detail-type")
    time: datetime
    region: str | None = None
    account: str | None = None
    resources: list[str] = Field(default_factory=list)
    detail: AnyDetail

    @property
    def sender(self) -> str | None:
        """The instance id of the node that sent it (its source); None for AWS's events."""
        return event_sender(self.source)

    @model_validator(mode="before")
    @classmethod
    def _detail_by_type(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        key = (str(raw.get("source")).partition("/")[0], raw.get("detail-type"))
        model = DETAIL_MODELS.get(key)  # type: ignore[arg-type]
        if model is None:
            raise ValueError(f"no handler for source={key[0]!r} detail-type={key[1]!r}")
        return {**raw, "detail": model.model_validate(raw.get("detail", {}))}


def parse_event(raw: dict[str, Any]) -> EventEnvelope:
    """An EventBridge event with its detail as the right model; ValidationError names the field."""
    return EventEnvelope.model_validate(raw)


def put_events_entry(detail: AgentEvent, event_bus_name: str, sender_arn: str) -> dict[str, Any]:
    """One PutEvents entry for an agent event sent by the instance `sender_arn` (the agent's
    boto3 call takes a list of these)."""
    resources = [detail.instance_id] if detail.instance_id else []
    return {
        "Source": node_event_source(sender_arn),
        "DetailType": detail.DETAIL_TYPE.value,
        "Detail": detail.model_dump_json(),
        "EventBusName": event_bus_name,
        "Resources": resources,
    }
