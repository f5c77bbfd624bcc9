"""A run of hundreds of nodes through the real control plane, on the local cloud.

    .venv/bin/python -m localcloud.scale --nodes 512            # one run, its figures as JSON
    .venv/bin/python -m localcloud.scale --nodes 512 --start-only   # its start alone
    .venv/bin/python bench/scale.py                              # 8, 64 and 512 side by side

The deployed template's state machine, handlers and EventBridge rules drive `nodes` p5.48xlarge
instances (and `spares` hot spares) whose processes are the real node agent with the stand-in
trainer (node/standin.py), forked from a warm image (localcloud/warm_image.py) so that 512 of
them fit on a small machine. The run goes allocate -> preflight -> train -> three failures of
different kinds, each after a checkpoint of the attempt before it -> recover -> complete ->
teardown:

- kill: node rank 1's instance dies (EC2's state-change event names it);
- spot: node rank 2 gets a Spot interruption notice (the checkpoint it asks for, then EC2 ends it);
- health: an AWS Health event schedules node rank 3's retirement (the run replaces it).

A freeze (no event at all) is left out: the stand-in's nodes do not step together, so the
liveness look after a hang would hold every node that drifted a few steps behind against the
lead, which in a real world cannot happen (node/standin.py). The chaos matrix proves the
freeze with the real trainer.

What it measures, from the cloud's own counters (harness reads go through internal clients and
are not counted): time allocate -> all nodes ready (the run trains); the busiest S3 prefixes
against S3's per-prefix rates, and the SlowDowns answered (the nodes copy their artifacts as the
user data does, each from its copy of them); per phase (start-up, steady
training, each recovery, teardown) the Lambda invocations, state transitions, DynamoDB reads and
writes, EventBridge events put, S3 and SQS requests; each recovery's time from the fault to the
replacement attempt training and to its first step; the largest Step Functions payload, DynamoDB
item and event; teardown time (the run leaves TRAINING -> every instance terminated).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from localcloud.cloud import exit_after_local_cloud
from localcloud.demo import DEMO_RUN_SPEC
from localcloud.stack import TIMEOUT_FLOORS_S, LocalRun, LocalStack, check_template, local_stack
from localcloud.waiting import until
from trainfleet.adapters.run_store import RunNotFound, RunStore
from trainfleet.core import pace
from trainfleet.core.records import LaunchSpec, RunRecord, RunState

__all__ = ["FAILURES", "scale_template", "scale_run", "main"]

INSTANCE_TYPE = "p5.48xlarge"
FAILURES = ("kill", "spot", "health")
"""The failures a run meets, in order, and which node each strikes (see the module docstring)."""
VICTIM_RANK = {"kill": 1, "spot": 2, "health": 3}
CHECKPOINT_INTERVAL = 10
"""Steps between two checkpoints up to 128 nodes, proportionally more above: node rank 0 of the
stand-in writes a part for every node, and the one local S3 takes about two minutes for 513 of
them while 512 agents look. A failure strikes once its attempt has committed one."""
STEADY_S = 60.0
"""The window of steady training, after the last recovery, whose counts give the hourly rates
(`--steady-s` sets another)."""
BOOTS_PER_SECOND = 8.0
"""How fast a fleet's instances reach `running` (LocalCloudConfig.boot_spread_seconds): 512 over a
minute, about what EC2 shows for a large launch."""
BOOT_S = 2.0
"""Seconds an instance stays pending before its agent starts: the local cloud's default. EC2
takes minutes to boot a p5 (`--boot-s` sets such a boot, for what a READY spare saves)."""
TIME_SCALE = 1.0
"""Real time: the agents look for a Spot notice every 5 s, as AWS recommends (scaled time would
shorten the notice and quicken the looks, hundreds of agents asking the one local metadata
service every half second)."""
LOOK_S = 0.5
DYNAMODB_READS = {"GetItem", "Query", "Scan", "BatchGetItem", "TransactGetItems"}
DYNAMODB_WRITES = {"PutItem", "UpdateItem", "DeleteItem", "BatchWriteItem", "TransactWriteItems"}
S3_CALLS = "s3"


def checkpoint_interval(nodes: int) -> int:
    return CHECKPOINT_INTERVAL * max(1, nodes // 128)


def scale_template(nodes: int, spares: int, step_s: float, steady_s: float) -> dict[str, Any]:
    """The demo RunSpec at `nodes` p5.48xlarge nodes (8 ranks each: pp=8 x dp=nodes) and spares,
    with steps enough to train `steady_s` after the last failure, and twice as much again: each
    failure is struck a checkpoint after its attempt's first step, and the Spot and Health ones
    keep the steps trained until the strike, more of them the busier the machine."""
    interval = checkpoint_interval(nodes)
    steps = (len(FAILURES) + 2) * interval + 3 * math.ceil(steady_s / step_s)
    template = json.loads(DEMO_RUN_SPEC.read_text())
    ranks = nodes * 8
    template |= {"run_name": f"scale-{nodes}", "instance_type": INSTANCE_TYPE, "node_count": nodes,
                 "spare_count": spares}
    template["trainer"]["model"]["n_layers"] = 8
    template["trainer"]["parallel"] |= {"pp": 8, "dp": ranks // 8, "microbatches": 8}
    template["trainer"]["training"] |= {"steps": steps, "batch_size": ranks // 8 * 8}
    template["checkpoint"] |= {"interval_steps": interval, "keep_last": 2}
    # The shortest hang timeout the pacing allows at this size (agents look less often in large
    # runs), and no shorter than the local floor: two busy cores must not pass for a hang. The
    # stall floor is the same: each of hundreds of stand-in nodes judges its own thread's cadence,
    # and a thread the machine starves for a minute is no hang of the world.
    hang_timeout = max(TIMEOUT_FLOORS_S["recovery.hang_timeout_seconds"], pace.least_hang_timeout(nodes + spares))
    # The timeouts grow from the hang detection to the collectives to the repair wait (the start-up
    # timeout): runspec.collective_timeout_order.
    collective = max(template["trainer"]["parallel"]["timeout_s"], hang_timeout + 60)
    template["trainer"]["parallel"]["timeout_s"] = collective
    template["recovery"] |= {"max_restarts": len(FAILURES) + 1, "hang_timeout_seconds": hang_timeout,
                             "stall_floor_seconds": hang_timeout, "startup_timeout_seconds": max(300, collective + 60),
                             "boot_timeout_seconds": 900}
    return template


@dataclass
class Meter:
    """The cloud's counters between two moments: what the control plane did in a phase."""

    cloud: Any
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    _mark: tuple[float, Counter, Counter, Counter, int] | None = None

    def start(self) -> None:
        self._mark = (time.monotonic(), *self.cloud.counters(), self.redelivered())

    def redelivered(self) -> int:
        return sum(self.cloud.sqs_redelivered.values())

    def stop(self, phase: str) -> dict[str, Any]:
        """The phase since `start`: its seconds and counts; starts the next phase."""
        started, requests0, transitions0, invocations0, redelivered0 = self._mark
        now, requests, transitions, invocations = time.monotonic(), *self.cloud.counters()
        redelivered = self.redelivered()
        requests.subtract(requests0)
        counts = {
            "seconds": round(now - started, 2),
            "lambda_invocations": sum(invocations.values()) - sum(invocations0.values()),
            "state_transitions": sum(transitions.values()) - sum(transitions0.values()),
            "dynamodb_reads": sum(n for (service, op), n in requests.items() if service == "dynamodb" and op in DYNAMODB_READS),
            "dynamodb_writes": sum(n for (service, op), n in requests.items() if service == "dynamodb" and op in DYNAMODB_WRITES),
            "events_put": requests[("events", "PutEvents")],
            "s3_requests": sum(n for (service, _), n in requests.items() if service == S3_CALLS),
            "sqs_requests": sum(n for (service, _), n in requests.items() if service == "sqs"),
            "sqs_records_redelivered": redelivered - redelivered0,
        }
        self.phases[phase] = counts
        self._mark = (now, requests0 + requests, transitions, invocations, redelivered)
        return counts


