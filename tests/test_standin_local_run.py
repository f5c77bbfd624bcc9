"""The stand-in trainer (node/standin.py) through the deployed state machine on the local cloud,
driven with `trainfleet run` (tests/cli_local_run.py): four real node agents, no torch on them,
node rank 1's instance killed after the first commit while `watch` follows the run.

The control plane cannot tell it from a real world: the lost node alone is replaced, the new
attempt resumes from the newest commit, checkpoints verify, and the run completes with its books
balanced and nothing left running. The commands, each a process of its own pointed at the local
cloud by the environment: start, status, watch, list, logs, a node's console, report, stop; and a
one-line error, exit 1 and no change for every bad input."""

import json
import re

import pytest
from localcloud_helpers import run_scenario

FINAL_STEP, CHECKPOINT_EVERY, NODES = 60, 10, 4


@pytest.fixture(scope="module")
def scenario() -> dict:
    return run_scenario("cli_local_run.py")


@pytest.fixture(scope="module")
def run(scenario) -> dict:
    return scenario["outcome"]


@pytest.fixture(scope="module")
def commands(scenario) -> dict:
    return scenario["commands"]


# --- the control plane ----------------------------------------------------------------------

@pytest.mark.slow
def test_the_lost_node_alone_is_replaced_and_the_run_completes(run):
    assert run["status"] == "SUCCEEDED", (run["error"], run["cause"])
    assert run["run"] == {"state": "SUCCEEDED", "attempt": 1, "restarts": 1, "latest_checkpoint": FINAL_STEP}
    loss = run["disrupted"]
    assert len(loss["first_nodes"]) == NODES
    blamed = {instance: node["failure"] for instance, node in run["nodes"].items() if node["failure"]}
    assert blamed == {loss["victim"]: "INSTANCE_LOST"}
    (replacement,) = set(run["nodes"]) - set(loss["first_nodes"])
    assert run["nodes"][replacement]["attempt"] == 1
    ranks = {launch["node_rank"]: instance for instance, launches in run["launches"].items() for launch in launches
             if launch["attempt"] == 1}
    assert sorted(ranks) == list(range(NODES)) and replacement in ranks.values() and loss["victim"] not in ranks.values()


@pytest.mark.slow
def test_every_node_of_the_new_attempt_resumes_from_the_newest_commit(run):
    (failure,) = run["report"]["failures"]
    resumed = {launch["resume_step"] for launches in run["launches"].values() for launch in launches
               if launch["attempt"] == 1}
    (step,) = resumed
    assert step % CHECKPOINT_EVERY == 0 and step >= failure["resume_step"]
    assert [commit for attempt, commit in run["commits"] if attempt == 1] == list(
        range(step + CHECKPOINT_EVERY, FINAL_STEP + 1, CHECKPOINT_EVERY))


@pytest.mark.slow
def test_the_books_balance_and_nothing_is_left_running(run):
    assert run["report"]["unaccounted_seconds"] == pytest.approx(0, abs=1e-3)
    assert set(run["instances"].values()) == {"terminated"} and len(run["instances"]) == NODES + 1


# --- the commands ---------------------------------------------------------------------------

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
def test_a_run_is_started_looked_at_while_it_trains_and_followed_to_its_end(commands, run):
    assert "started run cli-run: arn:aws:states:" in ok(commands["start"])
    training = ok(commands["status_training"])
    assert "run cli-run" in training and "TRAINING" in training and "step" in training
    assert "loss" in training and "tokens/s" in training and "goodput" in training
    assert re.search(r"cost\s+\$", training)
    assert f"workers {NODES} READY" in training
    # The step shown is never behind the checkpoint beside it: a committed step was trained.
    shown, committed = re.search(r"step (\d+) of", training), re.search(r"checkpoint\s+step (\d+)", training)
    assert shown and (committed is None or int(shown[1]) >= int(committed[1])), training
    watched = ok(commands["watch"])
    assert "SUCCEEDED" in watched and "execution SUCCEEDED" in watched and f"step {FINAL_STEP} of {FINAL_STEP}" in watched
    assert f"replaced {run['disrupted']['victim']} (INSTANCE_LOST)" in watched
    assert "INSTANCE_LOST ended attempt 0, detected after" in watched
    done = ok(commands["status_done"])
    assert "SUCCEEDED" in done and f"{NODES + 1} terminated" in done


