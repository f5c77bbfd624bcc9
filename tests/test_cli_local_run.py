"""`trainfleet run` against the local cloud, each command a process of its own pointed there by
the environment (tests/cli_local_run.py): start, status, watch, list, logs, a node's console,
report, stop; and a one-line error, exit 1 and no change for every bad input."""

import pytest
from localcloud_helpers import run_scenario


@pytest.fixture(scope="module")
def commands() -> dict:
    return run_scenario("cli_local_run.py", timeout_s=600)


def ok(result: dict) -> str:
    assert result["rc"] == 0, result["stderr"][-3000:]
    return result["stdout"]


def refused(result: dict, *words: str) -> str:
    """One line on stderr naming the problem, exit 1, nothing on stdout."""
    assert result["rc"] == 1 and result["stdout"] == "", result
    (line,) = result["stderr"].splitlines()
    assert line.startswith("trainfleet run ") and all(word in line for word in words), line
    return line


@pytest.mark.slow
def test_a_run_is_started_looked_at_while_it_trains_and_followed_to_its_end(commands):
    assert "started run cli-run: arn:aws:states:" in ok(commands["start"])
    training = ok(commands["status_training"])
    assert "run cli-run" in training and "TRAINING" in training and "step" in training
    assert "loss" in training and "tokens/s" in training and "goodput" in training and "cost $" in training
    watched = ok(commands["watch"])
    assert "SUCCEEDED" in watched and "execution SUCCEEDED" in watched and "step 60 of 60" in watched
    done = ok(commands["status_done"])
    assert "SUCCEEDED" in done and "terminated" in done


@pytest.mark.slow
def test_list_logs_and_a_nodes_console(commands):
    listed = ok(commands["list"])
    assert "cli-run" in listed and "SUCCEEDED" in listed and "cli-stopped" not in listed
    logs = ok(commands["logs"]).splitlines()
    assert logs and all("cli-run" in line for line in logs)
    assert any("recovery" in line or "launch spec written" in line for line in logs), logs[:5]
    console = ok(commands["node_log"])
    assert '{"agent": "starting torchrun"' in console.replace('{"agent":"', '{"agent": "')
    refused(commands["node_log_unknown"], "has no node", "i-0000000000000dead", "rank 0")


@pytest.mark.slow
def test_the_report_is_written_to_a_folder(commands):
    assert "report written:" in ok(commands["report"]) and "report.html" in commands["report"]["stdout"]
    files = commands["report"]["files"]
    assert {"report.html", "report.json", "report-loss.png", "report-throughput.png"} <= set(files)


@pytest.mark.slow
def test_stop_stops_a_running_run_and_its_teardown_follows(commands):
    assert "started run cli-stopped" in ok(commands["start_second"])
    stopped = ok(commands["stop"])
    assert "execution ABORTED" in stopped and "FAILED" in stopped
    assert commands["stopped_instances"] == ["terminated"]


@pytest.mark.slow
def test_bad_input_is_refused_in_one_line_and_changes_nothing(commands):
    refused(commands["start_again"], "cli-run", "was started before", "its execution RUNNING")
    refused(commands["start_missing"], "missing.json")
    refused(commands["start_broken"], "broken.json is not JSON")
    refused(commands["start_invalid"], "not a valid RunSpec", "node_count")
    refused(commands["start_outside_bucket"], "checkpoint.s3_uri", "another-bucket")
    refused(commands["stop_finished"], "cli-run is not running", "SUCCEEDED")
    refused(commands["status_unknown"], "no run named 'no-such-run'")
    refused(commands["report_unknown"], "no run named 'no-such-run'")
    refused(commands["list_unknown_stack"], "no stack 'no-such-stack'")
    listed = commands["list"]["stdout"]
    assert "cli-invalid" not in listed and "cli-outside" not in listed, "a refused start starts nothing"
