"""The RunSpec: what a user starts a run with (the Step Functions input), as a pydantic v2 model.

    RunSpec                      the run: instance type, nodes and spares, capacity, checkpoint,
      CapacitySpec, CapacityKind, CheckpointPolicy, RecoveryPolicy, PreflightPolicy,
      ScalingCheckPolicy, TrainerConfig (+ TrainerParallel, TrainerModel, TrainerTraining)
    TRAINER_FIELDS, FILLED_SECTIONS   the trainer config's sections and fields a RunSpec may set,
                                 and those the control plane fills from the RunSpec's own
    layout_problem, pipeline_layout_problem   why the trainer cannot run a layout (torch-free,
                                 the rules of trainer/config.py; the schedules' own rules are
                                 trainer/schedules.py's)
    NodeNetwork, with_stack_defaults   what a RunSpec may leave to the stack it runs in

Bad input raises pydantic.ValidationError; every message names the field (`loc`) and the value.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from typing import Any, NamedTuple

from pydantic import Field, field_validator, model_validator

from trainer.config import ParallelConfig
from trainer.schedules import SCHEDULES, schedule_problem
from trainfleet.core.catalogue import InstanceFacts, UnknownInstanceType, instance_facts
from trainfleet.core.pace import HANG_TIMEOUT_MIN_S, hang_timeout_problem
from trainfleet.core.shapes import Open, Strict

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


class CapacitySpec(Strict):
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


HOST_MEMORY_DIR = "/dev/shm/trainfleet"
"""Where a node keeps its in-memory checkpoints, under the run's name: a tmpfs, host memory that
outlives the trainer's processes and goes with the instance."""


class CheckpointPolicy(Strict):
    """Where and how often the trainer checkpoints (fills the trainer's checkpoint section)."""

    s3_uri: str
    """s3://BUCKET/PREFIX under which `step-NNNNNNNNN/` folders are written."""
    interval_steps: int = Field(default=100, ge=1)
    """Steps between checkpoints."""
    keep_last: int = Field(default=3, ge=2)
    """Committed checkpoints kept. At least 2: with asynchronous saves the only committed
    checkpoint could otherwise be pruned while the next one is still being written."""
    memory_interval_steps: int = Field(default=1, ge=0)
    """Steps between in-memory checkpoints (trainer/memory_checkpoint.py): each node's share of
    the state in its host memory and in its buddy node's, so that recovering a lost node redoes
    at most this many steps and reads nothing from S3; 0: none (S3 alone)."""

    @field_validator("s3_uri")
    @classmethod
    def _s3(cls, value: str) -> str:
        if not _S3_URI.match(value):
            raise ValueError(f"{value!r} is not an s3://BUCKET/PREFIX uri")
        return value.rstrip("/")


LATE_WORKER_DEFAULT_S = 600
"""A GPU instance boots and passes preflight in minutes; one ten minutes late is more likely
stuck than slow."""


class PreflightPolicy(Strict):
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


class ScalingCheckPolicy(Strict):
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


class RecoveryPolicy(Strict):
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
    """No training progress for this long means hung (the Train task's HeartbeatSeconds): the
    control plane's hang detection, the first of the three timeouts (collective_timeout_order).
    The agents look at the control plane often enough to tell a silent node within it, so a
    large run's read rate bounds it from below (trainfleet.core.pace)."""
    startup_timeout_seconds: int = Field(default=1800, ge=HANG_TIMEOUT_MIN_S)
    """Longest time from torchrun's start to the attempt's first step (rendezvous, NCCL set-up,
    checkpoint load): rank 0's agent heartbeats the Train task that long before a step, then a
    hang is declared hang_timeout_seconds later. At least hang_timeout_seconds. It is also the
    trainer's repair wait (parallel.repair_wait_s, which the agent sets to it)."""
    stall_floor_seconds: int = Field(default=30, ge=HANG_TIMEOUT_MIN_S)
    """Least silence of a world that was stepping for its agents to declare it hung from its own
    cadence (HANG_STEPS of its recent median step time, trainfleet.core.pace.hung_after), long
    before the hang timeout. Below it, pauses a healthy world takes (a garbage collection, a
    data shard fetched, a machine's load) would be taken for a hang."""
    repair_in_place: bool = True
    """With in-memory checkpoints: a lost node's place is taken without restarting the others'
    trainers, which keep their processes and form the next world around the replacement
    (trainer/repair.py; lifecycle.repair_in_place says when it can). False: every recovery
    restarts every node's trainer."""
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


class TrainerParallel(Open):
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

    @property
    def collective_timeout_s(self) -> float:
        """The collective timeout the trainer runs with: `timeout_s` where given (it passes through
        untyped), else the trainer's default."""
        return float((self.model_extra or {}).get("timeout_s", ParallelConfig.timeout_s))

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str) -> str:
        if value not in SCHEDULES:
            raise ValueError(f"schedule {value!r} is unknown; choose one of {sorted(SCHEDULES)}")
        return value


