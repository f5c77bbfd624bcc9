"""A whole training run on the local cloud, with a node lost after the first checkpoint.

    make demo                        (trainfleet demo; python -m localcloud.demo)
    trainfleet demo -- --disruption spot --workdir runs/local-demo   (a Spot notice instead; keep the folders)
    trainfleet demo --trainer-only   (the trainer alone: pp=2 under torchrun, trainer/demo.py)

What happens, as on AWS: a LocalCloud (moto plus the glue) and its instance metadata service
start; `template.yaml` is deployed into it (localcloud.deploy); an execution of the deployed
state machine starts with the RunSpec of events/local-demo-run.json (run name, bucket, subnet
and security group filled in); Allocate launches the instances and the local fleet boots each
as a real node agent (`python -m trainer.agent`, its own folder and loopback address, no shared
filesystem), which registers, passes preflight and starts torchrun when the launch spec names
it. Once the first checkpoint is committed to the local S3, the instance of node rank 1 is
killed: EC2 reports it, Recover replaces only it, the new attempt resumes from the latest
committed checkpoint, the run completes, Teardown terminates every instance.

`run_on_local_cloud` does that (or gives node rank 1 a Spot interruption notice instead, or runs
the RunSpec undisturbed) and returns what happened (states, nodes, instances, the agents'
launches and commits, each attempt's losses, the run report); tests/agent_local_run.py asserts
on it, `main` narrates it. It must run in a process that has not imported `functions` (the local
cloud imports the deployed copy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from trainfleet.adapters.ec2_fleet import TAG_RUN
from trainfleet.adapters.run_store import RunNotFound, RunStore
from trainfleet.contracts import RunSpec, validation_message

REPO = Path(__file__).resolve().parent.parent
DEMO_RUN_SPEC = REPO / "events" / "local-demo-run.json"

__all__ = ["run_on_local_cloud", "Narrator", "main", "DEMO_RUN_SPEC"]


@dataclass
class Narrator:
    """Prints what happens as it happens, with seconds since the start; silent when quiet."""

    quiet: bool = False
    started: float = field(default_factory=time.monotonic)

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)


def _network(ec2: Any) -> tuple[str, str]:
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24", AvailabilityZone="us-east-1a")
    group = ec2.create_security_group(GroupName=f"efa-{uuid.uuid4().hex[:6]}", Description="run", VpcId=vpc)
    return subnet["Subnet"]["SubnetId"], group["GroupId"]


def local_run_spec(template: dict[str, Any], run_name: str, bucket: str, subnet: str, group: str) -> dict[str, Any]:
    """The template RunSpec made concrete for one local stack: names, bucket, network."""
    spec = json.loads(json.dumps(template))
    spec["run_name"] = run_name
    spec["capacity"] |= {"subnet_ids": [subnet], "security_group_ids": [group]}
    spec["checkpoint"]["s3_uri"] = f"s3://{bucket}/runs/{run_name}/checkpoints"
    return spec


def states_entered(sfn: Any, execution_arn: str) -> list[str]:
    history = sfn.get_execution_history(executionArn=execution_arn, maxResults=1000)["events"]
    return [event["stateEnteredEventDetails"]["name"] for event in history if "stateEnteredEventDetails" in event]


def agent_lines(instance: Any) -> list[dict[str, Any]]:
    """What an instance's agent said (its JSON lines in the console; a killed agent's last line
    may be cut short)."""
    log = instance.console_log
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [json.loads(line) for line in lines if line.startswith('{"agent"') and line.endswith("}")]


def attempt_losses(instances: list[Any]) -> dict[int, dict[int, float]]:
    """attempt -> step -> loss, from the metrics file of the node that held global rank 0."""
    losses: dict[int, dict[int, float]] = {}
    for instance in instances:
        for metrics in sorted(instance.workdir.glob("attempt-*/metrics.jsonl")):
            attempt = int(metrics.parent.name.split("-")[1])
            text = metrics.read_text()
            for line in text[:text.rfind("\n") + 1].splitlines():  # a killed trainer's last line may be cut
                record = json.loads(line)
                if "loss" in record:  # not the `finished` record of a trainer resumed at its last step
                    losses.setdefault(attempt, {})[record["step"]] = record["loss"]
    return losses


def run_on_local_cloud(template: dict[str, Any], narrate: Callable[[str], None], *,
                       disruption: Literal["kill", "spot", "freeze"] | None = "kill", workdir: Path | None = None,
                       time_scale: float = 0.02, spot_notice_seconds: float = 120.0,
                       timeout_s: float = 600.0) -> dict[str, Any]:
    """Deploy, run `template` (its nodes are local instances with real agents), disrupt node
    rank 1 once the first checkpoint is recorded (kill its instance, give it a Spot
    interruption notice, or freeze it: a silent failure), wait for the end; what happened, as plain data. `workdir` keeps the instances' folders (console.log,
    each attempt's trainer config, torchrun output and metrics); None uses a temporary folder.
    `spot_notice_seconds` is nominal, like every local cloud time: scaled by `time_scale`."""
    # The SAM roles attach AWS managed policies; moto knows them only when asked before it loads.
    os.environ["MOTO_IAM_LOAD_MANAGED_POLICIES"] = "true"
    from localcloud import LocalCloud
    from localcloud.deploy import DeployRequest, deploy
    from localcloud.node_boot import publish_artifacts
    from localcloud.imds import serve_fleet

    with LocalCloud(time_scale=time_scale, workdir=workdir, spot_notice_seconds=spot_notice_seconds) as cloud:
        metadata = serve_fleet(cloud)
        try:
            narrate(f"local cloud up at {cloud.endpoint}; instance metadata at 127.0.0.1:{metadata.port}")
            stack = deploy(DeployRequest(template=REPO / "template.yaml", endpoint=cloud.endpoint,
                                         stack_name=f"tf-{uuid.uuid4().hex[:8]}"))
            outputs = stack.outputs
            bucket = outputs["CheckpointBucketName"]
            narrate(f"deployed template.yaml as stack {stack.stack_name}: state machine, "
                    f"{len(stack.resources)} resources")
            s3, sfn, ec2 = cloud.client("s3"), cloud.client("stepfunctions"), cloud.client("ec2")
            publish_artifacts(s3, bucket)
            store = RunStore(cloud.client("dynamodb"), outputs["RunTableName"])

            def agent_environment(instance: Any) -> dict[str, str]:
                return {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                        "TRAINFLEET_RUN_NAME": instance.tags[TAG_RUN], "TRAINFLEET_RUN_TABLE": outputs["RunTableName"],
                        "TRAINFLEET_BUCKET": bucket, "TRAINFLEET_EVENT_BUS": outputs["AgentEventBusName"],
                        "TRAINFLEET_AGENT_LIFETIME_S": str(int(timeout_s))}

            # What the user data does on EC2: copy the wheelhouse with the instance's role, then
            # start the agent (no pip here: it runs from this tree).
            cloud.fleet.boot = lambda instance: [sys.executable, "-m", "localcloud.node_boot",
                                                 sys.executable, "-m", "trainer.agent"]
            cloud.fleet.env_hooks.append(agent_environment)
            run_name = f"{template['run_name']}-{uuid.uuid4().hex[:4]}"
            spec = local_run_spec(template, run_name, bucket, *_network(ec2))
            arn = sfn.start_execution(stateMachineArn=outputs["StateMachineArn"], name=run_name,
                                      input=json.dumps(spec))["executionArn"]
            narrate(f"started execution {run_name}: {spec['node_count']} x {spec['instance_type']}, "
                    f"pp={spec['trainer']['parallel']['pp']}, {spec['trainer']['training']['steps']} steps, "
                    f"checkpoint every {spec['checkpoint']['interval_steps']} to s3://{bucket}/runs/{run_name}/")
            watch = _Watch(cloud, sfn, store, arn, run_name, narrate)

            def ended() -> bool:
                return sfn.describe_execution(executionArn=arn)["status"] != "RUNNING"

            disrupted = None
            if disruption is not None:
                watch.until(lambda: ended() or watch.first_checkpoint() is not None, timeout_s)
                if not ended():
                    disrupted = _disrupt_node_rank_1(cloud, store, run_name, watch, narrate, disruption)
            watch.until(ended, timeout_s)
            watch.until(lambda: all(i.state == "terminated" for i in cloud.fleet.instances()), 60)
            return _outcome(cloud, sfn, s3, ec2, store, bucket, arn, run_name) | {"disrupted": disrupted}
        except Exception:
            _dump_consoles(cloud)
            raise
        finally:
            metadata.stop()


def _disrupt_node_rank_1(cloud: Any, store: RunStore, run_name: str, watch: _Watch,
                         narrate: Callable[[str], None], how: Literal["kill", "spot", "freeze"]) -> dict[str, Any]:
    first_nodes = {node.instance_id: node.node_rank for node in store.nodes(run_name)}
    victim = next(instance for instance, rank in first_nodes.items() if rank == 1)
    survivor = next(instance for instance, rank in first_nodes.items() if rank == 0)
    where = f"{victim} (node rank 1, {cloud.fleet.get(victim).private_ip})"
    if how == "kill":
        narrate(f"checkpoint step {watch.first_checkpoint()} committed: killing {where}")
        cloud.fleet.kill(victim)
    elif how == "freeze":
        narrate(f"checkpoint step {watch.first_checkpoint()} committed: freezing {where} (no EC2 event)")
        cloud.fleet.hang(victim)
    else:
        narrate(f"checkpoint step {watch.first_checkpoint()} committed: Spot interruption notice for {where}")
        cloud.inject_spot_interruption(victim)
    return {"first_nodes": first_nodes, "victim": victim, "survivor": survivor}


class _Watch:
    """Polls the execution, the run record and the fleet; narrates what changed."""

    def __init__(self, cloud: Any, sfn: Any, store: RunStore, arn: str, run_name: str,
                 narrate: Callable[[str], None]):
        self.cloud, self.sfn, self.store, self.arn, self.run_name = cloud, sfn, store, arn, run_name
        self.narrate = narrate
        self.states_seen = 0
        self.instance_states: dict[str, str] = {}
        self.checkpoints_seen: set[int] = set()

    def first_checkpoint(self) -> int | None:
        try:
            run = self.store.run(self.run_name)
        except RunNotFound:
            return None
        return run.latest_checkpoint.step if run.latest_checkpoint and run.attempt == 0 else None

    def until(self, done: Callable[[], bool], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.look()
            if done():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not get there within {timeout_s:.0f} s")
            time.sleep(0.5)

    def look(self) -> None:
        states = states_entered(self.sfn, self.arn)
        for state in states[self.states_seen:]:
            self.narrate(f"state {state}")
        self.states_seen = len(states)
        for instance in self.cloud.fleet.instances():
            if self.instance_states.get(instance.instance_id) != instance.state:
                self.instance_states[instance.instance_id] = instance.state
                self.narrate(f"instance {instance.instance_id} ({instance.private_ip}) {instance.state}")
        try:
            run = self.store.run(self.run_name)
        except RunNotFound:
            return
        if run.latest_checkpoint and run.latest_checkpoint.step not in self.checkpoints_seen:
            self.checkpoints_seen.add(run.latest_checkpoint.step)
            self.narrate(f"checkpoint step {run.latest_checkpoint.step} recorded by the control plane")


def _outcome(cloud: Any, sfn: Any, s3: Any, ec2: Any, store: RunStore, bucket: str, arn: str,
             run_name: str) -> dict[str, Any]:
    execution = sfn.describe_execution(executionArn=arn)
    run = store.run(run_name)
    report = json.loads(s3.get_object(Bucket=bucket, Key=f"runs/{run_name}/report.json")["Body"].read())
    reservations = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_RUN}", "Values": [run_name]}])
    instances = cloud.fleet.instances()
    said = {instance.instance_id: agent_lines(instance) for instance in instances}
    return {
        "status": execution["status"],
        "error": execution.get("error"),
        "cause": execution.get("cause"),
        "states": states_entered(sfn, arn),
        "nodes": {node.instance_id: {"state": node.state.value, "attempt": node.attempt,
                                     "rank": node.node_rank, "failure": node.failure_class}
                  for node in store.nodes(run_name)},
        "instances": {instance["InstanceId"]: instance["State"]["Name"]
                      for reservation in reservations["Reservations"] for instance in reservation["Instances"]},
        "launches": {instance_id: [line for line in lines if line["agent"] == "starting torchrun"]
                     for instance_id, lines in said.items()},
        "commits": sorted({(line["attempt"], line["step"]) for lines in said.values() for line in lines
                           if line["agent"] == "sent CheckpointCommitted"}),
        "trainer_failures": [line for lines in said.values() for line in lines if line["agent"] == "sent TrainerFailed"],
        "spot_notices": {instance_id: [line for line in lines if line["agent"].startswith("spot interruption notice")]
                         for instance_id, lines in said.items()},
        "preflight": {instance_id: [line for line in lines if line["agent"] in ("sent NodeReady", "sent NodeUnhealthy")]
                      for instance_id, lines in said.items()},
        "losses": attempt_losses(instances),
        "run": {"state": run.state.value, "attempt": run.attempt, "restarts": run.restarts,
                "latest_checkpoint": run.latest_checkpoint.step if run.latest_checkpoint else None},
        "report": report,
    }


def _dump_consoles(cloud: Any) -> None:
    """What a failed run leaves to read: the end of every instance's console and trainer output."""
    for instance in cloud.fleet.instances():
        print(f"--- {instance.instance_id} ({instance.state}) console:", file=sys.stderr)
        log = instance.console_log
        print(log.read_text(errors="replace")[-3000:] if log.exists() else "(none)", file=sys.stderr)
        for output in sorted(instance.workdir.glob("attempt-*/torchrun.log")):
            print(f"--- {output.relative_to(instance.workdir)}:\n{output.read_text(errors='replace')[-3000:]}",
                  file=sys.stderr)


