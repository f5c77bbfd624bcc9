"""Recovery, measured: how fast a fault is known, acted on and trained past, on the local cloud.

    .venv/bin/python bench/recovery.py                      # kill, kill+spare, freeze, hang, spot, crash; 3 runs each
    .venv/bin/python bench/recovery.py --faults kill,kill+spare --repetitions 5

Each run is a chaos cell at the training phase (localcloud.chaos: two nodes, pp=2, real agents
and trainer, the fault on node rank 1 once the first checkpoint is committed; `kill+spare` is
the kill with one READY spare in the run, which Recover promotes instead of booting a new
instance). From the
execution history, the run's records and the trainers' metrics (each step stamped with the wall
clock) it takes, per run:

  detection_s       fault -> the control plane knows: the Train task fails (a crash, a lost
                    node, a hang's heartbeat timeout), or for a Spot notice, the departure is on
                    the node's record
  notice_wait_s     Spot only: the departure known -> the requested checkpoint committed and the
                    attempt failed (the trainer keeps training meanwhile)
  control_plane_s   knows -> replacement requested (Recover done) plus all nodes ready -> the
                    new attempt's launch spec written (Train's Lambda done); instance boot and
                    checkpoint load are excluded and printed apart:
  boot_s            Recover done -> every node of the new attempt ready (boot, preflight)
  resume_s          launch spec written -> the first step of the new attempt (torchrun,
                    rendezvous, checkpoint load, one step; repaired: the replacement's
                    torchrun, the world formed again, the restore, one step)
  first_step_s      fault -> the first step after the resume, the node replaced
  steps_lost        steps the failed world trained and the new one trained again (after a Spot
                    notice the failed world trains on until the leaving node is terminated)
  repaired          1 where Recover repaired the world in place (the survivors kept their
                    trainers: trainer/repair.py), 0 where it restarted every trainer

and an AWS estimate of control_plane_s: the Lambda invocations, state transitions, EventBridge
deliveries and EC2 calls counted in the control-plane windows, times AWS's published latencies
(the constants below), as if each were on the critical path. Medians over the repetitions; the
last three lines are `steps_redone_per_failure=<median over fault kinds of steps_lost>`,
`control_plane_recovery_s=<median over fault kinds, local>` and `aws_failure_to_training_s=<a node
lost at 512 p5 nodes with a READY spare, to the first step after: bench/goodput.py's timings with
this control plane's AWS estimate>`. steps_lost counts from where the trainer resumed (the nodes'
memory, or S3: from_memory says which).
"""

import argparse
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localcloud.chaos import (SPOT_NOTICE_S, Cell, Fault, Phase, cell_template, chaos_template,  # noqa: E402
                              reference_losses, run_cell)
from localcloud.demo import DEMO_RUN_SPEC  # noqa: E402
from localcloud.stack import LocalRun, LocalStack, execution_history, local_stack, metrics_records  # noqa: E402
from bench import goodput  # noqa: E402
from trainfleet.core.records import RecoveryKind  # noqa: E402

FAULTS = {"kill": (Fault.KILL, 0), "kill+spare": (Fault.KILL, 1), "freeze": (Fault.FREEZE, 0),
          "hang": (Fault.HANG, 0), "spot": (Fault.SPOT, 0), "crash": (Fault.CRASH, 0)}
"""Row -> the fault and the run's spare_count."""

# AWS's latencies per call, for the estimate (each as if on the critical path).
LAMBDA_INVOKE_S = 0.05
"""A warm Lambda invocation's overhead beyond the handler (tens of ms)."""
LAMBDA_HANDLER_S = 0.2
"""A control-plane handler's own time on AWS: a few DynamoDB/S3 round trips of ~10-20 ms."""
STATE_TRANSITION_S = 0.05
"""A Standard workflow's state transition (tens of ms)."""
EVENTBRIDGE_DELIVERY_S = 0.5
"""EventBridge's typical latency from PutEvents (or an AWS service's event) to the target: about
half a second, as AWS documents it."""
EC2_CALL_S = 0.3
"""An EC2 API call (CreateFleet of type instant, TerminateInstances, Describe*)."""

TRIES = 3
"""Runs of a cell until one recovers."""

