"""An attempt followed: torchrun for one launch spec on this node, and what the agent reports
of it (heartbeats, progress, commits, the world checks, a hang, a Spot notice, its end), through
the repairs of its world in place."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

import yaml

from node import node_log, standin
from node.control_plane import ControlPlane
from node.metadata import MetadataClient, SpotWatch
from node.node_log import say
from node.settings import LOOK_S, AgentError
from node.trainer_files import WORLD_CHECKS, AttemptFiles, Life, MetricsFollower, progress_samples
from node.trainer_process import (OUTPUT_TAIL_CHARS, failure_kind, failure_message, repair_order, standin_command,
                                  start_process, stop, torchrun_command, torchrun_env, trainer_config)
from trainer import checkpoint_catalog as catalog
from trainer.progress import read_progress
from trainer.repair_order import read_failure, write_order
from trainfleet.core.events import (PROGRESS_SAMPLES_MAX, CheckpointCommitted, CheckpointReason, TrainerFailed,
                                    TrainerHung, TrainingCompleted, TrainingProgress)
from trainfleet.core.lifecycle import checkpoint_request_answered
from trainfleet.core.pace import CADENCE_WINDOW, heartbeat_pace, hung_after, stalled
from trainfleet.core.records import (LaunchSpec, NodeLiveness, RunControl, StateRestoredFigures,
                                     TrainerFailureKind)

PROGRESS_EVERY_S = 10.0
"""Least time between two reports of TrainingProgress (CloudWatch gets each as metrics)."""
PEER_LOSS_GRACE_S = 1.0
"""How long a failed trainer waits for the run to move on before it reports the failure: EC2's
event about a lost peer, on its way when the peer's death broke this world, usually moves it on
by then. Only noise is saved: Recover names a lost instance from its EC2 state either way."""


class Attempt:
    """torchrun for one launch spec on this node, and what the agent reports about it; the
    attempts after it whose worlds repair its world in place, which its trainer joins with the
    processes it has (trainer/repair.py)."""

    def __init__(self, control: ControlPlane, metadata: MetadataClient, spec: LaunchSpec,
                 confirm: Callable[[int], bool], deadline: float | None = None):
        """`confirm(attempt)` confirms this node for a newer attempt (NodeReady), and says whether it is."""
        self.control, self.spec, self.confirm, self.deadline = control, spec, confirm, deadline
        self.identity = control.identity
        self.world = spec.repair.launched_attempt if spec.repair else spec.attempt
        """The attempt whose launch formed the world this node's trainer is in (a repair keeps it)."""
        self.launched_with = frozenset(spec.node_ranks)
        """The nodes whose torchrun this node's torchrun met (its rendezvous)."""
        self.generation = spec.repair.generation if spec.repair else 0
        """The repairs of that world this node's trainer was ordered into."""
        self.failure_said = -1
        """The last generation whose failed step the agent reported."""
        self.failure_seen_at: float | None = None
        self.failed_step: dict[str, Any] | None = None
        """What this node's trainer said of its world's failed step (trainer/repair_order.py), while it waits."""
        self.trainer_pid: int | None = None
        """torchrun's process (the stand-in's: the agent's own)."""
        self.returncode: int | None = None
        """torchrun's exit status, once it ended."""
        self.repair_pending: int | None = None
        """The attempt that repairs this node's world and keeps its trainer, until its launch spec is read."""
        self.run_seen: RunControl | None = None
        """The run at the last look."""
        self.node_rank = spec.node_ranks[self.identity.instance_id]
        self.files = AttemptFiles(control.settings.workdir / f"attempt-{spec.attempt}")
        self.metrics = MetricsFollower(self.files.metrics)
        self.checkpoints = catalog.open_store(spec.trainer_config["checkpoint"]["uri"], control.s3)
        committed = control.until_done("list the committed checkpoints", lambda: control.call(
            "list the committed checkpoints", lambda: catalog.committed_steps(self.checkpoints)), deadline)
        self.announced = announced_before(spec, committed)
        self.last_step: int | None = None
        self.speaks_for_world = False  # set once this node's trainer writes metrics (global rank 0)
        self.heartbeat_every = heartbeat_pace(spec.hang_timeout_seconds)
        self.torchrun_started: float | None = None  # control.clock() when torchrun was started
        self.stepped = False  # whether this node saw a step of this attempt (metrics or its progress)
        self.final_step = spec.trainer_config.get("training", {}).get("steps")
        self.finished: float | None = None  # control.clock() when the metrics showed the final step
        self.last_heartbeat = self.last_progress = -math.inf
        self.unsent_steps: list[tuple[int, dict[str, Any]]] = []
        """Metrics records of steps no TrainingProgress carried yet, each with the attempt that
        trained it: a world repaired in place goes on writing the same file in the next attempt."""
        self.beaten = Life()
        """What the trainer's files showed at the last heartbeat."""
        self.seen = Life()
        """What they showed at the heartbeat thread's last look."""
        self.alive_at = -math.inf
        """control.clock() when the heartbeat thread last saw them change: the trainer's last sign of life."""
        self.watched = Life()
        self.watched_alive_at = -math.inf
        """The same, as the watch loop sees them at its looks: what a hang is judged by. The heartbeat
        thread's view stalls while a heartbeat call waits out a slow control plane."""
        self.watched_alive_wall: datetime | None = None
        """That moment in wall-clock time, for the liveness record (NodeLiveness.alive_at)."""
        self.spot = SpotWatch(metadata, control.settings.metadata_look_s)
        self.commit_awaited_after: int | None = None
        """The last step when a checkpoint was asked for, until a later commit is announced."""
        self.checkpoint_request_seen: datetime | None = None
        self.node_step: int | None = None  # this node's trainer's last step (its progress file)
        self.node_step_at: datetime | None = None
        self.progress_changes = 0  # how often its progress file changed
        self.node_stepped_at = -math.inf  # control.clock() when it changed last
        self.node_step_s: float | None = None  # the time a step took, from the last two changes
        self.step_seconds: deque[float] = deque(maxlen=CADENCE_WINDOW)
        """node_step_s at each look that saw steps, oldest first: the world's cadence (pace.hung_after)."""
        self.hang_declared = False
        self.checks_reported: set[str] = set()
        """WORLD_CHECKS whose result the control plane took."""

    def run(self) -> RunControl | None:
        """Run torchrun until it exits or the run leaves this attempt; the run as the look that
        showed it had left it saw it, if that is what ended it."""
        self.files.folder.mkdir(parents=True, exist_ok=True)
        self.files.config.write_text(yaml.safe_dump(
            trainer_config(self.spec, self.files, self.control.settings.host_memory_dir), sort_keys=False))
        if self.spec.repair:  # this node joins a repaired world (a replacement, or its trainer ended): with the order
            write_order(self.files.repair_order, repair_order(self.spec))
        step_seconds = self.control.settings.standin_step_s
        command = (standin_command(self.spec, self.node_rank, step_seconds, self.files) if step_seconds
                   else torchrun_command(self.spec, self.node_rank, self.identity, self.files))
        # Reported before torchrun starts: a peer's trainer can train only once this node's torchrun
        # joined, so a node without a report while its peers trained has an agent that went silent.
        self.report_liveness()
        self.torchrun_started = self.control.clock()
        launch = standin.start_thread if step_seconds else start_process
        node_log.follow("trainer", self.files.output)
        with self.files.output.open("ab") as output:
            process = launch(command, self.files.folder, torchrun_env(self.files, self.identity, self.node_rank),
                             output)
        self.trainer_pid = process.pid
        say("starting torchrun", attempt=self.spec.attempt, node_rank=self.node_rank,
            resume_step=self.spec.resume_step, command=" ".join(command[1:]), pid=process.pid)
        stop_beating = threading.Event()
        threading.Thread(target=self.beat_until, args=(stop_beating,), name="heartbeat", daemon=True).start()
        try:
            while process.poll() is None:
                time.sleep(LOOK_S)
                self.follow()
                self.report_failed_step()
                run = self.control.look_at_run()
                self.run_seen = run or self.run_seen
                if run is not None and self.left_behind(run) and not self.awaits_repair(run):
                    say("attempt superseded: stopping torchrun", attempt=self.spec.attempt)
                    return run
                if run is not None and not self.left_behind(run):
                    self.look(run)
                if self.repair_pending is not None and not self.take_repaired_spec():
                    say("attempt superseded, not repaired in place: stopping torchrun", attempt=self.spec.attempt)
                    return self.run_seen
                if self.deadline is not None and time.monotonic() > self.deadline:
                    raise AgentError("the agent's lifetime is over: stopping torchrun")
        finally:
            self.control.pace_for(stepping=False)
            stop_beating.set()
            stop(process)
            self.follow()
            # The steps since the last TrainingProgress belong to the run's history, also those
            # of an attempt the run has left.
            self.send_progress()
        self.returncode = process.returncode
        self.report_exit(process.returncode)
        return None

    def left_behind(self, run: RunControl) -> bool:
        """Whether the run has left this attempt (a failure moved it on, or it finished)."""
        return run.attempt > self.spec.attempt or run.state.is_final

    def awaits_repair(self, run: RunControl) -> bool:
        """Whether the run, having left this attempt, repairs this node's world in place (Recover's
        WorldRepair): the node confirms the new attempt and reads its launch spec as soon as it is
        written (take_repaired_spec), which says whether its trainer is a survivor's and keeps
        running. False when the trainer is to stop."""
        repair = run.repair
        if (run.state.is_final or repair is None or repair.launched_attempt != self.world
                or repair.generation <= self.generation or not self.confirm(run.attempt)):
            return False
        self.repair_pending = run.attempt
        return True

    def take_repaired_spec(self) -> bool:
        """Read the pending repair's launch spec (ControlPlane.read_launch_spec_soon) and, once it
        is there, order the trainer into the repaired world and follow that attempt. False when the
        spec turned out not to repair this node's world: the trainer is to stop."""
        spec = self.control.read_launch_spec_soon(self.spec.attempt)
        if spec is None or spec.attempt != self.repair_pending:
            return True  # not written yet (a newer attempt is the run record's to tell)
        if spec.repair is None or self.identity.instance_id not in spec.repair.survivor_ids:
            return False
        say("repairing the world in place: the trainer keeps its processes", attempt=spec.attempt,
            generation=spec.repair.generation, node_rank=spec.node_ranks[self.identity.instance_id],
            pid=self.trainer_pid)
        for check in WORLD_CHECKS:  # the repaired world writes its own (its restore)
            self.files.check_result(check).unlink(missing_ok=True)
        self.checks_reported.clear()
        self.send_progress()  # the failed attempt's last steps, ahead of the new one's
        # The repaired world forms anew (its ranks meet, restore, rebuild their stages), silent as
        # long as a start-up at scale, far past five of the failed world's steps: its cadence is
        # learnt again from its own steps, the start-up timeout bounding the silence meanwhile.
        self.step_seconds.clear()
        self.progress_changes, self.hang_declared = 0, False
        self.spec, self.generation = spec, spec.repair.generation
        self.announce_from(spec)
        write_order(self.files.repair_order,
                    repair_order(spec, launch_nodes_gone=len(self.launched_with - set(spec.repair.survivor_ids))))
        self.report_liveness()
        self.repair_pending = None
        return True

    def announce_from(self, spec: LaunchSpec) -> None:
        """Take the commits up to `spec`'s resume point as announced, and only those: one this node
        announced for the attempt the run has since left (its world trained on after the attempt
        failed, as a world leaving a Spot notice does) was dropped as stale, and is the new
        attempt's to announce, or the run's last commit goes unrecorded."""
        self.announced = announced_before(spec, self.control.call(
            "list the committed checkpoints", lambda: catalog.committed_steps(self.checkpoints)) or ())

    @property
    def trained_to_the_end(self) -> bool:
        """Whether torchrun ended well after this node's trainer trained the run's last step (its
        progress file: every node's, not only the one whose metrics show it)."""
        return self.returncode == 0 and self.node_step == self.final_step

    def complete(self, spec: LaunchSpec) -> None:
        """Answer `spec`, a repair of this node's world, after its trainer trained the run's last
        step and ended before the order came (the world trained on while the control plane
        repaired it, as after a Spot notice near the end): nothing is left to train. The node that
        speaks for the world announces the commits the new attempt has not heard of and completes
        it; the others have nothing to say."""
        if not self.speaks_for_world:
            return
        say("the world trained its last step before it was repaired: nothing left to train", attempt=spec.attempt)
        self.spec = spec
        self.announce_from(spec)
        self.report_exit(0)

    def report_failed_step(self) -> None:
        """TrainerFailed once for a failed step of this node's world whose ranks wait for a repair
        order (trainer/repair_order.py): the trainer does not exit, so its exit cannot report it.
        As with an exit, after PEER_LOSS_GRACE_S: EC2's event about a lost peer usually moves the
        run on first, and then this attempt's failure is already known (the control plane drops
        the report as stale)."""
        failed = self.failed_step
        if failed is None or failed["generation"] <= self.failure_said:
            return
        now = self.control.clock()
        self.failure_seen_at = self.failure_seen_at or now
        if now - self.failure_seen_at < PEER_LOSS_GRACE_S:
            return
        say("the trainer's step failed: it waits to be repaired", attempt=self.spec.attempt, error=failed["error"])
        if self.control.send(TrainerFailed(
                run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
                kind=TrainerFailureKind.CRASH, message=failed["error"], last_step=self.last_step)):
            self.failure_said, self.failure_seen_at = failed["generation"], None

    def beat_until(self, stopped: threading.Event) -> None:
        """The heartbeat thread: beat_if_due every LOOK_S until `stopped`."""
        while not stopped.wait(LOOK_S):
            self.beat_if_due()

    def beat_if_due(self) -> None:
        """Heartbeat the Train task when a beat is due (heartbeat_every since the last) and the
        world showed life since: the metrics file grew (global rank 0 appends a record a step), or
        the trainer of the node that speaks for the world gave a sign of life in its progress file
        (a microbatch, a start-up phase: trainer/progress.py), or the world starts up or winds
        down and its last sign of life is recent enough. So a world whose steps are slow (a large
        model, a starved machine) is never taken for a hung one: only a silent one is."""
        token, now = self.spec.heartbeat_task_token, self.control.clock()
        life = Life.of(self.files)
        if life != self.seen:
            self.seen, self.alive_at = life, now
            self.control.trainer_alive_at = now
        if token is None or now - self.last_heartbeat < self.heartbeat_every:
            return
        spoke = life.progress != self.beaten.progress and (self.speaks_for_world or self.speaks_for_start())
        if life.metrics_size > self.beaten.metrics_size or spoke or self.starting_up(now) or self.winding_down(now):
            self.control.heartbeat(token)
            self.last_heartbeat, self.beaten = now, life

    def follow(self) -> None:
        """What the node shows since the last look: metrics, this node's progress, a Spot notice.
        Only the node that speaks for the world calls the control plane here (progress,
        new commits); the heartbeat has a thread of its own (beat_if_due)."""
        records = self.metrics.new_records()
        # A `finished` record (no loss) is what a trainer resumed at its last step writes instead
        # of step records: it speaks for the world all the same.
        steps = [record for record in records if not record.get("finished")]
        now = self.control.clock()
        life = Life.of(self.files)
        if life != self.watched:
            self.watched, self.watched_alive_at, self.watched_alive_wall = life, now, datetime.now(timezone.utc)
        step = read_progress(self.files.progress)
        if step is not None and step != self.node_step:
            # The first step written is where the trainer joined the world, the next its first
            # step; each later one times the steps since the one before.
            self.progress_changes += 1
            if self.progress_changes > 2:
                self.node_step_s = (now - self.node_stepped_at) / max(1, step - self.node_step)
                self.step_seconds.append(self.node_step_s)
            self.stepped = self.stepped or self.progress_changes > 1
            self.node_step, self.node_step_at, self.node_stepped_at = step, datetime.now(timezone.utc), now
        failed = read_failure(self.files.repair_order) if self.spec.repairable else None
        self.failed_step = failed if failed is not None and failed["generation"] == self.generation else None
        # A trainer whose step failed waits for the control plane: looks at the full rate at once.
        self.control.pace_for(stepping=self.progress_changes > 1 and self.failed_step is None
                              and not stalled(now - self.node_stepped_at, self.node_step_s))
        self.stepped = self.stepped or bool(steps)
        if records:
            self.speaks_for_world = True
            self.last_step = records[-1]["step"]
            if self.finished is None and self.last_step == self.final_step:
                self.finished = now
        self.unsent_steps += [(self.spec.attempt, step) for step in steps]
        # The final step goes out at once: the history and the run record end where training did.
        if self.unsent_steps and (now - self.last_progress >= PROGRESS_EVERY_S or self.finished is not None):
            self.send_progress()
            self.last_progress = now
        if records and self.commit_awaited_after is not None:
            # A checkpoint asked for now (a Spot notice, a departure) is announced as soon as it
            # commits, not at the next look: the Spot wait ends on it, and the next attempt
            # resumes from the newest announced. Other commits wait for the look (one S3 listing
            # a look, not two a second).
            self.announce_commits()
        for check in WORLD_CHECKS.keys() - self.checks_reported:
            if self.files.check_result(check).exists():
                self.report_check(check)
        if self.spot.new_notice(now):
            self.request_checkpoint("spot interruption notice")
        self.declare_if_hung(now)

    def declare_if_hung(self, now: float) -> None:
        """TrainerHung, once, when this node's trainer was stepping and has been silent for longer
        than the world's cadence allows (pace.hung_after): no step, no microbatch, no start-up
        phase, no sign from a save. A rank that stopped stops the whole world at its next
        collective, so every node's trainer falls silent and the first agent to tell fails the
        Train task at once, not a hang timeout later. A world that finished its steps is judged
        no more: its end (the final save, the exit) is the startup timeout's to bound."""
        limit = hung_after(self.step_seconds, self.spec.stall_floor_seconds)
        silent = now - self.watched_alive_at
        if self.hang_declared or limit is None or silent <= limit or self.node_step == self.final_step:
            return
        say("the trainer is silent past the world's cadence: declaring it hung", attempt=self.spec.attempt,
            last_step=self.node_step, silent_s=round(silent, 1), limit_s=round(limit, 1))
        self.hang_declared = self.control.send(TrainerHung(
            run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
            last_step=self.node_step, seconds_since_progress=silent))

    def speaks_for_start(self) -> bool:
        """Whether this node speaks for the attempt's start-up: before the first step no trainer
        writes metrics, so the agent of node rank 0 (the launch spec's choice, known to every
        agent) speaks for the world until a step (its trainer's, or one in the metrics file)."""
        return (self.node_rank == 0 and not self.stepped and self.seen.metrics_size == 0
                and self.torchrun_started is not None)

    def starting_up(self, now: float) -> bool:
        """Whether this node heartbeats the attempt's start-up whatever its trainer shows: the
        phases of a start-up (a rendezvous, NCCL set-up, a checkpoint load from S3) are long and
        show no step, so node rank 0 beats on until the startup timeout has passed since torchrun
        started or since its trainer's last sign of life, whichever is later."""
        return (self.speaks_for_start()
                and now - max(self.torchrun_started, self.alive_at) < self.spec.startup_timeout_seconds)

    def winding_down(self, now: float) -> bool:
        """Whether this node heartbeats the end of a trainer that reached its final step: the final
        checkpoint is saved and the world torn down before torchrun exits (and TrainingCompleted
        answers the task), with no step to show for it. Bounded like the start-up, which it
        mirrors (a checkpoint saved instead of loaded)."""
        return (self.finished is not None
                and now - max(self.finished, self.alive_at) < self.spec.startup_timeout_seconds)

    def look(self, run: RunControl) -> None:
        """At each look at the control plane: this node's liveness, a checkpoint the run asks for,
        and (the rank-0 node) the checkpoints committed since the last look."""
        self.report_liveness()
        requested = run.checkpoint_requested_at
        if requested is not None and requested != self.checkpoint_request_seen:
            self.checkpoint_request_seen = requested
            if not checkpoint_request_answered(run, self.spec.attempt):
                self.request_checkpoint("the run asks for a checkpoint (a worker is leaving)")
        # Commits that land after the trainer's last record (an asynchronous save). Only after the
        # first record: by then the trainer has deleted the folders of an abandoned timeline (steps
        # newer than its resume point), which must not be announced as this attempt's commits.
        if self.speaks_for_world:
            self.announce_commits()

    def request_checkpoint(self, why: str) -> None:
        self.files.checkpoint_request.touch()
        self.commit_awaited_after = self.last_step if self.last_step is not None else -1
        say(f"{why}: asked the trainer to checkpoint now", attempt=self.spec.attempt)

    def report_liveness(self, trainer_running: bool = True) -> None:
        self.control.report_liveness(NodeLiveness(
            instance_id=self.identity.instance_id, attempt=self.spec.attempt, step=self.node_step,
            step_at=self.node_step_at, alive_at=self.watched_alive_wall, trainer_running=trainer_running,
            reported_at=datetime.now(timezone.utc)))

    def report_check(self, check: str) -> None:
        """A world check's result, which global rank 0 wrote on this node; sent again at the
        next look if the bus does not take it now."""
        figures_of, event = WORLD_CHECKS[check]
        figures = figures_of(json.loads(self.files.check_result(check).read_text()), self.spec.attempt)
        verdict = "restored" if isinstance(figures, StateRestoredFigures) else "passed" if figures.passed else "failed"
        say(f"{check.replace('_', ' ')} {verdict}", attempt=self.spec.attempt, figures=figures.describe())
        if self.control.send(event(run_name=self.spec.run_name, attempt=self.spec.attempt,
                                   instance_id=self.identity.instance_id, figures=figures)):
            self.checks_reported.add(check)

    def send_progress(self) -> None:
        """Every step since the last TrainingProgress, PROGRESS_SAMPLES_MAX an event, each in an
        event of the attempt that trained it: the run's history holds each one. What could not be
        sent goes at the next try."""
        while self.unsent_steps:
            attempt = self.unsent_steps[0][0]
            records = list(itertools.takewhile(lambda unsent: unsent[0] == attempt,
                                               self.unsent_steps[:PROGRESS_SAMPLES_MAX]))
            latest = records[-1][1]
            if not self.control.send(TrainingProgress(
                    run_name=self.spec.run_name, attempt=attempt, instance_id=self.identity.instance_id,
                    step=latest["step"], loss=latest["loss"], tokens_per_second=latest["tokens_per_s"],
                    step_seconds=latest["step_time_s"], samples=progress_samples([record for _, record in records]))):
                return
            del self.unsent_steps[:len(records)]

    def announce_commits(self) -> None:
        committed = self.control.call("list the committed checkpoints",
                                      lambda: catalog.committed_steps(self.checkpoints))
        for step in sorted(committed or ()):
            if step in self.announced:
                continue
            try:
                manifest = self.control.call("read a commit marker",
                                             lambda: catalog.read_manifest(self.checkpoints, step))
            except catalog.CheckpointInvalid as error:
                # Listed a moment ago and pruned since by the trainer's retention (a newer commit
                # is listed too), or no commit after all: nothing to announce. It ended the agent,
                # and so its instance, before.
                say("a listed checkpoint is gone: not announced", attempt=self.spec.attempt, error=str(error))
                self.announced.add(step)
                continue
            if manifest is None or not self.control.send(CheckpointCommitted(
                    run_name=self.spec.run_name, attempt=self.spec.attempt, instance_id=self.identity.instance_id,
                    step=step, uri=self.checkpoints.step_uri(catalog.step_dir_name(step)),
                    reason=CheckpointReason(manifest.reason))):
                return  # announced at a later look
            self.announced.add(step)
            if self.commit_awaited_after is not None and step > self.commit_awaited_after:
                self.commit_awaited_after = None

    def report_exit(self, returncode: int) -> None:
        base = {"run_name": self.spec.run_name, "attempt": self.spec.attempt,
                "instance_id": self.identity.instance_id}
        if returncode == 0:
            say("torchrun finished", attempt=self.spec.attempt, last_step=self.last_step)
            if self.speaks_for_world:
                self.announce_commits()
                latest = max(self.announced, default=None)
                self.control.deliver(TrainingCompleted(
                    **base, final_step=self.last_step,
                    checkpoint_uri=self.checkpoints.step_uri(catalog.step_dir_name(latest)) if latest else None),
                    self.deadline)
            return
        # At once: Recover, deciding on the failure that the peers report a grace later, must not
        # order this node's ended trainer into a repaired world.
        self.report_liveness(trainer_running=False)
        time.sleep(PEER_LOSS_GRACE_S)
        run = self.control.read_run()
        if run is not None and self.left_behind(run):
            say("torchrun failed after the run moved on; not reported", attempt=self.spec.attempt,
                exit_code=returncode)
            return
        output = self.files.output.read_text(errors="replace")[-20 * OUTPUT_TAIL_CHARS:]
        self.control.deliver(TrainerFailed(**base, kind=failure_kind(output), exit_code=returncode,
                                           message=failure_message(output), last_step=self.last_step),
                             self.deadline)


def announced_before(spec: LaunchSpec, committed: Iterable[int]) -> set[int]:
    """The commits the attempts before `spec`'s announced (or could have): those up to its resume
    point. Its own are announced as they come."""
    return {step for step in committed if spec.resume_step is None or step <= spec.resume_step}
