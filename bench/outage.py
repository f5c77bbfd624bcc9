"""A regional DynamoDB outage while a run trains, on the local cloud: what the nodes do.

    .venv/bin/python bench/outage.py                      # 4 stand-in nodes, DynamoDB down 150 s
    .venv/bin/python bench/outage.py --nodes 8 --outage-s 300

A run of the deployed state machine trains with real agents and the stand-in trainer
(node/standin.py). Once it has trained a while, every DynamoDB request, the functions' and the
agents' alike, answers DynamoDB's internal error for `--outage-s` real seconds: longer than the
agents' unreachable limit (900 s on AWS, UNREACHABLE_LIMIT_S = 60 s here), so
an agent that ended its instance whenever the control plane was out of reach that long would end
every node. At the local cloud's 0.02 time scale, 150 s stands for two hours.

Printed every 10 s: instances alive and the newest step any trainer took; then how the run
ended. The last line is `instances_lost_in_outage=<n>`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localcloud.demo import DEMO_RUN_SPEC  # noqa: E402
from localcloud.stack import LocalRun, LocalStack, local_stack, metrics_records  # noqa: E402

STEP_S = 0.5
SAMPLE_S = 10.0
UNREACHABLE_LIMIT_S = 60.0
"""The agents' unreachable limit in this run: AWS's 900 s scaled down, for an outage of minutes."""


def newest_step(stack: LocalStack, run: LocalRun) -> int:
    records = [record for attempt in range(8) for record in metrics_records(stack.instances(run), attempt)]
    return max((record["step"] for record in records), default=0)


def alive(stack: LocalStack, run: LocalRun) -> int:
    return sum(instance.state in ("pending", "running") for instance in stack.instances(run))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="nodes of the run (even: pp=2)")
    parser.add_argument("--outage-s", type=float, default=150.0, help="real seconds DynamoDB answers errors")
    parser.add_argument("--before-s", type=float, default=20.0, help="real seconds of training before the outage")
    args = parser.parse_args()
    template = json.loads(DEMO_RUN_SPEC.read_text())
    template["run_name"] = "outage"
    template["node_count"] = args.nodes
    parallel = template["trainer"]["parallel"]
    parallel["dp"] = args.nodes // parallel["pp"]
    training = template["trainer"]["training"]
    training["batch_size"] = max(training["batch_size"], parallel["microbatches"] * parallel["dp"])
    # Steps for the training before, during and a minute after the outage.
    template["trainer"]["training"]["steps"] = int((args.before_s + args.outage_s + 60) / STEP_S)
    template["checkpoint"]["interval_steps"] = 100
    with local_stack(lambda message: None, standin_step_s=STEP_S, unreachable_limit_s=UNREACHABLE_LIMIT_S) as stack:
        run = stack.start_run(template)
        while newest_step(stack, run) == 0:
            if not stack.ended(run)():
                time.sleep(1.0)
                continue
            print(f"the run ended before training: {stack.status(run)}")
            return 1
        time.sleep(args.before_s)
        nodes_before, step_before = alive(stack, run), newest_step(stack, run)
        print(f"outage starts: {nodes_before} instances alive, step {step_before}", flush=True)
        stack.cloud.fail_requests("dynamodb", args.outage_s, "error")
        started = time.monotonic()
        least = nodes_before
        while (elapsed := time.monotonic() - started) < args.outage_s:
            time.sleep(min(SAMPLE_S, max(0.0, args.outage_s - elapsed)))
            least = min(least, alive(stack, run))
            print(f"  {time.monotonic() - started:5.0f} s into the outage: {alive(stack, run)} alive, "
                  f"step {newest_step(stack, run)}", flush=True)
        step_after = newest_step(stack, run)
        failed = dict(stack.cloud.failed_requests)
        print(f"outage over: {alive(stack, run)} alive, step {step_after} ({step_after - step_before} steps "
              f"trained during it), {sum(n for (service, _), n in failed.items() if service == 'dynamodb'):,} "
              f"DynamoDB requests refused", flush=True)
        while not stack.ended(run)():
            time.sleep(1.0)
        outcome = stack.outcome(run)
        print(f"run {outcome['status']}: attempt {outcome['run']['attempt']}, restarts {outcome['run']['restarts']}, "
              f"latest checkpoint {outcome['run']['latest_checkpoint']}, "
              f"failures booked {len(outcome['report']['failures'])}")
        print(f"instances_lost_in_outage={nodes_before - least}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