LOST_TIME_MEANING = {
    "startup": "allocation, boot, preflight, rendezvous until the first step",
    "restart": "backoff, replacement, rendezvous, checkpoint load until the first step after the failure",
    "redone": "training after the last checkpoint, done again after the failure",
    "give_up": "from giving up on the failure to teardown",
    "finishing": "after the final checkpoint or last reported step: the trainer's exit, the completion event",
    "unattributed": "booked before lost time had causes",
}
"""What each kind of lost time (GoodputLedger.lost_by_cause, before the ':') stands for."""


def narrate_outcome(outcome: dict[str, Any], narrate: Callable[[str], None]) -> None:
    """The summary at the end: where each attempt started, the losses, instances, goodput."""
    for instance_id, launches in outcome["launches"].items():
        for launch in launches:
            narrate(f"{instance_id}: attempt {launch['attempt']} as node rank {launch['node_rank']}, "
                    f"resuming from step {launch['resume_step']}" if launch["resume_step"] is not None
                    else f"{instance_id}: attempt {launch['attempt']} as node rank {launch['node_rank']}, from scratch")
    timeline: dict[int, float] = {}  # the run as it stands: each step from the last attempt that trained it
    for attempt, losses in sorted(outcome["losses"].items()):
        steps = sorted(losses)
        narrate(f"attempt {attempt} trained steps {steps[0]}-{steps[-1]}")
        timeline |= losses
    steps = sorted(timeline)
    for first in range(0, len(steps), 10):
        row = steps[first:first + 10]
        narrate(f"loss, steps {row[0]:>3}-{row[-1]:<3} " + " ".join(f"{timeline[step]:.3f}" for step in row))
    report = outcome["report"]
    for failure in report["failures"]:
        narrate(f"failure handled: {failure['failure_class']}, latest committed step then {failure['resume_step']}")
    narrate(f"instances: {len(outcome['instances'])} launched, now {sorted(set(outcome['instances'].values()))}; "
            f"replaced: {', '.join(report['nodes']['replaced']) or 'none'}")
    narrate(f"run {report['state']} after {report['restarts']} restart(s), last checkpoint step "
            f"{outcome['run']['latest_checkpoint']}")
    if outcome["error"]:
        narrate(f"execution failed: {outcome['error']}: {outcome['cause']}")
    ledger = report["ledger"]
    narrate(f"goodput {report['goodput']:.0%} of the run's time: {ledger['productive_seconds']:.1f} s productive, "
            f"{ledger['lost_seconds']:.1f} s lost")
    for cause, seconds in sorted(ledger["lost_by_cause"].items(), key=lambda item: -item[1]):
        kind, _, failure_class = cause.partition(":")
        narrate(f"  {seconds:6.1f} s lost to {cause}: {LOST_TIME_MEANING.get(kind, kind)}"
                + (f" ({failure_class})" if failure_class else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainfleet demo --",
                                     description="A training run on the local cloud with a node lost and replaced.")
    parser.add_argument("--run-spec", type=Path, default=DEMO_RUN_SPEC,
                        help="RunSpec JSON to run (name, bucket, subnet and security group are filled in)")
    parser.add_argument("--disruption", choices=["kill", "spot", "none"], default="kill",
                        help="what happens to node rank 1 after the first checkpoint: its instance is killed, "
                             "it gets a Spot interruption notice, or nothing")
    parser.add_argument("--workdir", type=Path, help="keep the instances' folders here (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each phase of the run")
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given[1:] if given[:1] == ["--"] else given)
    try:
        template = json.loads(args.run_spec.read_text())
        RunSpec.model_validate(template)  # the names, bucket and network filled in later keep it valid
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"--run-spec {args.run_spec}: {exc}")
    except ValidationError as exc:
        parser.error(f"--run-spec {args.run_spec}:\n{validation_message(exc)}")
    narrate = Narrator()
    disruption = None if args.disruption == "none" else args.disruption
    outcome = run_on_local_cloud(template, narrate, disruption=disruption, workdir=args.workdir,
                                 timeout_s=args.timeout)
    narrate_outcome(outcome, narrate)
    return 0 if outcome["status"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
