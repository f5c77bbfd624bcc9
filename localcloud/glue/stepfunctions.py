"""Step Functions glue: what moto's ASL interpreter (ported from LocalStack) lacks here.

moto executes state machines when its config says `execute_state_machine`; LocalCloud sets
that. These patches fill the gaps:

- JSONata: the interpreter evaluates JSONata (and JSONPath `Assign` variables, which it also
  compiles to JSONata) through a Java bridge it does not ship; `_eval_jsonata` is left None.
  It now evaluates with the `jsonata-python` package.
- JSONata variable values: strings are spliced into expressions as '"' + value + '"', which
  breaks on a quote, backslash or newline in the value; they are now encoded as JSON.
- Service integrations (lambda:invoke, sqs, events, aws-sdk ...) call `localhost` on
  MOTO_PORT (default 5000), not the server that runs the execution; they now reach this
  LocalCloud's port. They also built a new boto3 client for every task (about 10 ms of CPU
  each); clients are now made once per service and region and shared (boto3 clients are
  thread-safe once made).
- States.HeartbeatTimeout: a missed heartbeat was reported as States.Timeout, so ASL that
  catches States.HeartbeatTimeout never matched. AWS reports States.HeartbeatTimeout, and
  documents that States.Timeout also matches it; both now match, as does States.ALL
  (Task states; activity tasks keep moto's reporting, trainfleet uses none).
- Request and response shapes of service integrations: the port left
  `StateTaskService._normalise_parameters` / `_normalise_response` empty, so parameters went
  to boto3 in the ASL's casing (`states:startExecution` failed: boto3 knows
  `stateMachineArn`, not `StateMachineArn`) and results came back in boto3's. Both now go
  through the interpreter's own converters with botocore's shapes, as on AWS, and timestamps
  in results become ISO-8601 text (a datetime in a result broke DescribeExecution).
- StartExecution without a name: named the execution "None" (so a second one clashed);
  AWS generates a unique name, and so does the glue.
- SendTaskFailure: the API layer dropped `cause`, so a catcher's Cause was null; it is
  now passed on.
- A second answer to a task token: moto took it (the later outcome overwrote the first while
  the task had not yet read it, and afterwards it was silently accepted). Step Functions
  takes the first SendTaskSuccess/SendTaskFailure and answers any later one with
  TaskTimedOut; so does the glue, which is what lets racing handlers all send and exactly one
  of them win.
- StopExecution: moto marked the program stopped but left the execution RUNNING until the
  state in progress ended by itself (a task waiting on a token: its TimeoutSeconds, a year
  for Train). Step Functions aborts at once: the execution is now ABORTED when StopExecution
  returns, and the tasks waiting on tokens are released.
- Execution Status Change events: moto sent none. Step Functions puts one on the default
  bus each time a Standard workflow's execution starts or ends (RUNNING, SUCCEEDED, FAILED,
  TIMED_OUT, ABORTED); the glue now does, so a rule on them (the reaper's, which tears down
  what a stopped execution left) runs locally as on AWS.
- Log noise: the interpreter logs every state's failure at ERROR level, with its own internals
  (`Exception=FailureEventException, Error=States.Timeout ... at '(StateTaskServiceLambda| {...`,
  kilobytes on one line in the terminal of `trainfleet local up`), also the failures a Retry or
  Catch handles, and a Choice rule `IsPresent: false`'s expected miss
  ("Exception=NoSuchJsonPathError"). Step Functions writes a state's failure into the
  execution's history, where the glue's history has it too, and prints nothing: those records
  are dropped. Any other exception of the interpreter's own is one line, its type and message.
- Default TimeoutSeconds: a Task with HeartbeatSeconds(Path) and no TimeoutSeconds(Path) got a
  TimeoutSeconds of 60, so any task kept alive by heartbeats failed with States.Timeout after a
  minute. AWS's default is 99999999 with or without a heartbeat; it now is here too.
- Scaled time: Wait states and Retry intervals sleep `time_scale` times their nominal
  length (TimeoutSeconds and HeartbeatSeconds stay in real time: they bound real work).
- A Lambda function that timed out: the interpreter named the Task's error after the
  function's errorType, Sandbox.Timedout; Step Functions reports Lambda.Unknown (the cause
  is still the function's error object).
- State transitions: counted per state machine in `LocalCloud.state_transitions` as each
  state is entered; they never cross HTTP, so the endpoint's request count cannot see them.
- Payloads: each state's input (as entered) and output (as exited), as the execution history
  records them, is sized in UTF-8 bytes, as Step Functions measures them against its 256 KB
  limit; the largest is kept in `LocalCloud.largest_payloads["states"]`.
- Context object times: `$$.Execution.StartTime` was a datetime, so any state passing it on
  (a Parameters field, `$states.context` in JSONata) failed with "Object of type datetime is not
  JSON serializable", and `$$.State.EnteredTime` had microseconds and "+00:00". Both are now the
  ISO 8601 text Step Functions gives: UTC, milliseconds, "Z" (2019-03-26T20:14:13.192Z).
- Error names: the interpreter refused any error name beginning with "States." that the ASL
  does not define, at parse time in ErrorEquals and at run time in a Fail state, and re-raised
  a Parallel branch's or Map iteration's error under such a refused name, so a branch that
  failed with States.Timeout or States.TaskFailed failed its parent with States.Runtime.
  Step Functions accepts such definitions (a misspelt States.* name in a Retry simply never
  matches); names now pass through as given, and a branch's error keeps its name, its cause
  and its kind (a States.Timeout is still not matched by States.TaskFailed).
- Choice comparators whose `...Path` value is a context path (`"StringEqualsPath":
  "$$.Execution.Input.expected"`) failed with a JSONPath parse error: the interpreter read the
  path against the state input only. A `$$.` path now reads the context object, as AWS
  documents for "variable to variable comparison operators".
- DynamoDB binary attribute values (B, BS) are base64 text in the JSON Step Functions carries,
  as in DynamoDB's JSON API; they reached DynamoDB base64-encoded a second time, and a result
  holding binary (GetItem of such an item) carried raw bytes, which no execution could
  serialise (DescribeExecution answered 500). Binary now goes in decoded and comes back as
  base64 text, for the optimized and the aws-sdk integrations alike.
- GetExecutionHistory returned every event in one page whatever the request said; it now
  honours maxResults (default 100, at most 1000), reverseOrder and nextToken (a token from
  other arguments is refused with InvalidToken), as the API documents.
- Parsing a definition: the parser's stack of QueryLanguage scopes was one list shared by every
  parse in the process (a class attribute). A definition refused inside a JSONata scope left
  that scope on it, so every later JSONPath definition with a ResultPath was refused too, and
  executions started at the same moment parsed into each other's scopes: an execution whose
  parse failed that way stayed RUNNING, with no history, for ever. Each parse now has its own.
- A definition refused by CreateStateMachine or UpdateStateMachine came back with no error
  code (the parser's own exception type, which the API layer does not know); Step Functions
  answers InvalidDefinition (400), and so does the glue.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import functools
import importlib
import json
import logging
import pkgutil
import sys
import threading
import time
import uuid
from typing import Any

import botocore.session
import jsonata
from botocore import xform_name
from botocore.model import ListShape, MapShape, Shape, StructureShape
from moto.stepfunctions.parser.api import HistoryEventType, TaskTimedOutEventDetails
from moto.stepfunctions.parser.asl.component.common.error_name.error_name import ErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
    FailureEvent,
)
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import (
    StatesErrorName,
)
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
    StatesErrorNameType,
)
from moto.stepfunctions.parser.asl.component.common.retry import retrier_decl
from moto.stepfunctions.parser.asl.component.common.timeouts.timeout import Timeout, TimeoutSeconds
from moto.stepfunctions.parser.asl.component.state import state as state_module
from moto.stepfunctions.parser.asl.component.state.choice.comparison.operator.factory import Operator
from moto.stepfunctions.parser.asl.component.state.exec.execute_state import ExecutionState
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import iteration_worker
from moto.stepfunctions.parser.asl.component.state.exec.state_parallel import branches_decl
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service import (
    StateTaskService,
)
from moto.stepfunctions.parser.asl.component.common.error_name.custom_error_name import CustomErrorName
from moto.stepfunctions.parser.asl.component.state.exec.state_task.lambda_eval_utils import (
    LambdaFunctionErrorException,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_lambda import (
    StateTaskServiceLambda,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task import StateTask
from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task_lambda import StateTaskLambda
from moto.stepfunctions.parser.asl.component.state.fail import state_fail
from moto.stepfunctions.parser.asl.component.state.state import CommonStateField
from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import (
    WaitFunction,
)
from moto.stepfunctions.parser.asl.eval import states as eval_states
from moto.stepfunctions.parser.asl.eval import variable_store
from moto.stepfunctions.parser.asl.eval.callback.callback import (
    CallbackOutcome,
    CallbackPoolManager,
    HeartbeatTimeoutError,
)
from moto.stepfunctions.parser.asl.eval.environment import Environment
from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
from moto.stepfunctions.parser.asl.eval.states import StateData
from moto.stepfunctions.parser.asl.jsonata import jsonata as moto_jsonata
from moto.stepfunctions.parser.asl.parse.preprocessor import Preprocessor
from moto.stepfunctions.parser.asl.utils import boto_client

from moto.core.exceptions import AWSError
from moto.core.responses import ActionResult, EmptyResult
from moto.stepfunctions.exceptions import InvalidToken, ValidationException
from moto.stepfunctions.parser.api import ExecutionStatus, InvalidDefinition, StateMachineType
from moto.stepfunctions.parser.backend.execution import BaseExecutionWorkerCommunication, Execution
from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker
from moto.stepfunctions.parser.models import StepFunctionsParserBackend
from moto.stepfunctions.responses import StepFunctionResponse

from localcloud.aws_events import execution_status_change
from localcloud.glue import active_cloud


# --- JSONata -----------------------------------------------------------------------------

def evaluate_jsonata(expression: str) -> Any:
    try:
        return jsonata.Jsonata(expression).evaluate(None)
    except Exception as exc:  # jsonata-python raises its own JException and plain errors
        raise moto_jsonata.JSONataException("UNKNOWN", str(exc)) from exc


def encode_variable_declarations(bindings: dict[str, Any]) -> str:
    """`$name:=<json>;` for each binding, the form the interpreter prepends to expressions."""
    return "".join(f"{name}:={json.dumps(value, separators=(',', ':'))};"
                   for name, value in bindings.items())


# --- endpoint of service integrations ----------------------------------------------------

_moto_server_port = boto_client.moto_server_port
_moto_boto_client_for = boto_client.boto_client_for
_clients: dict[tuple[str, str, str], Any] = {}
_clients_lock = threading.Lock()


def _integration_port() -> str:
    cloud = active_cloud()
    return str(cloud.port) if cloud is not None else _moto_server_port()


def _shared_boto_client_for(region: str, service: str, state_credentials: Any = None) -> Any:
    """moto's client for an integration (it ignores state_credentials too), made once."""
    key = (_integration_port(), region, service)
    with _clients_lock:
        if key not in _clients:
            _clients[key] = _moto_boto_client_for(region, service, state_credentials)
        return _clients[key]


