"""The chaos cells `make test` runs (the whole matrix is `make chaos`), side by side on one stack:
a node lost while a checkpoint uploads (the partial checkpoint must never be loaded), a Spot
notice (nothing trained before it may be lost), and a starved machine: a healthy run whose
instances get a quarter of the CPU beside the other two runs and whatever else the machine runs,
slow but never silent. See localcloud.chaos for the promises every cell keeps; the tests below add
what each of these faults must be recorded as. The starved run takes several times a healthy
one's wall time while using little CPU: beside the others, that time is not a worker's alone."""

from chaos_cells import cell_tests

outcomes, test_the_cell_holds_every_promise = cell_tests(
    ["kill@checkpoint-write", "spot@training", "starved"], together=3)


def failure_and_victim(outcome: dict) -> tuple[dict, str]:
    (failure,) = outcome["report"]["failures"]
    (injection,) = outcome["injections"]
    return failure, injection["target"]


def test_a_spot_notice_is_a_spot_interruption_of_its_node_resumed_from_the_checkpoint_it_asked_for(outcomes):
    outcome = outcomes["spot@training"]
    failure, victim = failure_and_victim(outcome)
    assert failure["failure_class"] == "SPOT_INTERRUPTION" and outcome["nodes"][victim]["failure"] == "SPOT_INTERRUPTION"
    assert [instance for instance, notices in outcome["spot_notices"].items() if notices] == [victim]
    (resumed,) = {line["resume_step"] for lines in outcome["launches"].values() for line in lines
                  if line["attempt"] == 1}
    # Recover books the checkpoint the notice asked for; the nodes left keep training until the
    # relaunch, and a checkpoint they commit meanwhile is newer still and is the one resumed.
    assert failure["resume_step"] is not None and resumed >= failure["resume_step"]


def test_a_node_lost_mid_upload_resumes_from_the_commit_before(outcomes):
    outcome = outcomes["kill@checkpoint-write"]
    failure, victim = failure_and_victim(outcome)
    assert failure["failure_class"] == "INSTANCE_LOST" and outcome["nodes"][victim]["failure"] == "INSTANCE_LOST"


def test_a_healthy_run_on_a_starved_machine_books_no_failure(outcomes):
    outcome = outcomes["starved"]
    assert outcome["report"]["failures"] == [] and outcome["run"]["restarts"] == 0
    assert outcome["states"][-1] == "RunSucceeded"
