"""What the person who runs trainings does with runs, through AWS's APIs alone.

    stack = Stack.find("trainfleet")          # the deployed stack's outputs (CloudFormation)
    stack.start(run_spec)                     # an execution of its state machine
    stack.runs()                              # the executions, newest first, with their records
    stack.status("my-run")                    # RunStatus: state, attempt, nodes, step, loss, ...
    stack.stop("my-run")                      # StopExecution; the reaper tears the run down
    stack.wait_for_teardown("my-run", 600)    # its status once every instance is terminated
    stack.report("my-run", folder)            # the run report's files, written to a folder
    stack.logs("my-run"), stack.node_log("my-run", "i-..." or node rank)

Endpoint, region and credentials come from the environment, as the AWS CLI takes them:
AWS_ENDPOINT_URL points every client at the local cloud (`trainfleet local up` prints what to
set), so the same code serves AWS and the local cloud. Every refusal is an OperatorError whose
message names what is wrong, raised before anything changed.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import ValidationError

from trainfleet.adapters.run_history import read_history
from trainfleet.adapters.run_store import RunNotFound, RunStore
from trainfleet.core.events import ProgressSample
from trainfleet.core.lifecycle import book_attempt
from trainfleet.core.node_access import node_access_problems, node_log_stream
from trainfleet.core.records import (FailureRecord, FleetCheckFigures, NodeRecord, NodeRole, NodeState, RunRecord,
                                     RunState, ScalingCheckFigures)
from trainfleet.core.run_history import StateEntry
from trainfleet.core.runspec import RunSpec, with_stack_defaults
from trainfleet.operator.log_lines import function_line, node_line, recovered_failures, retried
from trainfleet.report.files import REPORT_HTML, report_files

__all__ = ["Stack", "RunStatus", "RunSummary", "OperatorError", "load_run_spec", "STACK_OUTPUTS"]

STACK_OUTPUTS = ("StateMachineArn", "RunTableName", "CheckpointBucketName", "FunctionLogGroups")
"""The outputs of template.yaml the commands use."""
NODE_LOG_LINES = 1000
"""`run logs --node` shows a node's last lines, this many."""
LOG_FIRST_WINDOW_MS = 3_600_000
"""`run logs` reads the run's last hour first, then earlier windows (Stack.logs)."""
LOG_WINDOW_GROWTH = 4
RECENT_STATES = 8
"""States of the execution a status shows."""
_CLIENT_CONFIG = Config(retries={"mode": "standard", "max_attempts": 8})


class OperatorError(RuntimeError):
    """A command that cannot be done; the message says why, in one line."""


def failure_line(error: Exception) -> str:
    """Why a command could not be done, in one line: an AWS error (AccessDenied, throttling that
    outlasted the retries ...) by its code and message, any other by its message."""
    if isinstance(error, ClientError):
        return f"{error.response['Error'].get('Code')}: {error.response['Error'].get('Message', error)}"
    return str(error)


def _listed(text: str) -> tuple[str, ...]:
    return tuple(item for item in text.split(",") if item)


