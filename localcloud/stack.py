"""template.yaml deployed on the local cloud, with real node agents: where local training runs run.

    with local_stack(narrate) as stack:            # LocalCloud + instance metadata + deploy
        run = stack.start_run(template)            # a Step Functions execution of the RunSpec
        stack.watch(run).until(stack.ended(run), "the end of the run")   # while the run advances
        outcome = stack.outcome(run)               # what happened, as plain data

One stack serves any number of runs, one after another or side by side (each run's instances,
agents' folders and records are found by its name): the demo runs one, the chaos suite and the
recovery bench many. Instances boot as real node agents (`python -m node.agent`, from this
tree) with the settings their user data gives them (localcloud/node_boot.py), as on EC2.

It must run in a process that has not imported `functions` (the local cloud imports the
deployed copy).
"""

from __future__ import annotations

import json
import math
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from botocore.config import Config

from localcloud.waiting import sizes, until
from trainfleet.adapters.ec2_fleet import TAG_RUN
from trainfleet.adapters.run_store import RunNotFound, RunStore
from trainfleet.core.records import RunRecord
from trainfleet.core.runspec import NodeNetwork, RecoveryPolicy, RunSpec, with_stack_defaults

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")

AGENT_LIFETIME_S = 3600.0
"""A local agent exits after this long at most, so that none outlives a harness that died without
ending its instances. Far longer than any local run, however slow the machine: it is no
timeout of the product's, and one that a slow run could reach would fail it for nothing."""
PATIENT = Config(retries={"max_attempts": 20, "mode": "standard"})
"""Up to 19 retries with capped exponential backoff: about a minute of a failing service."""

__all__ = ["LocalStack", "LocalRun", "Watch", "local_stack", "agent_lines", "attempt_losses", "metrics_records",
           "states_entered"]


@dataclass(frozen=True)
class LocalRun:
    """One execution of the deployed state machine."""

    run_name: str
    arn: str
    spec: dict[str, Any]
    """The RunSpec as started (names, bucket and network filled in)."""


def execution_history(sfn: Any, execution_arn: str) -> list[dict[str, Any]]:
    """Every event of an execution, oldest first (GetExecutionHistory gives at most 1000 a page)."""
    pages = sfn.get_paginator("get_execution_history").paginate(executionArn=execution_arn)
    return [event for page in pages for event in page["events"]]


def states_entered(sfn: Any, execution_arn: str) -> list[str]:
    return [event["stateEnteredEventDetails"]["name"] for event in execution_history(sfn, execution_arn)
            if "stateEnteredEventDetails" in event]


def agent_lines(instance: Any) -> list[dict[str, Any]]:
    """What an instance's agent said (its JSON lines in the console; a killed agent's last line
    may be cut short)."""
    log = instance.console_log
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [json.loads(line) for line in lines if line.startswith('{"agent"') and line.endswith("}")]


def metrics_records(instances: list[Any], attempt: int) -> list[dict[str, Any]]:
    """What the trainer's global rank 0 wrote to its metrics file in `attempt`, whole lines only
    (a killed trainer's last line may be cut short)."""
    records = []
    for instance in instances:
        for metrics in instance.workdir.glob(f"attempt-{attempt}/metrics.jsonl"):
            text = metrics.read_text()
            records += [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]
    return records


def attempt_losses(instances: list[Any]) -> dict[int, dict[int, float]]:
    """attempt -> step -> loss, from the metrics file of the node that held global rank 0."""
    attempts = sorted({int(metrics.parent.name.split("-")[1]) for instance in instances
                       for metrics in instance.workdir.glob("attempt-*/metrics.jsonl")})
    losses = {attempt: {record["step"]: record["loss"] for record in metrics_records(instances, attempt)
                        if "loss" in record}  # not the `finished` record of a trainer resumed at its last step
              for attempt in attempts}
    return {attempt: steps for attempt, steps in losses.items() if steps}


TIMEOUT_FLOORS_S = {"recovery.hang_timeout_seconds": 60, "recovery.stall_floor_seconds": 60,
                    "recovery.startup_timeout_seconds": 300, "recovery.boot_timeout_seconds": 300,
                    "trainer.parallel.timeout_s": 60}
