"""The state machine definition: every error name real, no path that skips Teardown, waits
driven by task tokens, and the local cloud's ASL parser (moto's) accepts both state machines."""

import importlib
import inspect
import json
import math
import pkgutil
from pathlib import Path

import pytest

import trainfleet
from localcloud_helpers import forget_functions
from trainfleet.core.records import FAILURE_ERROR
from trainfleet.operator.validate import substituted_definitions

REPO = Path(__file__).resolve().parent.parent
ASL_PATH = REPO / "statemachine" / "training_run.asl.json"

# Error names AWS defines: the States.* names of the Step Functions developer guide ("Error
# names"), the Lambda service errors the lambda:invoke integration raises, which AWS
# recommends retrying ("Handle Lambda service exceptions"), Lambda.Unknown for a function that
# timed out or ran out of memory, and the Lambda runtime's own error type for a timeout.
AWS_STATES_ERRORS = {
    "States.ALL", "States.DataLimitExceeded", "States.ExceedToleratedFailureThreshold",
    "States.HeartbeatTimeout", "States.Http.Socket", "States.IntrinsicFailure",
    "States.ItemReaderFailed", "States.NoChoiceMatched", "States.ParameterPathFailure",
    "States.Permissions", "States.ResultPathMatchFailure", "States.ResultWriterFailed",
    "States.Runtime", "States.TaskFailed", "States.Timeout", "States.QueryEvaluationError",
}
AWS_LAMBDA_ERRORS = {
    "Lambda.ServiceException", "Lambda.AWSLambdaException", "Lambda.SdkClientException",
    "Lambda.TooManyRequestsException", "Lambda.ClientExecutionTimeoutException", "Lambda.Unknown",
    "Sandbox.Timedout",
}
# What may go away by itself within minutes: Lambda's service errors and a function timeout.
TRANSIENT = AWS_LAMBDA_ERRORS
OUTAGE = "TransientError"
"""The one name the handlers give an AWS call that was throttled, answered 5xx or could not
connect: a regional outage of a store (DynamoDB's of hours in us-east-1) is waited out."""


@pytest.fixture(scope="module")
def asl() -> dict:
    return json.loads(ASL_PATH.read_text())


@pytest.fixture(scope="module")
def exception_classes() -> dict[str, type]:
    """Every exception class defined in functions/ and trainfleet/, by name. The functions
    package is dropped from sys.modules afterwards, so that the local cloud can later import
    the deployed copy of it."""
    import functions

    found = {}
    for package in (functions, trainfleet):
        for module_info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            module = importlib.import_module(module_info.name)
            for name, value in vars(module).items():
                if (inspect.isclass(value) and issubclass(value, BaseException)
                        and value.__module__ == module.__name__):
                    found[name] = value
    yield found
    forget_functions()


def _error_names(asl: dict) -> set[str]:
    names = set()
    for state in asl["States"].values():
        for rule in state.get("Retry", []) + state.get("Catch", []):
            names.update(rule["ErrorEquals"])
    return names


def _undefined_error_names(asl: dict, exception_classes: dict[str, type]) -> list[str]:
    # What the code can really raise: a handler's exception (named by its class) or the error
    # the event handler sends with SendTaskFailure.
    raised = set(exception_classes) | {FAILURE_ERROR}
    return sorted(name for name in _error_names(asl)
                  if name not in AWS_STATES_ERRORS | AWS_LAMBDA_ERRORS | raised)


def test_every_error_name_is_one_aws_defines_or_one_the_code_raises(asl, exception_classes):
    assert not _undefined_error_names(asl, exception_classes), "ErrorEquals names nothing defines"


def test_the_error_name_check_catches_a_misspelt_name(asl, exception_classes):
    misspelt = json.loads(json.dumps(asl))
    misspelt["States"]["Train"]["Catch"][0]["ErrorEquals"].append("States.TaskFailedId")
    misspelt["States"]["Allocate"]["Retry"][1]["ErrorEquals"].append("CapacityUnavailabel")
    assert _undefined_error_names(misspelt, exception_classes) == ["CapacityUnavailabel", "States.TaskFailedId"]


