"""READY spares through the deployed state machine on the local cloud: three workers with real
agents and the real trainer (pp=3) and a spare, an in-memory checkpoint every step and an S3 one
every 10 (tests/agent_local_run.py spares). One worker's network is made slow before the world
first forms: the fleet check names it before a step is trained and the spare takes its place.
Then node rank 1's instance is killed once step 10's commit reaches S3 and a later step is
trained, mid-interval: the spare that refilled the pool takes its place, the world is repaired in
place (the survivors keep their trainers' processes) and resumes from the nodes' host memory.
Every object the local S3 serves is heard."""

import pytest

from trainer.checkpoint_catalog import MARKER_NAME, step_dir_name


@pytest.fixture(scope="module")
def scenario(local_run) -> dict:
    return local_run


@pytest.fixture(scope="module")
def run(scenario) -> dict:
    return scenario["outcome"]


# --- the slow node, named by the fleet check -----------------------------------------------------

@pytest.mark.slow
def test_the_slow_node_is_named_and_replaced_by_the_spare_before_training(run):
    assert run["status"] == "SUCCEEDED", (run["error"], run["cause"])
    slow = run["slow"]
    slow_network, lost = run["report"]["failures"]
    assert slow_network["failure_class"] == "SLOW_NETWORK" and slow_network["resume_step"] is None
    assert slow_network["attempt"] == 0 and lost["attempt"] == 1
    blamed = {instance: node["failure"] for instance, node in run["nodes"].items() if node["failure"]}
    assert blamed == {slow: "SLOW_NETWORK", run["killed"]["victim"]: "INSTANCE_LOST"}
    (spare,) = [instance for instance, role in run["first_roles"].items() if role == "SPARE"]
    ranks = {launch["node_rank"]: instance for instance, launches in run["launches"].items() for launch in launches
             if launch["attempt"] == 1}
    assert sorted(ranks) == [0, 1, 2] and spare in ranks.values() and slow not in ranks.values()
    assert set(ranks.values()) <= set(run["first_roles"]), "the spare stepped in: no new worker was waited for"


@pytest.mark.slow
def test_the_failed_world_trained_no_step_and_its_figures_name_the_slow_node(run):
    assert "0" not in run["losses"], ("the world that failed its check trained", run["report"]["failures"])
    said = [line for lines in run["fleet_checks"].values() for line in lines]
    failed = [line for line in said if line["agent"] == "fleet check failed"]
    assert len(failed) == 1 and failed[0]["attempt"] == 0
    assert f"slow: {run['slow']}" in failed[0]["figures"]
    # The world repaired in place in attempt 2 is not checked again: its survivors are training.
    assert [line["attempt"] for line in said if line["agent"] == "fleet check passed"] == [1]
    latest = run["fleet_check"]
    assert latest["attempt"] == 1 and latest["passed"] and latest["busbw_gbytes_per_s"] >= latest["floor_gbytes_per_s"]


# --- the lost node, restored from its buddy's memory ---------------------------------------------

@pytest.mark.slow
def test_the_lost_nodes_place_is_taken_and_the_world_resumes_from_host_memory(run):
    (_, lost) = run["report"]["failures"]
    assert lost["failure_class"] == "INSTANCE_LOST" and lost["instance_ids"] == [run["killed"]["victim"]]
    restored = run["restored"]
    assert (restored["attempt"], restored["source"], restored["fallback"]) == (2, "memory", None)
    # The newcomer's shard came from its buddy's memory, the survivors' from their own node's:
    # ranks follow the launch spec's node ranks, which survivors keep, not torchrun's order.
    assert (restored["own_memory"], restored["peers"], restored["shards"]) == (2, 1, 3)
    assert restored["peer_bytes"] > 0
    ranks = {line["node_rank"]: instance for instance, lines in run["repairs"].items() for line in lines
             if line["attempt"] == 2}
    survivors = {instance: rank for instance, rank in run["killed"]["ranks"].items() if instance != run["killed"]["victim"]}
    assert {instance: rank for rank, instance in ranks.items()} == survivors


@pytest.mark.slow
def test_the_survivors_keep_their_trainer_processes_and_the_spare_joins_their_repaired_world(run):
    survivors = {instance for instance in run["killed"]["ranks"] if instance != run["killed"]["victim"]}
    (_, lost) = run["report"]["failures"]
    assert lost["recovery"] == "repaired in place" and "repair the world in place (generation 1)" in lost["decision"]
    for instance in survivors:
        (started,) = [launch for launch in run["launches"][instance] if launch["attempt"] >= 1]
        (repair,) = run["repairs"][instance]
        assert (started["attempt"], repair["attempt"], repair["generation"]) == (1, 2, 1)
        assert repair["pid"] == started["pid"], "the same torchrun, and under it (no restarts) the same ranks"
        assert run["repaired_trainers"][instance] == 1, "its rank formed generation 1 in the process it had"
    (joined,) = [instance for instance, launches in run["launches"].items()
                 if any(launch["attempt"] == 2 for launch in launches)]
    assert joined not in survivors and run["killed"]["ranks"].get(joined) is None
    (launch,) = [launch for launch in run["launches"][joined] if launch["attempt"] == 2]
    assert launch["node_rank"] == 1 and "--standalone" in launch["command"]


@pytest.mark.slow
def test_at_most_one_step_is_redone_and_the_losses_are_bit_equal(scenario, run):
    assert run["last_step_before"] > 10, "killed mid-interval, past the commit of step 10"
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
    # (Uploads of the failed world's save may end meanwhile: writes, which are not heard as reads,
    # tests/test_localcloud_s3_requests.py.)
    read = set(run["reads_during_recovery"])
    assert read <= {f"{step_dir_name(run['newest_commit_at_kill'])}/{MARKER_NAME}"}, read


@pytest.mark.slow
def test_every_instance_is_terminated(run):
    assert set(run["instances"].values()) == {"terminated"}
