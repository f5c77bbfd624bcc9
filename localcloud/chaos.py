"""Chaos: a fault of each kind at each phase of a real run on the local cloud, and what must hold.

    python -m localcloud.chaos kill@training freeze@rendezvous budget-exhausted ...   (one JSON line a cell)
    python -m localcloud.chaos --list

A cell is a fault (`Fault`) at a phase (`Phase`) of a two-node pipeline-parallel run with real
node agents and the real trainer (events/local-demo-run.json made shorter, hang and start-up
timeouts in seconds), or one of the `EXTRAS` (a second failure during recovery, duplicated and
out-of-order events, the restart budget spent, a crash loop, StopExecution mid-training, a
machine whose CPU is starved). The
fault hits node rank 1 (its instance, its agent or one trainer rank), or for `recovery` the
surviving node rank 0, or, for `throttle`, every control-plane service at once. A checkpoint
load and a recovery happen only after a failure, so those phases start with node rank 1 killed
after the first committed checkpoint.

Every cell must show (`problems`):
- the run succeeded (or failed with the reason its policy gives, for the extras that must fail);
- every attempt's per-step losses equal those of the same training never interrupted (bit for
  bit: CPU, fp32, the same layout and data order);
- only nodes a fault hit are blamed (and replaced), and no failure is booked that no fault
  caused (at most one per fault of a node; none for a throttled or failing control plane);
- every resume point is a checkpoint whose commit marker S3 had when the attempt's launch spec
  was written (never a partial one), and the newest such (no committed work lost), and after a
  Spot notice not older than the step training had reached when the notice came;
- no instance, placement group or launch template of the run left behind;
- the run's ledger accounts for every second from its creation to its last booking.

Phases are seen from outside, as an operator would: execution history, agents' console lines,
the run record, and requests reaching S3 (a checkpoint part being written or read).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from localcloud.chaos_route import on_instance
from localcloud.cloud import exit_after_local_cloud
from localcloud.glue import s3 as s3_requests
from localcloud.stack import (REPO, LocalRun, LocalStack, Watch, agent_lines, local_stack, metrics_records,
                              states_entered)
from localcloud.waiting import Stalled, run_captured, until, wait_for_exit
from localcloud.warm_image import WarmImage
from trainer.checkpoint_catalog import MARKER_NAME, marker_step

__all__ = ["Fault", "Phase", "Cell", "MATRIX", "EXTRAS", "CELLS", "chaos_template", "reference_losses",
           "run_cell", "problems", "main"]


class Fault(StrEnum):
    KILL = "kill"
    """The instance dies (EC2 reports it terminated)."""
    FREEZE = "freeze"
    """The whole instance stops (SIGSTOP of all its processes): a kernel hang or a network
    partition as seen from outside. No EC2 event; its status check goes impaired."""
    HANG = "hang"
    """One trainer rank stops (SIGSTOP); before there is a trainer, the node agent."""
    SPOT = "spot"
    """A Spot interruption notice (two minutes, nominal), then the interruption."""
    HEALTH = "health"
    """An AWS Health event: the instance is scheduled for retirement."""
    THROTTLE = "throttle"
    """Every control-plane service (Lambda, DynamoDB, S3, EC2, EventBridge, Step Functions)
    answers throttling errors for THROTTLE_S."""
    CRASH = "crash"
    """One trainer rank dies (SIGKILL): a worker crash."""
    ERROR = "error"
    """Every control-plane service answers its internal error (HTTP 500) for THROTTLE_S."""


class Phase(StrEnum):
    ALLOCATE = "allocate"
    """The instance exists, its agent has not said a word yet."""
    PREFLIGHT = "preflight"
    """Its agent registered and runs the preflight checks."""
    RENDEZVOUS = "rendezvous"
    """torchrun started, no training step yet."""
    TRAINING = "training"
    """The first checkpoint is committed; training goes on."""
    CHECKPOINT_WRITE = "checkpoint-write"
    """A checkpoint after the first is being uploaded."""
    CHECKPOINT_LOAD = "checkpoint-load"
    """After a node loss, the new attempt reads the checkpoint it resumes from."""
    RECOVERY = "recovery"
    """After a node loss, the control plane is in Recover (or its backoff or the wait for the
    replacement)."""
    BACKOFF = "backoff"
    """After a node loss, the run waits out its recovery backoff (a long one, for this phase)."""
    TEARDOWN = "teardown"
    """The run is over; Teardown terminates its instances."""


@dataclass(frozen=True)
class Cell:
    name: str
    fault: Fault | None = None
    phase: Phase | None = None
    must_fail_with: str | None = None
    """Text the execution's failure must name, for a cell whose policy must end the run."""
    cpu_share: float = 1.0
    """The share of CPU time the run's instances get (LocalFleet.cpu_share): below 1, a starved
    machine, slow but never silent, on which no failure may be booked."""


