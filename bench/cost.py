"""The control plane's own cost per training-day, counted on the local cloud and priced at AWS's
list prices, beside the fleet's.

    .venv/bin/python bench/cost.py                        # stand-in runs of 4, 8 and 16 nodes, twice each
    .venv/bin/python bench/cost.py --sizes 4,12 --repeats 3 --window-s 300

Each size is a run of the deployed state machine on the local cloud whose nodes run the real
agent with the stand-in trainer (node/standin.py: no torch, the real trainer's signals), at
production pacing (the RunSpec's default hang timeout, 600 s, sets how often agents look and
heartbeat). Once it trains, every request that reaches the local cloud's endpoint is counted
for `--window-s` real seconds of steady training (the harness makes none then: it reads the
instances' files and the cloud's counters), with the Lambda invocations, state transitions and
the bytes and billed durations the functions logged. Those are hourly rates of the run as AWS
would see them: the agents' looks and heartbeats run in real time.

What grows with the fleet is the agents' looks (a run record read and a liveness record written
each), and trainfleet.core.pace caps a run's looks a second above FULL_RATE_NODES. So each service's
rate is a per-run part plus a per-look part, fitted by least squares through every measured run
with neither part below zero (`fit`: a cost cannot be negative; a line through two noisy sizes
gave negative S3, SQS and EventBridge costs at 512 nodes), and a fleet is priced at
pace.looks_per_second(nodes). Every size is measured `--repeats` times, and each repeat's own
fit is printed beside the pooled one: the spread says how far to trust the figure. A recovery costs a few dozen calls once (bench/recovery.py
counts them); at the Llama 3 failure rate of a 64-node fleet (a failure every ~4 days) it is
left out. Units: a DynamoDB request counts as one read or write unit (an upper bound: the agents'
looks are eventually consistent reads of the run's control item, a few hundred bytes at any size,
half a unit; bench/control_plane_load.py sizes the items), a transaction as two per item written.

The last line is `usd_per_training_day=<64 nodes>`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.aws_prices import (DYNAMODB_PER_READ_UNIT, DYNAMODB_PER_WRITE_UNIT, EVENTBRIDGE_PER_EVENT,  # noqa: E402
                               LAMBDA_PER_GB_SECOND, LAMBDA_PER_REQUEST, LOGS_PER_GB, METRIC_PER_MONTH,
                               S3_PER_READ_REQUEST, S3_PER_WRITE_REQUEST, SQS_PER_REQUEST,
                               STEP_FUNCTIONS_PER_TRANSITION)
from localcloud.demo import DEMO_RUN_SPEC  # noqa: E402
from localcloud.stack import LocalRun, LocalStack, local_stack, metrics_records  # noqa: E402
from trainer.config import ParallelConfig  # noqa: E402
from trainfleet.core import pace  # noqa: E402
from trainfleet.core.catalogue import instance_facts  # noqa: E402
from trainfleet.core.runspec import RecoveryPolicy  # noqa: E402

HARNESS_ACTIONS = {("states", "StartExecution"), ("states", "StopExecution"), ("states", "DescribeExecution")}
"""Requests of the harness, not of the run."""

STEP_S = 0.5
"""A stand-in step: 7,200 steps an hour, progress sampled every 10 s, a checkpoint every 10 min."""
CHECKPOINT_EVERY_STEPS = 1200


@dataclass
class Rates:
    """Billed quantities per hour of steady training."""

    requests: Counter
    """(service, action) -> requests an hour."""
    transitions: float
    invocations: float
    gb_seconds: float
    log_bytes: float
    metrics: int
    """Custom metrics the run's functions created."""

    def usd_per_hour(self) -> dict[str, float]:
        dynamodb_reads = sum(n for (service, action), n in self.requests.items() if service == "dynamodb"
                             and action in ("GetItem", "Query", "BatchGetItem", "Scan", "TransactGetItems"))
        dynamodb_writes = sum(n * (2 if action == "TransactWriteItems" else 1)
                              for (service, action), n in self.requests.items()
                              if service == "dynamodb" and action in ("PutItem", "UpdateItem", "DeleteItem",
                                                                        "TransactWriteItems", "BatchWriteItem"))
        s3_writes = sum(n for (service, action), n in self.requests.items()
                        if service == "s3" and re.match(r"(Put|Copy|Post|List|Create|Complete|Upload)", action))
        s3_reads = sum(n for (service, _), n in self.requests.items() if service == "s3") - s3_writes
        events = sum(n for (service, action), n in self.requests.items() if (service, action) == ("events", "PutEvents"))
        sqs = sum(n for (service, _), n in self.requests.items() if service == "sqs")
        return {
            "step_functions": self.transitions * STEP_FUNCTIONS_PER_TRANSITION,
            "lambda": self.invocations * LAMBDA_PER_REQUEST + self.gb_seconds * LAMBDA_PER_GB_SECOND,
            "dynamodb": dynamodb_reads * DYNAMODB_PER_READ_UNIT + dynamodb_writes * DYNAMODB_PER_WRITE_UNIT,
            "eventbridge": events * EVENTBRIDGE_PER_EVENT,
            "s3": s3_writes * S3_PER_WRITE_REQUEST + s3_reads * S3_PER_READ_REQUEST,
            "sqs": sqs * SQS_PER_REQUEST,
            "cloudwatch": self.log_bytes / 1e9 * LOGS_PER_GB + self.metrics * METRIC_PER_MONTH / (30 * 24),
        }


