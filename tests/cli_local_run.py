"""A stand-in run driven with `trainfleet run` as a person drives it, against the local cloud:
every command a process of its own, pointed at the local endpoint by the environment alone, as
the AWS CLI is.

template.yaml is deployed into a local cloud whose instances run the stand-in trainer
(node/standin.py: the real trainer's signals, no torch). The commands start four nodes
(pp=2 x dp=2), look at the run while it trains, and follow it with `watch` while the harness
kills node rank 1's instance as the next commit after that reaches S3 (the control plane must
replace that node alone and resume from the newest commit); then they list, read logs and a node's console, write
the report, stop a second run after its first commit, go on from that commit in a third run
(`start --resume-from`), and are given bad input. The last line of stdout is one JSON
document: each command with its exit code and output, and the run's outcome as
localcloud.stack gathers it.

    python tests/cli_local_run.py
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localcloud.cloud import exit_after_local_cloud  # noqa: E402
from localcloud.demo import DEMO_RUN_SPEC, Narrator  # noqa: E402
from localcloud.glue import s3 as s3_requests  # noqa: E402
from localcloud.stack import LocalRun, local_stack  # noqa: E402
from localcloud.waiting import sizes, until  # noqa: E402
from trainer.checkpoint_catalog import latest_committed, marker_step  # noqa: E402
from trainfleet.adapters.run_store import RunNotFound  # noqa: E402

NODES, STEP_S = 4, 0.4
"""Steps of 0.4 s: from the first step the run record shows to the last commit before the final
one, about 20 s for the commands that look at the run while it trains to start."""


def recorded(stack, run_name: str, what: str) -> bool:
    """Whether the run record shows `what` yet: a first step, a first commit, its end."""
    try:
        record = stack.store.run(run_name)
    except RunNotFound:
        return False
    shown = {"step": lambda: bool(record.last_step), "commit": lambda: record.latest_checkpoint is not None,
             "end": lambda: record.state.is_final}
    return shown[what]()


def checkpoint_files(stack, run_name: str) -> dict[str, str]:
    """Every object under the run's checkpoints, with its ETag."""
    pages = stack.client("s3").get_paginator("list_objects_v2").paginate(
        Bucket=stack.bucket, Prefix=f"runs/{run_name}/checkpoints/")
    return {item["Key"]: item["ETag"] for page in pages for item in page.get("Contents", [])}


