"""The node agent: what runs on every instance of a run, between the control plane and torchrun.

    python -m node.agent
        environment: TRAINFLEET_RUN_NAME, TRAINFLEET_RUN_TABLE, TRAINFLEET_LIVENESS_TABLE, TRAINFLEET_BUCKET,
        TRAINFLEET_EVENT_BUS (the user data of trainfleet/adapters/ec2_fleet.py writes them);
        optional TRAINFLEET_SHUTDOWN_COMMAND (how the agent ends its instance, e.g.
        "systemctl poweroff"; unset, it just exits: locally that ends the instance) and
        TRAINFLEET_AGENT_LIFETIME_S (exit after that many seconds; local runs set it) and
        TRAINFLEET_STANDIN_STEP_S (run the stand-in trainer, node/standin.py, on a thread
        of the agent, with steps that many seconds long, in place of torchrun; the local
        cloud's large runs set it)

On EC2 the user data starts it under systemd; in the local cloud the fleet starts it as the
instance's process. It speaks to the control plane only through AWS:

1. identity from the instance metadata (IMDSv2): instance id, type, private IP, zone, region;
2. NodeRegistered once the run has recorded the node;
3. preflight (`python -m node.health`, a subprocess so the agent never imports torch), then
   NodeReady or NodeUnhealthy with the check results;
4. at each look at the control plane (every 5-10 s, drawn; less often in very large runs, so a
   run's read rate stays bounded, and more often with a hang timeout under about 35 s, so a
   silent agent is known silent before a hang is declared: lifecycle.poll_interval) it reads the
   run's control item (RunRecord.control: a few hundred bytes, however large the run record
   grows): it confirms its readiness (NodeReady) for each attempt the run moves to, and once the run trains an
   attempt newer than its last it reads `s3://BUCKET/runs/RUN/launch-spec.json` and, if the spec
   names it, runs torchrun for it: nnodes = the plan's nodes, c10d rendezvous at node rank 0's
   private IP, the trainer config from the spec written to a YAML file, resume as the spec says,
   and in its environment what NCCL needs on this node's type (catalogue.nccl_environment: its error
   handling, and EFA as preflight proved NCCL selects it);
5. while torchrun runs it looks at the trainer's files twice a second (no AWS call), for a Spot
   notice in the metadata service every 5 s (TRAINFLEET_METADATA_LOOK_S), and at the control
   plane at the paced rate: it writes its liveness record (its
   trainer's last step, lifecycle.liveness), asks the trainer for a checkpoint now when the run
   record requests one (a worker's departure was announced) or the metadata service gives a Spot
   notice, and stops torchrun when the run moves to a newer attempt. The agent whose node holds
   global rank 0 (the only one whose trainer writes the metrics file) also heartbeats the Train
   task as steps advance, sends TrainingProgress (every step) and CheckpointCommitted for every
   checkpoint committed to S3 with the reason it was saved, and the fleet check's figures
   (FleetChecked: the trainer measures the world's network before its first step,
   trainer/fleet_check.py; a world below the floor does not train). Before the attempt's first step
   (rendezvous, NCCL set-up, checkpoint load) no trainer writes metrics yet, so the agent of
   node rank 0 heartbeats the start-up, for at most the run's startup timeout after torchrun
   started or after its trainer's last sign of life; a start that falls silent longer is
   declared hung a hang timeout later. Likewise the end: after the final step the agent that
   speaks for the world heartbeats while the trainer saves its final checkpoint and exits, as
   long. The heartbeat's pace is a quarter of the hang timeout, at most 5 s
   (trainfleet.core.pace.heartbeat_pace), and it beats on a thread of its own, judging progress by
   the metrics file's growth and the speaking trainer's signs of life in its progress file (a
   microbatch, a start-up phase: trainer/progress.py), so a slow step is not a hang, only a
   silent world is; and a call of the watch loop waiting out throttling or an outage (botocore
   retries, then the agent's backoff) never delays it, so seconds of a slow control plane are
   not taken for a hang of the world either;
   every agent also times its own trainer's steps, and once it knows the world's cadence it
   sends TrainerHung when its trainer has been silent for HANG_STEPS of the recent median step
   time (at least the run's stall floor: trainfleet.core.pace.hung_after), so a hung world fails
   the Train task seconds after it stopped, not a hang timeout later;
6. torchrun's exit: 0 -> TrainingCompleted; otherwise TrainerFailed with the kind read from its
   output (config error, NaN loss, crash), unless the run has moved on meanwhile: a peer's
   death reaches this node as a crash. EC2's event about a lost peer usually lands within a
   second, so the agent waits that long first and then stays quiet; when it is later, Recover
   still blames the lost instance from its EC2 state. Its liveness record says at once that the
   trainer ended: it cannot be ordered into a repaired world;
7. a world repaired in place (trainer/repair.py; Recover's WorldRepair): a trainer whose step
   failed waits for an order and says so (trainer/repair_order.py), which the agent reports as
   TrainerFailed (a second later, as above); when the run's next attempt repairs this node's
   world and names it a survivor, the agent keeps torchrun, confirms the attempt, and once its
   launch spec is written orders the trainer into it (the store on node rank 0 at the attempt's
   port) and follows that attempt with the same process. A node that joins a repaired world (a
   replacement, or one whose trainer ended) starts `torchrun --standalone` with the order.

A failed control-plane call (throttling, a 5xx answer, a connection error, a timeout) is logged
and tried again at a later look with backoff; it never stops torchrun. When the run is over, when
the stack's table, bus or bucket has answered for UNREACHABLE_LIMIT_S that it no longer exists
(a deleted stack: the retained bucket still serves the launch spec), or when no AWS service has
answered for as long while its trainer showed no progress (the node is cut off), the agent ends
its instance (the launch template's shutdown behaviour is terminate), so no instance outlives its
run unwatched. An outage, a service that answers with errors, ends no instance however long it
lasts: a regional DynamoDB outage of hours would otherwise end every node whose trainer waits on
a lost peer, and the run that the state machine keeps through it would come back to no fleet; an
instance its run left behind is the reaper's to end.
"""