COUNTED = {"lambda_invocations": LAMBDA_INVOKE_S + LAMBDA_HANDLER_S, "state_transitions": STATE_TRANSITION_S,
           "eventbridge_deliveries": EVENTBRIDGE_DELIVERY_S, "ec2_calls": EC2_CALL_S}


class CallLog:
    """Samples the local cloud's call counters ten times a second, so that the calls between any
    two moments of the run can be told afterwards."""

    def __init__(self, stack: LocalStack):
        self.stack = stack
        self.samples: list[tuple[float, Counter]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def counts(self) -> Counter:
        requests, transitions, invocations = self.stack.cloud.counters()
        return Counter({
            "lambda_invocations": sum(invocations.values()),
            # Each event the rules deliver is one invocation of the Events function.
            "eventbridge_deliveries": sum(n for name, n in invocations.items() if "EventsFunction" in name),
            "state_transitions": sum(transitions.values()),
            "ec2_calls": sum(n for (service, _), n in requests.items() if service == "ec2"),
        })

    def _sample(self) -> None:
        while not self.stopped.wait(0.1):
            self.samples.append((time.time(), self.counts()))

    def between(self, start: float, end: float) -> Counter:
        before = next((c for t, c in reversed(self.samples) if t <= start), Counter())
        after = next((c for t, c in self.samples if t >= end), self.samples[-1][1] if self.samples else Counter())
        return after - before

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def _history(stack: LocalStack, run: LocalRun) -> list[tuple[float, str, str]]:
    """(time, event type, the state it belongs to) for every event of the execution."""
    events = execution_history(stack.client("stepfunctions"), run.arn)
    timeline, state = [], ""
    for event in events:
        state = event.get("stateEnteredEventDetails", {}).get("name", state)
        timeline.append((event["timestamp"].timestamp(), event["type"], state))
    return timeline


def trained_steps(stack: LocalStack, run: LocalRun) -> list[dict[str, Any]]:
    """The step records of the run's first two attempts (a world repaired in place writes on in
    the files of the attempt that launched it)."""
    instances = stack.instances(run)
    return [record for attempt in (0, 1) for record in metrics_records(instances, attempt) if "loss" in record]


def _first(timeline: list[tuple[float, str, str]], after: float | None, state: str, *types: str) -> float | None:
    """When `state` first had an event of `types` at or after `after`; None if it had none (or
    `after` is None)."""
    return None if after is None else next(
        (t for t, kind, name in timeline if t >= after and name == state and kind in types), None)


def measure(stack: LocalStack, calls: CallLog, fault: Fault, spares: int, template: dict,
            reference: dict) -> dict[str, Any]:
    cell = Cell(f"{fault}@training", fault, Phase.TRAINING)
    for _ in range(TRIES):
        outcome = run_cell(stack, cell, cell_template(cell, template) | {"spare_count": spares}, lambda: reference)
        if outcome["problems"]:
            raise RuntimeError(f"{cell.name}: {outcome['problems']}")
        run = LocalRun(outcome["run_name"], outcome["arn"], {})
        timeline = _history(stack, run)
        fault_at = outcome["injections"][0]["at"]
        failed = _first(timeline, fault_at, "Train", "TaskFailed", "TaskTimedOut")
        decided = _first(timeline, failed, "Recover", "TaskSucceeded")
        ready = _first(timeline, decided, "AwaitNodes", "TaskSucceeded")
        spec_written = _first(timeline, ready, "Train", "TaskSubmitted")
        steps = trained_steps(stack, run)
        # The new world steps only once its launch spec is written; the failed one never after: its
        # lost or leaving node is terminated before (a world left by a Spot notice trains on until
        # Recover terminates the leaving node, after the attempt failed).
        before = [record for record in steps if spec_written is None or record["time"] < spec_written]
        after = [record for record in steps if spec_written is not None and record["time"] > spec_written]
        if after:
            break
        # A Spot notice that came with the last steps: the run completed before the interruption
        # (no failure), or its emergency checkpoint was the last step and the resumed attempt had
        # none to train.
        print(f"{cell.name}: no step trained after a recovery; measuring again", flush=True)
    else:
        raise RuntimeError(f"{cell.name}: no recovery in {TRIES} runs")
    if fault is Fault.SPOT:
        noticed = min(node.departure_noticed_at.timestamp() for node in stack.store.nodes(run.run_name)
                      if node.departure_noticed_at is not None)
    else:
        noticed = failed
    first_step = min(record["time"] for record in after)
    # Where the trainer resumed: the nodes' memory or S3 (the launch spec's resume_step is S3's).
    restored = stack.store.run(run.run_name).restored
    resumed = restored.step if restored else next(line["resume_step"] for lines in outcome["launches"].values()
                                                  for line in lines if line["attempt"] == 1)
    repaired = stack.store.run(run.run_name).failures[-1].recovery is RecoveryKind.REPAIRED
    counted = calls.between(noticed, decided) + calls.between(ready, spec_written)
    figures = {
        "detection_s": noticed - fault_at,
        "control_plane_s": (decided - failed) + (spec_written - ready),
        "boot_s": ready - decided,
        "resume_s": first_step - spec_written,
        "first_step_s": first_step - fault_at,
        "steps_lost": max(0, max(record["step"] for record in before) - (resumed or 0)),
        "from_memory": float(restored is not None and restored.source == "memory"),
        "repaired": float(repaired),
        "aws_control_plane_s": sum(counted[name] * seconds for name, seconds in COUNTED.items()),
        **{name: counted[name] for name in COUNTED},
    }
    if fault is Fault.SPOT:
        figures["notice_wait_s"] = failed - noticed
    return figures


AWS_NODES = 512


def aws_failure_to_training(control_plane_s: float) -> dict[str, float]:
    """Seconds by part from a node lost to training again at AWS_NODES p5 nodes with a READY
    spare and the state from memory (bench/goodput.py failure_to_training), with the control
    plane's time as estimated here."""
    scenario = goodput.Scenario(nodes=AWS_NODES, spares=math.ceil(AWS_NODES * 0.02))
    return goodput.failure_to_training(scenario, goodput.Timings(control_plane_s=control_plane_s))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    rows = args.faults.split(",")
    unknown = [row for row in rows if row not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}: choose from {', '.join(FAULTS)}")
    template = chaos_template(json.loads(DEMO_RUN_SPEC.read_text()))
    with tempfile.TemporaryDirectory(prefix="recovery-reference-") as folder:
        reference = reference_losses(template["trainer"], Path(folder))
    results: dict[str, list[dict]] = {}
    with local_stack(lambda message: None, spot_notice_seconds=SPOT_NOTICE_S) as stack:
        calls = CallLog(stack)
        try:
            for _ in range(args.repetitions):
                for row in rows:
                    results.setdefault(row, []).append(measure(stack, calls, *FAULTS[row], template, reference))
                    print(f"{row}: {json.dumps({k: round(v, 2) for k, v in results[row][-1].items()})}", flush=True)
        finally:
            calls.stop()
    columns = ["detection_s", "notice_wait_s", "control_plane_s", "boot_s", "resume_s", "first_step_s",
               "steps_lost", "from_memory", "repaired", "aws_control_plane_s", *COUNTED]
    print(f"\nmedians over {args.repetitions} run(s) per fault, {datetime.now():%Y-%m-%d %H:%M}, local cloud "
          f"(time scale 0.02), 2 nodes pp=2:")
    print(f"{'fault':12}" + "".join(f"{column:>24}" for column in columns))
    medians = {fault: {column: statistics.median(run[column] for run in runs) if column in runs[0] else float("nan")
                       for column in columns} for fault, runs in results.items()}
    for fault, row in medians.items():
        print(f"{fault:12}" + "".join(f"{row[column]:>24.2f}" for column in columns))
    # Over the fault kinds: the spare variant is a kill again.
    kinds = [row for fault, row in medians.items() if FAULTS[fault][1] == 0] or list(medians.values())
    aws = aws_failure_to_training(statistics.median(row["aws_control_plane_s"] for row in kinds))
    print(f"\nAWS estimate, a node lost at {AWS_NODES} x p5 with a READY spare (bench/goodput.py's timings, this "
          "control plane's calls at AWS's latencies): " + ", ".join(f"{name} {value:.1f}" for name, value in aws.items()))
    print(f"steps_redone_per_failure={statistics.median(row['steps_lost'] for row in kinds):g}")
    print(f"control_plane_recovery_s={statistics.median(row['control_plane_s'] for row in kinds):.2f}")
    print(f"aws_failure_to_training_s={sum(aws.values()):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