SERVICE_FAULTS = (Fault.THROTTLE, Fault.ERROR)
"""Faults of the whole control plane rather than of a node."""
PROCESS_FAULTS = (Fault.HANG, Fault.CRASH)
"""Faults of one process of a node (process_role says which)."""
MATRIX_FAULTS = (Fault.KILL, Fault.FREEZE, Fault.HANG, Fault.SPOT, Fault.HEALTH, Fault.THROTTLE)
MATRIX_PHASES = (Phase.ALLOCATE, Phase.PREFLIGHT, Phase.RENDEZVOUS, Phase.TRAINING, Phase.CHECKPOINT_WRITE,
                 Phase.CHECKPOINT_LOAD, Phase.RECOVERY)
MATRIX = [Cell(f"{fault}@{phase}", fault, phase) for fault in MATRIX_FAULTS for phase in MATRIX_PHASES]
EXTRAS = [
    Cell("kill@backoff", Fault.KILL, Phase.BACKOFF),
    Cell("throttle@teardown", Fault.THROTTLE, Phase.TEARDOWN),
    Cell("error@training", Fault.ERROR, Phase.TRAINING),
    Cell("second-failure-in-preflight"),
    Cell("duplicate-events"),
    Cell("late-events"),
    Cell("out-of-order-events"),
    Cell("recover-times-out"),
    Cell("budget-exhausted", must_fail_with="restart budget spent"),
    Cell("crash-loop", must_fail_with="crash loop"),
    Cell("stop-execution"),
    Cell("starved", cpu_share=0.25),
]
CELLS = {cell.name: cell for cell in MATRIX + EXTRAS}

THROTTLE_S = 4.0
"""How long every control-plane service throttles in a `throttle` cell (real seconds)."""
CONTROL_PLANE_SERVICES = ("lambda", "dynamodb", "s3", "ec2", "events", "states")
LEAK_STALL_S = 60.0
"""How long what is left of a run in EC2 may stay as it is before it counts as left behind: the
reaper (every scaled five minutes: 6 s) deletes what Teardown found still in use."""
LOOK_S = 0.1
"""How often the phase watch looks."""
UNACCOUNTED_TOLERANCE_S = 1e-3
"""The books are exact but for float rounding."""
SPOT_NOTICE_S = 1500.0
"""Nominal (x time scale 0.02 = 30 s): the two minutes AWS gives would be 2.4 s here, shorter than
one checkpoint's round trip on these shared cores."""


def chaos_template(template: dict[str, Any]) -> dict[str, Any]:
    """The demo's RunSpec for chaos: short, checkpointed often, timeouts in seconds."""
    spec = json.loads(json.dumps(template))
    spec["run_name"] = "chaos"
    # The demo model trains about 60 steps a second here: 40 steps left a Spot notice given at the
    # first commit a second or two, and on busy cores the run ended before the notice reached it.
    spec["trainer"]["training"]["steps"] = 120
    spec["checkpoint"]["interval_steps"] = 10
    # The local floors (localcloud.stack.TIMEOUT_FLOORS_S): as short as a starved machine allows.
    spec["trainer"]["parallel"]["timeout_s"] = 120  # a frozen peer fails the survivor's collectives, after the hang timeout
    spec["recovery"] |= {"max_restarts": 3, "boot_timeout_seconds": 300, "startup_timeout_seconds": 300}
    return spec