class TrainerModel(Open):
    """The trainer's `model` section; these fields are typed, others pass through."""

    n_layers: int = Field(ge=1)
    """Transformer blocks; every pipeline stage needs at least one."""
    tie_embeddings: bool = False
    """A tied embedding and head need pp = 1."""


class TrainerTraining(Open):
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
    "model": frozenset({"architecture", "n_layers", "d_model", "n_heads", "vocab_size", "seq_len", "tie_embeddings",
                        "norm_eps", "mlp_ratio", "activation", "n_kv_heads", "ffn_hidden", "ffn_dim_multiplier",
                        "multiple_of", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor",
                        "rope_high_freq_factor", "rope_original_seq_len"}),
    "parallel": frozenset({"pp", "dp", "dp_shard", "tp", "reshard_after_forward", "schedule", "microbatches",
                           "stages_per_rank", "layers_per_stage", "timeout_s", "repair_file",
                           "repair_wait_s"}),
    "data": frozenset({"shards", "tokenizer", "corpus", "cache_dir", "cache_bytes", "corpus_bytes", "shard_tokens"}),
    "optim": frozenset({"lr", "min_lr_ratio", "warmup_steps", "decay_steps", "weight_decay", "beta1", "beta2",
                        "eps", "grad_clip"}),
    "training": frozenset({"steps", "batch_size", "seed", "device", "activation_checkpoint", "init_from", "compile",
                           "threads", "metrics_file"}),
}


class TrainerConfig(Open):
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


def collective_timeout_order(recovery: RecoveryPolicy, collective_s: float) -> str | None:
    """Why the run's timeouts are out of order, else None. They must grow:
    recovery.hang_timeout_seconds (the control plane declares a silent world hung and names the
    node that fell silent first) < trainer.parallel.timeout_s (a collective fails on a peer that
    does not answer) < recovery.startup_timeout_seconds (the repair wait: how long a rank that
    left a failed world waits for the order to form the next one)."""
    hang, repair_wait = recovery.hang_timeout_seconds, recovery.startup_timeout_seconds
    if hang < collective_s < repair_wait:
        return None
    return (f"trainer.parallel.timeout_s={collective_s:g} must lie between recovery.hang_timeout_seconds={hang} and "
            f"recovery.startup_timeout_seconds={repair_wait}: a silent world is declared hung (naming the node that "
            "fell silent first) before its collectives time out, and a rank that left a failed world waits for the "
            "repair order (as long as the start-up timeout) longer than a collective waits on a peer")


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


