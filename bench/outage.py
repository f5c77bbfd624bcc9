"""A regional DynamoDB outage while a run trains, with a node lost inside it, on the local cloud.

    .venv/bin/python bench/outage.py                      # DynamoDB down an hour (72 s at 0.02), a node lost 6 s in
    .venv/bin/python bench/outage.py --outage-s 150 --kill-at-s 40

A run of the deployed state machine trains the demo's model (events/local-demo-run.json: pp=2 on
two nodes, the real trainer) with real agents. Once it has trained a while, every DynamoDB request,
the functions' and the agents' alike, answers DynamoDB's internal error for `--outage-s` real
seconds; at the local cloud's 0.02 time scale the default 72 s stands for an hour, and its retries
(the state machine's, Lambda's, the agents' queue) are scaled alike. That is longer than the agents'
unreachable limit (900 s on AWS, UNREACHABLE_LIMIT_S = 60 s here) and than the 510 s of retries
after which the state machine used to tear the fleet down. `--kill-at-s` into it, node rank 1's
instance dies: its peer's trainer fails its step and waits to be repaired, silent, while nothing
that reads or writes a record can act on it. Once DynamoDB answers again, the run must recover.

Printed every 10 s: instances alive and the newest step; then what became of the loss: its
failure record, how long after the outage the run trained again, and how the run ended. The last
lines are `survivors_lost_in_outage=<n>` (instances the kill did not end that ended anyway: an
agent that took the outage for a lost control plane) and `outage_to_training_s=<s>`.
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
from localcloud.waiting import until  # noqa: E402
from trainfleet.adapters.run_store import RunNotFound, RunStore  # noqa: E402
from trainfleet.core.records import LaunchSpec, RunRecord, RunState  # noqa: E402

SAMPLE_S = 10.0
UNREACHABLE_LIMIT_S = 60.0
"""The agents' unreachable limit in this run: AWS's 900 s scaled down, for an outage of minutes."""
TIME_SCALE = 0.02


def newest_step(stack: LocalStack, run: LocalRun) -> int:
    records = [record for attempt in range(8) for record in metrics_records(stack.instances(run), attempt)]
    return max((record["step"] for record in records), default=0)


def alive(stack: LocalStack, run: LocalRun) -> set[str]:
    return {instance.instance_id for instance in stack.instances(run) if instance.state in ("pending", "running")}


def node_of_rank(stack: LocalStack, run: LocalRun, rank: int) -> str:
    s3 = stack.cloud.internal_client("s3")
    spec = LaunchSpec.model_validate_json(
        s3.get_object(Bucket=stack.bucket, Key=f"runs/{run.run_name}/launch-spec.json")["Body"].read())
    return next(instance for instance, node_rank in spec.node_ranks.items() if node_rank == rank)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outage-s", type=float, default=72.0, help="real seconds DynamoDB answers errors")
    parser.add_argument("--kill-at-s", type=float, default=6.0, help="real seconds into the outage node rank 1 dies")
    parser.add_argument("--before-s", type=float, default=15.0, help="real seconds of training before the outage")
    parser.add_argument("--steps", type=int, default=1500, help="steps of the run: enough to outlast the outage")
    args = parser.parse_args()
    if not 0 < args.kill_at_s < args.outage_s:
        parser.error("--kill-at-s must fall inside the outage")
    template = json.loads(DEMO_RUN_SPEC.read_text())
    template["run_name"] = "outage"
    template["trainer"]["training"]["steps"] = args.steps
    template["checkpoint"]["interval_steps"] = 50
    with local_stack(lambda message: None, time_scale=TIME_SCALE, unreachable_limit_s=UNREACHABLE_LIMIT_S) as stack:
        run = stack.start_run(template)
        store = RunStore(stack.cloud.internal_client("dynamodb"), stack.outputs["RunTableName"])

        def record() -> RunRecord:
            return store.run(run.run_name)

        def stepping(attempt: int) -> bool:
            """Whether the run trains an attempt from `attempt` on and it took a step."""
            if stack.ended(run)():
                raise RuntimeError(f"the run ended: {stack.status(run)}")
            try:
                current = record()
            except RunNotFound:  # not validated yet
                return False
            return (current.attempt >= attempt and current.state is RunState.TRAINING
                    and current.first_step_at is not None)

        until(lambda: stepping(0), stack.cloud.activity, what="the first step")
        time.sleep(args.before_s)
        before, step_before = alive(stack, run), newest_step(stack, run)
        print(f"outage starts: {len(before)} instances alive, step {step_before}", flush=True)
        stack.cloud.fail_requests("dynamodb", args.outage_s, "error")
        started = time.monotonic()
        victim, killed, sample_at = node_of_rank(stack, run, 1), False, SAMPLE_S
        survivors_seen = before - {victim}
        while (elapsed := time.monotonic() - started) < args.outage_s:
            if not killed and elapsed >= args.kill_at_s:
                stack.cloud.fleet.kill(victim)
                killed = True
                print(f"  {elapsed:5.0f} s into the outage: node rank 1 ({victim}) lost", flush=True)
            if elapsed >= sample_at:
                sample_at += SAMPLE_S
                print(f"  {elapsed:5.0f} s into the outage: {len(alive(stack, run))} alive, "
                      f"step {newest_step(stack, run)}", flush=True)
            time.sleep(min(1.0, args.outage_s - elapsed))
        ended = time.monotonic()
        survivors_left = survivors_seen & alive(stack, run)
        refused = sum(n for (service, _), n in stack.cloud.failed_requests.items() if service == "dynamodb")
        print(f"outage over ({args.outage_s:.0f} s, {args.outage_s / TIME_SCALE / 3600:.1f} h scaled): "
              f"{len(survivors_left)} of {len(survivors_seen)} survivors alive, step {newest_step(stack, run)}, "
              f"{refused:,} DynamoDB requests refused, attempt still {record().attempt}", flush=True)
        until(lambda: stepping(1), stack.cloud.activity, what="training again after the outage")
        recovered_s = time.monotonic() - ended
        failure = record().failures[0]
        print(f"the loss: {failure.failure_class.value}, blamed {failure.instance_ids}, "
              f"{failure.recovery.value if failure.recovery else '-'}; {failure.decision[:160]}")
        print(f"training again {recovered_s:.1f} s after the outage (attempt {record().attempt}, "
              f"step {record().last_step})", flush=True)
        until(stack.ended(run), stack.cloud.activity, what="the run's end")
        outcome = stack.outcome(run)
        print(f"run {outcome['status']}: attempt {outcome['run']['attempt']}, restarts {outcome['run']['restarts']}, "
              f"latest checkpoint {outcome['run']['latest_checkpoint']}, "
              f"failures booked {len(outcome['report']['failures'])}")
        print(f"survivors_lost_in_outage={len(survivors_seen - survivors_left)}")
        print(f"outage_to_training_s={recovered_s:.1f}")
    return 0 if outcome["status"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