class RunView:
    """The run as the harness reads it, without adding to the counts."""

    def __init__(self, stack: LocalStack, run: LocalRun):
        self.stack, self.run = stack, run
        self.store = RunStore(stack.cloud.internal_client("dynamodb"), stack.outputs["RunTableName"])

    def record(self) -> RunRecord | None:
        """The run record; None before it exists, or while the endpoint is too busy to answer (the
        harness asks again at its next look, as an agent would)."""
        try:
            return self.store.run(self.run.run_name)
        except (RunNotFound, BotoCoreError, ClientError):
            return None

    def until(self, what: str, done: Callable[[RunRecord], bool]) -> RunRecord:
        """The run record once `done` holds of it (looked at least once); an error when the run
        ends first, or when it stopped advancing (localcloud.waiting)."""
        seen: list[RunRecord | None] = [None]

        def settled() -> RunRecord | None:
            record = seen[0] = self.record()
            if record is not None and done(record):
                return record
            if record is not None and record.state.is_final:
                raise RuntimeError(f"run {self.run.run_name} ended {record.state.value} before {what}: {record.error}")
            return None

        def progress() -> tuple[Any, ...]:
            record = seen[0]
            reached = (record.state, record.attempt, record.last_step, record.latest_checkpoint) if record else None
            return reached, self.stack.cloud.activity()[0]  # and the states the execution entered
        return until(settled, progress, what=f"{what} ({self.run.run_name})", poll_s=LOOK_S)

    def in_attempt(self, record: RunRecord, attempt: int) -> bool:
        """True while the run is in `attempt`; an error naming the failure and its nodes' reasons
        once a recovery the harness did not strike has begun another."""
        if record.attempt == attempt:
            return True
        failures = "; ".join(f"attempt {failure.attempt}: {failure.failure_class.value} of {failure.instance_ids}"
                             for failure in record.failures)
        reasons = "; ".join(f"{node.instance_id}: {node.reason}" for node in self.store.nodes(record.run_name)
                            if node.reason)
        raise RuntimeError(f"run {record.run_name} is in attempt {record.attempt}, not {attempt}: {failures} "
                           f"(nodes: {reasons})")

    def node_of_rank(self, attempt: int, rank: int) -> str:
        """The instance the attempt's launch spec gives `rank`."""
        s3 = self.stack.cloud.internal_client("s3")
        raw = s3.get_object(Bucket=self.stack.bucket, Key=f"runs/{self.run.run_name}/launch-spec.json")["Body"].read()
        spec = LaunchSpec.model_validate_json(raw)
        if spec.attempt != attempt:
            raise RuntimeError(f"the launch spec is attempt {spec.attempt}'s, not attempt {attempt}'s")
        return next(instance for instance, node_rank in spec.node_ranks.items() if node_rank == rank)


