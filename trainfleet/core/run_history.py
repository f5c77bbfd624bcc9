"""A run's history for people: its progress, its lifecycle, its failures and where its time went.

The run report (trainfleet/report/page.py: an HTML page and PNG plots) and `trainfleet run
status` / `watch` show it. `build_history` is pure, over what the control plane keeps:

    run, nodes        the run and node records (DynamoDB)
    reports           the steps the agents reported (TrainingProgress.samples), by attempt, with
                      the node whose agent reported them (ProgressReport), thinned as they are
                      read (HISTORY_POINTS): its memory is bounded
    states            the states the execution entered, in order (Step Functions' history)
    now               the end of the history: the run's end, or the present for a live run

The adapter that reads them is trainfleet/adapters/run_history.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from trainfleet.core.events import ProgressSample
from trainfleet.core.lifecycle import book_attempt
from trainfleet.core.records import (FailureClass, FailureRecord, FleetCheckFigures, NodeRecord, RecoveryKind,
                                     RunRecord, RunState, ScalingCheckFigures)

__all__ = ["StateEntry", "ProgressReport", "AttemptProgress", "Phase", "PhaseName", "FailureMark", "RunHistory",
           "build_history", "phases_of", "PHASE_OF_STATE"]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PhaseName = Literal["validate", "allocate", "await_nodes", "train", "recover", "backoff", "teardown", "report"]

PHASE_OF_STATE: dict[str, PhaseName] = {
    "Validate": "validate",
    "Allocate": "allocate",
    "AwaitNodes": "await_nodes", "LateWorkers": "await_nodes", "WorldAfterSwap": "await_nodes",
    "BootTimedOut": "recover",
    "Train": "train",
    "Recover": "recover", "ReplacementsShort": "recover",
    "RecoveryBackoff": "backoff",
    "Teardown": "teardown",
    "Report": "report", "Outcome": "report",
}
"""The lifecycle phase each state of statemachine/training_run.asl.json belongs to; the final
states (RunSucceeded, RunFailed, TeardownFailed) end the last phase."""


class StateEntry(NamedTuple):
    """A state the execution entered (a StateEntered event of its history)."""

    name: str
    at: datetime
    attempt: int | None
    """The attempt of the state's input (`run.attempt`), None where the input carries none."""


class ProgressReport(NamedTuple):
    """The steps one TrainingProgress reported, as kept: in step order."""

    attempt: int
    reporter: str | None
    """The instance whose agent reported them (global rank 0's node); None where not kept."""
    samples: list[ProgressSample]


class AttemptProgress(_Shape):
    """The steps one attempt trained, as reported."""

    attempt: int = Field(ge=0)
    resume_step: int | None
    """The committed step it resumed from; None: it started from scratch."""
    samples: list[ProgressSample]
    """In step order."""
    reporter: str | None = None
    """The node whose agent reported its steps last (global rank 0 writes them); None: none did."""
    unknown_steps: tuple[int, int] | None = None
    """First and last of the steps it is known to have trained past its last reported one (the
    failure that ended it says so, or the checkpoint resumed from): trained, their losses never
    reported. None when every step it trained was reported."""
    reporter_lost: bool = False
    """Whether the failure that ended it took the reporter's node (the unknown steps' losses
    died with it, before its agent reported them)."""


class Phase(_Shape):
    """A span of the run's lifecycle."""

    name: PhaseName
    attempt: int = Field(ge=0)
    started_at: datetime
    ended_at: datetime


class FailureMark(_Shape):
    """A failure the run recovered from (or gave up on), as the report marks it."""

    attempt: int = Field(ge=0)
    """The attempt it ended."""
    failure_class: FailureClass
    onset_at: datetime | None
    """Its first sign; None when only its consequence was seen."""
    decided_at: datetime
    """When Recover decided what to do about it."""
    detection_seconds: float | None
    """decided_at - onset_at."""
    last_step: int | None
    """The last step the attempt is known to have reached: its last reported step, or the
    checkpoint resumed from when that is later (steps since the last report die with the node
    of global rank 0)."""
    resume_step: int | None
    """The step the next attempt resumed from: the nodes' in-memory copy it restored, else the
    committed checkpoint."""
    from_memory: bool = False
    """Whether that state came from the nodes' memory (StateRestored), not S3."""
    committed_step: int | None = None
    """The newest commit to S3 Recover knew of when it decided: the resume point in S3."""
    steps_lost: int = Field(ge=0)
    """Steps trained after that state, to be trained again (at least)."""
    instance_ids: list[str]
    """The nodes blamed (replaced): the first the run record keeps (FailureRecord.instance_ids)."""
    instances_blamed: int = Field(default=0, ge=0)
    """How many nodes it blamed in all, where the record says (0: as many as `instance_ids`)."""
    message: str
    recovery: RecoveryKind | None = None
    """How the world came back: repaired in place or restarted, or the run gave up (None: not recorded)."""
    decision: str = ""
    """Recover's decision, and why."""

    @property
    def blamed(self) -> int:
        """How many nodes it blamed."""
        return max(self.instances_blamed, len(self.instance_ids))