"""The least a local run may give the product's timeouts. A local run's processes share two
cores with whatever else the machine runs (a test suite's other workers): starved to a small
share, a node's agent boots and passes preflight in minutes, a rank imports torch in a minute, a
peer reaches a collective tens of seconds late, and the silence between two signs of life of a
world that trains can reach seconds. Measured on the `starved` cell beside the suite: a boot of
118 s and a silent start-up (torchrun's and a rank's imports) of more than 120 s, which the
earlier floors of 180 s and 120 s let through as a hang; and, with three chaos cells beside
the suite on a slow day, the Train task's 30 s heartbeat timeout passed twice in worlds that
went on committing checkpoints (the hang floor was 30 s): a world's silence is held to the same
floor, whether the heartbeat's timeout or its agents' cadence judges it. Below these a healthy run could be
failed for its machine's load; the chaos cell `starved` (a quarter of the CPU, beside the suite)
holds them."""


def timeout_floor_problems(spec: dict[str, Any]) -> list[str]:
    """The RunSpec's timeouts below TIMEOUT_FLOORS_S, each named (the defaults are far above)."""
    recovery = RecoveryPolicy.model_validate(spec.get("recovery", {}))
    given = {"recovery.hang_timeout_seconds": recovery.hang_timeout_seconds,
             "recovery.stall_floor_seconds": recovery.stall_floor_seconds,
             "recovery.startup_timeout_seconds": recovery.startup_timeout_seconds,
             "recovery.boot_timeout_seconds": recovery.boot_timeout_seconds,
             "trainer.parallel.timeout_s": spec["trainer"].get("parallel", {}).get("timeout_s", math.inf)}
    return [f"{name}={given[name]:g} is below the local floor of {floor} s" for name, floor in TIMEOUT_FLOORS_S.items()
            if given[name] < floor]


def check_template(template: dict[str, Any]) -> None:
    """ValidationError (or ValueError) for a template RunSpec that local_run_spec cannot make a
    valid RunSpec of, whatever stack it runs in: found before anything is deployed."""
    RunSpec.model_validate(with_stack_defaults(
        local_run_spec(template, str(template.get("run_name", "")), "any-bucket"), "any-bucket",
        lambda instance_type: NodeNetwork(["subnet-00000000000000000"], ["sg-00000000000000000"])))


def local_run_spec(template: dict[str, Any], run_name: str, bucket: str, *,
                   silent_nodes: bool = False) -> dict[str, Any]:
    """The template RunSpec made concrete for one local stack: names and bucket; its network is the
    stack's, which Validate fills in as on AWS. A template whose timeouts a starved machine could
    reach is refused (TIMEOUT_FLOORS_S), unless `silent_nodes`: no node of the run is meant ever
    to report (its network is broken on purpose), so there is no healthy boot to protect."""
    spec = json.loads(json.dumps(template))
    spec["run_name"] = run_name
    spec["checkpoint"]["s3_uri"] = f"s3://{bucket}/runs/{run_name}/checkpoints"
    problems = [] if silent_nodes else timeout_floor_problems(spec)
    if problems:
        raise ValueError(f"RunSpec {template['run_name']!r} cannot run locally: " + "; ".join(problems))
    return spec