def _import_all_integrations() -> None:
    """Load every state implementation now, so none binds boto_client_for after the rebind."""
    import moto.stepfunctions.parser.asl.component.state.exec as states

    for module in pkgutil.walk_packages(states.__path__, states.__name__ + "."):
        importlib.import_module(module.name)


def _share_integration_clients() -> None:
    """Every interpreter module imported boto_client_for by name: rebind it in each."""
    prefix = "moto.stepfunctions.parser.asl."
    for name, module in list(sys.modules.items()):
        if name.startswith(prefix) and getattr(module, "boto_client_for", None) is _moto_boto_client_for:
            module.boto_client_for = _shared_boto_client_for


# --- States.HeartbeatTimeout -------------------------------------------------------------

class HeartbeatTimeoutErrorName(StatesErrorName):
    """States.HeartbeatTimeout, which a retrier or catcher on States.Timeout matches too."""

    _MATCHED_BY = {"States.HeartbeatTimeout", "States.Timeout"}

    def __init__(self) -> None:
        super().__init__(typ=StatesErrorNameType.StatesHeartbeatTimeout)

    def matches(self, error_name: str | None) -> bool:
        return error_name in self._MATCHED_BY


_task_from_error = StateTask._from_error


def _task_from_error_with_heartbeat(self: StateTask, env: Environment, ex: Exception) -> FailureEvent:
    if not isinstance(ex, HeartbeatTimeoutError):
        return _task_from_error(self, env, ex)
    error = StatesErrorNameType.StatesHeartbeatTimeout.to_name()
    details = TaskTimedOutEventDetails(error=error)
    resource = getattr(self, "_get_sfn_resource", None)
    if resource is not None:
        details = TaskTimedOutEventDetails(error=error, resource=resource(),
                                           resourceType=self._get_sfn_resource_type())
    return FailureEvent(env=env, error_name=HeartbeatTimeoutErrorName(),
                        event_type=HistoryEventType.TaskTimedOut,
                        event_details=EventDetails(taskTimedOutEventDetails=details))


