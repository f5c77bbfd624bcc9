"""A lost node recovered from the nodes' host memory, through the deployed state machine on the
local cloud: three workers with real agents and the real trainer (pp=3) and a spare, an
in-memory checkpoint every step and an S3 one every 10; node rank 1's instance killed as soon as
step 10's commit reaches S3 (tests/agent_local_run.py memory-restore). Every object the local S3
serves is heard."""

import pytest
from localcloud_helpers import run_scenario


@pytest.fixture(scope="module")
def scenario() -> dict:
    return run_scenario("agent_local_run.py", "memory-restore")


@pytest.fixture(scope="module")
def run(scenario) -> dict:
    return scenario["outcome"]


@pytest.mark.slow
def test_the_spare_takes_the_lost_nodes_place_and_the_world_resumes_from_host_memory(run):
    assert run["status"] == "SUCCEEDED", (run["error"], run["cause"])
    (failure,) = run["report"]["failures"]
    assert failure["failure_class"] == "INSTANCE_LOST" and failure["instance_ids"] == [run["killed"]["victim"]]
    restored = run["restored"]
    assert (restored["attempt"], restored["source"], restored["fallback"]) == (1, "memory", None)
    # The newcomer's shard came from its buddy's memory, the survivors' from their own node's:
    # ranks follow the launch spec's node ranks, which survivors keep, not torchrun's order.
    assert (restored["own_memory"], restored["peers"], restored["shards"]) == (2, 1, 3)
    assert restored["peer_bytes"] > 0


@pytest.mark.slow
def test_at_most_one_step_is_redone_and_the_losses_are_bit_equal(scenario, run):
    assert run["killed"]["at"] and run["last_step_before"] > 10, "killed mid-interval, past the commit of step 10"
    assert run["last_step_before"] - run["restored"]["step"] <= 1
    assert run["first_step_after"] == run["restored"]["step"] + 1
    reference = {int(step): loss for step, loss in scenario["reference"].items()}
    for attempt, losses in run["losses"].items():
        assert {int(step): loss for step, loss in losses.items()} == {int(step): reference[int(step)]
                                                                      for step in losses}, attempt


@pytest.mark.slow
def test_no_checkpoint_state_is_read_from_s3_on_the_recovery_path(run):
    # From the kill to the first step after it, S3 serves the control plane the newest commit's
    # marker (the fallback resume point it records), and not one object of checkpoint state.
    read = set(run["reads_during_recovery"])
    assert read <= {"step-000000010/commit.json"}, read