@dataclass
class LocalStack:
    """A deployed stack on a running local cloud."""

    cloud: Any
    stack_name: str
    outputs: dict[str, str]
    narrate: Callable[[str], None]
    clients: dict[str, Any] = field(default_factory=dict)
    cpu_shares: dict[str, float] = field(default_factory=dict)
    """Run name -> the share of CPU time its instances get (LocalFleet.cpu_share; 1 if absent)."""
    standin: bool = False
    """The agents run the stand-in trainer (node/standin.py), which no repair order reaches: the
    runs restart their worlds (RecoveryPolicy.repair_in_place off)."""

    def client(self, service: str) -> Any:
        """A client that rides out a service throttling or failing for seconds (a chaos cell's
        doing) as a patient AWS client does: standard retries, many attempts."""
        if service not in self.clients:
            self.clients[service] = self.cloud.client(service, config=PATIENT)
        return self.clients[service]

    @property
    def bucket(self) -> str:
        return self.outputs["CheckpointBucketName"]

    @property
    def store(self) -> RunStore:
        return RunStore(self.client("dynamodb"), self.outputs["RunTableName"])

    def start_run(self, template: dict[str, Any], cpu_share: float = 1.0, *, silent_nodes: bool = False) -> LocalRun:
        """An execution of `template` under a name of its own; its instances, replacements too,
        get `cpu_share` of the CPU time (below 1: a starved machine). `silent_nodes`: see
        local_run_spec."""
        run_name = f"{template['run_name']}-{uuid.uuid4().hex[:4]}"
        self.cpu_shares[run_name] = cpu_share
        spec = self.run_spec(template, run_name, silent_nodes=silent_nodes)
        arn = self.client("stepfunctions").start_execution(
            stateMachineArn=self.outputs["StateMachineArn"], name=run_name, input=json.dumps(spec))["executionArn"]
        self.narrate(f"started execution {run_name}: {spec['node_count']} x {spec['instance_type']}, "
                     f"pp={spec['trainer']['parallel']['pp']}, {spec['trainer']['training']['steps']} steps, "
                     f"checkpoint every {spec['checkpoint']['interval_steps']} to s3://{self.bucket}/runs/{run_name}/")
        return LocalRun(run_name, arn, spec)

    def run_spec(self, template: dict[str, Any], run_name: str, *, silent_nodes: bool = False) -> dict[str, Any]:
        """`template` as a RunSpec named `run_name` for this stack (local_run_spec), its repairs off
        where the agents run the stand-in trainer."""
        spec = local_run_spec(template, run_name, self.bucket, silent_nodes=silent_nodes)
        if self.standin:
            spec["recovery"] = spec.get("recovery", {}) | {"repair_in_place": False}
        return spec

    def operations(self) -> Any:
        """The stack as `trainfleet run` sees it (trainfleet.operator.runs.Stack), through this cloud's
        endpoint with the harness's credentials."""
        import boto3

        from trainfleet.operator.runs import Stack

        env = self.cloud.env()
        session = boto3.session.Session(aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                                        aws_session_token=env.get("AWS_SESSION_TOKEN"), region_name=self.cloud.region)
        return Stack.find(self.stack_name, session, endpoint_url=self.cloud.endpoint)

    def status(self, run: LocalRun) -> str:
        return self.client("stepfunctions").describe_execution(executionArn=run.arn)["status"]

    def ended(self, run: LocalRun) -> Callable[[], bool]:
        return lambda: self.status(run) != "RUNNING"

    def instances(self, run: LocalRun) -> list[Any]:
        """The run's local instances, in launch order."""
        return [instance for instance in self.cloud.fleet.instances() if instance.tags.get(TAG_RUN) == run.run_name]

    def watch(self, run: LocalRun, narrate: Callable[[str], None] | None = None) -> Watch:
        return Watch(self, run, narrate)

    def report_written(self, run: LocalRun) -> bool:
        """Whether the run's report is in S3: Report writes it, or after an execution that ended
        without Teardown (stopped, timed out) the reaper, once it has terminated the instances."""
        return bool(self.client("s3").list_objects_v2(Bucket=self.bucket, Prefix=self.report_key(run)).get("Contents"))

    def report_key(self, run: LocalRun) -> str:
        return f"runs/{run.run_name}/report.json"

    def outcome(self, run: LocalRun) -> dict[str, Any]:
        """What happened to `run`, as plain data; its report must be written."""
        sfn, s3, ec2, store = self.client("stepfunctions"), self.client("s3"), self.client("ec2"), self.store
        execution = sfn.describe_execution(executionArn=run.arn)
        record = store.run(run.run_name)
        report = json.loads(s3.get_object(Bucket=self.bucket, Key=self.report_key(run))["Body"].read())
        reservations = ec2.describe_instances(Filters=[{"Name": f"tag:{TAG_RUN}", "Values": [run.run_name]}])
        instances = self.instances(run)
        said = {instance.instance_id: agent_lines(instance) for instance in instances}
        return {
            "run_name": run.run_name,
            "arn": run.arn,
            "status": execution["status"],
            "error": execution.get("error"),
            "cause": execution.get("cause"),
            "states": states_entered(sfn, run.arn),
            "nodes": {node.instance_id: {"state": node.state.value, "attempt": node.attempt,
                                         "rank": node.node_rank, "failure": node.failure_class,
                                         "reason": node.reason}
                      for node in store.nodes(run.run_name)},
            "instances": {instance["InstanceId"]: instance["State"]["Name"]
                          for reservation in reservations["Reservations"] for instance in reservation["Instances"]},
            "launches": {instance_id: [line for line in lines if line["agent"] == "starting torchrun"]
                         for instance_id, lines in said.items()},
            "repairs": {instance_id: [line for line in lines
                                      if line["agent"].startswith("repairing the world in place")]
                        for instance_id, lines in said.items()},
            "commits": sorted({(line["attempt"], line["step"]) for lines in said.values() for line in lines
                               if line["agent"] == "sent CheckpointCommitted"}),
            "trainer_failures": [line for lines in said.values() for line in lines
                                 if line["agent"] == "sent TrainerFailed"],
            "spot_notices": {instance_id: [line for line in lines if line["agent"].startswith("spot interruption notice")]
                             for instance_id, lines in said.items()},
            "restores": sorted((line["attempt"], line["figures"]) for lines in said.values() for line in lines
                               if line["agent"] == "checkpoint restored"),
            "preflight": {instance_id: [line for line in lines if line["agent"] in ("sent NodeReady", "sent NodeUnhealthy")]
                          for instance_id, lines in said.items()},
            "losses": attempt_losses(instances),
            "run": {"state": record.state.value, "attempt": record.attempt, "restarts": record.restarts,
                    "latest_checkpoint": record.latest_checkpoint.step if record.latest_checkpoint else None},
            "report": report,
        }

    def dump_consoles(self, run: LocalRun) -> None:
        """What a failed run leaves to read: the end of its instances' consoles and trainer output."""
        for instance in self.instances(run):
            print(f"--- {instance.instance_id} ({instance.state}) console:", file=sys.stderr)
            log = instance.console_log
            print(log.read_text(errors="replace")[-3000:] if log.exists() else "(none)", file=sys.stderr)
            for output in sorted(instance.workdir.glob("attempt-*/torchrun.log")):
                print(f"--- {output.relative_to(instance.workdir)}:\n{output.read_text(errors='replace')[-3000:]}",
                      file=sys.stderr)


