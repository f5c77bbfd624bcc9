"""Step Functions glue: the Distributed Map as AWS documents it, where moto's interpreter falls short.

moto runs a Distributed Map's ItemReader (s3:getObject, s3:listObjectsV2), ItemSelector,
MaxConcurrency(Path) and its child workflows, with their own Retry. Two things it lacked:

- Tolerated failures: a child workflow that failed (after its retries) was counted and dropped,
  and the Map Run succeeded whatever failed, with a null in the failed child's place. Step
  Functions fails the Map Run with States.ExceedToleratedFailureThreshold (a Catch can match it)
  once the children that failed or timed out are more than ToleratedFailureCount, or more than
  ToleratedFailurePercentage of all items; a field left out does not apply, and with neither
  any failed child fails the Map Run (the documented default of zero).
- ResultWriter: the manifest it wrote listed no result files, and the children's results were
  lost. Step Functions writes each child's execution as the export documents it (ExecutionArn,
  Name, Input, Output, Status, StartDate, StopDate, and a failed child's Error and Cause) into
  `<Prefix>/<map run id>/SUCCEEDED_0.json` and `FAILED_0.json` (JSON arrays), and lists them with
  their sizes in `manifest.json`; the Map's output is the Map Run's ARN and where the manifest is.
- ResultWriter Parameters: their paths were read from the children's results; Step Functions reads
  them, as the ItemReader's, from the Map state's input.
- ToleratedFailurePercentage as a whole number: its grammar took only a number with a fraction
  ("5.0") and refused the definition for "5"; Step Functions takes any number from 0 to 100. A
  whole number is now read as that number.
"""

from __future__ import annotations

import datetime
import json
import threading
import uuid
from typing import Any

