"""The EventBridge events the control plane handles: AWS's (EC2 state changes, Spot and
rebalance notices, AWS Health) and the node agents' (source "trainfleet/SENDER-INSTANCE-ARN").

    Ec2InstanceStateChange (LOST_STATES: its states of an instance leaving),
      Ec2SpotInterruptionWarning, Ec2RebalanceRecommendation, HealthEvent   AWS's shapes
    AgentEvent: NodeRegistered, NodeReady, NodeUnhealthy (HealthCheckResult, BOOT_CHECK, BOOT_STEPS,
      failed_boot_step),
      CheckpointCommitted (CheckpointReason), TrainerFailed, TrainerHung, TrainingCompleted,
      TrainingProgress (its ProgressSample steps, at most PROGRESS_SAMPLES_MAX), FleetChecked,
      ScalingChecked, StateRestored             the agents'
    DetailType, EVENT_SOURCE, EventEnvelope (.sender), parse_event, put_events_entry,
      instance_arn, node_event_source, event_sender
"""

from __future__ import annotations

import email.utils
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainfleet.core.records import FleetCheckFigures, ScalingCheckFigures, StateRestoredFigures, TrainerFailureKind
from trainfleet.core.shapes import Open, Strict

EVENT_SOURCE = "trainfleet"
"""The family of the EventBridge `source` of every event a node sends: `trainfleet/INSTANCE-ARN`
(node_event_source), the sender's own ARN, which the node role lets it put and nothing else."""


def instance_arn(partition: str, region: str, account_id: str, instance_id: str) -> str:
    """An EC2 instance's ARN: what `ec2:SourceInstanceARN` holds in its profile's requests."""
    return f"arn:{partition}:ec2:{region}:{account_id}:instance/{instance_id}"


def node_event_source(sender_arn: str) -> str:
    """The `source` of an event sent by the instance `sender_arn`."""
    return f"{EVENT_SOURCE}/{sender_arn}"


def event_sender(source: str) -> str | None:
    """The instance id of the node that sent an event with this `source`; None for any other."""
    family, _, sender_arn = source.partition("/")
    resource = sender_arn.rsplit(":", 1)[-1]
    if family != EVENT_SOURCE or not resource.startswith("instance/i-"):
        return None
    return resource.removeprefix("instance/")

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
    STATE_RESTORED = "StateRestored"


class Ec2InstanceStateChange(Open):
    """aws.ec2 "EC2 Instance State-change Notification" detail."""

    SOURCE: ClassVar[str] = "aws.ec2"
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.EC2_STATE_CHANGE

    instance_id: str = Field(alias="instance-id")
    state: Literal["pending", "running", "stopping", "stopped", "shutting-down", "terminated"]


LOST_STATES = frozenset({"stopping", "stopped", "shutting-down", "terminated"})
"""EC2 instance states in which an instance is leaving for good (or at least leaving the world)."""


class Ec2SpotInterruptionWarning(Open):
    """aws.ec2 "EC2 Spot Instance Interruption Warning" detail (two minutes ahead)."""

    SOURCE: ClassVar[str] = "aws.ec2"
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.EC2_SPOT_INTERRUPTION

    instance_id: str = Field(alias="instance-id")
    instance_action: Literal["terminate", "stop", "hibernate"] = Field(alias="instance-action")


class Ec2RebalanceRecommendation(Open):
    """aws.ec2 "EC2 Instance Rebalance Recommendation" detail."""

    SOURCE: ClassVar[str] = "aws.ec2"
    DETAIL_TYPE: ClassVar[DetailType] = DetailType.EC2_REBALANCE

    instance_id: str = Field(alias="instance-id")


class HealthEventDescription(Open):
    language: str
    latest_description: str = Field(alias="latestDescription")


class HealthAffectedEntity(Open):
    entity_value: str = Field(alias="entityValue")
    """For EC2 events, an instance id."""


class HealthEvent(Open):
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


class AgentEvent(Strict):
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


class HealthCheckResult(Strict):
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
"""The check a node's user data reports failed (NodeUnhealthy) when a step of its bootstrap fails
every try: its detail is the end of the step's output; the reason names the step (BOOT_FAILED_AT)."""
BOOT_STEPS = ("reading the instance metadata", "writing the agent's settings", "copying the artifacts",
              "unpacking the artifacts", "installing trainfleet and torch", "starting the agent")
"""A node bootstrap's steps, in order (trainfleet.adapters.ec2_fleet.node_user_data)."""
BOOT_FAILED_AT = "bootstrap failed at: "
"""How a boot failure's reason names its step: `bootstrap failed at: STEP (exit N, T tries)`."""


def failed_boot_step(text: str) -> str | None:
    """The bootstrap step a boot failure's reason, or a message quoting it, names; None if none."""
    return next((step for step in BOOT_STEPS if f"{BOOT_FAILED_AT}{step}" in text), None)


class CheckpointReason(StrEnum):
    """Why the trainer saved a checkpoint (the `reason` of its commit marker)."""

    INTERVAL = "interval"
    """On the checkpoint interval."""
    REQUESTED = "requested"
    """Asked for: the agent's answer to a Spot interruption notice."""
    FINAL = "final"
    """The run's last step."""
    IMPORTED = "imported"
    """A model brought in by `trainfleet checkpoint import` (step 0, its weights alone), found
    where the run saves."""
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


class ProgressSample(Strict):
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


class StateRestored(AgentEvent):
    """The agent of global rank 0's node: where the attempt's trainer took the state it resumed
    from (host memory, S3, or nothing to resume)."""

    DETAIL_TYPE: ClassVar[DetailType] = DetailType.STATE_RESTORED

    figures: StateRestoredFigures


AnyDetail = (Ec2InstanceStateChange | Ec2SpotInterruptionWarning | Ec2RebalanceRecommendation
             | HealthEvent | NodeRegistered | NodeReady | NodeUnhealthy | CheckpointCommitted
             | TrainerFailed | TrainerHung | TrainingCompleted | TrainingProgress | FleetChecked | ScalingChecked
             | StateRestored)

DETAIL_MODELS: dict[tuple[str, DetailType], type[BaseModel]] = {
    (model.SOURCE, model.DETAIL_TYPE): model
    for model in (Ec2InstanceStateChange, Ec2SpotInterruptionWarning, Ec2RebalanceRecommendation,
                  HealthEvent, NodeRegistered, NodeReady, NodeUnhealthy, CheckpointCommitted,
                  TrainerFailed, TrainerHung, TrainingCompleted, TrainingProgress, FleetChecked, ScalingChecked,
                  StateRestored)
}


class EventEnvelope(Open):
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
