"""Log lines for people (trainfleet/operator/log_lines.py): time, source, level and message on one
line, from the records the functions and the nodes write as they write them."""

import json

from trainfleet.operator.log_lines import FIELD_CHARS, function_line, node_line, recovered_failures, retried

AT = 1_796_662_514_157  # 2026-12-07 16:55:14.157 UTC
GROUP = "trainfleet-AllocateLogGroup-TGU5UCN8N7QL"
PROFILE_ERROR = "the run's instance profile is not visible to EC2 yet: CreateFleet: InvalidParameterValue"


def powertools(message: str, **fields) -> str:
    return json.dumps({"level": "INFO", "location": "handler:63", "message": message,
                       "timestamp": "2026-12-07 16:55:14,157+0000", "service": "trainfleet", "cold_start": False,
                       "function_name": "trainfleet-AllocateFunction-PR2BUHRVPYNC", "function_memory_size": 512,
                       "function_arn": "arn:aws:lambda:us-east-1:123456789012:function:x",
                       "function_request_id": "9c9df964", "run_name": "flow-a", **fields})


def test_a_functions_record_is_its_time_function_level_message_and_own_fields():
    line = function_line(AT, GROUP, powertools("fleet allocated", instances=2, plan={"pp": 2}))
    assert str(line) == '2026-12-07 16:55:14 Allocate INFO fleet allocated instances=2 plan={"pp": 2}'


def test_a_long_or_many_valued_field_is_cut_on_the_line():
    line = str(function_line(AT, GROUP, powertools("sent", samples=list(range(500)), note="x" * 1000)))
    assert "samples=[500 items]" in line and f"note={'x' * (FIELD_CHARS - 1)}…" in line and len(line) < 300


def test_a_metrics_record_is_not_a_line_for_people():
    emf = json.dumps({"_aws": {"Timestamp": AT, "CloudWatchMetrics": []}, "RunName": "flow-a", "Loss": 2.9})
    assert function_line(AT, GROUP, emf) is None


def test_an_error_a_handler_raised_is_an_error_line_in_either_log_format():
    text = function_line(AT, GROUP, f"[ERROR] TransientError: {PROFILE_ERROR}\n")
    as_json = function_line(AT, GROUP, json.dumps({"timestamp": "2026-12-07T16:55:14Z", "level": "ERROR",
                                                   "errorType": "TransientError", "errorMessage": PROFILE_ERROR,
                                                   "stackTrace": ["  File x"], "requestId": "9c9df964"}))
    for line in (text, as_json):
        assert str(line) == f"2026-12-07 16:55:14 Allocate ERROR TransientError: {PROFILE_ERROR}"
        assert line.error == ("TransientError", PROFILE_ERROR)


def history(*failures_then_success: str) -> list[dict]:
    events = [{"type": "TaskStateEntered"}]
    for kind in failures_then_success:
        if kind == "failed":
            cause = json.dumps({"errorMessage": PROFILE_ERROR, "errorType": "TransientError", "stackTrace": []})
            events.append({"type": "TaskFailed", "taskFailedEventDetails": {"error": "TransientError", "cause": cause}})
        else:
            events.append({"type": "TaskSucceeded"})
    return events


def test_an_error_the_state_machine_retried_and_then_succeeded_past_is_a_warning():
    line = function_line(AT, GROUP, f"[ERROR] TransientError: {PROFILE_ERROR}")
    recovered = recovered_failures(history("failed", "failed", "succeeded"))
    assert str(retried(line, recovered)) == (
        f"2026-12-07 16:55:14 Allocate WARNING TransientError: {PROFILE_ERROR} (retried, then succeeded)")
    # Its retries spent (the state failed): it stays an error.
    assert retried(line, recovered_failures(history("failed", "failed"))).level == "ERROR"


def test_a_nodes_agent_line_and_trainer_lines():
    agent = node_line(AT, 'agent {"agent": "starting torchrun", "attempt": 0, "node_rank": 1}')
    assert str(agent) == "2026-12-07 16:55:14 agent INFO starting torchrun attempt=0 node_rank=1"
    assert str(node_line(AT, "trainer step     1 | loss 5.5926")) == (
        "2026-12-07 16:55:14 trainer INFO step     1 | loss 5.5926")
    assert node_line(AT, "trainer Traceback (most recent call last):").level == "ERROR"
    assert node_line(AT, "trainer torch.distributed.DistBackendError: peer gone").level == "ERROR"
    assert node_line(AT, "trainer x.py:3: UserWarning: careful").level == "WARNING"