from moto.stepfunctions.parser.api import ExecutionFailedEventDetails, HistoryEventType
from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
    FailureEvent,
    FailureEventException,
)
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import StatesErrorNameType
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.distributed_iteration_component import (
    DistributedIterationComponent,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.distributed_item_processor_worker import (  # noqa: E501
    DistributedItemProcessorWorker,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_map.result_writer.resource_eval.resource_eval_s3 import (
    ResourceEvalS3,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_map.result_writer.result_writer_decl import ResultWriter
from moto.stepfunctions.parser.asl.component.state.exec.state_map.state_map import StateMap
from moto.stepfunctions.parser.asl.component.state.exec.state_map.tolerated_failure import (
    ToleratedFailureCountDecl,
    ToleratedFailurePercentageDecl,
)
from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
from moto.stepfunctions.parser.asl.eval.program_state import ProgramError

from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser

from localcloud.glue.stepfunctions import aws_timestamp

_given = threading.local()
"""The thresholds the Map state being run names and its input, for its Map Run and its ResultWriter
(run on the same thread)."""


class _Child:
    """One child workflow execution of a Map Run, as the ResultWriter exports it."""

    def __init__(self, map_run_arn: str, item: Any):
        self.name = str(uuid.uuid4())
        head, _, _ = map_run_arn.rpartition(":")  # arn:...:mapRun:MACHINE/LABEL
        self.execution_arn = head.replace(":mapRun:", ":execution:", 1) + f":{self.name}"
        self.state_machine_arn = head.replace(":mapRun:", ":stateMachine:", 1)
        self.input, self.started = item, datetime.datetime.now(datetime.timezone.utc)
        self.status, self.output, self.error, self.cause, self.stopped = "RUNNING", None, None, None, None

    def end(self, status: str, output: Any = None, error: str | None = None, cause: str | None = None) -> None:
        self.status, self.output, self.error, self.cause = status, output, error, cause
        self.stopped = datetime.datetime.now(datetime.timezone.utc)

    def exported(self) -> dict[str, Any]:
        record = {"ExecutionArn": self.execution_arn, "Input": json.dumps(self.input),
                  "InputDetails": {"Included": True}, "Name": self.name, "RedriveCount": 0,
                  "RedriveStatus": "NOT_REDRIVABLE", "StartDate": aws_timestamp(self.started),
                  "StateMachineArn": self.state_machine_arn, "Status": self.status,
                  "StopDate": aws_timestamp(self.stopped)}
        if self.status == "SUCCEEDED":
            record |= {"Output": json.dumps(self.output), "OutputDetails": {"Included": True}}
        else:
            record |= {"Error": self.error or "States.Runtime", "Cause": self.cause or ""}
        return record


def _children(map_run_record: Any) -> list[_Child]:
    if not hasattr(map_run_record, "children"):
        map_run_record.children = []
    return map_run_record.children


def _remember_thresholds(from_state_props: Any) -> Any:
    def remembered(self: StateMap, state_props: Any) -> None:
        from_state_props(self, state_props)
        self.thresholds_given = (state_props.get(ToleratedFailureCountDecl) is not None,
                                 state_props.get(ToleratedFailurePercentageDecl) is not None)
    return remembered


def _with_thresholds(eval_execution: Any) -> Any:
    def evaluated(self: StateMap, env: Any) -> None:
        outer = getattr(_given, "thresholds", None), getattr(_given, "state_input", None)
        _given.thresholds = getattr(self, "thresholds_given", (False, False))
        _given.state_input = env.states.get_input()
        try:
            eval_execution(self, env)
        finally:
            _given.thresholds, _given.state_input = outer
    return evaluated


def _parameters_from_the_state_input(eval_body: Any) -> Any:
    def evaluated(self: ResultWriter, env: Any) -> None:
        env.stack.append(_given.state_input)
        self.parargs.eval(env=env)
        parameters = env.stack.pop()
        env.stack.pop()
        env.stack.append(parameters)
        self.resource_eval.eval_resource(env=env)
    return evaluated


def _recording_children(eval_job: Any) -> Any:
    def recorded(self: DistributedItemProcessorWorker, env: Any, job: Any) -> None:
        child = _Child(self._map_run_record.map_run_arn, job.job_input)
        _children(self._map_run_record).append(child)
        _given.child = child
        eval_job(self, env, job)
        state = env.program_state()
        if isinstance(state, ProgramError):
            details = state.error or {}
            child.end("FAILED", error=details.get("error"), cause=details.get("cause"))
        elif job.job_output is None:
            child.end("FAILED", error="States.Runtime", cause="the child workflow ended without an output")
        else:
            child.end("SUCCEEDED", output=job.job_output)
    return recorded


def _recording_child_input(eval_input: Any) -> Any:
    def evaluated(self: DistributedItemProcessorWorker, env_frame: Any) -> None:
        eval_input(self, env_frame)
        _given.child.input = env_frame.states.get_input()  # the child's input: the item as ItemSelector made it
    return evaluated


def exceeds_tolerance(failed: int, total: int, count: int, percentage: float, given: tuple[bool, bool]) -> bool:
    """Whether `failed` of `total` children fail the Map Run (AWS: failed or timed out over the
    total, against each threshold the state names; none named: no failure tolerated)."""
    count_given, percentage_given = given
    if not count_given and not percentage_given:
        return failed > 0
    return (count_given and failed > count) or (percentage_given and total and failed * 100 / total > percentage)


def _failing_past_tolerance(map_run: Any) -> Any:
    def run(self: DistributedIterationComponent, env: Any, eval_input: Any) -> None:
        map_run(self, env, eval_input)
        children = _children(eval_input.map_run_record)
        failed = [child for child in children if child.status != "SUCCEEDED"]
        given = getattr(_given, "thresholds", (False, False))
        if exceeds_tolerance(len(failed), len(children), eval_input.tolerated_failure_count,
                             eval_input.tolerated_failure_percentage, given):
            name = StatesErrorNameType.StatesExceedToleratedFailureThreshold.to_name()
            cause = (f"The specified tolerated failure threshold was exceeded: {len(failed)} of {len(children)} "
                     f"items failed (first: {failed[0].error}: {failed[0].cause})")
            raise FailureEventException(failure_event=FailureEvent(
                env=env, error_name=StatesErrorName(typ=StatesErrorNameType.StatesExceedToleratedFailureThreshold),
                event_type=HistoryEventType.MapRunFailed,
                event_details=EventDetails(executionFailedEventDetails=ExecutionFailedEventDetails(
                    error=name, cause=cause))))
    return run


def _write_results(env: Any, resource_runtime_part: Any, state_credentials: Any) -> None:
    parameters = env.stack.pop()
    env.stack.pop()  # the children's outputs: exported below with the rest of each execution
    s3 = ResourceEvalS3._get_s3_client(resource_runtime_part=resource_runtime_part,
                                       state_credentials=state_credentials)
    record = env.map_run_record_pool_manager.get_all().pop()
    prefix = parameters.get("Prefix", "")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    folder = f"{prefix}{record.map_run_arn.split(':')[-1]}/"
    files: dict[str, list[dict[str, Any]]] = {"FAILED": [], "PENDING": [], "SUCCEEDED": []}
    children = _children(record)
    for status in ("SUCCEEDED", "FAILED"):
        exported = [child.exported() for child in children if (child.status == "SUCCEEDED") == (status == "SUCCEEDED")]
        if exported:
            body = json.dumps(exported).encode()
            key = f"{folder}{status}_0.json"
            s3.put_object(Bucket=parameters["Bucket"], Key=key, Body=body)
            files[status].append({"Key": key, "Size": len(body)})
    manifest = f"{folder}manifest.json"
    s3.put_object(Bucket=parameters["Bucket"], Key=manifest, Body=json.dumps(
        {"DestinationBucket": parameters["Bucket"], "MapRunArn": record.map_run_arn, "ResultFiles": files},
        indent=2).encode())
    env.stack.append({"MapRunArn": record.map_run_arn,
                      "ResultWriterDetails": {"Bucket": parameters["Bucket"], "Key": manifest}})


def _percentages_as_fractions(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: float(item) if key == "ToleratedFailurePercentage" and type(item) is int
                else _percentages_as_fractions(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_percentages_as_fractions(item) for item in value]
    return value


def _parsing_whole_percentages(parse: Any) -> Any:
    def parsed(definition: str) -> Any:
        try:
            document = json.loads(definition)
        except ValueError:
            return parse(definition)  # the parser names what is wrong with it
        return parse(json.dumps(_percentages_as_fractions(document)))
    return parsed


def apply() -> None:
    AmazonStateLanguageParser.parse = staticmethod(_parsing_whole_percentages(AmazonStateLanguageParser.parse))
    StateMap.from_state_props = _remember_thresholds(StateMap.from_state_props)
    StateMap._eval_execution = _with_thresholds(StateMap._eval_execution)
    DistributedItemProcessorWorker._eval_job = _recording_children(DistributedItemProcessorWorker._eval_job)
    DistributedItemProcessorWorker._eval_input = _recording_child_input(DistributedItemProcessorWorker._eval_input)
    DistributedIterationComponent._map_run = _failing_past_tolerance(DistributedIterationComponent._map_run)
    ResourceEvalS3._handle_put_object = staticmethod(_write_results)
    ResultWriter._eval_body = _parameters_from_the_state_input(ResultWriter._eval_body)
