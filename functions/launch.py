"""Train: park the task token, write the launch spec (world layout, rendezvous, resume point).

The resume point is read from S3 by the trainer's commit protocol, not taken from events: the
newest step with a commit marker whose files are all there; before the run has one, the newest
of the run it resumes (RunSpec.resume_from), whose checkpoints its nodes only read. A failure of the attempt reported
before the token was parked (a worker lost after AwaitNodes succeeded) fails the task at once.
"""

from typing import Any

from aws_lambda_powertools.utilities.parser import event_parser
from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import (TaskPayload, addressed, aws, launch_spec_key, logger, park_task, tracer,
                              transient_errors_named)
from trainfleet.adapters.checkpoints import resume_checkpoint
from trainfleet.core.lifecycle import build_launch_spec, world_complete
from trainfleet.core.records import RunState, TaskWait


@transient_errors_named
@logger.inject_lambda_context
@tracer.capture_lambda_handler
@event_parser(model=TaskPayload)
def handler(event: TaskPayload, context: LambdaContext) -> dict[str, Any]:
    cloud, ref = aws(), event.run.run
    store = cloud.store
    run = store.run(ref.run_name)
    resume_from = resume_checkpoint(cloud.s3, run.spec)
    run = store.transition_run(ref.run_name, RunState.TRAINING, latest_checkpoint=resume_from)
    # Park before the spec lands: an agent may finish (and the event handler answer) right after.
    if park_task(ref.run_name, TaskWait(purpose="train", attempt=ref.attempt, token=event.task_token)):
        logger.info("the attempt failed before training", run_name=ref.run_name, attempt=ref.attempt)
        return {"attempt": ref.attempt, "failed_before_launch": True}
    nodes = addressed(store.nodes(ref.run_name))
    if not world_complete(nodes, run.plan, ref.attempt):
        # A worker retired while this ran: the failure that retired it answers the parked token.
        logger.warning("world no longer complete; launch spec not written", run_name=ref.run_name,
                       attempt=ref.attempt)
        return {"attempt": ref.attempt, "failed_before_launch": True}
    launch_spec = build_launch_spec(run, nodes, heartbeat_task_token=event.task_token)
    ranks_before = {node.instance_id: node.node_rank for node in nodes}
    for instance_id, rank in launch_spec.node_ranks.items():
        if ranks_before[instance_id] != rank:
            store.modify_node(ref.run_name, instance_id,
                              lambda node, rank=rank: node.model_copy(update={"node_rank": rank}))
    cloud.s3.put_object(Bucket=cloud.settings.bucket, Key=launch_spec_key(ref.run_name),
                        Body=launch_spec.model_dump_json().encode(), ContentType="application/json")
    logger.info("launch spec written", run_name=ref.run_name, attempt=ref.attempt,
                resume_step=launch_spec.resume_step, plan=launch_spec.plan.model_dump())
    return {"attempt": ref.attempt, "resume_step": launch_spec.resume_step}