# --- a Lambda function that timed out ------------------------------------------------

LAMBDA_UNKNOWN_ERROR_TYPES = {"Sandbox.Timedout"}
"""Error types of failures outside the handler's code that Step Functions reports as
Lambda.Unknown ("Unhandled errors in Lambda are reported as Lambda.Unknown in the error output.
These include out-of-memory errors and function timeouts", Step Functions developer guide,
Handle Lambda service exceptions)."""


def _reports_unknown(from_error: Any) -> Any:
    def from_lambda_error(self: StateTask, env: Environment, ex: Exception) -> FailureEvent:
        failure = from_error(self, env, ex)
        if not isinstance(ex, LambdaFunctionErrorException):
            return failure
        try:
            error_type = json.loads(ex.payload).get("errorType")
        except (ValueError, AttributeError):
            return failure
        if error_type in LAMBDA_UNKNOWN_ERROR_TYPES:
            failure.error_name = CustomErrorName("Lambda.Unknown")
            for details in (failure.event_details or {}).values():
                details["error"] = "Lambda.Unknown"  # the cause keeps the function's error object
        return failure

    return from_lambda_error


# --- error names -------------------------------------------------------------------------

def _any_error_name(self: ErrorName, error_name: str | None) -> None:
    # CustomErrorName's own check refused names beginning with "States.": the ASL reserves the
    # prefix for errors the service raises, but Step Functions does not refuse a definition that
    # uses one of its own making.
    ErrorName.__init__(self, error_name=error_name)