def _strike(stack: LocalStack, how: str, instance_id: str) -> None:
    if how == "kill":
        stack.cloud.fleet.kill(instance_id)
    elif how == "spot":
        stack.cloud.inject_spot_interruption(instance_id)
    else:
        stack.cloud.inject_health_event([instance_id])


def step_seconds(nodes: int) -> float:
    """A stand-in step: half a second, a second above 128 nodes (more agents share the machine)."""
    return 0.5 if nodes <= 128 else 1.0


def scale_run(nodes: int, spares: int = 0, *, step_s: float | None = None, steady_s: float = STEADY_S,
              boot_s: float = BOOT_S, start_only: bool = False,
              narrate: Callable[[str], None] = print) -> dict[str, Any]:
    """One run of `nodes` nodes (and `spares`) through every failure of FAILURES; its figures.
    `boot_s`: seconds an instance stays pending before it boots (LocalCloudConfig.boot_seconds);
    `start_only`: the figures of the start alone, up to the whole fleet training."""
    step_s = step_s or step_seconds(nodes)
    template = scale_template(nodes, spares, step_s, steady_s)
    interval = template["checkpoint"]["interval_steps"]
    check_template(template)  # a mistake here is the harness's: say so before deploying
    with local_stack(narrate, time_scale=TIME_SCALE, standin_step_s=step_s,
                     boot_seconds=boot_s, boot_spread_seconds=(nodes + spares) / BOOTS_PER_SECOND) as stack:
        meter = Meter(stack.cloud)
        meter.start()
        run = stack.start_run(template)
        view = RunView(stack, run)
        view.until("training", lambda record: record.state is RunState.TRAINING)
        startup = meter.stop("allocate_to_ready")
        narrate(f"{nodes} nodes ready and training after {startup['seconds']:.1f} s, "
                f"{startup['sqs_records_redelivered']} agent event(s) delivered again")
        if start_only:
            return {"nodes": nodes, "spares": spares, "boot_s": boot_s, "allocate_to_ready_s": startup["seconds"],
                    "phases": meter.phases}
        recoveries, resumed_from = [], 0
        for attempt, how in enumerate(FAILURES):
            view.until(f"a checkpoint of attempt {attempt}", lambda record: view.in_attempt(record, attempt) and bool(
                record.latest_checkpoint) and record.latest_checkpoint.step > resumed_from)
            meter.stop("training" if attempt == 0 else f"training_{attempt}")
            victim = view.node_of_rank(attempt, VICTIM_RANK[how])
            narrate(f"attempt {attempt}: {how} of {victim} (node rank {VICTIM_RANK[how]})")
            struck = time.monotonic()
            _strike(stack, how, victim)
            training = view.until(f"attempt {attempt + 1} training",
                                  lambda record: record.attempt > attempt and record.state is RunState.TRAINING)
            trained_again = time.monotonic()
            stepped = view.until(f"attempt {attempt + 1}'s first step",
                                 lambda record: record.attempt > attempt and record.first_step_at is not None)
            stepped_seen = time.monotonic()
            resumed_from = stepped.latest_checkpoint.step if stepped.latest_checkpoint else 0
            counts = meter.stop(f"recovery_{how}")
            recoveries.append({"failure": how, "victim": victim, "attempt": training.attempt,
                               "to_training_s": round(trained_again - struck, 2), **counts})
            narrate(f"attempt {training.attempt} trains {trained_again - struck:.1f} s after the {how}, "
                    f"first step after {counts['seconds']:.1f} s")
        # The window ends a checkpoint interval before the last step: the final commit and the
        # teardown it starts are not steady training.
        steps = template["trainer"]["training"]["steps"]
        window_s = min(steady_s, (steps - resumed_from - interval) * step_s - (time.monotonic() - stepped_seen))
        if window_s < steady_s / 2:
            raise RuntimeError(f"run {run.run_name}: {window_s:.0f} s of training left after the last recovery, "
                               f"too few for a {steady_s:.0f} s steady window (more steps)")
        time.sleep(window_s)
        view.until("steady training to go on", lambda record: record.state is RunState.TRAINING)
        steady = meter.stop("steady_training")
        view.until("the end of training", lambda record: record.state is RunState.TEARING_DOWN or record.state.is_final)
        meter.stop("training_to_end")
        end = view.until("the end", lambda record: record.state.is_final)
        until(lambda: all(instance.state == "terminated" for instance in stack.instances(run)), stack.cloud.activity,
              what="every instance to terminate")
        teardown = meter.stop("teardown")
        payloads = {kind: payload._asdict() for kind, payload in stack.cloud.largest_payloads.items()}
        return {
            "nodes": nodes, "spares": spares, "boot_s": boot_s, "state": end.state.value, "restarts": end.restarts,
            "instances_launched": len(stack.instances(run)),
            "allocate_to_ready_s": startup["seconds"], "teardown_s": teardown["seconds"],
            "recoveries": recoveries, "phases": meter.phases,
            "per_training_hour": {name: round(value * 3600 / steady["seconds"])
                                  for name, value in steady.items() if name != "seconds"},
            "largest_payloads": payloads, "s3_prefixes": s3_prefix_figures(stack.cloud),
        }


