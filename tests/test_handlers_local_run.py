"""The deployed app end to end on the local cloud (tests/handlers_local_run.py does the runs in
a process of its own; see its docstring for why)."""

import json

import pytest
from localcloud_helpers import run_scenario



@pytest.fixture(scope="module")
def outcome() -> dict:
    return run_scenario("handlers_local_run.py")


@pytest.mark.slow
def test_a_lost_node_is_replaced_alone_and_training_resumes_from_the_latest_checkpoint(outcome):
    run = outcome["recovered"]
    assert run["status"] == "SUCCEEDED"
    assert run["states"] == ["Validate", "Allocate", "AwaitNodes", "Train", "Recover", "RecoveryBackoff",
                             "AwaitNodes", "Train", "Teardown", "Report", "Outcome", "RunSucceeded"]
    killed, survivor = run["killed"], run["survivor"]
    replacements = set(run["nodes"]) - set(run["first_nodes"])
    assert len(replacements) == 1, "exactly one new instance, for the lost one"
    (replacement,) = replacements
    assert run["nodes"][killed]["failure"] == "INSTANCE_LOST"
    assert run["nodes"][replacement] | {"state": None} == {"state": None, "attempt": 1, "rank": 1, "failure": None}
    assert run["nodes"][survivor]["failure"] is None and run["nodes"][survivor]["rank"] == 0
    # The survivor was launched twice: from scratch, then from the newest checkpoint the first
    # attempt committed to S3.
    first, second = run["survivor_launches"]
    assert (first["attempt"], first["resume_step"]) == (0, None)
    first_attempt_commits = [line["committed_step"] for line in run["survivor_commits"] if line["attempt"] == 0]
    assert second["attempt"] == 1 and second["resume_step"] == max(first_attempt_commits)
    assert [line["committed_step"] for line in run["survivor_commits"] if line["attempt"] == 1] == list(
        range(second["resume_step"] + 10, 61, 10))
    assert run["committed_steps"] == list(range(10, 61, 10))
    assert run["run"] == {"state": "SUCCEEDED", "attempt": 1, "restarts": 1, "latest_checkpoint": 60}
    report = run["report"]
    assert (report["state"], report["restarts"]) == ("SUCCEEDED", 1)
    # The simulated agents report no steps: every second from the run's creation to Teardown is
    # start-up, of the first attempt or of the one after the lost node.
    assert set(report["lost_by_cause"]) == {"startup", "restart:INSTANCE_LOST"}
    assert report["unaccounted_seconds"] == pytest.approx(0, abs=1e-3)


@pytest.mark.slow
def test_teardown_leaves_no_instance_running(outcome):
    run = outcome["recovered"]
    assert set(run["instances"].values()) <= {"shutting-down", "terminated"}, run["instances"]
    assert len(run["instances"]) == 3
    assert {node["state"] for node in run["nodes"].values()} <= {"TERMINATING", "TERMINATED"}


@pytest.mark.slow
def test_a_bad_run_spec_fails_at_validate_naming_the_field_and_creates_nothing(outcome):
    rejected = outcome["invalid"]
    assert rejected["status"] == "FAILED"
    assert rejected["error"] == "InvalidRunSpec"
    assert rejected["states"] == ["Validate"]
    message = json.loads(rejected["cause"])["errorMessage"]
    assert "node_count=3" in message and "trainer.parallel.pp x dp" in message
    assert rejected["instances_after"] == rejected["instances_before"] == 0


@pytest.mark.slow
def test_a_model_the_trainer_refuses_fails_at_validate_with_the_trainers_message(outcome):
    refused = outcome["refused_by_trainer"]
    assert (refused["status"], refused["error"], refused["states"]) == ("FAILED", "InvalidRunSpec", ["Validate"])
    assert json.loads(refused["cause"])["errorMessage"] == "trainer: model.n_heads=3 must divide model.d_model=64"
    assert refused["instances"] == 0


@pytest.mark.slow
def test_a_stopped_execution_leaves_no_instance_running(outcome):
    """StopExecution runs no Catch; the status-change event's reaper terminates the fleet."""
    stopped = outcome["stopped"]
    print(f"StopExecution to the last instance terminated: {stopped['stop_to_terminated_s']} s "
          f"({stopped['launched']} instances, local cloud at time_scale 0.02)")
    assert stopped["status"] == "ABORTED"
    assert stopped["launched"] == 2 and set(stopped["instances"].values()) == {"terminated"}
    assert stopped["run"] == {"state": "STOPPED", "error": None}
    assert stopped["report"] == [f"runs/{stopped['name']}/report.json"]


@pytest.mark.slow
def test_a_node_of_one_run_can_read_write_or_end_nothing_of_another(outcome):
    """A node of the stopped run, with its own instance's credentials, while the recovered run
    trains: what it may do on its own run it is refused on the other, and what IAM lets it
    send (events about the other run, as itself) changes nothing there."""
    hostile = outcome["hostile"]
    attempts = {key.split(": ", 1)[1] for key in hostile if key.startswith("own: ")}
    assert len(attempts) == 8
    for attempt in attempts:
        assert hostile[f"own: {attempt}"] == "accepted", attempt
        assert hostile[f"other: {attempt}"] in ("AccessDenied", "AccessDeniedException"), attempt
    assert hostile["other: send as the other run's node"] == "AccessDeniedException"
    assert hostile["attacker_status"] == "SUCCEEDED"
    assert hostile["other: end the other run"] == hostile["other: blame the other run's node"] == "accepted"
    run = outcome["recovered"]
    assert run["status"] == "SUCCEEDED" and run["run"]["restarts"] == 1
    blamed = {instance: node["failure"] for instance, node in run["nodes"].items() if node["failure"]}
    assert blamed == {run["killed"]: "INSTANCE_LOST"}, "only the node the test killed"
