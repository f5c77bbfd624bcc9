"""A whole training run on the local cloud, with a node lost after the first checkpoint.

    make demo                        (trainfleet demo; python -m localcloud.demo)
    trainfleet demo -- --disruption spot --workdir runs/local-demo   (a Spot notice instead; keep the folders)
    trainfleet demo --trainer-only   (the trainer alone: pp=2 under torchrun, trainer/demo.py)

What happens, as on AWS: a LocalCloud (moto plus the glue) and its instance metadata service
start; `template.yaml` is deployed into it (localcloud.deploy); an execution of the deployed
state machine starts with the RunSpec of events/local-demo-run.json (run name, bucket, subnet
and security group filled in); Allocate launches the instances and the local fleet boots each
as a real node agent (`python -m node.agent`, its own folder and loopback address, no shared
filesystem), which registers, passes preflight and starts torchrun when the launch spec names
it. Once the first checkpoint is committed to the local S3, the instance of node rank 1 is
killed: EC2 reports it, Recover replaces only it, the new attempt resumes from the nodes'
in-memory checkpoints (node rank 1's share from node rank 0's memory), the run completes,
Teardown terminates every instance.

The run is followed with the live view of `trainfleet run watch` (trainfleet/operator/live_view.py),
through the same AWS calls the command makes, and ends with the run report written to a folder
by `trainfleet run report`'s code (its path printed): the HTML page and the PNG plots show the
kill and the resume.

`run_on_local_cloud` does that (or gives node rank 1 a Spot interruption notice instead, or runs
the RunSpec undisturbed) and returns what happened (states, nodes, instances, the agents'
launches and commits, each attempt's losses, the run report); tests/agent_local_run.py asserts
on it. It must run in a process that has not imported `functions` (the local cloud imports the
deployed copy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError
from rich.console import Console

from localcloud.glue import s3 as s3_requests
from localcloud.stack import LocalRun, LocalStack, check_template, local_stack
from localcloud.waiting import Progress, run_captured
from trainer.checkpoint_catalog import marker_step
from trainfleet.core.shapes import validation_message
from trainfleet.operator.live_view import watch

REPO = Path(__file__).resolve().parent.parent
DEMO_RUN_SPEC = REPO / "events" / "local-demo-run.json"

__all__ = ["run_on_local_cloud", "Narrator", "main", "DEMO_RUN_SPEC"]


@dataclass
class Narrator:
    """Prints what happens as it happens, with seconds since the start; silent when quiet. Given
    the console of a live view, it prints above the view."""

    quiet: bool = False
    started: float = field(default_factory=time.monotonic)
    console: Console | None = None

    def __call__(self, message: str) -> None:
        if self.quiet:
            return
        line = f"[{time.monotonic() - self.started:6.1f}s] {message}"
        if self.console is None:
            print(line, flush=True)
        else:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)


LIVE_REFRESH_S = 0.5
"""The live view's reads of the run: a local run's attempts last seconds."""


def run_on_local_cloud(template: dict[str, Any], narrate: Callable[[str], None], *,
                       disruption: Literal["kill", "spot", "freeze"] | None = "kill", workdir: Path | None = None,
                       time_scale: float = 0.02, spot_notice_seconds: float = 120.0,
                       standin_step_s: float | None = None,
                       console: Console | None = None, reports: Path | None = None,
                       export_model: bool = False) -> dict[str, Any]:
    """Deploy, run `template` (its nodes are local instances with real agents), disrupt node
    rank 1 once the first checkpoint is recorded (kill its instance, give it a Spot
    interruption notice, or freeze it: a silent failure), follow it with the live view on
    `console` to its end, write its report into a folder named after the run under `reports`
    (None: a temporary folder); what happened, as plain data (`report_page`: the report's HTML
    page). `workdir` keeps the instances' folders (console.log, each attempt's trainer config,
    torchrun output and metrics); None uses a temporary folder.
    `spot_notice_seconds` is nominal, like every local cloud time: scaled by `time_scale`.
    `standin_step_s` set, the agents run the stand-in trainer (node/standin.py) with steps
    that long in place of torchrun. `export_model`: the run's model exported from its last
    committed checkpoint by `trainfleet checkpoint export`, into `model/` beside the report
    (`model`: its folder)."""
    # Made before the local cloud starts: its Lambda runtime then replaces sys.stdout in this
    # process (capturing each handler thread's output), and the view must write past it.
    console = console or Console(file=sys.stdout)
    with local_stack(narrate, time_scale=time_scale, workdir=workdir, spot_notice_seconds=spot_notice_seconds,
                     standin_step_s=standin_step_s) as stack:
        run = stack.start_run(template)
        try:
            operations = stack.operations()
            disrupted: dict[str, Any] = {}
            quiet = stack.watch(run, narrate=lambda news: None)
            advancing = Progress(quiet.progress, what=f"the end of {run.run_name}")
            first_commit = Future()

            def heard(kind: str, key: str, body: bytes | None) -> None:
                # The first commit marker as it reaches S3: training goes on meanwhile (a second
                # or two of the demo's 60 steps), too fast to wait for the control plane's record.
                step = marker_step(key) if kind == "write" and key.startswith(f"runs/{run.run_name}/") else None
                if step is not None and not first_commit.done():
                    first_commit.set_result(step)

            if disruption is not None:
                first_commit.add_done_callback(lambda commit: stack.cloud.submit("disrupt node rank 1", lambda: (
                    disrupted.update(_disrupt_node_rank_1(stack, run, commit.result(), disruption)))))
            with s3_requests.listen(heard):
                watch(operations, run.run_name, console, refresh_s=LIVE_REFRESH_S,
                      on_look=lambda status: advancing.check())
            quiet.until(lambda: all(i.state == "terminated" for i in stack.instances(run)), "every instance terminated")
            page = operations.report(run.run_name, (reports or Path(tempfile.mkdtemp(prefix="reports-"))) / run.run_name)
            model = _export_model(stack, run, page.parent / "model") if export_model else None
            return stack.outcome(run) | {"disrupted": disrupted or None, "report_page": str(page),
                                         "model": model and str(model)}
        except Exception:
            stack.dump_consoles(run)
            raise


def _export_model(stack: LocalStack, run: LocalRun, folder: Path) -> Path:
    """`trainfleet checkpoint export` of the run's last committed checkpoint, as a user runs it
    against the local cloud (AWS_ENDPOINT_URL and the harness's credentials)."""
    location = stack.store.run(run.run_name).spec.checkpoint.s3_uri
    done = run_captured([sys.executable, "-m", "trainfleet.cli", "checkpoint", "export", location, "--to", str(folder),
                         "--dtype", "float32"], what="the model's export", cwd=REPO, env=os.environ | stack.cloud.env())
    if done.returncode != 0:
        raise RuntimeError(f"trainfleet checkpoint export {location} failed: {done.stderr[-2000:]}")
    stack.narrate(done.stdout.strip())
    return folder


def _disrupt_node_rank_1(stack: LocalStack, run: LocalRun, checkpoint_step: int,
                         how: Literal["kill", "spot", "freeze"]) -> dict[str, Any]:
    cloud, narrate = stack.cloud, stack.narrate
    first_nodes = {node.instance_id: node.node_rank for node in stack.store.nodes(run.run_name)}
    victim = next(instance for instance, rank in first_nodes.items() if rank == 1)
    survivor = next(instance for instance, rank in first_nodes.items() if rank == 0)
    where = f"{victim} (node rank 1, {cloud.fleet.get(victim).private_ip})"
    if how == "kill":
        narrate(f"checkpoint step {checkpoint_step} committed: killing {where}")
        cloud.fleet.kill(victim)
    elif how == "freeze":
        narrate(f"checkpoint step {checkpoint_step} committed: freezing {where} (no EC2 event)")
        cloud.fleet.hang(victim)
    else:
        narrate(f"checkpoint step {checkpoint_step} committed: Spot interruption notice for {where}")
        cloud.inject_spot_interruption(victim)
    return {"first_nodes": first_nodes, "victim": victim, "survivor": survivor}


SAMPLE_PROMPT = "def "
"""What the demo's model continues: it trained on Python's standard library for a minute."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainfleet demo --",
                                     description="A training run on the local cloud with a node lost and replaced.")
    parser.add_argument("--run-spec", type=Path, default=DEMO_RUN_SPEC,
                        help="RunSpec JSON to run (name, bucket, subnet and security group are filled in)")
    parser.add_argument("--disruption", choices=["kill", "spot", "none"], default="kill",
                        help="what happens to node rank 1 after the first checkpoint: its instance is killed, "
                             "it gets a Spot interruption notice, or nothing")
    parser.add_argument("--workdir", type=Path, help="keep the instances' folders here (default: a temporary folder)")
    parser.add_argument("--reports", type=Path, default=Path("reports"),
                        help="write the run report under this folder, in one named after the run (default: reports)")
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given[1:] if given[:1] == ["--"] else given)
    try:
        template = json.loads(args.run_spec.read_text())
        check_template(template)  # with the names, bucket and network the local stack fills in
    except (OSError, json.JSONDecodeError, ValueError) as exc:
        parser.error(f"--run-spec {args.run_spec}: {exc}")
    except ValidationError as exc:
        parser.error(f"--run-spec {args.run_spec}:\n{validation_message(exc)}")
    disruption = None if args.disruption == "none" else args.disruption
    console = Console(file=sys.stdout)
    outcome = run_on_local_cloud(template, Narrator(console=console), disruption=disruption, workdir=args.workdir,
                                 reports=args.reports, console=console, export_model=True)
    print(f"run report: {outcome['report_page']} (and its plots as PNGs beside it)", flush=True)
    print(f"the trained model: {outcome['model']} (safetensors; trainfleet sample --from {outcome['model']} "
          f"--prompt TEXT)", flush=True)
    from trainer.export import exported_tokenizer, load_exported
    from trainer.sample import generate

    print(f"a sample, after {SAMPLE_PROMPT!r}:", flush=True)
    model = Path(outcome["model"])
    print(SAMPLE_PROMPT + generate(load_exported(model), exported_tokenizer(model), SAMPLE_PROMPT, new_tokens=160),
          flush=True)
    return 0 if outcome["status"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    from localcloud.cloud import exit_after_local_cloud

    exit_after_local_cloud(main())