def main() -> dict:
    template = json.loads(DEMO_RUN_SPEC.read_text())
    template["node_count"] = NODES
    template["trainer"]["parallel"]["dp"] = NODES // template["trainer"]["parallel"]["pp"]
    results: dict[str, dict] = {}
    with local_stack(Narrator(), standin_step_s=STEP_S) as stack, \
            tempfile.TemporaryDirectory(prefix="cli-") as folder:
        folder = Path(folder)
        env = {**os.environ, **stack.cloud.env(), "TRAINFLEET_STACK": stack.stack_name, "COLUMNS": "160"}

        def command(*args: str) -> list[str]:
            return [sys.executable, "-m", "trainfleet.cli", "run", *args]

        def finished(name: str, done: subprocess.CompletedProcess, started: float) -> dict:
            results[name] = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                             "seconds": round(time.monotonic() - started, 1)}
            return results[name]

        def cli(name: str, *args: str) -> dict:
            """One command, waited for while it writes or the cloud advances (localcloud.waiting)."""
            started = time.monotonic()
            stdout, stderr = folder / f"{name}.stdout", folder / f"{name}.stderr"
            with stdout.open("w") as out, stderr.open("w") as err, \
                    subprocess.Popen(command(*args), env=env, cwd=folder, stdout=out, stderr=err) as process:
                until(lambda: process.poll() is not None, lambda: (sizes([stdout, stderr]), stack.cloud.activity()),
                      what=f"trainfleet run {' '.join(args)}", poll_s=0.1)
            return finished(name, subprocess.CompletedProcess(process.args, process.returncode, stdout.read_text(),
                                                              stderr.read_text()), started)

        def spec_file(run_name: str, base: dict = template, **changes) -> str:
            spec = stack.run_spec(base, run_name) | changes
            path = folder / f"{run_name}.json"
            path.write_text(json.dumps(spec))
            return str(path)

        def first(run_name: str, what: str) -> None:
            until(lambda: recorded(stack, run_name, what), stack.cloud.activity, what=f"{run_name}'s first {what}")

        (folder / "broken.json").write_text("{ not json")
        cli("start", "start", spec_file("cli-run"))
        cli("start_again", "start", spec_file("cli-run"))
        cli("start_missing", "start", str(folder / "missing.json"))
        cli("start_broken", "start", str(folder / "broken.json"))
        cli("start_invalid", "start", spec_file("cli-invalid", node_count=0))
        cli("start_outside_bucket", "start", spec_file("cli-outside", checkpoint={
            "s3_uri": "s3://another-bucket/runs/x", "interval_steps": 10}))
        first("cli-run", "step")
        cli("status_training", "status", "cli-run")
        with ThreadPoolExecutor(1) as beside:
            watching = beside.submit(cli, "watch", "watch", "cli-run")
            first_nodes = {node.instance_id: node.node_rank for node in stack.store.nodes("cli-run")}
            victim = next(instance for instance, rank in first_nodes.items() if rank == 1)
            killed = threading.Event()
            final_step = template["trainer"]["training"]["steps"]

            def kill_at_the_next_commit(kind: str, key: str, body: bytes | None) -> None:
                # As the marker is stored, not once the control plane hears of it (its events take
                # seconds on a loaded machine): a commit the run makes after the commands above,
                # never its final one, so that the kill falls while it trains.
                step = marker_step(key) if kind == "write" and key.startswith("runs/cli-run/") else None
                if step is not None and step < final_step and not killed.is_set():
                    stack.cloud.fleet.kill(victim)
                    killed.set()
            with s3_requests.listen(kill_at_the_next_commit):
                until(lambda: killed.is_set() or recorded(stack, "cli-run", "end"), stack.cloud.activity,
                      what="cli-run's next commit, to kill node rank 1 at")
            if not killed.is_set():
                raise RuntimeError(f"cli-run trained to its end before the commands that look at it while it "
                                   f"trains were done: steps of {STEP_S} s are too short for this machine")
            watching.result()
        cli("status_done", "status", "cli-run")
        cli("list", "list")
        cli("logs", "logs", "cli-run")
        cli("logs_json", "logs", "cli-run", "--json")
        cli("node_log", "logs", "cli-run", "--node", "0")
        cli("node_log_unknown", "logs", "cli-run", "--node", "i-0000000000000dead")
        cli("report", "report", "cli-run", "--out", str(folder / "report"))
        results["report"]["files"] = sorted(path.name for path in (folder / "report").iterdir())
        results["report"]["page"] = (folder / "report" / "report.html").read_text()
        cli("stop_finished", "stop", "cli-run")
        cli("status_unknown", "status", "no-such-run")
        cli("report_unknown", "report", "no-such-run")
        cli("list_unknown_stack", "list", "--stack", "no-such-stack")
        two_nodes = json.loads(json.dumps(template))
        two_nodes["node_count"], two_nodes["trainer"]["parallel"]["dp"] = 2, 1
        cli("start_second", "start", spec_file("cli-stopped", two_nodes))
        first("cli-stopped", "commit")
        cli("stop", "stop", "cli-stopped", "--timeout", "120")
        # As EC2 describes them the moment `stop` returned: every one terminated.
        results["stopped_instances"] = sorted({
            instance["State"]["Name"] for reservation in stack.cloud.client("ec2").describe_instances(
                Filters=[{"Name": "tag:trainfleet:run", "Values": ["cli-stopped"]}])["Reservations"]
            for instance in reservation["Instances"]})
        cli("status_stopped", "status", "cli-stopped")
        # The stopped run goes on in a run of its own from its newest commit, which it keeps as it was.
        stopped_uri = f"s3://{stack.bucket}/runs/cli-stopped/checkpoints"
        results["resumed"] = {"stopped_commit": latest_committed(stopped_uri, stack.client("s3")).step,
                              "stopped_files_before": checkpoint_files(stack, "cli-stopped")}
        resumable = folder / "resumable.json"  # the RunSpec a person wrote: its checkpoints are the stack's
        spec = stack.run_spec(two_nodes, "cli-stopped")
        del spec["checkpoint"]["s3_uri"]
        resumable.write_text(json.dumps(spec))
        cli("start_resume_itself", "start", str(resumable), "--resume-from", "cli-stopped")
        cli("start_resumed", "start", str(resumable), "--run-name", "cli-resumed", "--resume-from", "cli-stopped",
            "--watch")
        results["resumed"] |= {
            "stopped_files_after": checkpoint_files(stack, "cli-stopped"),
            "outcome": stack.outcome(LocalRun("cli-resumed", stack.operations().execution_arn("cli-resumed"), {}))}
        until(lambda: all(instance.state == "terminated" for instance in stack.cloud.fleet.instances()
                          if instance.tags.get("trainfleet:run") == "cli-run"), stack.cloud.activity,
              what="every instance of cli-run terminated")
        run = LocalRun("cli-run", stack.operations().execution_arn("cli-run"), {})
        outcome = stack.outcome(run) | {"disrupted": {"first_nodes": first_nodes, "victim": victim}}
    return {"commands": results, "outcome": outcome}


if __name__ == "__main__":
    print(json.dumps(main(), default=str))
    exit_after_local_cloud(0)
