"""`trainfleet run` as a person uses it, against the local cloud: every command a process of its
own, pointed at the local endpoint by the environment alone, as the AWS CLI is.

template.yaml is deployed into a local cloud whose instances run the stand-in trainer (two nodes,
fast steps); then the commands start a run, look at it while it trains, follow it to its end,
list, read logs and a node's console, write the report, stop a second run, and are given bad
input. The last line of stdout is one JSON document: each command with its exit code and output.

    python tests/cli_local_run.py
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localcloud.demo import DEMO_RUN_SPEC, Narrator  # noqa: E402
from localcloud.stack import local_run_spec, local_stack  # noqa: E402
from trainfleet.adapters.run_store import RunNotFound  # noqa: E402

STEP_S = 0.2
STEPS = 60
TIMEOUT_S = 240


def trained(stack, run_name: str) -> bool:
    try:
        return (stack.store.run(run_name).last_step or 0) > 0
    except RunNotFound:
        return False


def main() -> dict:
    template = json.loads(DEMO_RUN_SPEC.read_text())
    template["trainer"]["training"]["steps"] = STEPS
    results: dict[str, dict] = {}
    with local_stack(Narrator(), agent_lifetime_s=TIMEOUT_S, standin_step_s=STEP_S) as stack, \
            tempfile.TemporaryDirectory(prefix="cli-") as folder:
        folder = Path(folder)
        env = {**os.environ, **stack.cloud.env(), "TRAINFLEET_STACK": stack.stack_name, "COLUMNS": "160"}

        def cli(name: str, *args: str, timeout: float = TIMEOUT_S) -> dict:
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "trainfleet.cli", "run", *args], env=env, cwd=folder,
                                  capture_output=True, text=True, timeout=timeout)
            results[name] = {"rc": done.returncode, "stdout": done.stdout, "stderr": done.stderr,
                             "seconds": round(time.monotonic() - started, 1)}
            return results[name]

        def spec_file(run_name: str, **changes) -> str:
            spec = local_run_spec(template, run_name, stack.bucket, *stack.network) | changes
            path = folder / f"{run_name}.json"
            path.write_text(json.dumps(spec))
            return str(path)

        (folder / "broken.json").write_text("{ not json")
        cli("start", "start", spec_file("cli-run"))
        cli("start_again", "start", spec_file("cli-run"))
        cli("start_missing", "start", str(folder / "missing.json"))
        cli("start_broken", "start", str(folder / "broken.json"))
        cli("start_invalid", "start", spec_file("cli-invalid", node_count=0))
        cli("start_outside_bucket", "start", spec_file("cli-outside", checkpoint={
            "s3_uri": "s3://another-bucket/runs/x", "interval_steps": 10}))
        stack.cloud.wait_until(lambda: trained(stack, "cli-run"), TIMEOUT_S, "cli-run's first step", poll_s=0.5)
        cli("status_training", "status", "cli-run")
        cli("watch", "watch", "cli-run")
        cli("status_done", "status", "cli-run")
        cli("list", "list")
        cli("logs", "logs", "cli-run")
        cli("node_log", "logs", "cli-run", "--node", "0")
        cli("node_log_unknown", "logs", "cli-run", "--node", "i-0000000000000dead")
        cli("report", "report", "cli-run", "--out", str(folder / "report"))
        results["report"]["files"] = sorted(path.name for path in (folder / "report").iterdir())
        cli("stop_finished", "stop", "cli-run")
        cli("status_unknown", "status", "no-such-run")
        cli("report_unknown", "report", "no-such-run")
        cli("list_unknown_stack", "--stack", "no-such-stack", "list")
        cli("start_second", "start", spec_file("cli-stopped"))
        stack.cloud.wait_until(lambda: trained(stack, "cli-stopped"), TIMEOUT_S, "cli-stopped's first step", poll_s=0.5)
        cli("stop", "stop", "cli-stopped", "--timeout", "120")
        results["stopped_instances"] = sorted({instance.state for instance in stack.cloud.fleet.instances()
                                               if instance.tags.get("trainfleet:run") == "cli-stopped"})
    return results


if __name__ == "__main__":
    print(json.dumps(main()))
