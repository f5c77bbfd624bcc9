"""A simulated node agent: what the real one (the next piece of work) tells the control plane.

Started by the local fleet as an instance's process, it speaks only through AWS, as an agent
on EC2 does: it reports NodeRegistered and NodeReady, then waits for a launch spec naming it,
confirming its readiness (NodeReady) for every attempt the run moves to.
Node rank 0 "trains": it counts steps from the resume step, heartbeats the Train task, writes
a checkpoint in the trainer's commit format every CHECKPOINT_EVERY steps and announces it, and
reports TrainingCompleted at the last step. When the run leaves its attempt (the Train task
was failed) it stops. Either way it then waits for a newer launch spec, until Teardown ends
its instance. It logs what it does to stdout (the
instance's console.log), one JSON line per launch spec it acts on and per checkpoint.

    python tests/handlers_sim_agent.py      (environment: the local fleet's and TRAINFLEET_*)
"""

import json
import os
import time

import boto3

from node.metadata import MetadataClient
from trainer.checkpoint_catalog import MARKER_NAME, Manifest, StoredFile, open_store, shard_folder, step_dir_name
from trainfleet.adapters.run_store import NodeNotFound, RunStore
from trainfleet.core.events import (CheckpointCommitted, NodeReady, NodeRegistered, TrainingCompleted,
                                    put_events_entry)
from trainfleet.core.records import LaunchSpec

TOTAL_STEPS = 60
CHECKPOINT_EVERY = 10
STEP_SECONDS = 0.1
POLL_SECONDS = 0.1
GIVE_UP_AFTER_SECONDS = 120  # a stray agent must never outlive its test

RUN_NAME = os.environ["TRAINFLEET_RUN_NAME"]
BUCKET = os.environ["TRAINFLEET_BUCKET"]
EVENT_BUS = os.environ["TRAINFLEET_EVENT_BUS"]
INSTANCE_ID = os.environ["LOCALCLOUD_INSTANCE_ID"]
PRIVATE_IP = os.environ["LOCALCLOUD_PRIVATE_IP"]

events = boto3.client("events")
# From the instance metadata, as the real agent's: the node subnets have no STS endpoint.
SENDER = MetadataClient().identity().arn
s3 = boto3.client("s3")
sfn = boto3.client("stepfunctions")
store = RunStore(boto3.client("dynamodb"), os.environ["TRAINFLEET_RUN_TABLE"])
started = time.monotonic()


def send(detail) -> None:
    response = events.put_events(Entries=[put_events_entry(detail, EVENT_BUS, SENDER)])
    assert response["FailedEntryCount"] == 0, response


def wait_for(what: str, probe):
    while time.monotonic() - started < GIVE_UP_AFTER_SECONDS:
        found = probe()
        if found is not None:
            return found
        time.sleep(POLL_SECONDS)
    raise TimeoutError(f"{INSTANCE_ID}: gave up waiting for {what}")


def node_attempt() -> int | None:
    try:
        return store.node(RUN_NAME, INSTANCE_ID).attempt
    except NodeNotFound:
        return None


def launch_spec_after(attempt: int) -> LaunchSpec | None:
    try:
        raw = s3.get_object(Bucket=BUCKET, Key=f"runs/{RUN_NAME}/launch-spec.json")["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    spec = LaunchSpec.model_validate_json(raw)
    return spec if spec.attempt > attempt and INSTANCE_ID in spec.node_ranks else None


def still_current(spec: LaunchSpec) -> bool:
    waiting = store.run(RUN_NAME).waiting
    return waiting is not None and waiting.purpose == "train" and waiting.attempt == spec.attempt


def commit_checkpoint(spec: LaunchSpec, step: int) -> None:
    uri = spec.trainer_config["checkpoint"]["uri"]
    checkpoint = open_store(uri, s3)
    shard = json.dumps({"step": step}).encode()
    shards = f"{shard_folder(0)}/{step_dir_name(step)}"
    checkpoint.create(shards, "__0_0.distcp", shard)
    manifest = Manifest(step=step, layout={"pp": spec.plan.pp, "dp": spec.plan.dp},
                        files=(StoredFile(f"{shards}/__0_0.distcp", len(shard)),))
    checkpoint.create(step_dir_name(step), MARKER_NAME, manifest.to_json())
    send(CheckpointCommitted(run_name=RUN_NAME, attempt=spec.attempt, instance_id=INSTANCE_ID,
                             step=step, uri=f"{uri}/{step_dir_name(step)}"))
    print(json.dumps({"attempt": spec.attempt, "committed_step": step}), flush=True)


def train(spec: LaunchSpec) -> bool:
    """Rank 0's loop; True when it reached the last step, False when the attempt ended."""
    for step in range((spec.resume_step or 0) + 1, TOTAL_STEPS + 1):
        time.sleep(STEP_SECONDS)
        if not still_current(spec):
            return False
        try:
            sfn.send_task_heartbeat(taskToken=spec.heartbeat_task_token)
        except (sfn.exceptions.TaskTimedOut, sfn.exceptions.InvalidToken, sfn.exceptions.TaskDoesNotExist):
            return False
        if step % CHECKPOINT_EVERY == 0:
            commit_checkpoint(spec, step)
    send(TrainingCompleted(run_name=RUN_NAME, attempt=spec.attempt, instance_id=INSTANCE_ID,
                           final_step=TOTAL_STEPS))
    return True


def main() -> None:
    attempt = wait_for("the node record", node_attempt)
    send(NodeRegistered(run_name=RUN_NAME, attempt=attempt, instance_id=INSTANCE_ID, private_ip=PRIVATE_IP))
    send(NodeReady(run_name=RUN_NAME, attempt=attempt, instance_id=INSTANCE_ID))
    confirmed = attempt

    def confirm_then_launch_spec(ran: int) -> LaunchSpec | None:
        """Confirm readiness for each attempt the run moves to, as the real agent does."""
        nonlocal confirmed
        current = store.run(RUN_NAME).attempt
        if current > confirmed:
            send(NodeReady(run_name=RUN_NAME, attempt=current, instance_id=INSTANCE_ID))
            confirmed = current
        return launch_spec_after(ran)

    ran = -1
    while True:
        spec = wait_for("a launch spec naming this node", lambda: confirm_then_launch_spec(ran))
        ran = spec.attempt
        rank = spec.node_ranks[INSTANCE_ID]
        print(json.dumps({"attempt": spec.attempt, "node_rank": rank, "resume_step": spec.resume_step}),
              flush=True)
        if rank == 0:
            train(spec)


if __name__ == "__main__":
    main()