def s3_prefix_figures(cloud: Any) -> dict[str, Any]:
    """How near the run came to S3's per-prefix rates (glue/s3_rates.py): the busiest prefix of each
    kind, the busiest copy of the artifacts, and the requests answered SlowDown."""
    rates = cloud.s3_rates

    def busiest(kind: str, within: str = "") -> dict[str, Any]:
        found = [(count, where) for (where, what), count in rates.busiest.items()
                 if what == kind and within in where]
        count, where = max(found, default=(0, None))
        return {"prefix": where, "requests_in_a_second": count, "limit": rates.limits[kind]}

    return {"busiest_read": busiest("read"), "busiest_write": busiest("write"),
            "busiest_artifacts_read": busiest("read", "/artifacts/"),
            "slowdowns": cloud.failed_requests[("s3", "slowdown")]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localcloud.scale", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--spares", type=int, default=0)
    parser.add_argument("--step-s", type=float, help="seconds a stand-in step takes (default: step_seconds)")
    parser.add_argument("--steady-s", type=float, default=STEADY_S, help="seconds of steady training measured")
    parser.add_argument("--boot-s", type=float, default=BOOT_S, help="seconds an instance is pending before it boots")
    parser.add_argument("--start-only", action="store_true", help="measure the start alone, up to the fleet training")
    args = parser.parse_args(argv)
    started = time.monotonic()
    figures = scale_run(args.nodes, args.spares, step_s=args.step_s, steady_s=args.steady_s, boot_s=args.boot_s,
                        start_only=args.start_only,
                        narrate=lambda message: print(f"[{time.monotonic() - started:7.1f}s] {message}",
                                                      file=sys.stderr, flush=True))
    print(json.dumps(figures | {"duration_s": round(time.monotonic() - started, 1)}))
    return 0 if args.start_only or figures["state"] == RunState.SUCCEEDED.value else 1


if __name__ == "__main__":
    exit_after_local_cloud(main())
