"""Runs that lose a node when the zone has no capacity left to replace it, through the deployed
state machine on the local cloud with simulated agents (see tests/handlers_local_run.py, whose
helpers this uses, for the set-up and why it runs in a process of its own).

1. 4 nodes at pp=2 x dp=2 with min_nodes=2: once a checkpoint is committed the zone's capacity
   is capped at what is running and node rank 1 is killed. Recover cannot replace it, the
   shortfall comes back to Recover as CAPACITY, the run shrinks to 2 nodes at pp=2 x dp=1 (3
   nodes run no layout), the worker left out is terminated (no spare is wanted), training
   resumes from the newest committed step and succeeds; every instance ends terminated;
2. the same loss on 2 nodes without min_nodes: Recover tries to replace the node again, the
   waits growing, until capacity has been short longer than the run waits for it (a few seconds
   here); the run fails through Teardown, every instance terminated.

    python tests/handlers_capacity_run.py
"""

import json
import uuid

# First: it puts the repository on the path and sets what moto must know before it starts.
from handlers_local_run import (checkpointed, console_lines, deploy_with_agents, instances_of, network,
                                report_failure, run_spec, states_entered, wait)
from localcloud import LocalCloud
from localcloud.cloud import exit_after_local_cloud
from trainfleet.adapters.run_store import RunStore

INSTANCE_TYPE = "c5.large"
CAPACITY_WAIT_S = 5.0
"""How long the run without min_nodes waits for the capacity it lacks (real seconds: the
decision compares the recorded times of its failures)."""


def lose_a_node_without_capacity(cloud, outputs: dict[str, str], zone: str, nodes: int,
                                 **changes) -> dict:
    """Start a run in `zone`, cap the zone at the nodes running once a checkpoint is committed,
    kill node rank 1, wait for the end; what happened."""
    ec2, sfn = cloud.client("ec2"), cloud.client("stepfunctions")
    store = RunStore(cloud.client("dynamodb"), outputs["RunTableName"])
    subnet, group = network(ec2, outputs, zone)
    run_name = f"cap-{uuid.uuid4().hex[:6]}"
    spec = run_spec(run_name, outputs["CheckpointBucketName"], subnet, group) | {"node_count": nodes}
    for key, value in changes.items():  # sections are merged, other fields replaced
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    arn = sfn.start_execution(stateMachineArn=outputs["StateMachineArn"], name=run_name,
                              input=json.dumps(spec))["executionArn"]
    wait("the first committed checkpoint", lambda: checkpointed(store, run_name))
    first_ranks = {node.instance_id: node.node_rank for node in store.nodes(run_name)}
    killed = next(instance_id for instance_id, rank in first_ranks.items() if rank == 1)
    survivor = next(instance_id for instance_id, rank in first_ranks.items() if rank == 0)
    cloud.set_capacity(INSTANCE_TYPE, zone, nodes - 1)
    cloud.fleet.kill(killed)
    wait("the run to end", lambda: sfn.describe_execution(executionArn=arn)["status"] != "RUNNING")
    execution, run = sfn.describe_execution(executionArn=arn), store.run(run_name)
    last_launch = json.loads(cloud.client("s3").get_object(
        Bucket=outputs["CheckpointBucketName"], Key=f"runs/{run_name}/launch-spec.json")["Body"].read())
    return {
        "status": execution["status"], "error": execution.get("error"), "cause": execution.get("cause"),
        "states": states_entered(sfn, arn),
        "first_ranks": first_ranks, "killed": killed, "survivor": survivor,
        "nodes": {node.instance_id: {"role": node.role.value, "state": node.state.value, "rank": node.node_rank}
                  for node in store.nodes(run_name)},
        "instances": instances_of(ec2, run_name),
        "survivor_launches": [line for line in console_lines(cloud, survivor) if "node_rank" in line],
        "survivor_commits": [line for line in console_lines(cloud, survivor) if "committed_step" in line],
        "last_launch": {"attempt": last_launch["attempt"], "nodes": len(last_launch["node_ranks"]),
                        "parallel": last_launch["trainer_config"]["parallel"],
                        "batch_size": last_launch["trainer_config"]["training"]["batch_size"]},
        "run": {"state": run.state.value, "attempt": run.attempt, "error": run.error,
                "plan": run.plan.model_dump() if run.plan else None,
                "failures": [failure.failure_class.value for failure in run.failures],
                "latest_checkpoint": run.latest_checkpoint.step if run.latest_checkpoint else None},
    }


def main() -> None:
    with LocalCloud(time_scale=0.02) as cloud:
        try:
            outputs = deploy_with_agents(cloud, f"tf-{uuid.uuid4().hex[:8]}")
            shrunk = lose_a_node_without_capacity(
                cloud, outputs, "us-east-1c", nodes=4, min_nodes=2,
                trainer={"model": {"n_layers": 2}, "parallel": {"pp": 2, "dp": 2, "schedule": "gpipe",
                                                                "microbatches": 2},
                         "training": {"batch_size": 4}})
            gave_up = lose_a_node_without_capacity(cloud, outputs, "us-east-1b", nodes=2,
                                                   recovery={"capacity_wait_hours": CAPACITY_WAIT_S / 3600})
        except Exception:
            report_failure(cloud, cloud.client("stepfunctions"))
            raise
    print(json.dumps({"shrunk": shrunk, "gave_up": gave_up}, default=str))


if __name__ == "__main__":
    main()
    exit_after_local_cloud(0)