def typed_error_name(error_name: str) -> ErrorName:
    """The interpreter's ErrorName for an error reported under `error_name`: a name the ASL
    defines keeps its kind (States.TaskFailed's wildcard passes over them), a heartbeat timeout is
    also a States.Timeout, and any other name is a custom one."""
    if error_name == StatesErrorNameType.StatesHeartbeatTimeout.to_name():
        return HeartbeatTimeoutErrorName()
    try:
        return StatesErrorName.from_name(error_name)
    except ValueError:
        return CustomErrorName(error_name=error_name)


# --- default TimeoutSeconds --------------------------------------------------------------

_moto_execution_state_props = ExecutionState.from_state_props


def _execution_state_props(self: ExecutionState, state_props: Any) -> None:
    _moto_execution_state_props(self, state_props)
    if state_props.get(Timeout) is None:
        self.timeout = TimeoutSeconds(timeout_seconds=TimeoutSeconds.DEFAULT_TIMEOUT_SECONDS)


# --- request and response shapes of integrations ---------------------------------------

@functools.lru_cache(maxsize=None)
def _operation_model(service: str, action: str) -> Any:
    """botocore's model of an operation named in snake_case (start_execution)."""
    model = botocore.session.get_session().get_service_model(service)
    for name in model.operation_names:
        if xform_name(name) == action:
            return model.operation_model(name)
    raise ValueError(f"{service} has no operation {action!r}")