def priced(per_run: dict[str, float], per_look: dict[str, float], nodes: int, hang_timeout_s: float) -> dict[str, float]:
    """USD an hour of a fleet: the per-run part plus the per-look part at the fleet's look rate."""
    looks = pace.looks_per_second(nodes, hang_timeout_s)
    return {part: per_run[part] + per_look[part] * looks for part in per_run}


def fit(measured: list[tuple[int, dict[str, float]]],
        hang_timeout_s: float) -> tuple[dict[str, float], dict[str, float]]:
    """The per-run and per-look parts (USD an hour, USD an hour per look a second) of each
    service, fitted through every (nodes, USD an hour) measured: least squares with both parts at
    or above zero. When the unconstrained line has a negative part, that part is zero and the
    other is fitted alone, which for two parameters is the constrained optimum."""
    looks = [pace.looks_per_second(nodes, hang_timeout_s) for nodes, _ in measured]
    per_run, per_look = {}, {}
    for part in measured[0][1]:
        usd = [rates[part] for _, rates in measured]
        per_run[part], per_look[part] = _line_at_or_above_zero(looks, usd)
    return per_run, per_look


def _line_at_or_above_zero(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys) with both >= 0."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        raise ValueError("fit needs runs of at least two sizes whose look rates differ")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    intercept = mean_y - slope * mean_x
    if slope < 0:
        return max(0.0, mean_y), 0.0
    if intercept < 0:
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return intercept, slope


class Counts:
    """A snapshot of what the local cloud counted, to take differences of."""

    def __init__(self, stack: LocalStack):
        requests, transitions, invocations = stack.cloud.counters()
        self.at = time.monotonic()
        self.requests = Counter({key: n for key, n in requests.items() if key not in HARNESS_ACTIONS})
        self.transitions = sum(transitions.values())
        self.invocations = sum(invocations.values())
        self.log_bytes, self.gb_seconds = _function_logs(stack)