def reference_losses(trainer_config: dict[str, Any], folder: Path, image: WarmImage | None = None) -> dict[int, float]:
    """step -> loss of the same training under a plain torchrun on this machine, never interrupted
    (waited for while its output and metrics grow). With `image` (a local stack's), torchrun and
    its ranks are forked from it, torch already imported, instead of each importing it afresh."""
    metrics = folder / "metrics.jsonl"
    config = json.loads(json.dumps(trainer_config))
    config["training"]["metrics_file"] = str(metrics)
    config["data"]["shards"] = str(folder / "data")
    (folder / "trainer.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "node.torchrun", "--standalone",
               f"--nproc-per-node={config['parallel']['pp'] * config['parallel'].get('dp', 1)}",
               "-m", "trainer.train", "--config", str(folder / "trainer.yaml")]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    what = "the uninterrupted reference run"
    if image is None:
        done = run_captured(command, also_watch=[metrics], what=what, cwd=folder, env=env, start_new_session=True)
        returncode, output = done.returncode, done.stderr
    else:
        console = folder / "console.log"
        returncode = wait_for_exit(image.fork(command, folder, env, console), [console, metrics], what=what)
        output = console.read_text(errors="replace")
    if returncode != 0:
        raise RuntimeError(f"the reference run failed ({returncode}): {output[-3000:]}")
    return {record["step"]: record["loss"] for record in map(json.loads, metrics.read_text().splitlines())}


# --- seeing phases --------------------------------------------------------------------------

def _is_checkpoint_part(run_name: str, key: str) -> bool:
    return key.startswith(f"runs/{run_name}/checkpoints/") and "/step-" in key and not key.endswith(MARKER_NAME)


@dataclass
class _Commits:
    """What S3 saw of a run's commits and launch specs, in order: the ground truth a resume point
    is checked against (an agent may die before it announces a commit the next attempt uses)."""

    run_name: str
    markers: list[tuple[float, int]] = field(default_factory=list)
    """(time, step) of every commit marker written."""
    launches: list[tuple[float, int, int | None]] = field(default_factory=list)
    """(time, attempt, resume step) of every launch spec written."""

    def __call__(self, kind: str, key: str, body: bytes | None) -> None:
        if kind != "write" or not key.startswith(f"runs/{self.run_name}/"):
            return
        if (step := marker_step(key)) is not None:
            self.markers.append((time.time(), step))
        elif key == f"runs/{self.run_name}/launch-spec.json" and body is not None:
            spec = json.loads(body)
            self.launches.append((time.time(), spec["attempt"], spec.get("resume_step")))


@dataclass
class _View:
    """What an operator sees of the run now."""

    stack: LocalStack
    run: LocalRun
    commits: _Commits
    watch: Watch = field(init=False)
    """Tells whether the run advances (the waits below wait only as long as it does)."""

    def __post_init__(self) -> None:
        self.watch = self.stack.watch(self.run, narrate=lambda news: self.stack.narrate(f"{self.run.run_name}: {news}"))

    def states(self) -> list[str]:
        return states_entered(self.stack.client("stepfunctions"), self.run.arn)

    def record(self) -> Any:
        from trainfleet.adapters.run_store import RunNotFound
        try:
            return self.stack.store.run(self.run.run_name)
        except RunNotFound:
            return None

    def committed(self) -> bool:
        """Whether a checkpoint of the run has committed (its marker is in S3), whether or not the
        control plane has heard of it yet: a fault may strike a node between the two."""
        return bool(self.commits.markers)

    def said(self, instance_id: str, what: str, attempt: int | None = None) -> bool:
        return any(line["agent"] == what and (attempt is None or line.get("attempt") == attempt)
                   for line in agent_lines(self.stack.cloud.fleet.get(instance_id)))

    def node_of_rank(self, attempt: int, rank: int) -> str | None:
        """The instance that holds node rank `rank` in `attempt` (None before the launch spec)."""
        for instance in self.stack.instances(self.run):
            for line in agent_lines(instance):
                if line["agent"] == "starting torchrun" and line["attempt"] == attempt and line["node_rank"] == rank:
                    return instance.instance_id
        return None

    def running(self, instance_id: str | None) -> bool:
        """The instance is running and not frozen: a fault can still land on it."""
        if instance_id is None:
            return False
        instance = self.stack.cloud.fleet.get(instance_id)
        return instance.state == "running" and not instance.hung

    def nodes_of_attempt(self, attempt: int) -> list[str]:
        return [node.instance_id for node in self.stack.store.nodes(self.run.run_name) if node.attempt == attempt]

    def step(self) -> int | None:
        """The step the run's current attempt has reached: its rank 0's newest metrics record, or
        before its first step the checkpoint it resumes from (None: from scratch). Once the attempt
        failed, its world can save nothing more: the step is its newest commit."""
        record = self.record()
        if record is None:
            return None
        if record.attempt_failure is not None and record.attempt_failure.attempt == record.attempt:
            return record.latest_checkpoint.step if record.latest_checkpoint else None
        steps = [line["step"] for line in metrics_records(self.stack.instances(self.run), record.attempt)]
        if steps:
            return max(steps)
        return next((line["resume_step"] for instance in self.stack.instances(self.run)
                     for line in agent_lines(instance)
                     if line["agent"] == "starting torchrun" and line["attempt"] == record.attempt), None)