def _normalise_parameters(self: StateTaskService, parameters: dict, boto_service_name: str | None = None,
                          service_action_name: str | None = None) -> None:
    operation = _operation_model(self._get_boto_service_name(boto_service_name),
                                 self._get_boto_service_action(service_action_name))
    if operation.input_shape is not None:
        self._to_boto_request(parameters, operation.input_shape)
        parameters.update(_binary_from_text(parameters, operation.input_shape))


def _normalise_response(self: StateTaskService, response: Any, boto_service_name: str | None = None,
                        service_action_name: str | None = None) -> None:
    operation = _operation_model(self._get_boto_service_name(boto_service_name),
                                 self._get_boto_service_action(service_action_name))
    if operation.output_shape is not None:
        self._from_boto_response(response, operation.output_shape)


_moto_response_value = StateTaskService._from_boto_response_value


def _response_value(response_value: Any) -> Any:
    return _as_json_value(_moto_response_value(response_value))


def _as_json_value(value: Any) -> Any:
    """A result value as Step Functions' JSON carries it: timestamps as ISO 8601 text, binary as
    base64 text (also inside maps, such as a DynamoDB item's attribute values)."""
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {key: _as_json_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_json_value(item) for item in value]
    return value


def _binary_from_text(value: Any, shape: Shape) -> Any:
    """`value` with every blob given as text decoded from base64, as DynamoDB's JSON API carries
    its binary attribute values (B, BS) and as they stand in an ASL document.

    moto's own conversion already turned the blobs it reaches into JSON bytes (Lambda's Payload
    is a JSON document), and it stops at maps, so the text blobs left are those inside maps:
    DynamoDB's Item, Key and ExpressionAttributeValues."""
    if isinstance(shape, StructureShape) and isinstance(value, dict):
        return {key: _binary_from_text(item, shape.members[key]) if key in shape.members else item
                for key, item in value.items()}
    if isinstance(shape, ListShape) and isinstance(value, list):
        return [_binary_from_text(item, shape.member) for item in value]
    if isinstance(shape, MapShape) and isinstance(value, dict):
        return {key: _binary_from_text(item, shape.value) for key, item in value.items()}
    if shape.type_name == "blob" and isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as error:
            raise ValueError(f"binary value {value[:40]!r} is not base64 text: {error}") from error
    return value


# --- parsing a definition: its own QueryLanguage scopes; InvalidDefinition --------------------

_moto_preprocessor_init = Preprocessor.__init__
_moto_validate_definition = StepFunctionsParserBackend._validate_definition


def _preprocessor_with_own_scopes(self: Preprocessor, *args: Any, **kwargs: Any) -> None:
    _moto_preprocessor_init(self, *args, **kwargs)
    self._query_language_per_scope = []


def _validate_definition(definition: str) -> None:
    try:
        _moto_validate_definition(definition)
    except InvalidDefinition as refused:
        raise AWSError(refused.message, "InvalidDefinition") from None


# --- StartExecution without a name -------------------------------------------------------

_moto_start_execution = StepFunctionsParserBackend.start_execution


def _start_execution(self: StepFunctionsParserBackend, state_machine_arn: str, name: str | None = None,
                     execution_input: Any = None, trace_header: Any = None) -> Any:
    return _moto_start_execution(self, state_machine_arn, name=name or str(uuid.uuid4()),
                                 execution_input=execution_input, trace_header=trace_header)