def load_run_spec(path: Path, stack: Stack, run_name: str | None = None, resume_from: str | None = None) -> dict[str, Any]:
    """A RunSpec file, with `run_name` and `resume_from` (RunSpec.resume_from) given instead of its
    own, completed with the stack's defaults (runspec.with_stack_defaults, as Validate completes
    it) and validated; OperatorError naming the file and the fields otherwise."""
    from trainfleet.adapters.network import NetworkNotFound, node_network

    try:
        document = json.loads(path.read_text())
    except OSError as error:
        raise OperatorError(f"{path}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise OperatorError(f"{path} is not JSON: {error}") from None
    if isinstance(document, dict):
        document |= {key: value for key, value in (("run_name", run_name), ("resume_from", resume_from)) if value}
    try:
        document = with_stack_defaults(document, stack.bucket, lambda instance_type: node_network(
            stack.client("ec2"), list(stack.node_subnet_ids), list(stack.node_security_group_ids), instance_type))
    except NetworkNotFound as error:
        raise OperatorError(f"{path}: {error}") from None
    try:
        RunSpec.model_validate(document)
    except ValidationError as error:
        problems = "; ".join(_one_line(error))
        raise OperatorError(f"{path} is not a valid RunSpec: {problems}") from None
    return document


def _one_line(error: ValidationError) -> list[str]:
    from trainfleet.core.shapes import validation_message

    return validation_message(error).splitlines()


@dataclass(frozen=True)
class RunSummary:
    """One run of the stack, as `trainfleet run list` shows it."""

    run_name: str
    execution_status: str
    started_at: datetime
    state: RunState | None
    attempt: int | None
    last_step: int | None
    goodput: float | None


@dataclass(frozen=True)
class RunStatus:
    """Where a run is, what it has done and what it cost so far."""

    run_name: str
    execution_status: str
    """The execution's: RUNNING, SUCCEEDED, FAILED, ABORTED or TIMED_OUT."""
    started_at: datetime
    stopped_at: datetime | None
    now: datetime
    record: RunRecord | None
    """None when the execution never recorded the run (a RunSpec Validate refused)."""
    nodes: list[NodeRecord] = field(default_factory=list)
    latest: tuple[int, ProgressSample] | None = None
    """The newest step reported, with its attempt."""
    recent_states: list[StateEntry] = field(default_factory=list)
    """The execution's last states, oldest first."""
    error: str | None = None
    """Why the execution or the run failed."""

    @property
    def state(self) -> RunState | None:
        return self.record.state if self.record else None

    @property
    def target_steps(self) -> int:
        if self.record is None:
            return 0
        return int((self.record.spec.trainer.training.model_extra or {}).get("steps", 0))

    @property
    def nodes_by_state(self) -> dict[str, Counter]:
        """Role -> state -> how many."""
        by_role: dict[str, Counter] = {role.value: Counter() for role in NodeRole}
        for node in self.nodes:
            by_role[node.role.value][node.state.value] += 1
        return by_role

    @property
    def replaced(self) -> list[NodeRecord]:
        return [node for node in self.nodes if node.failure_class is not None]

    @property
    def ledger(self):
        """The books so far: a live run's current attempt booked up to now."""
        if self.record is None:
            return None
        if self.record.state.is_final or self.record.created_at is None:
            return self.record.ledger
        return book_attempt(self.record, self.nodes, max(self.now, self.record.updated_at or self.now),
                            completed=True)

    @property
    def failures(self) -> list[FailureRecord]:
        return self.record.failures if self.record else []

    @property
    def fleet_check(self) -> FleetCheckFigures | None:
        return self.record.fleet_check if self.record else None

    @property
    def scaling_check(self) -> ScalingCheckFigures | None:
        return self.record.scaling_check if self.record else None

    @property
    def running(self) -> bool:
        return self.execution_status == "RUNNING"


@dataclass(frozen=True)
class Stack:
    """A deployed trainfleet stack, found by its name."""

    name: str
    state_machine_arn: str
    run_table: str
    bucket: str
    log_groups: tuple[str, ...]
    session: Any = field(repr=False, compare=False)
    endpoint_url: str | None = None
    """None: the environment's (AWS_ENDPOINT_URL), as for every command; a process that runs a
    local cloud of its own names it (the demo)."""
    node_log_group: str | None = None
    """Where the nodes ship their logs (output NodeLogGroupName; node/node_log.py)."""
    node_subnet_ids: tuple[str, ...] = ()
    """Where nodes launch when a RunSpec names no subnets (output NodeSubnetIds)."""
    node_security_group_ids: tuple[str, ...] = ()
    """Their security groups (output NodeSecurityGroupIds)."""
    _clients: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    """One client per service, made at first use: a live view asks several a second, and making
    a client (its service model read and parsed) costs more than the call."""

    @classmethod
    def find(cls, stack_name: str, session: Any = None, endpoint_url: str | None = None) -> Stack:
        """The stack's outputs (DescribeStacks); OperatorError when there is no such stack."""
        session = session or boto3.session.Session()
        try:
            stacks = session.client("cloudformation", endpoint_url=endpoint_url,
                                    config=_CLIENT_CONFIG).describe_stacks(StackName=stack_name)
        except ClientError as error:
            raise OperatorError(f"no stack {stack_name!r} in {session.region_name}: "
                                f"{error.response['Error'].get('Message', error)} (deploy it, or name it "
                                "with --stack)") from None
        except BotoCoreError as error:
            raise OperatorError(f"cannot reach AWS: {error}") from None
        outputs = {output["OutputKey"]: output["OutputValue"] for output in stacks["Stacks"][0].get("Outputs", [])}
        missing = [name for name in STACK_OUTPUTS if name not in outputs]
        if missing:
            raise OperatorError(f"stack {stack_name!r} is not a trainfleet stack: it has no output "
                                f"{', '.join(missing)}")
        return cls(stack_name, outputs["StateMachineArn"], outputs["RunTableName"], outputs["CheckpointBucketName"],
                   tuple(group for group in outputs["FunctionLogGroups"].split(",") if group), session, endpoint_url,
                   outputs.get("NodeLogGroupName"), _listed(outputs.get("NodeSubnetIds", "")),
                   _listed(outputs.get("NodeSecurityGroupIds", "")))

    def client(self, service: str) -> Any:
        if service not in self._clients:
            self._clients[service] = self.session.client(service, endpoint_url=self.endpoint_url,
                                                         config=_CLIENT_CONFIG)
        return self._clients[service]

    @property
    def store(self) -> RunStore:
        return RunStore(self.client("dynamodb"), self.run_table)

    def execution_arn(self, run_name: str) -> str:
        """The run's execution: the one its record names (Validate records it, whatever the
        execution is called: one started from the console has a name of its own), else the
        one `start` names after the run (run names are unique in a stack)."""
        try:
            recorded = self.store.run(run_name, consistent=False).execution_arn
        except RunNotFound:
            recorded = None
        return recorded or f"{self.state_machine_arn.replace(':stateMachine:', ':execution:', 1)}:{run_name}"

    # --- commands ---------------------------------------------------------------------------

    def start(self, spec: dict[str, Any]) -> str:
        """Start an execution of the run (its name is the run's); its ARN."""
        name = spec["run_name"]
        problems = node_access_problems(RunSpec.model_validate(spec), self.bucket)
        if problems:
            raise OperatorError(f"run {name}: {'; '.join(problems)}")
        sfn = self.client("stepfunctions")
        # StartExecution answers a repeated name and input of a running execution with that
        # execution: asked first, so that a second start says so instead of seeming to start.
        try:
            before = sfn.describe_execution(executionArn=self.execution_arn(name))["status"]
        except sfn.exceptions.ExecutionDoesNotExist:
            before = None
        try:
            if before is None:
                return sfn.start_execution(stateMachineArn=self.state_machine_arn, name=name,
                                           input=json.dumps(spec))["executionArn"]
        except sfn.exceptions.ExecutionAlreadyExists:
            before = "started meanwhile"
        raise OperatorError(f"a run named {name!r} was started before in stack {self.name} (its execution "
                            f"{before}): run names are unique")

    def runs(self, limit: int = 50) -> list[RunSummary]:
        """The stack's latest runs, newest first."""
        sfn, store = self.client("stepfunctions"), self.store
        summaries = []
        pages = sfn.get_paginator("list_executions").paginate(stateMachineArn=self.state_machine_arn)
        executions = sorted((execution for page in pages for execution in page["executions"]),
                            key=lambda execution: execution["startDate"], reverse=True)[:limit]
        for execution in executions:
            # `start` names an execution after its run; the console names it as it likes, and
            # the run's name is in the execution's input.
            record = _record(store, execution["name"]) or _record(store, _input_run_name(sfn, execution))
            if record is not None and record.execution_arn not in (None, execution["executionArn"]):
                record = None  # a second execution refused for reusing the run's name
            summaries.append(RunSummary(
                record.run_name if record else execution["name"], execution["status"], execution["startDate"], record.state if record else None,
                record.attempt if record else None, record.last_step if record else None,
                record.ledger.goodput if record else None))
        return summaries

    def status(self, run_name: str) -> RunStatus:
        execution = self._execution(run_name)
        store = self.store
        try:
            record: RunRecord | None = store.run(run_name)
        except RunNotFound:
            record = None
        nodes = store.nodes(run_name) if record else []
        return RunStatus(
            run_name=run_name, execution_status=execution["status"], started_at=execution["startDate"],
            stopped_at=execution.get("stopDate"), now=datetime.now(timezone.utc), record=record, nodes=nodes,
            latest=store.latest_progress(run_name) if record else None,
            recent_states=self._recent_states(execution["executionArn"]),
            error=(record.error if record and record.error else None) or _execution_error(execution))

    def stop(self, run_name: str) -> None:
        """Stop a running run's execution. Its teardown follows: the reaper's, on the execution's
        status change (a stopped execution runs no Catch)."""
        execution = self._execution(run_name)
        if execution["status"] != "RUNNING":
            raise OperatorError(f"run {run_name} is not running: its execution {execution['status']}")
        self.client("stepfunctions").stop_execution(executionArn=execution["executionArn"],
                                                    cause="by trainfleet run stop")

    def wait_for_teardown(self, run_name: str, wait_s: float) -> tuple[RunStatus, list[str]]:
        """The run's status once it is torn down (its record final, every instance it launched
        terminated), or after `wait_s`; with the instances not terminated yet (none when it is)."""
        deadline = time.monotonic() + wait_s
        while True:
            status = self.status(run_name)
            ended = status.record is None or status.state.is_final
            left = (self.not_terminated(status.nodes) if ended else
                    [node.instance_id for node in status.nodes if node.state is not NodeState.TERMINATED])
            if (ended and not left) or time.monotonic() >= deadline:
                return status, left
            time.sleep(1.0)

    def not_terminated(self, nodes: list[NodeRecord]) -> list[str]:
        """The nodes' instances EC2 does not report terminated: the records say so once EC2's
        state-change event reached the control plane; EC2 is asked about the others."""
        asked = sorted(node.instance_id for node in nodes if node.state is not NodeState.TERMINATED)
        if not asked:
            return []
        ec2 = self.client("ec2")
        try:
            pages = ec2.get_paginator("describe_instances").paginate(InstanceIds=asked)
            found = {instance["InstanceId"]: instance["State"]["Name"]
                     for page in pages for reservation in page["Reservations"] for instance in reservation["Instances"]}
        except ClientError as error:
            if error.response["Error"].get("Code") != "InvalidInstanceID.NotFound":
                raise
            found = {}  # an instance terminated long ago is no longer described: gone
        return [instance for instance in asked if found.get(instance, "terminated") != "terminated"]

    def report(self, run_name: str, folder: Path) -> Path:
        """Write the run's report (trainfleet/report/files.py) into `folder`; the page's path."""
        self._execution(run_name)
        store = self.store
        try:
            run = store.run(run_name)
        except RunNotFound:
            raise OperatorError(f"run {run_name} has no record: its execution never started it "
                                "(trainfleet run status shows why)") from None
        nodes = store.nodes(run_name)
        history = read_history(store, self.client("stepfunctions"), run, nodes, datetime.now(timezone.utc))
        folder.mkdir(parents=True, exist_ok=True)
        for name, file in report_files(run, nodes, history).items():
            (folder / name).write_bytes(file.body)
        return folder / REPORT_HTML

    def logs(self, run_name: str, limit: int = 1000, raw: bool = False) -> list[str]:
        """The control plane's log lines about the run (its functions' lines that name it), the
        last `limit`, oldest first: for people (log_lines.function_line: time, function, level,
        message; an error the state machine retried and then succeeded past is a WARNING), or
        with `raw` the events as CloudWatch Logs holds them, one JSON object a line.

        FilterLogEvents reads forward only, five requests a second, and a run of weeks logs
        millions of lines: they are read from the run's end backwards, in windows each
        LOG_WINDOW_GROWTH times the one before, until `limit` are found."""
        execution = self._execution(run_name)
        logs = self.client("logs")
        since = int(execution["startDate"].timestamp() * 1000)
        upper = int((execution.get("stopDate") or datetime.now(timezone.utc)).timestamp() * 1000) + 1
        window, lines = LOG_FIRST_WINDOW_MS, []
        while len(lines) < limit and upper > since:
            lower = max(since, upper - window)
            events = self._log_events(logs, run_name, lower, upper)
            lines = ([json.dumps({"timestamp": at, "logGroupName": group, "message": message})
                      for at, group, message in events] if raw else
                     [line for at, group, message in events if (line := function_line(at, group, message))]) + lines
            upper, window = lower, window * LOG_WINDOW_GROWTH
        lines = lines[-limit:]
        if raw:
            return lines
        if any(line.error for line in lines):
            pages = self.client("stepfunctions").get_paginator("get_execution_history").paginate(
                executionArn=execution["executionArn"], maxResults=1000)
            recovered = recovered_failures(event for page in pages for event in page["events"])
            lines = [retried(line, recovered) for line in lines]
        return [str(line) for line in lines]

    def _log_events(self, logs: Any, run_name: str, start_ms: int, end_ms: int) -> list[tuple[int, str, str]]:
        """(time, group, message) of the events naming the run in [start_ms, end_ms), oldest first."""
        lines = []
        for group in self.log_groups:
            try:
                pages = logs.get_paginator("filter_log_events").paginate(
                    logGroupName=group, filterPattern=f'"{run_name}"', startTime=start_ms, endTime=end_ms - 1)
                lines += [(event["timestamp"], group, event["message"]) for page in pages for event in page["events"]]
            except logs.exceptions.ResourceNotFoundException:
                continue  # a function never invoked has no log group yet
        return sorted(lines)

    def node_log(self, run_name: str, node: str, limit: int = NODE_LOG_LINES, raw: bool = False) -> str:
        """A node's log, its last `limit` lines: what its agent said and its trainers printed,
        from its stream in the nodes' log group, for people (log_lines.node_line) or with `raw`
        as CloudWatch Logs holds them; `node` is an instance id or the node rank of the run's
        current world. A node that shipped nothing (one whose software did not install) has its
        console output instead, where its bootstrap writes."""
        self._execution(run_name)
        try:
            nodes = self.store.nodes(run_name)
        except RunNotFound:
            nodes = []
        # A node rank names the worker that holds it now, or held it last in a run that ended.
        chosen = sorted((record for record in nodes if record.instance_id == node
                         or (str(record.node_rank) == node and record.role is NodeRole.WORKER)),
                        key=lambda record: (not record.state.is_retired, record.attempt))
        if not chosen:
            known = ", ".join(f"{record.instance_id} (rank {record.node_rank})" if record.node_rank is not None
                              else record.instance_id for record in nodes) or "none"
            raise OperatorError(f"run {run_name} has no node {node!r}; its nodes: {known}")
        instance_id = chosen[-1].instance_id
        if self.node_log_group is not None:
            logs = self.client("logs")
            try:
                # startFromHead false: the stream's newest events (a page holds at most 10,000).
                events = logs.get_log_events(logGroupName=self.node_log_group,
                                             logStreamName=node_log_stream(run_name, instance_id),
                                             startFromHead=False, limit=min(limit, 10_000))["events"]
                return "\n".join(json.dumps({"timestamp": event["timestamp"], "message": event["message"]}) if raw
                                 else str(node_line(event["timestamp"], event["message"])) for event in events)
            except logs.exceptions.ResourceNotFoundException:
                pass
        # The SDKs decode the console's base64 themselves (botocore does for GetConsoleOutput).
        console = self.client("ec2").get_console_output(InstanceId=instance_id, Latest=True).get("Output", "")
        return f"({instance_id} shipped no log; its console:)\n{console}"

    # --- plumbing ---------------------------------------------------------------------------

    def _execution(self, run_name: str) -> dict[str, Any]:
        sfn = self.client("stepfunctions")
        try:
            return sfn.describe_execution(executionArn=self.execution_arn(run_name))
        except (sfn.exceptions.ExecutionDoesNotExist, sfn.exceptions.InvalidArn):
            raise OperatorError(f"no run named {run_name!r} in stack {self.name} "
                                "(trainfleet run list shows its runs)") from None

    def _recent_states(self, execution_arn: str) -> list[StateEntry]:
        sfn = self.client("stepfunctions")
        events = sfn.get_execution_history(executionArn=execution_arn, reverseOrder=True,
                                           maxResults=4 * RECENT_STATES)["events"]
        entered = [StateEntry(event["stateEnteredEventDetails"]["name"], event["timestamp"], None)
                   for event in events if "stateEnteredEventDetails" in event]
        return sorted(entered, key=lambda entry: entry.at)[-RECENT_STATES:]


def _record(store: RunStore, run_name: str | None) -> RunRecord | None:
    if not run_name:
        return None
    try:
        return store.run(run_name, consistent=False)
    except RunNotFound:
        return None


def _input_run_name(sfn: Any, execution: dict[str, Any]) -> str | None:
    """The run_name of an execution's input, if it has one."""
    described = sfn.describe_execution(executionArn=execution["executionArn"])
    try:
        name = json.loads(described.get("input") or "{}").get("run_name")
    except (ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _execution_error(execution: dict[str, Any]) -> str | None:
    if execution["status"] in ("RUNNING", "SUCCEEDED"):
        return None
    return ": ".join(part for part in (execution.get("error"), execution.get("cause")) if part) or None

