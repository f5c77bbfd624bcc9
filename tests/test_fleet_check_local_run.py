"""The fleet-wide check through the deployed state machine on the local cloud: three workers and
a spare with real agents and the real trainer, one worker's network made slow before the world
first forms (tests/agent_local_run.py slow-node). The check names that node before a step is
trained, the spare takes its place, the new world passes and the run completes."""

import pytest
from localcloud_helpers import run_scenario


@pytest.fixture(scope="module")
def run() -> dict:
    return run_scenario("agent_local_run.py", "slow-node")["outcome"]


@pytest.mark.slow
def test_the_slow_node_is_named_and_replaced_by_the_spare_before_training(run):
    assert run["status"] == "SUCCEEDED", (run["error"], run["cause"])
    slow = run["slow"]
    failures = run["report"]["failures"]
    assert len(failures) == 1, failures
    (failure,) = failures
    assert failure["failure_class"] == "SLOW_NETWORK" and failure["resume_step"] is None
    blamed = {instance: node["failure"] for instance, node in run["nodes"].items() if node["failure"]}
    assert blamed == {slow: "SLOW_NETWORK"}
    (spare,) = [instance for instance, role in run["first_roles"].items() if role == "SPARE"]
    ranks = {launch["node_rank"]: instance for instance, launches in run["launches"].items() for launch in launches
             if launch["attempt"] == 1}
    assert sorted(ranks) == [0, 1, 2] and spare in ranks.values() and slow not in ranks.values()
    assert set(ranks.values()) <= set(run["first_roles"]), "the spare stepped in: no new worker was waited for"
    assert len(run["instances"]) == 5, "a new spare refilled the pool"


@pytest.mark.slow
def test_the_failed_world_trained_no_step_and_its_figures_name_the_slow_node(run):
    assert list(run["losses"]) == ["1"], ("the world that failed its check trained", run["report"]["failures"])
    said = [line for lines in run["fleet_checks"].values() for line in lines]
    failed = [line for line in said if line["agent"] == "fleet check failed"]
    assert len(failed) == 1 and failed[0]["attempt"] == 0
    assert f"slow: {run['slow']}" in failed[0]["figures"]
    assert [line["attempt"] for line in said if line["agent"] == "fleet check passed"] == [1]
    latest = run["fleet_check"]
    assert latest["attempt"] == 1 and latest["passed"] and latest["busbw_gbytes_per_s"] >= latest["floor_gbytes_per_s"]


@pytest.mark.slow
def test_every_instance_is_terminated(run):
    assert set(run["instances"].values()) == {"terminated"}