def _until(view: _View, what: str, done: Callable[[], Any], ended: Callable[[], bool] = lambda: False) -> Any:
    """Poll `done` until it gives something truthy, while the run advances; None when the run
    ended first. Stalled once the run showed nothing new for localcloud.waiting.STALL_S."""
    found: list[Any] = [None]

    def settled() -> bool:
        found[0] = done()
        return bool(found[0]) or ended()
    until(settled, view.watch.progress, what=f"{what} ({view.run.run_name})", poll_s=LOOK_S)
    return found[0] or None


# --- faults -----------------------------------------------------------------------------------

class MissedInjection(RuntimeError):
    """The fault's target was gone by the time the fault came (it lost a race with the run)."""


@dataclass
class Injection:
    """One fault as it was injected."""

    fault: str
    target: str
    phase: str
    at: float
    """time.time() of the injection."""
    step: int | None
    """The newest step trained when it hit."""


def process_role(phase: Phase) -> str:
    """The process a hang or crash at `phase` hits: torchrun while its rendezvous forms the world,
    a trainer rank while the world trains, else the agent (no trainer exists)."""
    if phase is Phase.RENDEZVOUS:
        return "launcher"
    if phase in (Phase.TRAINING, Phase.CHECKPOINT_WRITE, Phase.CHECKPOINT_LOAD):
        return "trainer"
    return "agent"


def _has_process(view: _View, instance_id: str, role: str) -> bool:
    try:
        view.stack.cloud.fleet.process_of(instance_id, role)
    except RuntimeError:
        return False
    return True


def inject(view: _View, fault: Fault, target: str, phase: Phase) -> Injection:
    cloud = view.stack.cloud
    injection = Injection(str(fault), "control plane" if fault in SERVICE_FAULTS else target, str(phase),
                          time.time(), view.step())
    if fault in SERVICE_FAULTS:
        for service in CONTROL_PLANE_SERVICES:
            cloud.fail_requests(service, THROTTLE_S, answer=str(fault))
    else:
        try:
            on_instance(cloud, str(fault), target, role=process_role(phase))
        except RuntimeError as error:
            raise MissedInjection(f"{fault} during {phase} missed {target}: {error}") from error
    view.stack.narrate(f"{fault} {injection.target} during {phase}")
    return injection


def _first_instance(view: _View, ready: Callable[[str], bool]) -> str | None:
    """Node rank 1 before ranks exist: the run's second instance of attempt 0, once `ready`."""
    instances = view.stack.instances(view.run)
    return instances[1].instance_id if len(instances) > 1 and ready(instances[1].instance_id) else None


def _at_checkpoint_request(view: _View, what: str, ended: Callable[[], bool],
                           after: Callable[[], bool]) -> bool:
    """Wait until a checkpoint part of the run is being written (or read), once `after` holds."""
    heard = threading.Event()

    def listener(kind: str, key: str, body: bytes | None) -> None:
        if kind == what and _is_checkpoint_part(view.run.run_name, key) and after():
            heard.set()

    with s3_requests.listen(listener):
        return bool(_until(view, f"checkpoint {what}", heard.is_set, ended))


