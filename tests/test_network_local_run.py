"""One RunSpec on three networks through the deployed state machine (tests/network_local_run.py):
a subnet with no way to AWS is refused at Validate, naming it and the services; a network broken
under an accepted run leaves every node silent, and the run ends after its one boot timeout,
saying what no node did; on the stack's network, as it made it, the same run trains."""

import pytest
from localcloud_helpers import run_scenario


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_scenario("network_local_run.py")


@pytest.mark.slow
def test_a_subnet_without_a_way_to_aws_is_refused_at_validate_naming_it_and_the_services(runs):
    refused = runs["refused"]
    assert (refused["status"], refused["error"]) == ("FAILED", "InvalidRunSpec")
    # Its route table has no gateway endpoint; the VPC's interface endpoints serve every subnet.
    assert f"the nodes could not reach S3 (s3), DynamoDB (dynamodb) from {refused['subnet']}" in refused["cause"]
    assert "no gateway endpoint on its route table" in refused["cause"] and "EventBridge" not in refused["cause"]
    assert refused["instances"] == [], "nothing launched"


@pytest.mark.slow
def test_a_fleet_that_cannot_reach_aws_ends_the_run_after_one_boot_timeout_saying_what_no_node_did(runs):
    silent = runs["silent"]
    assert runs["silent_broken_before_boot"], "the network broke before any instance booted"
    assert silent["status"] == "FAILED"
    assert silent["record"]["failures"] == ["SETUP_FAILED"], "one boot timeout, no replacement"
    assert silent["record"]["error"].startswith("the run's set-up failed: States.Timeout: not one of the 2 nodes "
                                                "of attempt 0 reported within the boot timeout")
    assert set(silent["instances"]) == {"terminated"}
    assert silent["unreachable"].get("s3", 0) > 0, "the nodes' calls went nowhere, as on AWS"


@pytest.mark.slow
def test_the_same_run_on_the_stacks_network_trains(runs):
    trains = runs["trains"]
    assert trains["status"] == "SUCCEEDED", trains
    assert trains["record"]["last_step"] == trains["steps"] and trains["record"]["failures"] == []
