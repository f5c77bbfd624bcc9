"""A node lost when the zone has no capacity to replace it, end to end on the local cloud
(tests/handlers_capacity_run.py does the runs in a process of its own)."""

import json

import pytest
from localcloud_helpers import run_scenario

GONE = {"shutting-down", "terminated"}


@pytest.fixture(scope="module")
def outcome() -> dict:
    return run_scenario("handlers_capacity_run.py")


@pytest.mark.slow
def test_with_min_nodes_the_run_shrinks_onto_the_nodes_left_and_succeeds(outcome):
    run = outcome["shrunk"]
    assert run["status"] == "SUCCEEDED", run["cause"]
    assert run["states"] == ["Validate", "Allocate", "AwaitNodes", "Train", "Recover", "ReplacementsShort",
                             "Recover", "RecoveryBackoff", "AwaitNodes", "Train", "Teardown", "Report",
                             "Outcome", "RunSucceeded"]
    assert run["run"]["failures"] == ["INSTANCE_LOST", "CAPACITY"]
    # 3 nodes run no layout of this trainer, so 2 at pp=2 x dp=1; the global batch stays.
    assert run["run"]["plan"] == {"nodes": 2, "ranks_per_node": 1, "pp": 2, "dp": 1, "tp": 1}
    launch = run["last_launch"]
    assert (launch["attempt"], launch["nodes"], launch["batch_size"]) == (2, 2, 4)
    assert (launch["parallel"]["pp"], launch["parallel"]["dp"]) == (2, 1)
    assert set(run["instances"]) == set(run["first_ranks"]), "no instance launched after the loss"
    ranks = run["first_ranks"]
    roles = {ranks[instance_id]: node["role"] for instance_id, node in run["nodes"].items()}
    # Rank 1 is the lost one; rank 3, left out of the smaller world, was terminated, not kept as
    # an idle spare (the run wants none).
    assert roles == {0: "WORKER", 1: "WORKER", 2: "WORKER", 3: "WORKER"}
    first, resumed = run["survivor_launches"]
    first_attempt_commits = [line["committed_step"] for line in run["survivor_commits"] if line["attempt"] == 0]
    assert (first["resume_step"], resumed["attempt"]) == (None, 2)
    assert resumed["resume_step"] == max(first_attempt_commits)
    assert [line["committed_step"] for line in run["survivor_commits"] if line["attempt"] == 2] == list(
        range(resumed["resume_step"] + 10, 61, 10))
    assert (run["run"]["state"], run["run"]["latest_checkpoint"]) == ("SUCCEEDED", 60)
    assert set(run["instances"].values()) <= GONE, run["instances"]


@pytest.mark.slow
def test_without_min_nodes_the_run_gives_up_through_teardown(outcome):
    run = outcome["gave_up"]
    assert (run["status"], run["error"]) == ("FAILED", "RecoveryGaveUp")
    message = json.loads(run["cause"])["errorMessage"]
    assert "capacity short for" in message and "InsufficientInstanceCapacity" in message, message
    # The replacement is tried again and again, the fleet kept, until the run's wait is spent.
    states = run["states"]
    assert states[:6] == ["Validate", "Allocate", "AwaitNodes", "Train", "Recover", "ReplacementsShort"]
    assert states[-5:] == ["Recover", "Teardown", "Report", "Outcome", "RunFailed"]
    failures = run["run"]["failures"]
    assert failures[0] == "INSTANCE_LOST" and len(failures) >= 3 and set(failures[1:]) == {"CAPACITY"}
    assert run["run"]["state"] == "FAILED" and run["run"]["plan"]["nodes"] == 2
    assert set(run["instances"]) == set(run["first_ranks"])
    assert set(run["instances"].values()) <= GONE, run["instances"]
    assert {node["state"] for node in run["nodes"].values()} <= {"TERMINATING", "TERMINATED"}
