"""DynamoDB reads and writes a second of one run, by node count: what the agents' looks and the
event handler cost the run's partition (3,000 RCU / 1,000 WCU per partition).

    .venv/bin/python bench/control_plane_load.py [--nodes 2 512] [--hours 1] [--hang-timeout 600]

Agents: measured. One agent's ControlPlane (node/agent.py) runs its own pacing against a
simulated clock for the given time, with the run's node count and hang timeout (a short one
quickens the looks, down to the least hang timeout the node count allows); every look is one eventually
consistent GetItem of the run record, so a run's reads are nodes x looks / seconds. Liveness
records go to S3, not DynamoDB. Event handler: counted from what it does per event while a run
trains undisturbed: a TrainingProgress every PROGRESS_EVERY_S (read the run, read-modify-write
it, query the nodes for an announced departure) and a CheckpointCommitted per checkpoint (the
same three reads and one write, after checking the files in S3). Heartbeats go to Step
Functions. Last lines: reads_per_s_<n>=, rcu_per_s_<n>=, writes_per_s_<n>= for each count.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # this folder would shadow the packages it measures

RUN_RECORD_KB = 6.0
"""A run record's item (RunSpec, plan, failures, ledger): about 3-8 KB; 6 KB assumed."""
NODE_RECORD_KB = 0.8
"""One node's item."""
CHECKPOINT_EVERY_S = 600.0
"""A checkpoint every ten minutes (the handler's cost per checkpoint is small either way)."""


def agent_looks_per_second(nodes: int, hang_timeout_s: float, seconds: float, seed: int = 7) -> float:
    """The looks a second of a run's `nodes` agents, from one agent's pacing over `seconds`."""
    from node.agent import AgentSettings, ControlPlane, Identity

    clock = {"now": 0.0}
    settings = AgentSettings(run_name="bench", run_table="t", bucket="b", event_bus="e", workdir=Path("."),
                             lifetime_s=None)
    identity = Identity(instance_id="i-0bench", instance_type="p5.48xlarge", private_ip="10.0.0.1",
                        availability_zone="us-east-1a", region="us-east-1")
    control = ControlPlane(settings, identity, clock=lambda: clock["now"], draw=random.Random(seed).random)
    control.run_nodes, control.hang_timeout_s, control.training = nodes, hang_timeout_s, True
    looks = 0
    while clock["now"] < seconds:
        looks += control.take_look()
        clock["now"] += 0.5  # the agent's LOOK_S
    return nodes * looks / seconds


def handler_load(nodes: int) -> tuple[float, float, float]:
    """(reads, RCU, writes) a second of the event handler while the run trains."""
    from node.agent import PROGRESS_EVERY_S

    events_per_s = 1 / PROGRESS_EVERY_S + 1 / CHECKPOINT_EVERY_S
    # Per event: GetItem run (strong), modify_run = GetItem + PutItem, Query of every node (strong).
    reads = 3 * events_per_s
    rcu = events_per_s * (2 * RUN_RECORD_KB / 4 + max(1.0, nodes * NODE_RECORD_KB / 4))
    writes = events_per_s * RUN_RECORD_KB  # one PutItem of the run record: 1 WCU per KB
    return reads, rcu, writes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 512])
    parser.add_argument("--hours", type=float, default=1.0)
    parser.add_argument("--hang-timeout", type=float, default=600.0,
                        help="the runs' recovery.hang_timeout_seconds (raised to the least a node count allows)")
    args = parser.parse_args()
    from node.agent import PROGRESS_EVERY_S
    from trainfleet.core.lifecycle import looks_per_second
    from trainfleet.core.pace import least_hang_timeout

    summary = []
    for nodes in args.nodes:
        hang = max(args.hang_timeout, least_hang_timeout(nodes))
        agents = agent_looks_per_second(nodes, hang, args.hours * 3600)
        agent_rcu = agents * math.ceil(RUN_RECORD_KB / 4) / 2  # eventually consistent: half
        reads, rcu, writes = handler_load(nodes)
        print(f"{nodes} nodes, hang timeout {hang:g} s: agents {agents:.2f} reads/s measured (formula "
              f"{looks_per_second(nodes, hang):.2f}: nodes / mean look interval, trainfleet.core.pace), "
              f"{agent_rcu:.1f} RCU/s; event handler {reads:.2f} reads/s, {rcu:.1f} RCU/s, {writes:.2f} WCU/s; "
              "agents write no DynamoDB item")
        summary += [f"reads_per_s_{nodes}={agents + reads:.2f}", f"rcu_per_s_{nodes}={agent_rcu + rcu:.1f}",
                    f"writes_per_s_{nodes}={1 / PROGRESS_EVERY_S + 1 / CHECKPOINT_EVERY_S:.3f}",
                    f"wcu_per_s_{nodes}={writes:.2f}"]
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