@contextmanager
def local_stack(narrate: Callable[[str], None], *, time_scale: float = 0.02, workdir: Path | None = None,
                spot_notice_seconds: float = 120.0, standin_step_s: float | None = None, boot_seconds: float = 2.0,
                boot_spread_seconds: float = 0.0, unreachable_limit_s: float | None = None) -> Iterator[LocalStack]:
    """A LocalCloud and its instance metadata service, template.yaml deployed into it, the
    agents' artifacts published and instances booting as node agents. `workdir` keeps the
    instances' folders (None: a temporary folder); `spot_notice_seconds` is nominal, like every
    local cloud time: scaled by `time_scale`; an agent exits after AGENT_LIFETIME_S at most;
    `standin_step_s` set, the agents run the stand-in trainer (node/standin.py) with steps
    that long (real seconds) in place of torchrun; `boot_seconds`, `boot_spread_seconds`:
    LocalCloudConfig's; `unreachable_limit_s`: the agents' (real seconds; None: AWS's 900 s, which
    no local run reaches however starved its machine is)."""
    # The SAM roles attach AWS managed policies; moto knows them only when asked before it loads.
    os.environ["MOTO_IAM_LOAD_MANAGED_POLICIES"] = "true"
    from localcloud import LocalCloud
    from localcloud.deploy import DeployRequest, deploy
    from localcloud.imds import serve_fleet
    from localcloud.node_boot import boot_as_nodes, publish_artifacts
    from node.settings import LOOK_S, METADATA_LOOK_S
    from trainfleet.adapters.ec2_fleet import BOOT_RETRY_S

    with LocalCloud(time_scale=time_scale, workdir=workdir, spot_notice_seconds=spot_notice_seconds,
                    boot_seconds=boot_seconds, boot_spread_seconds=boot_spread_seconds) as cloud:
        metadata = serve_fleet(cloud)
        try:
            narrate(f"local cloud up at {cloud.endpoint}; instance metadata at 127.0.0.1:{metadata.port}")
            deployed = deploy(DeployRequest(template=REPO / "template.yaml", endpoint=cloud.endpoint,
                                            stack_name=f"tf-{uuid.uuid4().hex[:8]}"))
            outputs = deployed.outputs
            narrate(f"deployed template.yaml as stack {deployed.stack_name}: state machine, "
                    f"{len(deployed.resources)} resources")
            stack = LocalStack(cloud, deployed.stack_name, outputs, narrate, standin=bool(standin_step_s))
            publish_artifacts(stack.client("s3"), stack.bucket)

            def local_settings(instance: Any) -> dict[str, str]:
                """Beside what the user data gives the agent: its paces and limits on this machine."""
                return {"TRAINFLEET_AGENT_LIFETIME_S": str(int(AGENT_LIFETIME_S)),
                        # The notices are as much shorter as time is scaled: so is the pace of the looks,
                        # and the waits between a bootstrap step's tries.
                        "TRAINFLEET_METADATA_LOOK_S": str(max(LOOK_S, METADATA_LOOK_S * time_scale)),
                        "TRAINFLEET_BOOT_RETRY_S": str(BOOT_RETRY_S * time_scale)} | (
                    {"TRAINFLEET_UNREACHABLE_LIMIT_S": str(unreachable_limit_s)} if unreachable_limit_s else {}) | (
                    {"TRAINFLEET_STANDIN_STEP_S": str(standin_step_s)} if standin_step_s else {})

            # Every node forked from a warm image, and what it starts run in place: the large runs'
            # stand-in trainer is a thread of the agent, the real trainer's processes would each
            # import torch again (localcloud/warm_image.py, localcloud/in_place.py).
            boot_as_nodes(cloud, local_settings, real_trainer=not standin_step_s)
            cloud.fleet.cpu_share = lambda instance: stack.cpu_shares.get(instance.tags.get(TAG_RUN, ""), 1.0)
            yield stack
        finally:
            metadata.stop()


