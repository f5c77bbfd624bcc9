"""The scaling check through the deployed state machine on the local cloud: two nodes with real
agents and the real trainer (pp=2), both on a slow network, the fleet check off
(tests/agent_local_run.py poor-scaling). The world's first timed steps come out far slower than
its ranks' compute predicts, uniformly (no node to replace): the run ends there, failed, with the
figures and the slowest stage named, before it trains on, and every instance terminated."""

import pytest


@pytest.fixture(scope="module")
def run(local_run) -> dict:
    return local_run["outcome"]


@pytest.mark.slow
def test_a_world_that_does_not_scale_ends_the_run_with_its_figures(run):
    assert run["status"] == "FAILED" and run["states"][-1] == "RunFailed", run["states"]
    (failure,) = run["report"]["failures"]
    assert failure["failure_class"] == "POOR_SCALING" and failure["attempt"] == 0
    assert run["report"]["restarts"] == 0, "a world that does not scale is not retried"
    figures = run["report"]["scaling_check"]
    assert not figures["passed"] and figures["efficiency"] < figures["efficiency_floor"] == 0.5
    # The expected step holds the end of the step, whose all-reduce waits the slow network's delay too.
    assert figures["step_seconds"] > 2 * figures["expected_step_seconds"]
    assert figures["slowest_stages"] in ([0], [1]) and len(figures["slowest_stage_instance_ids"]) == 1
    assert figures["slow_instance_ids"] == [], "pp=2: no rank has a peer to be slower than; uniformly poor"
    assert "the fleet does not scale" in run["report"]["error"] and "slowest stage" in run["report"]["error"]


@pytest.mark.slow
def test_the_run_stops_after_the_timed_steps(run):
    (attempt,) = run["losses"].values()
    assert max(map(int, attempt)) <= 2 + 3 + 1, "warm-up and timed steps, and at most the step in flight"
    said = [line["agent"] for line in run["scaling_checks"]]
    assert said == ["scaling check failed"]


@pytest.mark.slow
def test_the_report_shows_the_scaling_check_and_every_instance_is_terminated(run):
    assert "POOR_SCALING" in run["report_page"] and "scaling" in run["report_page"].lower()
    assert set(run["instances"].values()) == {"terminated"}