class RunHistory(_Shape):
    """Everything the run report shows."""

    run_name: str
    state: RunState
    error: str | None
    instance_type: str
    node_count: int
    spare_count: int
    target_steps: int
    """training.steps of the RunSpec; 0 when it names none (the trainer's default)."""
    created_at: datetime
    until: datetime
    """The end of the history: the run's last booking once it ended, else when it was read."""
    attempts: list[AttemptProgress]
    phases: list[Phase]
    failures: list[FailureMark]
    productive_seconds: float
    lost_by_cause: dict[str, float]
    """Lost seconds by cause (GoodputLedger's causes)."""
    goodput: float
    cost_usd: float
    node_seconds: float
    steps_lost: int
    """All failures' steps_lost."""
    last_step: int | None
    fleet_check: FleetCheckFigures | None
    scaling_check: ScalingCheckFigures | None
    resumed_from: str | None = None
    """The run this one resumed (RunSpec.resume_from), whose report is beside this one's."""

    @property
    def samples(self) -> list[ProgressSample]:
        """Every reported step, attempt after attempt."""
        return [sample for attempt in self.attempts for sample in attempt.samples]


def phases_of(states: Iterable[StateEntry], until: datetime) -> list[Phase]:
    """Consecutive states of one phase and attempt merged into one span; each ends where the
    next begins, the last at `until`. A state's attempt is its input's, or the one before it."""
    phases: list[Phase] = []
    attempt = 0
    for entry in sorted(states, key=lambda entry: entry.at):
        attempt = entry.attempt if entry.attempt is not None else attempt
        name = PHASE_OF_STATE.get(entry.name)
        if phases:
            phases[-1] = phases[-1].model_copy(update={"ended_at": entry.at})
        if name is None:  # a final state: the run is over
            break
        if phases and (phases[-1].name, phases[-1].attempt) == (name, attempt):
            continue
        phases.append(Phase(name=name, attempt=attempt, started_at=entry.at, ended_at=entry.at))
    if phases and phases[-1].ended_at == phases[-1].started_at:
        phases[-1] = phases[-1].model_copy(update={"ended_at": max(until, phases[-1].started_at)})
    return phases


HISTORY_POINTS = 1000
"""The steps an attempt's history keeps at full resolution; past them, every 2nd, 4th ... step
(twice as many at most) and the newest: a run of weeks reports hundreds of thousands."""


class _Thinned:
    """One attempt's samples, thinned as they come: the steps divisible by a stride that doubles
    whenever more than twice HISTORY_POINTS are kept, and always the first and the newest. A
    redelivered sample counts once."""

    def __init__(self) -> None:
        self.stride, self.kept, self.first, self.newest = 1, {}, None, None

    def add(self, sample: ProgressSample) -> None:
        if self.first is None or sample.step <= self.first.step:
            self.first = sample
        if self.newest is None or sample.step >= self.newest.step:
            self.newest = sample
        if sample.step % self.stride:
            return
        self.kept[sample.step] = sample
        if len(self.kept) > 2 * HISTORY_POINTS:
            self.stride *= 2
            self.kept = {step: kept for step, kept in self.kept.items() if step % self.stride == 0}

    def samples(self) -> list[ProgressSample]:
        ends = {sample.step: sample for sample in (self.first, self.newest) if sample is not None}
        kept = {**self.kept, **ends}
        return [kept[step] for step in sorted(kept)]