from __future__ import annotations

import subprocess
import sys
import time

import boto3
from botocore.config import Config

from node import control_plane
from node.attempt import Attempt
from node.control_plane import ControlPlane, Unreachable, wait_for
from node.metadata import Identity, MetadataClient, boot_identity
from node.node_log import NodeLog, say, ship, stop_node_log
from node.preflight import run_preflight, standin_preflight
from node.settings import LOOK_S, AgentError, AgentSettings
from node.spare import Spare
from node.trainer_process import raise_open_files_limit
from trainfleet.core.events import NodeReady, NodeRegistered, NodeUnhealthy, TrainerFailed
from trainfleet.core.node_access import node_log_stream
from trainfleet.core.records import TrainerFailureKind


def serve(settings: AgentSettings) -> None:
    """Boot, preflight, then each attempt that names this node, until the run is over (returns)."""
    deadline = time.monotonic() + settings.lifetime_s if settings.lifetime_s else None
    metadata = MetadataClient()
    identity = boot_identity(metadata)
    control = ControlPlane(settings, identity)
    start_node_log(settings, identity)
    say("agent up", instance_id=identity.instance_id, instance_type=identity.instance_type,
        private_ip=identity.private_ip, run_name=settings.run_name, open_files_limit=raise_open_files_limit())
    node = wait_for("the run's record of this node", control.node, deadline, control)
    ids = {"run_name": settings.run_name, "attempt": node.attempt, "instance_id": identity.instance_id}
    control.deliver(NodeRegistered(**ids, private_ip=identity.private_ip,
                                   availability_zone=identity.availability_zone), deadline)
    checks, problem = standin_preflight() if settings.standin_step_s else run_preflight(identity.instance_type)
    if problem:  # never named in a launch spec: it waits to be terminated
        control.deliver(NodeUnhealthy(**ids, reason=problem, checks=checks), deadline)
    else:
        control.deliver(NodeReady(**ids, checks=checks), deadline)
    spare = Spare(control, node, checks, problem)
    run = attempt = None
    while True:
        if run is not None and run.state.is_final:
            return
        spec = spare.launch_spec(run)
        if spec is not None:
            if spec.repair and identity.instance_id in spec.repair.survivor_ids:
                if attempt is not None and attempt.trained_to_the_end:
                    attempt.complete(spec)
                    continue
                # Its trainer ended before the order came: the control plane restarts the world.
                control.deliver(TrainerFailed(**{**ids, "attempt": spec.attempt}, kind=TrainerFailureKind.CRASH,
                                              message="no trainer left on this node to repair the world with"),
                                deadline)
                continue
            attempt = Attempt(control, metadata, spec, spare.confirm, deadline)
            run = attempt.run()
            spare.ran = attempt.spec.attempt
            continue
        if deadline is not None and time.monotonic() > deadline:
            raise AgentError("the agent's lifetime is over")
        time.sleep(LOOK_S)
        run = control.look_at_run()


def start_node_log(settings: AgentSettings, identity: Identity) -> None:
    """Ship what the agent says and its trainers print to the stack's node log group."""
    if settings.log_group is None:
        return
    logs = boto3.client("logs", config=Config(region_name=identity.region, retries=control_plane.CLIENT_RETRIES,
                                              connect_timeout=5, read_timeout=30))
    ship(NodeLog(logs, settings.log_group, node_log_stream(settings.run_name, identity.instance_id)))


def end_instance(settings: AgentSettings, why: str) -> None:
    """End this instance: its shutdown behaviour is terminate (launch template). Without a
    shutdown command the agent's exit is what ends it (a local instance)."""
    say(f"{why}: ending this instance", command=" ".join(settings.shutdown_command) or None)
    stop_node_log()
    if settings.shutdown_command:
        subprocess.run(settings.shutdown_command, check=False)


def main() -> int:
    """The agent's life on its instance; its exit status."""
    try:
        settings = AgentSettings.from_env()
    except AgentError as exc:
        say("agent stopped", error=str(exc))
        return 1
    try:
        serve(settings)
    except Unreachable as exc:
        end_instance(settings, str(exc))
        return 0
    except AgentError as exc:
        say("agent stopped", error=str(exc))
        stop_node_log()
        return 1
    end_instance(settings, "the run is over")
    return 0


if __name__ == "__main__":
    sys.exit(main())