def disrupt(view: _View, cell: Cell, ended: Callable[[], bool]) -> list[Injection]:
    """Wait for the cell's phase and inject its fault; the injections, in order."""
    if cell.fault is None:
        return EXTRA_DISRUPTIONS[cell.name](view, ended)
    fault, phase = cell.fault, cell.phase
    assert phase is not None
    done: list[Injection] = []

    def hit(target: str | None) -> None:
        if target is not None and not ended():
            done.append(inject(view, fault, target, phase))

    if phase is Phase.ALLOCATE:
        hit(_until(view, "an instance booting", lambda: _first_instance(view, lambda i: _booting(view, i, fault)), ended))
    elif phase is Phase.PREFLIGHT:
        hit(_until(view, "a preflight", lambda: _first_instance(
            view, lambda i: view.said(i, "sent NodeRegistered") and not view.said(i, "sent NodeReady")), ended))
    elif phase is Phase.RENDEZVOUS:
        def starting() -> str | None:
            record = view.record()
            target = view.node_of_rank(0, 1)
            if not target or record is None or record.first_step_at is not None:
                return None
            return target if fault not in PROCESS_FAULTS or _has_process(view, target, "launcher") else None
        hit(_until(view, "a rendezvous", starting, ended))
    elif phase is Phase.TRAINING:
        if _first_checkpoint(view, ended):
            hit(view.node_of_rank(0, 1))
    elif phase is Phase.CHECKPOINT_WRITE:
        if _at_checkpoint_request(view, "write", ended, view.committed):
            hit(view.node_of_rank(0, 1))
    elif phase is Phase.TEARDOWN:
        if _until(view, "Teardown", lambda: "Teardown" in view.states(), ended):
            hit(view.nodes_of_attempt(0)[-1])
    else:
        setup = _kill_rank_1_after_first_checkpoint(view, ended)
        if setup is None:
            return done
        done.append(setup)
        if phase is Phase.CHECKPOINT_LOAD:
            if _at_checkpoint_request(view, "read", ended, lambda: view.running(view.node_of_rank(1, 1))):
                hit(view.node_of_rank(1, 1))
        else:
            state = "RecoveryBackoff" if phase is Phase.BACKOFF else "Recover"
            if _until(view, state, lambda: state in view.states(), ended):
                hit(next(i for i in view.nodes_of_attempt(0) if i != setup.target))  # the survivor
    return done


def _booting(view: _View, instance_id: str, fault: Fault) -> bool:
    """The instance runs its boot, its agent not yet registered; for a hang, once there is an
    agent process to stop (the boot copies the wheelhouse first, then becomes the agent)."""
    fleet = view.stack.cloud.fleet
    if fleet.get(instance_id).process is None:
        return False
    if fault not in PROCESS_FAULTS:
        return True
    return _has_process(view, instance_id, "agent") and not view.said(instance_id, "sent NodeRegistered")


def _first_checkpoint(view: _View, ended: Callable[[], bool]) -> Any:
    """Whether a checkpoint committed before the run ended."""
    return _until(view, "first checkpoint", view.committed, ended)


def _kill_rank_1_after_first_checkpoint(view: _View, ended: Callable[[], bool]) -> Injection | None:
    if not _first_checkpoint(view, ended):
        return None
    return inject(view, Fault.KILL, view.node_of_rank(0, 1), Phase.TRAINING)


def _second_failure_in_preflight(view: _View, ended: Callable[[], bool]) -> list[Injection]:
    """Node rank 1 killed while training; its replacement killed during its preflight."""
    setup = _kill_rank_1_after_first_checkpoint(view, ended)
    if setup is None:
        return []

    def replacement_in_preflight() -> str | None:
        return next((i for i in view.nodes_of_attempt(1) if view.said(i, "sent NodeRegistered")
                     and not view.said(i, "sent NodeReady")), None)
    target = _until(view, "the replacement's preflight", replacement_in_preflight, ended)
    return [setup] + ([inject(view, Fault.KILL, target, Phase.PREFLIGHT)] if target else [])


def _with(arm: Callable[[Any], None]) -> Callable[[_View, Callable[[], bool]], list[Injection]]:
    """Node rank 1 killed while training, with the local cloud armed by `arm` from the start
    (events delivered twice, late or out of order; a function timing out) and disarmed after."""
    def disruption(view: _View, ended: Callable[[], bool]) -> list[Injection]:
        cloud = view.stack.cloud
        arm(cloud)
        try:
            setup = _kill_rank_1_after_first_checkpoint(view, ended)
            _until(view, "the end of the run", ended)
        finally:
            cloud.clear_event_faults()
        return [setup] if setup else []
    return disruption