def test_every_task_retries_transient_errors_with_backoff_before_anything_catches_them(asl):
    """A Lambda timeout, an S3 5xx or an EC2 RequestLimitExceeded is retried, patiently (a run
    may be weeks old), not sent to Teardown; StaleRecord (a lost race on a record) too, where a
    task writes records others write too."""
    for name, state in asl["States"].items():
        if state["Type"] != "Task":
            continue
        rules = [rule for rule in state["Retry"] if TRANSIENT <= set(rule["ErrorEquals"])
                 or rule["ErrorEquals"] == ["States.ALL"]]
        assert rules, f"{name} does not retry transient errors"
        rule = rules[0]
        assert rule["BackoffRate"] >= 2 and rule["MaxAttempts"] >= 6 and rule["MaxDelaySeconds"] >= 60, name
        if name not in ("Validate", "Report"):
            assert "StaleRecord" in rule["ErrorEquals"] or rule["ErrorEquals"] == ["States.ALL"], name


def _mean_wait_hours(rule: dict) -> float:
    """A retrier's mean total wait: full jitter waits a uniform share of each capped interval."""
    waits = [min(rule["IntervalSeconds"] * rule["BackoffRate"] ** attempt, rule.get("MaxDelaySeconds", math.inf))
             for attempt in range(rule["MaxAttempts"])]
    return sum(waits) * (0.5 if rule.get("JitterStrategy") == "FULL" else 1.0) / 3600


def test_an_outage_of_the_control_planes_stores_is_waited_out_for_hours_never_sent_to_teardown(asl):
    """Recover, Launch and AwaitNodes gave up on TransientError after about 510 s, and the Catch
    tore a fleet down that a DynamoDB outage had not touched; at about two failures a day on 512
    p5, a failure inside a three-hour outage is likely. Every task after Validate waits about
    12 hours (bounded: a run that cannot reach its stores for longer ends)."""
    for name, state in asl["States"].items():
        if state["Type"] != "Task" or name == "Validate":
            continue
        matching = next(rule for rule in state["Retry"] if OUTAGE in rule["ErrorEquals"]
                        or rule["ErrorEquals"] == ["States.ALL"])
        assert matching["ErrorEquals"] == [OUTAGE], f"{name}: {matching['ErrorEquals']} comes first"
        assert 11 <= _mean_wait_hours(matching) <= 13 and matching["MaxDelaySeconds"] <= 300, name
        assert matching["JitterStrategy"] == "FULL", f"{name}: runs hit by one outage must not retry in lockstep"


def test_the_event_handler_reports_failures_under_the_name_the_asl_catches(asl):
    for name in ("AwaitNodes", "Train"):
        assert FAILURE_ERROR in asl["States"][name]["Catch"][0]["ErrorEquals"]
        assert asl["States"][name]["Catch"][0]["Next"] == "Recover"


def _successors(state: dict) -> list[str]:
    following = [state["Next"]] if "Next" in state else []
    following += [rule["Next"] for rule in state.get("Catch", [])]
    following += [choice["Next"] for choice in state.get("Choices", [])]
    following += [state["Default"]] if "Default" in state else []
    return following


def test_no_path_after_validate_ends_without_teardown(asl):
    """Walk every edge (Next, Catch, Choice) from Allocate without passing Teardown: no end
    state may be reachable, so every way out of the run goes through Teardown."""
    states, seen, frontier = asl["States"], set(), ["Allocate"]
    while frontier:
        name = frontier.pop()
        if name in seen or name == "Teardown":
            continue
        seen.add(name)
        state = states[name]
        assert state["Type"] not in ("Succeed", "Fail") and not state.get("End"), (
            f"{name} ends the execution without Teardown")
        frontier.extend(_successors(state))
    assert {"Allocate", "AwaitNodes", "Train", "Recover"} <= seen


def test_every_task_after_validate_catches_everything_into_teardown(asl):
    for name, state in asl["States"].items():
        if state["Type"] != "Task" or name in ("Validate", "Teardown", "Report"):
            continue
        catch_all = [rule for rule in state.get("Catch", []) if rule["ErrorEquals"] == ["States.ALL"]]
        assert catch_all and catch_all[0]["Next"] == "Teardown", name
        assert state["Catch"][-1] is catch_all[0], f"{name}: States.ALL must be the last catcher"
        assert catch_all[0]["ResultPath"] == "$.failure", f"{name}: the run reference must survive"


