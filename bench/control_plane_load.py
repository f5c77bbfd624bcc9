"""DynamoDB reads and writes a second of one run, by node count: what the agents' looks and the
event handler cost the run's partition (3,000 read units and 1,000 write units a second).

    .venv/bin/python bench/control_plane_load.py [--nodes 2 512 2048] [--hours 1] [--hang-timeout 600]

Items: measured. A run record of each size is built as Recover leaves one after a long run (the
50 newest failures kept, each naming 128 nodes, messages and decisions at their clipped length,
a world repaired in place around all but one node), and sized as DynamoDB sizes an item (its
attribute names and values); beside it the control item the agents read (RunRecord.control).

Agents: measured. One agent's ControlPlane (node/control_plane.py) runs its own pacing against a
simulated clock for the given time, with the run's node count and hang timeout (a short one
quickens the looks, down to the least hang timeout the node count allows): what a stepping
world reads. While a run starts, stalls or recovers every agent looks at the full rate, nodes /
7.5 s (trainfleet.core.pace). Every look is one eventually consistent GetItem: half a read unit
per 4 KB of the item read. Event handler: counted from what it does per event while a run trains
undisturbed: a TrainingProgress every PROGRESS_EVERY_S (read the run, read-modify-write it, read
the nodes a departure names) and a CheckpointCommitted per checkpoint (the same). Heartbeats go
to Step Functions, liveness records to their own table.

Last lines, for each count: rru_per_look_<n>= (the control item), rru_per_s_<n>= (while training),
rru_per_s_recovering_<n>=, wcu_per_s_<n>=.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # this folder would shadow the packages it measures

CHECKPOINT_EVERY_S = 600.0
"""A checkpoint every ten minutes (the handler's cost per checkpoint is small either way)."""
FAILURES = 50
NAMED = 128
"""Failures a long run's record keeps, and the nodes each names (a Capacity Block's end, a hang)."""
PARTITION_RRU = 3000
NODE_ITEM_KB = 1.0
"""One node record's item: about 1 KB."""


def item_kb(doc: str, *attributes: str) -> float:
    """An item's size in KB as DynamoDB counts it: attribute names and values (UTF-8)."""
    return (len(doc.encode()) + sum(len(name) for name in ("pk", "sk", "doc", *attributes)) + 40) / 1024


def read_units(kb: float, consistent: bool) -> float:
    """Read units of one GetItem of an item of `kb`: a unit per 4 KB, half of it eventually consistent."""
    return math.ceil(kb / 4) * (1.0 if consistent else 0.5)


def long_run(nodes: int):
    """A run record after a long run at `nodes` nodes: its kept failures, a world repaired in place."""
    from trainfleet.core.lifecycle import apply_decision, decide_recovery
    from trainfleet.core.records import CheckpointRef, FailureClass, FailureReport, RunRecord, WorldRepair
    from trainfleet.core.runspec import RunSpec

    spec = RunSpec.model_validate({
        "run_name": "bench", "instance_type": "p5.48xlarge", "node_count": nodes,
        "capacity": {"subnet_ids": ["subnet-0123456789abcdef0"], "security_group_ids": ["sg-0123456789abcdef0"]},
        "image_id": "ami-0123456789abcdef0",
        "trainer": {"model": {"n_layers": 8}, "training": {"batch_size": nodes * 8},
                    "parallel": {"pp": 8, "dp": nodes, "schedule": "1f1b", "microbatches": 8}},
        "checkpoint": {"s3_uri": "s3://bucket/runs/bench/checkpoints"},
        "recovery": {"max_restarts": 1000, "hang_timeout_seconds": 600, "crash_loop_repeats": 100}})
    ids = [f"i-{n:017x}" for n in range(nodes)]
    run = RunRecord(run_name="bench", spec=spec)
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    for index in range(FAILURES):
        now = start + timedelta(days=index)  # one a day: each counted by the budget, none a loop
        failure = FailureReport(failure_class=FailureClass.HANG, attempt=run.attempt, instance_ids=ids[:NAMED],
                                message="raised above: RuntimeError: NCCL watchdog ... " + "x" * 3000)
        run = run.model_copy(update={"latest_checkpoint": CheckpointRef(step=index, uri=f"s3://bucket/{index}")})
        run = apply_decision(run, failure, decide_recovery(run, [], failure, jitter_draw=0.0, now=now), now)
    return run.model_copy(update={"repair": WorldRepair(generation=1, launched_attempt=0, survivor_ids=ids[1:])})


def agent_looks_per_second(nodes: int, hang_timeout_s: float, seconds: float, seed: int = 7) -> float:
    """The looks a second of a stepping run's `nodes` agents, from one agent's pacing over `seconds`."""
    from node.control_plane import ControlPlane
    from node.metadata import Identity
    from node.settings import LOOK_S, AgentSettings

    clock = {"now": 0.0}
    settings = AgentSettings(run_name="bench", run_table="t", liveness_table="l", bucket="b", event_bus="e",
                             workdir=Path("."), lifetime_s=None)
    identity = Identity(instance_id="i-0bench", instance_type="p5.48xlarge", private_ip="10.0.0.1",
                        availability_zone="us-east-1a", region="us-east-1", account_id="123456789012")
    control = ControlPlane(settings, identity, clock=lambda: clock["now"], draw=random.Random(seed).random)
    control.run_nodes, control.hang_timeout_s, control.stepping = nodes, hang_timeout_s, True
    looks = 0
    while clock["now"] < seconds:
        looks += control.take_look()
        clock["now"] += LOOK_S
    return nodes * looks / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 512, 2048])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--hang-timeout", type=float, default=600.0,
                        help="the runs' recovery.hang_timeout_seconds (raised to the least a node count allows)")
    args = parser.parse_args()
    from node.attempt import PROGRESS_EVERY_S
    from trainfleet.core.pace import POLL_MAX_S, POLL_MIN_S, least_hang_timeout

    summary = []
    for nodes in args.nodes:
        run = long_run(nodes)
        record_kb = item_kb(run.model_dump_json(), "state", "version")
        control_kb = item_kb(run.control().model_dump_json())
        hang = max(args.hang_timeout, least_hang_timeout(nodes))
        stepping = agent_looks_per_second(nodes, hang, args.hours * 3600)
        recovering = nodes / ((POLL_MIN_S + POLL_MAX_S) / 2)
        per_look, per_look_before = read_units(control_kb, False), read_units(record_kb, False)
        events_per_s = 1 / PROGRESS_EVERY_S + 1 / CHECKPOINT_EVERY_S
        # Per event: GetItem of the run (strong), modify_run (GetItem + PutItem), a node's record.
        handler_rru = events_per_s * (2 * read_units(record_kb, True) + read_units(NODE_ITEM_KB, True))
        handler_wcu = events_per_s * math.ceil(record_kb)  # one PutItem of the run record: a unit per KB
        print(f"{nodes} nodes, hang timeout {hang:g} s: run record {record_kb:.1f} KB, control item "
              f"{control_kb * 1024:.0f} bytes; agents {stepping:.1f} looks/s stepping, {recovering:.1f} recovering, "
              f"{per_look:g} RRU a look ({per_look_before:g} reading the whole record): "
              f"{stepping * per_look:.1f} RRU/s stepping ({stepping * per_look_before:.0f} before), "
              f"{recovering * per_look:.1f} RRU/s recovering ({recovering * per_look_before:.0f} before, "
              f"of the partition's {PARTITION_RRU:,}); event handler {handler_rru:.1f} RRU/s, {handler_wcu:.1f} WCU/s")
        summary += [f"rru_per_look_{nodes}={per_look:g}", f"rru_per_s_{nodes}={stepping * per_look + handler_rru:.1f}",
                    f"rru_per_s_recovering_{nodes}={recovering * per_look + handler_rru:.1f}",
                    f"wcu_per_s_{nodes}={handler_wcu:.2f}"]
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
