"""The stand-in trainer (trainer/standin.py) through the deployed state machine on the local cloud:
eight real node agents, no torch on them, node rank 1's instance killed after the first commit
(tests/agent_local_run.py standin-node-loss). The control plane cannot tell it from a real world:
the lost node alone is replaced, the new attempt resumes from the newest commit, checkpoints verify,
and the run completes with its books balanced and nothing left running."""

import pytest
from localcloud_helpers import run_scenario

FINAL_STEP, CHECKPOINT_EVERY, NODES = 60, 10, 8


@pytest.fixture(scope="module")
def run() -> dict:
    return run_scenario("agent_local_run.py", "standin-node-loss", timeout_s=600)["outcome"]


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
