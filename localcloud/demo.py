"""A whole training run on the local cloud, with a node lost after the first checkpoint.

    make demo                        (trainfleet demo; python -m localcloud.demo)
    trainfleet demo -- --disruption spot --workdir runs/local-demo   (a Spot notice instead; keep the folders)
    trainfleet demo --trainer-only   (the trainer alone: pp=2 under torchrun, trainer/demo.py)

What happens, as on AWS: a LocalCloud (moto plus the glue) and its instance metadata service
start; `template.yaml` is deployed into it (localcloud.deploy); an execution of the deployed
state machine starts with the RunSpec of events/local-demo-run.json (run name, bucket, subnet
and security group filled in); Allocate launches the instances and the local fleet boots each
as a real node agent (`python -m trainer.agent`, its own folder and loopback address, no shared
filesystem), which registers, passes preflight and starts torchrun when the launch spec names
it. Once the first checkpoint is committed to the local S3, the instance of node rank 1 is
killed: EC2 reports it, Recover replaces only it, the new attempt resumes from the latest
committed checkpoint, the run completes, Teardown terminates every instance.

`run_on_local_cloud` does that (or gives node rank 1 a Spot interruption notice instead, or runs
the RunSpec undisturbed) and returns what happened (states, nodes, instances, the agents'
launches and commits, each attempt's losses, the run report); tests/agent_local_run.py asserts
on it, `main` narrates it. It must run in a process that has not imported `functions` (the local
cloud imports the deployed copy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from localcloud.stack import LocalRun, LocalStack, Watch, local_stack
from trainfleet.contracts import RunSpec, validation_message

REPO = Path(__file__).resolve().parent.parent
DEMO_RUN_SPEC = REPO / "events" / "local-demo-run.json"

__all__ = ["run_on_local_cloud", "Narrator", "main", "DEMO_RUN_SPEC"]


@dataclass
class Narrator:
    """Prints what happens as it happens, with seconds since the start; silent when quiet."""

    quiet: bool = False
    started: float = field(default_factory=time.monotonic)

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)


def run_on_local_cloud(template: dict[str, Any], narrate: Callable[[str], None], *,
                       disruption: Literal["kill", "spot", "freeze"] | None = "kill", workdir: Path | None = None,
                       time_scale: float = 0.02, spot_notice_seconds: float = 120.0,
                       timeout_s: float = 600.0, standin_step_s: float | None = None) -> dict[str, Any]:
    """Deploy, run `template` (its nodes are local instances with real agents), disrupt node
    rank 1 once the first checkpoint is recorded (kill its instance, give it a Spot
    interruption notice, or freeze it: a silent failure), wait for the end; what happened, as
    plain data. `workdir` keeps the instances' folders (console.log, each attempt's trainer
    config, torchrun output and metrics); None uses a temporary folder. `spot_notice_seconds` is
    nominal, like every local cloud time: scaled by `time_scale`. `standin_step_s` set, the agents
    run the stand-in trainer (trainer/standin.py) with steps that long in place of torchrun."""
    with local_stack(narrate, time_scale=time_scale, workdir=workdir, spot_notice_seconds=spot_notice_seconds,
                     agent_lifetime_s=timeout_s, standin_step_s=standin_step_s) as stack:
        run = stack.start_run(template)
        try:
            watch = stack.watch(run)
            ended = stack.ended(run)
            disrupted = None
            if disruption is not None:
                watch.until(lambda: ended() or watch.first_checkpoint() is not None, timeout_s)
                if not ended():
                    disrupted = _disrupt_node_rank_1(stack, run, watch, disruption)
            watch.until(ended, timeout_s)
            watch.until(lambda: all(i.state == "terminated" for i in stack.instances(run)), 60)
            return stack.outcome(run) | {"disrupted": disrupted}
        except Exception:
            stack.dump_consoles(run)
            raise


def _disrupt_node_rank_1(stack: LocalStack, run: LocalRun, watch: Watch,
                         how: Literal["kill", "spot", "freeze"]) -> dict[str, Any]:
    cloud, narrate = stack.cloud, stack.narrate
    first_nodes = {node.instance_id: node.node_rank for node in stack.store.nodes(run.run_name)}
    victim = next(instance for instance, rank in first_nodes.items() if rank == 1)
    survivor = next(instance for instance, rank in first_nodes.items() if rank == 0)
    where = f"{victim} (node rank 1, {cloud.fleet.get(victim).private_ip})"
    if how == "kill":
        narrate(f"checkpoint step {watch.first_checkpoint()} committed: killing {where}")
        cloud.fleet.kill(victim)
    elif how == "freeze":
        narrate(f"checkpoint step {watch.first_checkpoint()} committed: freezing {where} (no EC2 event)")
        cloud.fleet.hang(victim)
    else:
        narrate(f"checkpoint step {watch.first_checkpoint()} committed: Spot interruption notice for {where}")
        cloud.inject_spot_interruption(victim)
    return {"first_nodes": first_nodes, "victim": victim, "survivor": survivor}


LOST_TIME_MEANING = {
    "startup": "allocation, boot, preflight, rendezvous until the first step",
    "restart": "backoff, replacement, rendezvous, checkpoint load until the first step after the failure",
    "redone": "training after the last checkpoint, done again after the failure",
    "give_up": "from giving up on the failure to teardown",
    "finishing": "after the final checkpoint or last reported step: the trainer's exit, the completion event",
    "unattributed": "booked before lost time had causes",
}
"""What each kind of lost time (GoodputLedger.lost_by_cause, before the ':') stands for."""


def narrate_outcome(outcome: dict[str, Any], narrate: Callable[[str], None]) -> None:
    """The summary at the end: where each attempt started, the losses, instances, goodput."""
    for instance_id, launches in outcome["launches"].items():
        for launch in launches:
            narrate(f"{instance_id}: attempt {launch['attempt']} as node rank {launch['node_rank']}, "
                    f"resuming from step {launch['resume_step']}" if launch["resume_step"] is not None
                    else f"{instance_id}: attempt {launch['attempt']} as node rank {launch['node_rank']}, from scratch")
    timeline: dict[int, float] = {}  # the run as it stands: each step from the last attempt that trained it
    for attempt, losses in sorted(outcome["losses"].items()):
        steps = sorted(losses)
        narrate(f"attempt {attempt} trained steps {steps[0]}-{steps[-1]}")
        timeline |= losses
    steps = sorted(timeline)
    for first in range(0, len(steps), 10):
        row = steps[first:first + 10]
        narrate(f"loss, steps {row[0]:>3}-{row[-1]:<3} " + " ".join(f"{timeline[step]:.3f}" for step in row))
    report = outcome["report"]
    for failure in report["failures"]:
        narrate(f"failure handled: {failure['failure_class']}, latest committed step then {failure['resume_step']}")
    narrate(f"instances: {len(outcome['instances'])} launched, now {sorted(set(outcome['instances'].values()))}; "
            f"replaced: {', '.join(report['nodes']['replaced']) or 'none'}")
    narrate(f"run {report['state']} after {report['restarts']} restart(s), last checkpoint step "
            f"{outcome['run']['latest_checkpoint']}")
    if outcome["error"]:
        narrate(f"execution failed: {outcome['error']}: {outcome['cause']}")
    ledger = report["ledger"]
    narrate(f"goodput {report['goodput']:.0%} of the run's time: {ledger['productive_seconds']:.1f} s productive, "
            f"{ledger['lost_seconds']:.1f} s lost")
    for cause, seconds in sorted(ledger["lost_by_cause"].items(), key=lambda item: -item[1]):
        kind, _, failure_class = cause.partition(":")
        narrate(f"  {seconds:6.1f} s lost to {cause}: {LOST_TIME_MEANING.get(kind, kind)}"
                + (f" ({failure_class})" if failure_class else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainfleet demo --",
                                     description="A training run on the local cloud with a node lost and replaced.")
    parser.add_argument("--run-spec", type=Path, default=DEMO_RUN_SPEC,
                        help="RunSpec JSON to run (name, bucket, subnet and security group are filled in)")
    parser.add_argument("--disruption", choices=["kill", "spot", "none"], default="kill",
                        help="what happens to node rank 1 after the first checkpoint: its instance is killed, "
                             "it gets a Spot interruption notice, or nothing")
    parser.add_argument("--workdir", type=Path, help="keep the instances' folders here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each phase of the run")
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given[1:] if given[:1] == ["--"] else given)
    try:
        template = json.loads(args.run_spec.read_text())
        RunSpec.model_validate(template)  # the names, bucket and network filled in later keep it valid
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"--run-spec {args.run_spec}: {exc}")
    except ValidationError as exc:
        parser.error(f"--run-spec {args.run_spec}:\n{validation_message(exc)}")
    narrate = Narrator()
    disruption = None if args.disruption == "none" else args.disruption
    outcome = run_on_local_cloud(template, narrate, disruption=disruption, workdir=args.workdir,
                                 timeout_s=args.timeout)
    narrate_outcome(outcome, narrate)
    return 0 if outcome["status"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