class RunSpec(Strict):
    """A training run as the user asks for it: the input of a Step Functions execution."""

    run_name: str
    """Lower-case letters, digits and dashes, at most 48; names the run everywhere (S3, tags)."""
    instance_type: str
    """An EC2 instance type from the catalogue (trainfleet.core.catalogue.CATALOGUE)."""
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
    """Give the run up once its instance cost (at on-demand prices) has reached this, when a
    failure brings it to Recover; a world that trains without failing is not stopped by it (its
    training.steps bound it). None = no ceiling."""
    resume_from: str | None = None
    """An ended run of the stack whose newest committed checkpoint this run starts from (a run
    that gave up: its Capacity Block ended, its budget or cost ceiling was reached): its nodes read
    that run's checkpoints (resume_from_uri), never write or prune them, and save their own under
    this run's. Its model must be this one's. None: start from scratch."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Extra tags on every instance (besides the trainfleet ones)."""

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        if not _RUN_NAME.match(value):
            raise ValueError(f"{value!r} must be 1-48 lower-case letters, digits or dashes, "
                             "starting with a letter or digit")
        return value

    @field_validator("resume_from")
    @classmethod
    def _resume_from(cls, value: str | None) -> str | None:
        if value is not None and not _RUN_NAME.match(value):
            raise ValueError(f"{value!r} is not a run name (1-48 lower-case letters, digits or dashes)")
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
        if problem := collective_timeout_order(self.recovery, self.trainer.parallel.collective_timeout_s):
            raise ValueError(problem)
        if self.resume_from == self.run_name:
            raise ValueError(f"resume_from: a run resumes another run, not itself: give this one a run_name of its "
                             f"own (trainfleet run start --run-name NAME --resume-from {self.run_name})")
        if self.resume_from is not None and self.trainer.model_dump()["training"].get("init_from"):
            raise ValueError("resume_from: a resumed run starts from the other run's newest checkpoint, whole; "
                             "trainer.training.init_from (weights to start from) cannot be given with it")
        return self

    @property
    def resume_from_uri(self) -> str | None:
        """Where the run it resumes keeps its checkpoints, in this run's bucket (a run's own place:
        node_access), or None."""
        if self.resume_from is None:
            return None
        bucket = self.checkpoint.s3_uri.removeprefix("s3://").split("/", 1)[0]
        return f"s3://{bucket}/runs/{self.resume_from}/checkpoints"

    @property
    def facts(self) -> InstanceFacts:
        """The catalogue entry of the instance type."""
        return instance_facts(self.instance_type)

    @property
    def repairable(self) -> bool:
        """Whether the run's worlds may be repaired in place (lifecycle.repair_in_place): it asks for
        it and keeps the in-memory checkpoints a repaired world resumes from."""
        return self.recovery.repair_in_place and self.checkpoint.memory_interval_steps > 0

    @property
    def shrink_floor(self) -> int:
        """Fewest nodes the run may continue with."""
        return self.min_nodes or self.node_count

    def trainer_mapping(self, pp: int, dp: int, resume_step: int | None, scaling_check_due: bool = True,
                        resume_uri: str | None = None) -> dict[str, Any]:
        """The trainer's full config at pp x dp: the trainer section with the checkpoint section
        made from `checkpoint`, resuming from `resume_step` (None: from scratch), found under
        `resume_uri` where that is not the run's own place (the run it resumes), and the world
        checks; the scaling check only while it is due (no world of the run has passed it)."""
        policy, preflight, scaling = self.checkpoint, self.preflight, self.scaling_check
        nodes = pp * dp * self.trainer.parallel.tp // self.facts.ranks_per_node
        return self.trainer.as_trainer_mapping(pp, dp, {
            "checkpoint": {"uri": policy.s3_uri, "interval": policy.interval_steps, "keep_last": policy.keep_last,
                           "resume": "none" if resume_step is None else str(resume_step),
                           **({"resume_uri": resume_uri} if resume_uri else {}),
                           "memory_interval": policy.memory_interval_steps,
                           # The node agent puts its own host-memory folder here.
                           "memory_dir": f"{HOST_MEMORY_DIR}/{self.run_name}"},
            "fleet_check": {"enabled": preflight.fleet_check and nodes > 1,
                            "size_mib": preflight.size_mib or (1024.0 if self.facts.accelerator != "none" else 16.0),
                            "iterations": preflight.iterations,
                            "busbw_floor_gbytes_per_s": (preflight.busbw_floor_gbytes_per_s
                                                         or self.facts.busbw_floor_gbytes_per_s)},
            "scaling_check": {"enabled": scaling_check_due and scaling.enabled_for(self.facts),
                              "warmup_steps": scaling.warmup_steps,
                              "steps": scaling.steps, "efficiency_floor": scaling.efficiency_floor}})



class NodeNetwork(NamedTuple):
    """The stack's network for nodes (template.yaml: the VPC it makes, or the subnets it was
    deployed with): its subnets in the zones that offer the run's instance type, in order, and its
    security groups (one lets all traffic pass among its members: what EFA needs)."""

    subnet_ids: list[str]
    security_group_ids: list[str]


STACK_DEFAULTS = {
    "checkpoint.s3_uri": "the stack's bucket, under runs/RUN/checkpoints",
    "capacity.subnet_ids": "with security_group_ids left out too: the stack's node network's subnets in the "
                           "zones that offer the instance type (docs/NETWORK.md)",
    "capacity.security_group_ids": "with subnet_ids left out too: the stack's node network's security group",
}
"""The fields a RunSpec may leave to the stack it runs in (with_stack_defaults), and what they
then are: docs/RUNSPEC.md shows them."""


def with_stack_defaults(document: Any, bucket: str, node_network: Callable[[str], NodeNetwork]) -> Any:
    """The RunSpec document with what its author may leave to the stack filled in, as given
    otherwise: `checkpoint.s3_uri`, the stack's bucket under runs/RUN/checkpoints; the capacity's
    subnets and security groups when it names neither, the stack's node network for its instance
    type (`node_network(instance_type)`, asked only then). A document that is not a RunSpec is
    returned as it is: validation names its problems."""
    if not isinstance(document, dict) or not isinstance(document.get("run_name"), str):
        return document
    filled = dict(document)
    checkpoint = filled.get("checkpoint", {})
    if isinstance(checkpoint, dict) and "s3_uri" not in checkpoint:
        filled["checkpoint"] = {**checkpoint, "s3_uri": f"s3://{bucket}/runs/{document['run_name']}/checkpoints"}
    capacity = filled.get("capacity", {})
    if isinstance(capacity, dict) and "subnet_ids" not in capacity and "security_group_ids" not in capacity:
        network = node_network(str(document.get("instance_type", "")))
        filled["capacity"] = {"subnet_ids": network.subnet_ids, "security_group_ids": network.security_group_ids,
                              **capacity}
    return filled