def test_replacements_recover_cannot_launch_go_back_to_recover_as_the_failure(asl):
    """Retried first, then caught with the failure recorded and decided again by Recover (shrink
    or the usual rules); the Pass state in between only names the loop."""
    states = asl["States"]
    recover = states["Recover"]
    assert any(rule["ErrorEquals"] == ["CapacityUnavailable"] for rule in recover["Retry"])
    short = next(rule for rule in recover["Catch"] if rule["ErrorEquals"] == ["CapacityUnavailable"])
    assert short["ResultPath"] == "$.failure"
    loop = states[short["Next"]]
    assert (loop["Type"], loop["Next"]) == ("Pass", "Recover")
    assert not {"Parameters", "Result", "ResultPath", "InputPath", "OutputPath"} & set(loop), "passes the input on"
    # Allocate's shortfall has no nodes to shrink onto: it ends in Teardown.
    assert [rule["Next"] for rule in states["Allocate"]["Catch"]] == ["Teardown"]


def test_waits_are_task_tokens_bounded_by_timeouts(asl):
    states = asl["States"]
    assert not [name for name, state in states.items() if state["Type"] == "Wait"
                and state["Next"] != "AwaitNodes"], "only the recovery backoff may wait"
    for name in ("AwaitNodes", "Train"):
        assert states[name]["Resource"].endswith(".waitForTaskToken")
        assert states[name]["Parameters"]["Payload"]["task_token.$"] == "$$.Task.Token"
    assert states["AwaitNodes"]["TimeoutSecondsPath"] == "$.timeouts.late_worker_seconds"
    assert states["Train"]["HeartbeatSecondsPath"] == "$.timeouts.heartbeat_seconds"
    # A hang surfaces as States.HeartbeatTimeout (also matched by States.Timeout): recover it.
    recover_names = states["Train"]["Catch"][0]["ErrorEquals"]
    assert states["Train"]["Catch"][0]["Next"] == "Recover"
    assert {"States.HeartbeatTimeout", "States.Timeout", FAILURE_ERROR} <= set(recover_names)


def test_the_late_worker_deadline_fires_the_spare_swap_and_the_boot_timeout_still_ends_in_recover(asl):
    """AwaitNodes' timeout (the late-worker deadline) goes to LateWorkers with the payload
    unchanged (no $.failure: the run has not failed); what it finds picks Train, another round of
    AwaitNodes, or Recover with the boot timeout AwaitNodes used to raise itself."""
    states = asl["States"]
    timeout = next(rule for rule in states["AwaitNodes"]["Catch"] if "States.Timeout" in rule["ErrorEquals"])
    assert (timeout["Next"], timeout["ResultPath"]) == ("LateWorkers", None)
    choice = states[states["LateWorkers"]["Next"]]
    assert states["LateWorkers"]["ResultPath"] == "$.late_workers"
    assert {(rule["Variable"], rule["Next"]) for rule in choice["Choices"]} == {
        ("$.late_workers.world_complete", "Train"), ("$.late_workers.boot_over", "BootTimedOut")}
    assert choice["Default"] == "AwaitNodes"
    boot_over = states["BootTimedOut"]
    assert (boot_over["Next"], boot_over["ResultPath"], boot_over["Result"]["Error"]) == (
        "Recover", "$.failure", "States.Timeout")


def test_every_task_states_its_own_outer_bound(asl):
    """No interpreter's default TimeoutSeconds decides how long a wait on a task token may last
    (moto's was 60 for a task with a heartbeat, AWS's is 99999999): each names its bound (the
    other tasks are bounded by their function's timeout). Train's is the longest a Standard
    execution may run, a year; its heartbeat is what catches a hang."""
    for name, state in asl["States"].items():
        if state.get("Resource", "").endswith(".waitForTaskToken"):
            assert {"TimeoutSeconds", "TimeoutSecondsPath"} & set(state), name
    assert asl["States"]["Train"]["TimeoutSeconds"] == 365 * 24 * 3600


def test_payloads_are_references_not_fleets(asl):
    """Every task passes the small state on, or a named part of it; none builds a payload
    from anything that could grow with the fleet."""
    for name, state in asl["States"].items():
        if state["Type"] != "Task":
            continue
        payload = state["Parameters"].get("Payload.$") or state["Parameters"]["Payload"]
        assert payload in ("$",) or set(payload) <= {"run.$", "task_token.$", "run_spec.$",
                                                     "execution_arn.$"}, name


def test_moto_parses_the_definition():
    from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser

    from localcloud.cloud import apply_glue

    apply_glue()  # the parser as the local cloud runs it: its grammar took ToleratedFailurePercentage 5 only as 5.0
    definitions = substituted_definitions(REPO / "template.yaml")
    assert set(definitions) == {"TrainingRunStateMachine", "DataPrepStateMachine"}
    for definition in definitions.values():
        program, _ = AmazonStateLanguageParser.parse(definition)
        assert program is not None