@pytest.mark.slow
def test_list_logs_and_a_nodes_log(commands):
    listed = ok(commands["list"])
    assert "cli-run" in listed and "SUCCEEDED" in listed and "cli-stopped" not in listed
    # One line each, as a person reads it: time, function, level, message. Nothing of a run that
    # succeeded is an error (what the state machine retried and then got past is a warning).
    logs = ok(commands["logs"]).splitlines()
    line = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Za-z]+ (INFO|WARNING|ERROR) \S")
    assert logs and all(line.match(text) and len(text) < 1000 for text in logs), logs[:5]
    assert any(" Recover INFO recovery decided" in text for text in logs)
    assert any(" Launch INFO launch spec written" in text for text in logs)
    assert not [text for text in logs if " ERROR " in text]
    assert not [text for text in logs if "TransientError" in text and "(retried, then succeeded)" not in text]
    raw = [json.loads(text) for text in ok(commands["logs_json"]).splitlines()]
    assert raw and all("cli-run" in event["message"] for event in raw)
    assert any(event["message"].startswith('{"_aws"') for event in raw), "--json: every record, metrics too"
    # The node's log is its stream in CloudWatch Logs: its agent's lines and its trainer's output,
    # and no warning the user cannot act on.
    node_log = ok(commands["node_log"]).splitlines()
    assert not any("shipped no log" in text for text in node_log)
    assert any(" agent INFO starting torchrun attempt=" in text for text in node_log)
    assert any(" trainer INFO " in text for text in node_log)
    assert not [text for text in node_log if "RuntimeWarning" in text]
    refused(commands["node_log_unknown"], "has no node", "i-0000000000000dead", "rank 0")


@pytest.mark.slow
def test_the_report_is_written_to_a_folder_and_shows_the_kill(commands, run):
    assert "report written:" in ok(commands["report"]) and "report.html" in commands["report"]["stdout"]
    assert {"report.html", "report.json", "report-loss.png", "report-throughput.png", "report-timeline.png",
            "report-goodput.png"} <= set(commands["report"]["files"])
    page = commands["report"]["page"]
    (failure,) = run["report"]["failures"]
    assert "INSTANCE_LOST after step" in page and f"resume from step {failure['resume_step']}" in page


@pytest.mark.slow
def test_stop_stops_a_running_run_and_its_teardown_follows(commands):
    assert "started run cli-stopped" in ok(commands["start_second"])
    stopped = ok(commands["stop"])
    assert "stopped run cli-stopped" in stopped and "execution ABORTED" in stopped
    assert "STOPPED" in stopped and "FAILED" not in stopped and "error" not in stopped
    assert "run cli-stopped torn down: every instance terminated" in stopped
    assert commands["stopped_instances"] == ["terminated"]
    status = ok(commands["status_stopped"])
    assert "STOPPED" in status and "TERMINATING" not in status and "error" not in status


@pytest.mark.slow
def test_a_run_resumed_from_a_stopped_one_starts_at_its_newest_commit_and_leaves_its_checkpoints_alone(commands):
    """`trainfleet run start --resume-from`: the new run's nodes read the stopped run's newest commit
    with their own role (tagged with it), train to the end, save under their own run, and neither
    write nor prune a file of the stopped run's; the report names and links the run it resumed."""
    resumed = commands["resumed"]
    assert "started run cli-resumed" in ok(commands["start_resumed"])
    outcome = resumed["outcome"]
    assert outcome["status"] == "SUCCEEDED", outcome
    report = outcome["report"]
    assert report["resumed_from"] == "cli-stopped"
    started_at = {launch["resume_step"] for launches in outcome["launches"].values() for launch in launches}
    assert started_at == {resumed["stopped_commit"]} and resumed["stopped_commit"] > 0, started_at
    assert resumed["stopped_files_after"] == resumed["stopped_files_before"]
    assert outcome["commits"] and min(step for _, step in outcome["commits"]) > resumed["stopped_commit"]


@pytest.mark.slow
def test_bad_input_is_refused_in_one_line_and_changes_nothing(commands):
    refused(commands["start_resume_itself"], "resume_from: a run resumes another run, not itself")
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