# --- SendTaskFailure --------------------------------------------------------------------

def _send_task_failure(self: StepFunctionResponse) -> EmptyResult:
    self.stepfunction_backend.send_task_failure(
        self._get_param("taskToken"), error=self._get_param("error"), cause=self._get_param("cause"))
    return EmptyResult()


# --- a second answer to a task token ----------------------------------------------------

_moto_notify = CallbackPoolManager.notify
_notify_lock = threading.Lock()


def _notify_once(self: CallbackPoolManager, callback_id: str, outcome: CallbackOutcome) -> bool:
    with _notify_lock:
        endpoint = self.get(callback_id)
        if endpoint is not None and endpoint.get_outcome() is not None:
            # Raised as the API error itself: moto's own mapping of a consumer error cannot build
            # its TaskTimedOut (it needs a message) and answered 500, which clients retry.
            raise AWSError("Task Timed Out: 'Provided task does not exist anymore'", "TaskTimedOut")
        return _moto_notify(self, callback_id, outcome)


# --- StopExecution and Execution Status Change events ----------------------------------

_moto_execution_start = Execution.start
_moto_execution_stop = Execution.stop
_moto_execution_terminated = BaseExecutionWorkerCommunication.terminated


def _publish_status(execution: Execution) -> None:
    cloud = active_cloud()
    if cloud is None or execution.sm_type != StateMachineType.STANDARD:
        return
    cloud.put_event(execution_status_change(execution.region_name, execution.account_id,
                                            dict(execution.to_describe_output())))


def _start_and_publish(self: Execution) -> None:
    _moto_execution_start(self)
    _publish_status(self)


def _stop_now(self: Execution, stop_date: datetime.datetime, error: str | None, cause: str | None) -> None:
    if self.exec_status != ExecutionStatus.RUNNING:
        return
    _moto_execution_stop(self, stop_date, error, cause)
    env = self.exec_worker.env if self.exec_worker is not None else None
    if env is not None:
        # The interpreter keeps no public list of the callbacks a task waits on.
        for endpoint in list(env.callback_pool_manager._pool.values()):
            endpoint.interrupt_all()
    self.exec_status, self.stop_date = ExecutionStatus.ABORTED, stop_date
    _publish_status(self)


def _terminated_and_publish(self: BaseExecutionWorkerCommunication) -> None:
    execution = self.execution
    if execution.exec_status == ExecutionStatus.ABORTED:
        # Stopped, and published then; the released task may have ended the program with an
        # error since, which must not turn the execution into a failed one.
        stopped_at = execution.stop_date
        _moto_execution_terminated(self)
        execution.exec_status, execution.stop_date = ExecutionStatus.ABORTED, stopped_at
        execution.error = execution.cause = None
        return
    _moto_execution_terminated(self)
    _publish_status(execution)


# --- context object times ----------------------------------------------------------------