def resumed_step(failure: FailureRecord) -> int | None:
    """Where the attempt after `failure` resumed: the step its trainer restored (StateRestored),
    else the commit Recover knew of."""
    if failure.restored is not None:
        return failure.restored.step or None
    return failure.resume_step


def build_history(run: RunRecord, nodes: list[NodeRecord], reports: Iterable[ProgressReport],
                  states: Iterable[StateEntry], now: datetime) -> RunHistory:
    """The run's history up to `now` (see the module docstring)."""
    if run.created_at is None:
        raise ValueError(f"run {run.run_name!r} has no creation time")
    by_attempt: dict[int, _Thinned] = {}
    reporters: dict[int, tuple[int, str]] = {}  # attempt -> (newest step, its reporter)
    for report in reports:
        steps = by_attempt.setdefault(report.attempt, _Thinned())
        for sample in report.samples:
            steps.add(sample)
        if report.reporter and report.samples and report.samples[-1].step >= reporters.get(report.attempt, (-1,))[0]:
            reporters[report.attempt] = (report.samples[-1].step, report.reporter)
    failures = sorted(run.failures, key=lambda failure: failure.at)
    resumed_from = {attempt: resumed_step(failure) for attempt, failure in enumerate(failures, start=1)}
    reported = {attempt: steps.samples() for attempt, steps in by_attempt.items()}
    last_steps = {attempt: samples[-1].step for attempt, samples in reported.items() if samples}
    marks = []
    for number, failure in enumerate(failures):
        attempt = failure.attempt if failure.attempt is not None else number
        resume = resumed_step(failure)
        # The attempt reached its last reported step, and the checkpoint resumed from: a node
        # that dies with global rank 0 takes the steps since its last report with it.
        reached = [step for step in (last_steps.get(attempt), failure.last_step, resume) if step is not None]
        last_step = max(reached, default=None)
        marks.append(FailureMark(
            attempt=attempt, failure_class=failure.failure_class, onset_at=failure.onset_at, decided_at=failure.at,
            detection_seconds=failure.detection_seconds, last_step=last_step, resume_step=resume,
            from_memory=failure.restored is not None and failure.restored.source == "memory",
            committed_step=failure.resume_step,
            steps_lost=last_step - (resume or 0) if last_step is not None else 0,
            instance_ids=failure.instance_ids, message=failure.message, recovery=failure.recovery,
            instances_blamed=failure.instances_blamed or 0,
            decision=failure.decision))
    unknown, lost = {}, set()
    for mark in marks:
        first = last_steps.get(mark.attempt, resumed_from.get(mark.attempt) or 0) + 1
        if mark.last_step is not None and mark.last_step >= first:
            unknown[mark.attempt] = (first, mark.last_step)
            if mark.attempt in reporters and reporters[mark.attempt][1] in mark.instance_ids:
                lost.add(mark.attempt)
    attempts = [AttemptProgress(attempt=attempt, resume_step=resumed_from.get(attempt),
                                samples=reported.get(attempt, []), reporter=reporters.get(attempt, (0, None))[1],
                                unknown_steps=unknown.get(attempt), reporter_lost=attempt in lost)
                for attempt in sorted(reported.keys() | unknown.keys())]
    # A run still going has its current attempt booked up to now, as if it ended here; `now`, a
    # reader's clock, is never taken before the record's last write (AWS's clock).
    now = max(now, run.updated_at or now)
    ledger = run.ledger if run.state.is_final else book_attempt(run, nodes, now, completed=True)
    until = (ledger.booked_until or now) if run.state.is_final else now
    spec = run.spec
    return RunHistory(
        run_name=run.run_name, state=run.state, error=run.error, instance_type=spec.instance_type,
        node_count=spec.node_count, spare_count=spec.spare_count,
        target_steps=int((spec.trainer.training.model_extra or {}).get("steps", 0)),
        created_at=run.created_at, until=until, attempts=attempts, phases=phases_of(states, until),
        failures=marks, productive_seconds=ledger.productive_seconds, lost_by_cause=dict(ledger.lost_by_cause),
        goodput=ledger.goodput, cost_usd=ledger.cost_usd, node_seconds=ledger.node_seconds,
        steps_lost=sum(mark.steps_lost for mark in marks), last_step=run.last_step,
        fleet_check=run.fleet_check, scaling_check=run.scaling_check, resumed_from=spec.resume_from)
