"""The control plane at 8, 64 and 512 nodes, side by side, and what a READY spare saves.

    .venv/bin/python bench/scale.py                          # 8, 64, 512 nodes; 8 nodes with 3 spares
    .venv/bin/python bench/scale.py --sizes 8,64 --spare-nodes 0

Each size is one run of localcloud.scale (the deployed state machine, real agents with the
stand-in trainer, forked from a warm image) through a kill, a Spot interruption and an AWS Health
retirement, each in a process of its own (the local cloud's handlers are imported once per
process). Printed
per size: allocate -> all ready; each recovery's time from the fault to the next attempt
training and to its first step; the control plane's counts per training hour and per recovery
(Lambda invocations, state transitions, DynamoDB reads and writes, events put, S3 and SQS requests); the
largest Step Functions payload, DynamoDB item and event; teardown time. Then the same recoveries
of a run with spares (each failure promotes a READY spare, which needs no boot) next to the run
without, both with instances that take `--spare-boot-s` to boot.

Growth with the node count, as the design intends: per-run control-plane rates stay flat (the
Lambda invocations, transitions and events of a training hour are those of the run, not of its
nodes), while the agents' own looks (a run record read and a liveness write each) grow with the
nodes up to trainfleet.core.pace's bound (FULL_RATE_NODES), then stay there.

The last line is `recovery_saved_by_spare_s=<median over the failures>`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from localcloud.waiting import run_captured

REPO = Path(__file__).resolve().parents[1]
RATES = ("lambda_invocations", "state_transitions", "dynamodb_reads", "dynamodb_writes", "events_put", "s3_requests",
         "sqs_requests")


def scale_run(nodes: int, spares: int, boot_s: float | None = None) -> dict:
    """One localcloud.scale run in its own process; its figures."""
    started = time.monotonic()
    boot = ["--boot-s", str(boot_s)] if boot_s is not None else []
    done = run_captured([sys.executable, "-m", "localcloud.scale", "--nodes", str(nodes), "--spares", str(spares),
                         *boot], what=f"a scale run of {nodes} nodes", cwd=REPO)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"{nodes} nodes, {spares} spares failed ({done.returncode}):\n{done.stderr[-4000:]}")
    figures = done.stdout.strip().splitlines()[-1]
    # Each run's figures as they come: a later run that fails loses none of them.
    print(f"  {nodes} nodes, {spares} spares, boot {boot_s or 'default'}: {time.monotonic() - started:.0f} s\n"
          f"  {figures}", file=sys.stderr, flush=True)
    return json.loads(figures)


def table(rows: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)


def print_sizes(runs: list[dict]) -> None:
    header = ["", *(f"{run['nodes']} nodes" for run in runs)]
    rows = [header,
            ["run duration s", *(f"{run['duration_s']:.0f}" for run in runs)],
            ["allocate -> all ready s", *(f"{run['allocate_to_ready_s']:.1f}" for run in runs)]]
    for index, recovery in enumerate(runs[0]["recoveries"]):
        rows.append([f"{recovery['failure']}: fault -> training s",
                     *(f"{run['recoveries'][index]['to_training_s']:.1f}" for run in runs)])
        rows.append([f"{recovery['failure']}: fault -> first step s",
                     *(f"{run['recoveries'][index]['seconds']:.1f}" for run in runs)])
    for rate in RATES:
        rows.append([f"{rate} / training hour", *(f"{run['per_training_hour'][rate]:,}" for run in runs)])
    for rate in RATES:
        rows.append([f"{rate} / recovery (median)",
                     *(f"{statistics.median(r[rate] for r in run['recoveries']):,.0f}" for run in runs)])
    for kind in ("states", "dynamodb", "events"):
        rows.append([f"largest {kind} payload KB",
                     *(f"{run['largest_payloads'][kind]['size_bytes'] / 1024:.1f}" for run in runs)])
    rows.append(["teardown s", *(f"{run['teardown_s']:.1f}" for run in runs)])
    rows.append(["state", *(run["state"] for run in runs)])
    print(table(rows))
    for run in runs:
        for kind, payload in run["largest_payloads"].items():
            print(f"  {run['nodes']} nodes, largest {kind}: {payload['size_bytes']:,} B ({payload['what']})")


def print_spares(without: dict, with_spares: dict) -> float:
    rows = [["failure", "no spare: to first step s", f"{with_spares['spares']} spares: to first step s", "saved s"]]
    saved = []
    for plain, spared in zip(without["recoveries"], with_spares["recoveries"]):
        saved.append(plain["seconds"] - spared["seconds"])
        rows.append([plain["failure"], f"{plain['seconds']:.1f}", f"{spared['seconds']:.1f}", f"{saved[-1]:.1f}"])
    print(f"\nRecovery at {without['nodes']} nodes with and without READY spares (one run each, instances "
          f"pending {without['boot_s']:.0f} s before they boot):")
    print(table(rows))
    return statistics.median(saved)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8,64,512", help="node counts, comma-separated")
    parser.add_argument("--spare-nodes", type=int, default=8, help="the size run again with spares (0: none)")
    parser.add_argument("--spares", type=int, default=3, help="spares of that run: one a failure")
    parser.add_argument("--spare-boot-s", type=float, default=60.0,
                        help="seconds an instance is pending before it boots, in the runs with and without spares "
                             "(the local default of 2 s hides what a spare saves; EC2 takes minutes)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    runs = [scale_run(nodes, 0) for nodes in sizes]
    print_sizes(runs)
    if args.spare_nodes:
        without = scale_run(args.spare_nodes, 0, args.spare_boot_s)
        saved = print_spares(without, scale_run(args.spare_nodes, args.spares, args.spare_boot_s))
        print(f"recovery_saved_by_spare_s={saved:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
