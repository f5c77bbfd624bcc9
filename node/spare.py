"""The node between attempts: registered and preflighted, it confirms its readiness for each
attempt the run moves to, says it is alive while the run trains without it (a READY spare, a node
whose trainer ended), and finds the launch spec of an attempt that names it."""

from __future__ import annotations

from datetime import datetime, timezone

from node.control_plane import ControlPlane
from trainfleet.core.events import HealthCheckResult, NodeReady
from trainfleet.core.records import LaunchSpec, NodeLiveness, NodeRecord, RunControl, RunState


class Spare:
    """What the agent knows of its node's place in the run while no attempt of its own runs."""

    def __init__(self, control: ControlPlane, node: NodeRecord, checks: list[HealthCheckResult],
                 problem: str | None):
        self.control, self.checks, self.problem = control, checks, problem
        self.ids = {"run_name": control.settings.run_name, "attempt": node.attempt,
                    "instance_id": control.identity.instance_id}
        """What every event of this node about the run names."""
        self.confirmed = node.attempt
        """The newest attempt this node confirmed its readiness for (NodeReady)."""
        self.ran = -1
        """The newest attempt whose launch spec this node took."""
        self.latest: RunControl | None = None
        """The run at the last look that read it."""

    def confirm(self, attempt: int) -> bool:
        """Confirm this node for `attempt` (NodeReady) if it is newer; whether it is confirmed."""
        if attempt > self.confirmed and self.control.send(NodeReady(**{**self.ids, "attempt": attempt},
                                                                    checks=self.checks)):
            self.confirmed = attempt  # this node answers: it may join that attempt's world
        return self.confirmed >= attempt

    def launch_spec(self, run: RunControl | None) -> LaunchSpec | None:
        """The launch spec of a newer attempt that names this node, at a look (`run`, not final) or
        between the looks (None); taken, it is the attempt this node ran last."""
        spec = None
        if run is not None:
            self.latest = run
            if not self.problem:
                self.confirm(run.attempt)
                if run.state is RunState.TRAINING:
                    # Idle while the run trains (a READY spare): Recover confirms a spare seen alive
                    # for a world repaired around it, which then waits on no look of its agent.
                    self.control.report_liveness(NodeLiveness(
                        instance_id=self.ids["instance_id"], attempt=self.confirmed, trainer_running=False,
                        reported_at=datetime.now(timezone.utc)))
            if not self.problem and run.state is RunState.TRAINING and run.attempt > self.ran:
                spec = self.control.launch_spec_after(self.ran)
                spec = spec if spec is not None and spec.attempt == run.attempt else None
        elif not self.problem and self.latest is not None and self.latest.state is RunState.TRAINING:
            # An idle agent of a training run (a READY spare, a node whose trainer ended) reads the
            # launch spec between its looks too: a world repaired around it waits on no look.
            spec = self.control.read_launch_spec_soon(self.ran)
        if spec is not None:
            self.ran = spec.attempt
        return spec