class Watch:
    """Follows a run's execution, record and instances as an operator would; narrates what
    changed, and tells whether anything did (`progress`)."""

    def __init__(self, stack: LocalStack, run: LocalRun, narrate: Callable[[str], None] | None = None):
        self.stack, self.run = stack, run
        self.narrate = narrate or stack.narrate
        self.states_seen = 0
        self.instance_states: dict[str, str] = {}
        self.checkpoints_seen: set[int] = set()
        self.fleet_checks_seen: set[int] = set()
        self.news = "nothing yet"
        """The last change seen, in words."""

    def first_checkpoint(self) -> int | None:
        """The first attempt's latest checkpoint the control plane recorded, while it trains."""
        try:
            record = self.stack.store.run(self.run.run_name)
        except RunNotFound:
            return None
        return record.latest_checkpoint.step if record.latest_checkpoint and record.attempt == 0 else None

    def until(self, done: Callable[[], T], what: str) -> T:
        """Wait for `done` while the run advances (localcloud.waiting.until)."""
        return until(done, self.progress, what=f"{what} ({self.run.run_name})")

    def progress(self) -> tuple[Any, ...]:
        """A snapshot of everything that shows the run advancing: states entered, instance
        states, the run record's attempt, step and checkpoint, and what its instances wrote (the
        agents' consoles, the trainers' output, metrics and progress files). Narrates what
        changed since the last look."""
        record = self.look()
        written = sizes([path for instance in self.stack.instances(self.run)
                         for path in (instance.console_log, *sorted(instance.workdir.glob("attempt-*/*")))])
        reached = (record.state.value, record.attempt, record.last_step,
                   record.latest_checkpoint.step if record.latest_checkpoint else None) if record else None
        return self.states_seen, tuple(sorted(self.instance_states.items())), reached, written, self.news

    def look(self) -> RunRecord | None:
        """Narrate what changed since the last look; the run record, if there is one yet."""
        states = states_entered(self.stack.client("stepfunctions"), self.run.arn)
        for state in states[self.states_seen:]:
            self._tell(f"state {state}")
        self.states_seen = len(states)
        for instance in self.stack.instances(self.run):
            if self.instance_states.get(instance.instance_id) != instance.state:
                self.instance_states[instance.instance_id] = instance.state
                self._tell(f"instance {instance.instance_id} ({instance.private_ip}) {instance.state}")
        try:
            record = self.stack.store.run(self.run.run_name)
        except RunNotFound:
            return None
        if record.latest_checkpoint and record.latest_checkpoint.step not in self.checkpoints_seen:
            self.checkpoints_seen.add(record.latest_checkpoint.step)
            self._tell(f"checkpoint step {record.latest_checkpoint.step} recorded by the control plane")
        checked = record.fleet_check
        if checked and checked.attempt not in self.fleet_checks_seen:
            self.fleet_checks_seen.add(checked.attempt)
            self._tell(f"fleet check of attempt {checked.attempt} {'passed' if checked.passed else 'FAILED'}: "
                       f"{checked.describe()}")
        return record

    def _tell(self, news: str) -> None:
        self.news = news
        self.narrate(news)