def _function_logs(stack: LocalStack) -> tuple[int, float]:
    """Bytes the functions logged so far, and the GB-seconds their REPORT lines bill (1 ms steps)."""
    from moto.logs.models import logs_backends
    total_bytes, gb_seconds = 0, 0.0
    for backend in logs_backends.values():
        for region in backend.values():
            for group in region.groups.values():
                for stream in group.streams.values():
                    for event in stream.events:
                        message = event.message
                        total_bytes += len(message.encode())
                        if (report := re.search(r"Duration: ([\d.]+) ms\s+Memory Size: (\d+) MB", message)):
                            billed_ms = -(-float(report.group(1)) // 1)
                            gb_seconds += billed_ms / 1000 * int(report.group(2)) / 1024
    return total_bytes, gb_seconds


def measure(stack: LocalStack, nodes: int, window_s: float, repeat: int, say) -> Rates:
    template = json.loads(DEMO_RUN_SPEC.read_text())
    template["run_name"] = f"cost{nodes}-{repeat}"
    template["node_count"] = nodes
    parallel = template["trainer"]["parallel"]
    parallel["dp"] = nodes // parallel["pp"]
    training = template["trainer"]["training"]
    training["batch_size"] = max(training["batch_size"], parallel["microbatches"] * parallel["dp"])
    template["trainer"]["training"]["steps"] = 1_000_000
    template["checkpoint"]["interval_steps"] = CHECKPOINT_EVERY_STEPS
    # The agents look at the pace of the default hang timeout; the RunSpec wants the collective
    # timeout between it and the start-up timeout, so all three are the defaults.
    defaults = RecoveryPolicy()
    template["recovery"] |= {"hang_timeout_seconds": defaults.hang_timeout_seconds,
                             "startup_timeout_seconds": defaults.startup_timeout_seconds}
    parallel["timeout_s"] = ParallelConfig.timeout_s
    run = stack.start_run(template)
    try:
        deadline = time.monotonic() + 300
        while not metrics_records(stack.instances(run), 0):
            execution = stack.client("stepfunctions").describe_execution(executionArn=run.arn)
            if execution["status"] != "RUNNING":
                raise RuntimeError(f"{nodes} nodes: the run ended {execution['status']} before its first step: "
                                   f"{execution.get('error')}: {execution.get('cause')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{nodes} nodes: no step within 300 s")
            time.sleep(1.0)
        time.sleep(10.0)  # past the first step's events
        before = Counts(stack)
        time.sleep(window_s)
        after = Counts(stack)
    finally:
        _stop(stack, run)
    hours = (after.at - before.at) / 3600
    metrics = _run_metrics(stack, run)
    say(f"{nodes} nodes: counted {sum((after.requests - before.requests).values())} requests in "
        f"{after.at - before.at:.0f} s of training")
    return Rates(requests=Counter({key: n / hours for key, n in (after.requests - before.requests).items()}),
                 transitions=(after.transitions - before.transitions) / hours,
                 invocations=(after.invocations - before.invocations) / hours,
                 gb_seconds=(after.gb_seconds - before.gb_seconds) / hours,
                 log_bytes=(after.log_bytes - before.log_bytes) / hours, metrics=metrics)


def _run_metrics(stack: LocalStack, run: LocalRun) -> int:
    """Custom metrics with the run's name among their dimensions."""
    listed = stack.client("cloudwatch").get_paginator("list_metrics").paginate(
        Dimensions=[{"Name": "RunName", "Value": run.run_name}])
    return sum(len(page["Metrics"]) for page in listed)


def _stop(stack: LocalStack, run: LocalRun) -> None:
    sfn = stack.client("stepfunctions")
    sfn.stop_execution(executionArn=run.arn, error="Bench", cause="measured")
    deadline = time.monotonic() + 120
    while any(instance.state != "terminated" for instance in stack.instances(run)) and time.monotonic() < deadline:
        time.sleep(1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,8,16", help="node counts to measure (at least two, even: pp=2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each size")
    parser.add_argument("--window-s", type=float, default=90.0, help="real seconds of training counted per run")
    parser.add_argument("--instance-type", default="p5.48xlarge", help="whose price the fleet's cost uses")
    args = parser.parse_args()
    sizes = sorted({int(size) for size in args.sizes.split(",")})
    if len(sizes) < 2 or any(size < 2 or size % 2 for size in sizes) or args.repeats < 1:
        parser.error("--sizes takes at least two different even node counts (pp=2), e.g. 4,8,16; --repeats >= 1")
    hang = RecoveryPolicy().hang_timeout_seconds
    runs: list[tuple[int, int, Rates]] = []
    with local_stack(lambda message: None, standin_step_s=STEP_S) as stack:
        for repeat in range(args.repeats):
            for nodes in sizes:
                runs.append((repeat, nodes, measure(stack, nodes, args.window_s, repeat,
                                                    lambda message: print(message, flush=True))))
    for repeat, nodes, rate in runs:
        top = ", ".join(f"{service} {action} {n:,.0f}" for (service, action), n in rate.requests.most_common(6))
        print(f"{nodes} nodes (run {repeat + 1}), per hour: {top}; {rate.invocations:,.0f} Lambda invocations, "
              f"{rate.gb_seconds:,.1f} GB-s, {rate.transitions:,.0f} transitions, "
              f"{rate.log_bytes / 1e6:,.1f} MB logged, {rate.metrics} custom metrics")
    per_run, per_look = fit([(nodes, rate.usd_per_hour()) for _, nodes, rate in runs], hang)
    each_repeat = [fit([(nodes, rate.usd_per_hour()) for r, nodes, rate in runs if r == repeat], hang)
                   for repeat in range(args.repeats)]
    facts = instance_facts(args.instance_type)
    parts = list(per_run)
    print(f"\nUSD per training-day (24 h of steady training; list prices us-east-1; looks at trainfleet.core.pace's "
          f"rate, hang timeout {hang} s); fitted through all {len(runs)} runs, the range of each repeat's own fit")
    print(f"{'nodes':>6}" + "".join(f"{part:>14}" for part in parts)
          + f"{'control plane':>15}{'repeats':>16}{'fleet':>14}{'share':>10}")
    day = {}
    for nodes in (*sizes, 64, 512, 2048):
        usd = {part: 24 * value for part, value in priced(per_run, per_look, nodes, hang).items()}
        fleet = 24 * nodes * facts.on_demand_usd_per_hour
        day[nodes] = sum(usd.values())
        alone = [24 * sum(priced(*fitted, nodes, hang).values()) for fitted in each_repeat]
        print(f"{nodes:>6}" + "".join(f"{usd[part]:>14.4f}" for part in parts)
              + f"{day[nodes]:>15.2f}{f'{min(alone):.2f}-{max(alone):.2f}':>16}{fleet:>14,.0f}{day[nodes] / fleet:>10.2e}")
    estimate = " (an estimate: see trainfleet/core/catalogue.py)" if facts.price_is_estimate else ""
    print(f"fleet: {args.instance_type} on-demand at ${facts.on_demand_usd_per_hour:,.2f} an hour{estimate}")
    print(f"usd_per_training_day={day[64]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
