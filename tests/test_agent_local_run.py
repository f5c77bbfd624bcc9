"""Real node agents and the real trainer through the deployed state machine on the local cloud
(tests/agent_local_run.py runs each scenario in a process of its own; see its docstring): two
nodes at pp=2, node rank 1's instance killed after the first committed checkpoint; and a trainer
config the trainer refuses."""

from datetime import datetime

import pytest
from localcloud_helpers import run_scenario

FINAL_STEP, CHECKPOINT_EVERY = 60, 10  # events/local-demo-run.json


def agent_scenario(name: str) -> dict:
    return run_scenario("agent_local_run.py", name)


@pytest.fixture(scope="module")
def scenario() -> dict:
    return agent_scenario("node-loss")


@pytest.fixture(scope="module")
def run(scenario) -> dict:
    return scenario["outcome"]


def by_attempt(losses: dict[str, dict[str, float]]) -> dict[int, dict[int, float]]:
    return {int(attempt): {int(step): loss for step, loss in steps.items()} for attempt, steps in losses.items()}


@pytest.mark.slow
def test_only_the_lost_node_is_replaced_and_the_run_succeeds(run):
    assert run["status"] == "SUCCEEDED"
    # A failure besides the one injected names itself: its class, message and nodes.
    assert run["states"] == ["Validate", "Allocate", "AwaitNodes", "Train", "Recover", "RecoveryBackoff",
                             "AwaitNodes", "Train", "Teardown", "Report", "Outcome", "RunSucceeded"], (
        run["report"]["failures"], run["nodes"])
    loss = run["disrupted"]
    killed, survivor = loss["victim"], loss["survivor"]
    assert loss["first_nodes"] == {killed: 1, survivor: 0}
    (replacement,) = set(run["nodes"]) - set(loss["first_nodes"])
    assert run["nodes"][killed]["failure"] == "INSTANCE_LOST"
    assert run["nodes"][survivor] | {"state": None} == {"state": None, "attempt": 0, "rank": 0, "failure": None,
                                                     "reason": None}
    assert run["nodes"][replacement] | {"state": None} == {"state": None, "attempt": 1, "rank": 1, "failure": None,
                                                        "reason": None}
    assert run["run"] == {"state": "SUCCEEDED", "attempt": 1, "restarts": 1, "latest_checkpoint": FINAL_STEP}


@pytest.mark.slow
def test_the_report_accounts_for_every_second_of_the_run_by_cause(run):
    report = run["report"]
    causes = set(report["ledger"]["lost_by_cause"])
    assert {"startup", "restart:INSTANCE_LOST"} <= causes <= {
        "startup", "restart:INSTANCE_LOST", "redone:INSTANCE_LOST", "finishing"}, causes
    assert report["ledger"]["productive_seconds"] > 0
    assert report["unaccounted_seconds"] == pytest.approx(0, abs=1e-3)


@pytest.mark.slow
def test_every_agent_passed_preflight_with_the_checks_that_apply_here(run):
    # The first report is the preflight's; the survivor then confirms it is ready for attempt 1.
    survivor = run["disrupted"]["survivor"]
    assert [(report["agent"], report["attempt"]) for report in run["preflight"][survivor]] == [
        ("sent NodeReady", 0), ("sent NodeReady", 1)]
    for instance_id, reports in run["preflight"].items():
        report = reports[0]
        assert report["agent"] == "sent NodeReady", (instance_id, report)
        checks = {check["name"]: check for check in report["checks"]}
        assert checks["gloo_allreduce"]["passed"] is True
        for skipped in ("accelerator_count", "efa_devices", "allreduce_busbw"):  # c5.large: no GPU, no EFA
            assert checks[skipped]["skipped"] is True and checks[skipped]["passed"] is False
            assert checks[skipped]["detail"]


def resume_point(run: dict, survivor: str, lost: str, replacement: str) -> int:
    """The step the new attempt's launch names in S3, after checking every node's launches: the
    survivor's torchrun, started once, was ordered into the repaired world of attempt 1 with the
    process it had; the replacement started its own."""
    launches = {instance: [(launch["attempt"], launch["node_rank"], launch["resume_step"]) for launch in found]
                for instance, found in run["launches"].items()}
    (_, _, resumed), = launches[replacement]
    assert launches == {survivor: [(0, 0, None)], lost: [(0, 1, None)], replacement: [(1, 1, resumed)]}
    (started,), (repaired,) = run["launches"][survivor], run["repairs"][survivor]
    assert (repaired["attempt"], repaired["generation"], repaired["pid"]) == (1, 1, started["pid"])
    return resumed