def aws_timestamp(moment: datetime.datetime) -> str:
    """A time as the context object gives it: ISO 8601, UTC, milliseconds, "Z"."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.astimezone(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


_moto_evaluation_environment = ExecutionWorker._get_evaluation_environment


def _environment_with_start_time_text(self: ExecutionWorker) -> Environment:
    env = _moto_evaluation_environment(self)
    execution = env.states.context_object.context_object_data["Execution"]
    execution["StartTime"] = aws_timestamp(execution["StartTime"])
    return env


def _state_data(**fields: Any) -> StateData:
    """The context's State node, its EnteredTime (moto's isoformat) in the same form."""
    fields["EnteredTime"] = aws_timestamp(datetime.datetime.fromisoformat(fields["EnteredTime"]))
    return StateData(**fields)


# --- Choice comparators with a context path ------------------------------------------------

def _reading_context_paths(evaluate: Any) -> Any:
    """A `...Path` comparator's eval that also takes a `$$.` path: for one, the context object
    stands in for the state input the comparator reads its path from."""
    def evaluate_path(env: Environment, value: Any) -> None:
        if not (isinstance(value, str) and value.startswith("$$")):
            evaluate(env, value)
            return
        variable = env.stack.pop()  # on top of the state input, which the comparator peeks at
        env.stack.extend([env.states.context_object.context_object_data, variable])
        evaluate(env, "$" + value[2:])
        outcome = env.stack.pop()
        env.stack.pop()
        env.stack.append(outcome)

    return evaluate_path


def _path_comparators() -> list[type[Operator]]:
    found, pending = [], list(Operator.__subclasses__())
    while pending:
        operator = pending.pop()
        pending.extend(operator.__subclasses__())
        if operator.__name__.endswith("Path"):
            found.append(operator)
    return found


# --- GetExecutionHistory paging ----------------------------------------------------------

HISTORY_PAGE_DEFAULT = 100
HISTORY_PAGE_MAX = 1000
"""GetExecutionHistory's maxResults: 0 or absent means the default; more than the maximum is
refused (Step Functions API reference)."""


def history_page(events: list[Any], reverse: bool, max_results: int,
                 next_token: str | None) -> tuple[list[Any], str | None]:
    """One page of an execution's history and the token of the next (None on the last).

    The token records where the next page starts and in which order; one made for the other
    order is refused, as a token used with changed arguments is."""
    if not 0 <= max_results <= HISTORY_PAGE_MAX:
        raise ValidationException(
            f"1 validation error detected: Value '{max_results}' at 'maxResults' failed to satisfy "
            f"constraint: Member must have value less than or equal to {HISTORY_PAGE_MAX}")
    ordered = list(reversed(events)) if reverse else events
    start = _page_start(next_token, reverse, len(ordered)) if next_token else 0
    end = start + (max_results or HISTORY_PAGE_DEFAULT)
    token = None
    if end < len(ordered):
        token = base64.urlsafe_b64encode(json.dumps({"start": end, "reverse": reverse}).encode()).decode()
    return ordered[start:end], token


def _page_start(token: str, reverse: bool, count: int) -> int:
    try:
        position = json.loads(base64.urlsafe_b64decode(token.encode()))
        start, same_order = int(position["start"]), position["reverse"] == reverse
    except (ValueError, TypeError, KeyError, binascii.Error) as error:
        raise InvalidToken(f"{token!r} is not a token of this history") from error
    if not same_order or not 0 <= start <= count:
        raise InvalidToken(f"{token!r} was made for other arguments; keep them unchanged between pages")
    return start


def _get_execution_history(self: StepFunctionResponse) -> ActionResult:
    history = self.stepfunction_backend.get_execution_history(self._get_param("executionArn"))
    events, next_token = history_page(history["events"], bool(self._get_param("reverseOrder")),
                                      int(self._get_param("maxResults") or 0), self._get_param("nextToken"))
    return ActionResult({"events": events, **({"nextToken": next_token} if next_token else {})})


# --- state transitions -----------------------------------------------------------------

_moto_state_body = CommonStateField._eval_body


def _count_transition(self: CommonStateField, env: Environment) -> None:
    cloud = active_cloud()
    if cloud is not None:
        state_machine = env.states.context_object.context_object_data["StateMachine"]["Name"]
        cloud.count(cloud.state_transitions, state_machine)
    _moto_state_body(self, env)


_moto_state_entered = CommonStateField._get_state_entered_event_details
_moto_state_exited = CommonStateField._get_state_exited_event_details


def _note_state_payload(env: Environment, state: str, which: str, payload: str) -> None:
    cloud = active_cloud()
    if cloud is not None:
        state_machine = env.states.context_object.context_object_data["StateMachine"]["Name"]
        cloud.note_payload("states", len(payload.encode()), f"{state_machine} {state} {which}")


def _entered_sized(self: CommonStateField, env: Environment) -> Any:
    details = _moto_state_entered(self, env)
    _note_state_payload(env, self.name, "input", details["input"])
    return details


def _exited_sized(self: CommonStateField, env: Environment) -> Any:
    details = _moto_state_exited(self, env)
    _note_state_payload(env, self.name, "output", details["output"])
    return details


# --- scaled time -------------------------------------------------------------------------

def time_scale() -> float:
    cloud = active_cloud()
    return cloud.config.time_scale if cloud is not None else 1.0


def _scaled_wait_interval(self: WaitFunction, env: Environment, wait_seconds: int) -> None:
    """Wait `wait_seconds` nominal seconds, or until the execution stops running."""
    deadline = time.monotonic() + max(0.0, wait_seconds) * time_scale()
    while env.is_running():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        env.program_state_event.wait(remaining)


class _ScaledSleepTime:
    """Stands in for the `time` module inside the retrier, which only calls time.sleep."""

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds * time_scale())


_INTERPRETER_LINE_CHARS = 300


def _interpreters_line(record: logging.LogRecord) -> bool:
    """Drop a state's failure (the execution's history has it) and a missing path's expected
    miss; make any other error of the interpreter one short line, without the component it
    was in (`... at '<repr of the ASL program>'`)."""
    text = record.getMessage()
    if text.startswith(("Exception=FailureEventException", "Exception=NoSuchJsonPathError")):
        return False
    first = text.split(" at '", 1)[0].splitlines()[0] if text else text
    record.msg, record.args = f"Step Functions interpreter: {first[:_INTERPRETER_LINE_CHARS]}", None
    return True


def apply() -> None:
    logging.getLogger("moto.stepfunctions.parser.asl.component.eval_component").addFilter(_interpreters_line)
    moto_jsonata._eval_jsonata = evaluate_jsonata
    eval_states.encode_jsonata_variable_declarations = encode_variable_declarations
    variable_store.encode_jsonata_variable_declarations = encode_variable_declarations
    boto_client.moto_server_port = _integration_port
    _import_all_integrations()
    _share_integration_clients()
    StateTask._from_error = _task_from_error_with_heartbeat
    ExecutionState.from_state_props = _execution_state_props
    StepFunctionResponse.send_task_failure = _send_task_failure
    CallbackPoolManager.notify = _notify_once
    Execution.start = _start_and_publish
    Execution.stop = _stop_now
    BaseExecutionWorkerCommunication.terminated = _terminated_and_publish
    StepFunctionsParserBackend.start_execution = _start_execution
    Preprocessor.__init__ = _preprocessor_with_own_scopes
    StepFunctionsParserBackend._validate_definition = staticmethod(_validate_definition)
    StateTaskService._normalise_parameters = _normalise_parameters
    StateTaskService._normalise_response = _normalise_response
    StateTaskService._from_boto_response_value = staticmethod(_response_value)
    WaitFunction._wait_interval = _scaled_wait_interval
    CommonStateField._eval_body = _count_transition
    CommonStateField._get_state_entered_event_details = _entered_sized
    CommonStateField._get_state_exited_event_details = _exited_sized
    StateTaskServiceLambda._from_error = _reports_unknown(StateTaskServiceLambda._from_error)
    StateTaskLambda._from_error = _reports_unknown(StateTaskLambda._from_error)
    retrier_decl.time = _ScaledSleepTime
    CustomErrorName.__init__ = _any_error_name
    for module in (branches_decl, iteration_worker, state_fail):
        module.CustomErrorName = typed_error_name  # the name a branch, an iteration or a Fail state reports
    ExecutionWorker._get_evaluation_environment = _environment_with_start_time_text
    state_module.StateData = _state_data
    for comparator in _path_comparators():
        comparator.eval = staticmethod(_reading_context_paths(comparator.eval))
    StepFunctionResponse.get_execution_history = _get_execution_history
