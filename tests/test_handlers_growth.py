"""A run that shrank for want of capacity grows back when it returns, handler by handler against
the local cloud (fixtures of test_handlers): at an interval checkpoint the run asks EC2 for the
nodes it lacks, as spares; once they are READY, the next interval checkpoint ends the attempt
there, and Recover promotes them and re-plans for the planned size."""

from test_adapters_checkpoints import save
from test_handlers import (Context, INSTANCE_TYPE, STACK, ZONE, agent_event, cloud, finished,  # noqa: F401
                           handlers, node_network, parked_token, resources, validated_run)
from trainfleet.adapters.ec2_fleet import run_instance_ids
from trainfleet.adapters.run_store import RunStore
from trainfleet.core.records import FAILURE_ERROR, FailureClass, NodeRole, NodeState, RecoveryAction, RunState, TaskWait


def interval_checkpoint(cloud, run, instance_id: str, step: int) -> dict:
    save(cloud.client("s3"), run.spec.checkpoint.s3_uri, step)
    return agent_event("CheckpointCommitted", {
        "run_name": run.run_name, "attempt": run.attempt, "instance_id": instance_id, "step": step,
        "uri": f"{run.spec.checkpoint.s3_uri}/step-{step:09d}", "reason": "interval"})


def test_a_shrunk_run_asks_for_the_nodes_it_lacks_and_grows_back_at_a_checkpoint(
        handlers, cloud, resources, monkeypatch):
    payload = validated_run(handlers, cloud, resources, monkeypatch, nodes=4, min_nodes=2,
                            parallel={"pp": 2, "dp": 2, "microbatches": 2})
    name = payload["run"]["run_name"]
    store, ec2 = RunStore(cloud.client("dynamodb"), resources["run_table"]), cloud.client("ec2")
    others = ec2.describe_instances(Filters=[
        {"Name": "instance-type", "Values": [INSTANCE_TYPE]}, {"Name": "availability-zone", "Values": [ZONE]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "shutting-down", "stopping", "stopped"]}])
    cloud.set_capacity(INSTANCE_TYPE, ZONE, 2 + sum(len(r["Instances"]) for r in others["Reservations"]))
    try:
        handlers.allocate.handler(payload, Context())
    finally:
        cloud.set_capacity(INSTANCE_TYPE, ZONE, None)
    run = store.run(name)
    assert (run.plan.nodes, run.plan.pp, run.plan.dp) == (2, 2, 1), "shrunk onto the 2 nodes there were"
    for state in (RunState.AWAITING_NODES, RunState.TRAINING):
        store.transition_run(name, state)
    execution, token = parked_token(cloud)
    store.park_task(name, TaskWait(purpose="train", attempt=0, token=token))
    worker = sorted(node.instance_id for node in store.nodes(name))[0]

    # Capacity is back: the first interval checkpoint asks for the 2 nodes the world lacks.
    outcome = handlers.events.handler(interval_checkpoint(cloud, run, worker, 10), Context())["outcome"]
    assert outcome == "checkpoint step 10 recorded; growing back: 2 of 2 spare(s) launched"
    spares = sorted(node.instance_id for node in store.nodes(name) if node.role is NodeRole.SPARE)
    assert len(spares) == 2 and store.run(name).grow_tried_at is not None
    # They boot; the next checkpoint, before GROW_RETRY, asks for nothing more and trains on.
    assert handlers.events.handler(interval_checkpoint(cloud, run, worker, 20), Context())["outcome"] == (
        "checkpoint step 20 recorded")
    assert len(store.nodes(name)) == 4
    for index, spare in enumerate(spares):
        store.transition_node(name, spare, NodeState.REGISTERED, private_ip=f"10.0.9.{index + 1}")
        store.transition_node(name, spare, NodeState.READY, ready_attempt=0)
    # READY, they make a larger world: the attempt ends at this checkpoint, nothing to redo.
    outcome = handlers.events.handler(interval_checkpoint(cloud, run, worker, 30), Context())["outcome"]
    assert outcome == "checkpoint step 30 recorded; CAPACITY_RETURNED: task failed"
    caught = {**payload, "failure": {"Error": FAILURE_ERROR, "Cause": finished(cloud, execution)["cause"]}}
    step = handlers.recover.handler(caught, Context())
    assert step["recovery"]["action"] == RecoveryAction.GROW.value
    run = store.run(name)
    assert (run.plan.nodes, run.plan.pp, run.plan.dp, run.restarts) == (4, 2, 2, 1)
    assert {node.instance_id for node in store.nodes(name) if node.role is NodeRole.WORKER} >= set(spares)
    assert run.failures[-1].failure_class is FailureClass.CAPACITY_RETURNED
    assert run.latest_checkpoint.step == 30
    ec2.terminate_instances(InstanceIds=run_instance_ids(ec2, name, STACK))