def check_resumed_from_the_latest_commit(run: dict, resumed: int) -> None:
    """The launch's resume point in S3 is a checkpoint attempt 0 took, at least the newest the
    control plane knew when it decided to recover. (Which step that is depends on timing: the lost
    node may have been the one announcing commits, and an announcement sent after the run moved on
    is ignored.) The world resumed later still, from the nodes' memory: node rank 1's share came
    from node rank 0's."""
    (failure,) = run["report"]["failures"]
    trained = by_attempt(run["losses"])[0]
    assert resumed % CHECKPOINT_EVERY == 0 and resumed in trained
    assert failure["committed_step"] is not None and resumed >= failure["committed_step"]
    assert failure["from_memory"] and resumed <= failure["resume_step"] <= failure["last_step"]
    assert failure["recovery"] == "repaired in place"
    # Announced at the agent's looks (one S3 listing each, every few seconds): a commit that
    # retention (keep_last 3) pruned before the next look is never announced.
    announced = [step for attempt, step in run["commits"] if attempt == 1]
    assert announced == sorted(announced) and announced[-1:] == [FINAL_STEP]
    assert set(announced) <= set(range(resumed + CHECKPOINT_EVERY, FINAL_STEP + 1, CHECKPOINT_EVERY))


@pytest.mark.slow
def test_the_new_attempt_resumes_from_the_latest_checkpoint_the_first_committed(run):
    loss = run["disrupted"]
    (replacement,) = set(run["nodes"]) - set(loss["first_nodes"])
    resumed = resume_point(run, loss["survivor"], loss["victim"], replacement)
    check_resumed_from_the_latest_commit(run, resumed)


@pytest.mark.slow
def test_losses_after_the_resume_are_those_of_an_uninterrupted_run(scenario):
    losses = by_attempt(scenario["outcome"]["losses"])
    reference = {int(step): loss for step, loss in scenario["reference"].items()}
    assert sorted(reference) == list(range(1, FINAL_STEP + 1))
    # Global rank 0's node survived and kept its trainer, which wrote every step to the files of
    # the launch it started in (a step redone after the repair, again).
    (steps,) = losses.values()
    assert sorted(steps) == list(range(1, FINAL_STEP + 1))
    # Bit for bit: the same layout, the same data order, the state restored exactly.
    assert steps == {step: reference[step] for step in steps}


@pytest.mark.slow
def test_teardown_leaves_no_instance_running(run):
    assert len(run["instances"]) == 3
    assert set(run["instances"].values()) == {"terminated"}, run["instances"]
    assert {node["state"] for node in run["nodes"].values()} <= {"TERMINATING", "TERMINATED"}


@pytest.mark.slow
def test_the_demo_writes_the_report_and_it_shows_the_kill_and_the_resume(run):
    assert {"report.html", "report.json", "report-loss.png", "report-throughput.png", "report-timeline.png",
            "report-goodput.png"} <= set(run["report_files"])
    page = run["report_html"]
    (failure,) = run["report"]["failures"]
    trained = by_attempt(run["losses"])[0]
    assert failure["last_step"] is not None and failure["resume_step"] <= failure["last_step"] <= max(trained)
    assert "INSTANCE_LOST after step " in page and f"resume from step {failure['resume_step']}" in page
    assert run["disrupted"]["victim"] in page, "the node replaced"
    assert failure["detection_seconds"] is not None and 0 <= failure["detection_seconds"] < 30
    assert run["report"]["steps_lost"] >= 0
    # Each step with the attempt that trained it (the survivor kept its trainer, and its agent
    # reported attempt 0's last steps as attempt 0's), nothing unknown: every step was reported.
    first, second = run["report"]["progress"]
    assert (first["attempt"], first["steps"], first["unknown_steps"]) == (0, [1, failure["last_step"]], None)
    assert (second["attempt"], second["steps"], second["unknown_steps"]) == (
        1, [failure["resume_step"] + 1, FINAL_STEP], None)
    assert datetime.fromisoformat(second["from"]) > datetime.fromisoformat(failure["decided_at"]), (
        "attempt 1's steps after it began")
    assert first["reporter"] == second["reporter"] == run["disrupted"]["survivor"]


@pytest.mark.slow
def test_the_demo_exports_its_final_model_and_it_writes_text(run):
    exported = run["exported"]
    config = exported["config"]
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["trainfleet"]["step"] == FINAL_STEP
    assert config["trainfleet"]["saved_layout"]["pp"] == 2
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors",
            "tokenizer.json", "tokenizer_config.json"} == set(exported["files"])
    assert exported["sample"], "the model writes after the prompt"