def _events_out_of_order(cloud: Any) -> None:
    # Every three events are held (one real second, nominal 50 s) and delivered newest first.
    for _ in range(EVENTS_FAULTED // 3):
        cloud.reorder_events(50.0, count=3)


def _two_losses(view: _View, ended: Callable[[], bool]) -> list[Injection]:
    """Node rank 1 killed while training, then again in the attempt that replaced it: with a
    budget of one restart the second must end the run."""
    setup = _kill_rank_1_after_first_checkpoint(view, ended)
    if setup is None:
        return []
    target = _until(view, "attempt 1 training", lambda: view.record() and view.record().attempt == 1
                    and view.record().first_step_at and view.node_of_rank(1, 1), ended)
    return [setup] + ([inject(view, Fault.KILL, target, Phase.TRAINING)] if target else [])


def _crash_every_attempt(view: _View, ended: Callable[[], bool]) -> list[Injection]:
    """A trainer rank of node rank 1 crashes as soon as it exists, at every attempt: the same
    failure again and again with no step trained, so no checkpoint between, which the crash-loop
    rule must end. (Waiting for the run record's first step instead is a race: under load the
    step reaches the record after a checkpoint already committed, and the streak is broken.)"""
    done = []
    for attempt in range(CRASH_LOOP_ATTEMPTS):
        target = _until(view, f"attempt {attempt}'s trainer", lambda: _trainer_of_rank_1(view, attempt), ended)
        if not target:
            break
        done.append(inject(view, Fault.CRASH, target, Phase.TRAINING))
    return done


def _trainer_of_rank_1(view: _View, attempt: int) -> str | None:
    """Node rank 1 of `attempt`, once the run is at that attempt and the node's trainer exists."""
    record, target = view.record(), view.node_of_rank(attempt, 1)
    if record is None or record.attempt != attempt or target is None:
        return None
    return target if _has_process(view, target, "trainer") else None


def _stop_mid_training(view: _View, ended: Callable[[], bool]) -> list[Injection]:
    if _first_checkpoint(view, ended):
        view.stack.client("stepfunctions").stop_execution(executionArn=view.run.arn, error="Operator",
                                                          cause="stopped mid-training")
        view.stack.narrate("StopExecution mid-training")
    return []


EVENTS_FAULTED = 3000
"""More events than a cell's run sends: every one of them gets the fault."""
EC2_STATE_CHANGE = "EC2 Instance State-change Notification"
CRASH_LOOP_ATTEMPTS = 4
"""More than the crash-loop rule's default repeats (3), fewer than the restart budget allows."""
EXTRA_DISRUPTIONS: dict[str, Callable[[_View, Callable[[], bool]], list[Injection]]] = {
    "second-failure-in-preflight": _second_failure_in_preflight,
    "duplicate-events": _with(lambda cloud: cloud.duplicate_events(count=EVENTS_FAULTED)),
    # EC2's news of the lost instance 5 real seconds late: its peer's crash report comes first.
    "late-events": _with(lambda cloud: cloud.delay_events(250.0, [EC2_STATE_CHANGE], count=EVENTS_FAULTED)),
    "out-of-order-events": _with(_events_out_of_order),
    # Recover does its work, then its first invocation is reported timed out: the retry must not
    # decide, book or launch a second time.
    "recover-times-out": _with(lambda cloud: cloud.time_out_invocations("RecoverFunction", 1)),
    "budget-exhausted": _two_losses,
    "crash-loop": _crash_every_attempt,
    "stop-execution": _stop_mid_training,
    "starved": lambda view, ended: [],
}


# --- running a cell ------------------------------------------------------------------------------

def run_cell(stack: LocalStack, cell: Cell, template: dict[str, Any],
             reference: Callable[[], dict[int, float]]) -> dict[str, Any]:
    """Run `template` with the cell's faults; the outcome, its injections and its problems.
    `reference` gives the uninterrupted run's losses, asked for once the cell's run ended (it may
    train beside the cell until then)."""
    started = time.monotonic()
    run = stack.start_run(template, cpu_share=cell.cpu_share)
    commits = _Commits(run.run_name)
    view = _View(stack, run, commits)
    ended = stack.ended(run)
    missed: list[str] = []
    try:
        with s3_requests.listen(commits):
            try:
                injections = disrupt(view, cell, ended)
            except MissedInjection as error:  # the run goes on to its end all the same
                injections, missed = [], [str(error)]
            _until(view, "the end of the run", ended)
            _until(view, "every instance gone", lambda: all(i.state == "terminated" for i in stack.instances(run)))
        outcome = stack.outcome(run)
    except Exception:
        stack.dump_consoles(run)
        raise
    outcome |= {"cell": cell.name, "injections": [vars(i) for i in injections],
                "s3": {"markers": commits.markers, "launches": commits.launches},
                "leftovers": leftovers(stack, run), "seconds": round(time.monotonic() - started, 1)}
    outcome["problems"] = missed + problems(cell, outcome, reference(), template)
    return outcome


def leftovers(stack: LocalStack, run: LocalRun) -> dict[str, list[str]]:
    """What of the run still exists in EC2 (after giving the reaper its time)."""
    from trainfleet.adapters.ec2_fleet import TAG_RUN
    ec2 = stack.client("ec2")
    tagged = [{"Name": f"tag:{TAG_RUN}", "Values": [run.run_name]}]

    def left() -> dict[str, list[str]]:
        reservations = ec2.describe_instances(Filters=tagged)["Reservations"]
        return {
            "instances": [i["InstanceId"] for r in reservations for i in r["Instances"]
                          if i["State"]["Name"] != "terminated"],
            "placement_groups": [g["GroupName"] for g in ec2.describe_placement_groups(Filters=tagged)["PlacementGroups"]],
            "launch_templates": [t["LaunchTemplateName"] for t in
                                 ec2.describe_launch_templates(Filters=tagged)["LaunchTemplates"]],
        }

    snapshot = [left()]

    def progress() -> str:
        snapshot[0] = left()
        return json.dumps(snapshot[0], sort_keys=True)
    try:
        until(lambda: not any(snapshot[0].values()), progress, what=f"what is left of {run.run_name} to go",
              stall_s=LEAK_STALL_S, poll_s=1.0)
    except Stalled:
        pass  # left behind: the problems name it
    return snapshot[0]


def problems(cell: Cell, outcome: dict[str, Any], reference: dict[int, float], template: dict[str, Any]) -> list[str]:
    """Everything that must hold after a cell and does not, in words (empty: the cell passed)."""
    found: list[str] = []
    if cell.must_fail_with:
        if outcome["status"] != "FAILED" or cell.must_fail_with not in f"{outcome['error']} {outcome['cause']}":
            found.append(f"expected the run to fail naming {cell.must_fail_with!r}; got {outcome['status']} "
                         f"{outcome['error']}: {outcome['cause']}")
    elif cell.name == "stop-execution":
        if (outcome["status"], outcome["run"]["state"]) != ("ABORTED", "STOPPED"):
            found.append(f"expected an ABORTED execution and a STOPPED run, got {outcome['status']} "
                         f"and {outcome['run']['state']}")
    elif outcome["status"] != "SUCCEEDED":
        found.append(f"run {outcome['status']}: {outcome['error']}: {outcome['cause']}")
    elif outcome["run"]["latest_checkpoint"] != template["trainer"]["training"]["steps"]:
        found.append(f"last checkpoint {outcome['run']['latest_checkpoint']}, not the last step")
    for attempt, losses in sorted(outcome["losses"].items()):
        wrong = {step: loss for step, loss in losses.items() if reference.get(step) != loss}
        if wrong:
            found.append(f"attempt {attempt}: losses differ from the uninterrupted run at steps {sorted(wrong)[:5]}")
    found += _resume_problems(outcome)
    targets = {injection["target"] for injection in outcome["injections"]}
    blamed = {instance_id for instance_id, node in outcome["nodes"].items() if node["failure"]}
    if blamed - targets:
        found.append(f"nodes no fault hit were blamed and replaced: {sorted(blamed - targets)}")
    node_faults = [injection for injection in outcome["injections"] if injection["fault"] not in SERVICE_FAULTS]
    booked = outcome["report"]["failures"]
    if len(booked) > len(node_faults):
        found.append(f"failures booked: {len(booked)}, faults of nodes: {len(node_faults)} (a slow or "
                     f"throttled world taken for a failed one?): " + "; ".join(
                         f"attempt {failure['attempt']} {failure['failure_class']}: {failure['message']}"
                         for failure in booked))
    for kind, names in outcome["leftovers"].items():
        if names:
            found.append(f"{kind} left behind: {names}")
    unaccounted = outcome["report"]["unaccounted_seconds"]
    if unaccounted is None or abs(unaccounted) > UNACCOUNTED_TOLERANCE_S:
        found.append(f"the ledger does not account for every second: {unaccounted} s unaccounted")
    if "unattributed" in outcome["report"]["ledger"]["lost_by_cause"]:
        found.append("lost time without a cause")
    return found


def _resume_problems(outcome: dict[str, Any]) -> list[str]:
    """Resume points, against the commit markers S3 had when each launch spec was written: a
    committed checkpoint (never a partial one), the newest (no committed work lost), and after a
    Spot notice not older than the step training had reached when it came."""
    found = []
    notices = [injection for injection in outcome["injections"] if injection["fault"] == "spot"]
    for written, attempt, resume in outcome["s3"]["launches"]:
        committed = {step for at, step in outcome["s3"]["markers"] if at < written}
        newest = max(committed, default=None)
        if resume is not None and resume not in committed:
            found.append(f"attempt {attempt} resumed from step {resume}, not committed when it launched")
        if newest is not None and (resume is None or resume < newest):
            found.append(f"attempt {attempt} resumed from step {resume}, older than the committed {newest}")
        for notice in notices:
            if written > notice["at"] and notice["step"] is not None and (resume or 0) < notice["step"]:
                found.append(f"attempt {attempt} resumed from step {resume}: the steps up to {notice['step']} "
                             f"trained when the Spot notice came were lost")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcloud.chaos", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cells", nargs="*", help="cells to run (default: all); see --list")
    parser.add_argument("--list", action="store_true", help="print the cells' names and exit")
    parser.add_argument("--quiet", action="store_true", help="no narration on stderr")
    parser.add_argument("--together", type=int, default=1, metavar="N",
                        help="run N cells side by side on the one stack (only for cells that fault nodes, not "
                             "the whole control plane: a throttle would hit every run)")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CELLS))
        return 0
    unknown = [name for name in args.cells if name not in CELLS]
    if unknown:
        parser.error(f"unknown cell(s) {unknown}; see --list")
    cells = [CELLS[name] for name in args.cells] or list(CELLS.values())
    from localcloud.demo import DEMO_RUN_SPEC
    template = chaos_template(json.loads(DEMO_RUN_SPEC.read_text()))

    def narrate(message: str) -> None:
        if not args.quiet:
            print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="chaos-reference-") as folder, \
            local_stack(narrate, spot_notice_seconds=SPOT_NOTICE_S) as stack, ThreadPoolExecutor(1) as beside, \
            ThreadPoolExecutor(max(1, args.together)) as cells_at_once:
        # The uninterrupted run trains beside the cells, forked from the stack's warm image.
        uninterrupted = beside.submit(reference_losses, template["trainer"], Path(folder), stack.cloud.fleet.image)

        def run(cell: Cell) -> dict[str, Any]:
            return run_cell(stack, cell, cell_template(cell, template), uninterrupted.result)
        for outcome in cells_at_once.map(run, cells):
            print(json.dumps(outcome, default=str), flush=True)
    return 0


def cell_template(cell: Cell, template: dict[str, Any]) -> dict[str, Any]:
    """The RunSpec a cell runs: Spot capacity for a Spot notice, a budget of one restart where
    it must run out."""
    spec = json.loads(json.dumps(template))
    if cell.fault is Fault.SPOT:
        spec["capacity"]["kind"] = "spot"
    if cell.phase is Phase.BACKOFF:  # nominal, x time scale 0.02: a few seconds of wait to hit
        spec["recovery"] |= {"backoff_base_seconds": 300, "backoff_max_seconds": 300}
    if cell.name == "budget-exhausted":
        spec["recovery"]["max_restarts"] = 1
    if cell.name == "crash-loop":
        spec["recovery"]["max_restarts"] = CRASH_LOOP_ATTEMPTS + 1
    return spec


if __name__ == "__main__":
    exit_after_local_cloud(main())
