"""The chaos cells `make test` runs (the whole matrix is `make chaos`), side by side on one stack:
a node lost while a checkpoint uploads (the partial checkpoint must never be loaded), and a Spot
notice (nothing trained before it may be lost). See localcloud.chaos for the promises every cell
keeps; the tests below add what each of these faults must be recorded as. The starved machine (a
healthy run whose instances get a quarter of the CPU) is one of `make chaos`'s extras: here every
local run is already slowed by the suite's other workers on two cores."""

from chaos_cells import cell_tests

outcomes, test_the_cell_holds_every_promise = cell_tests(
    ["kill@checkpoint-write", "spot@training"], together=2)


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
    # relaunch, and a checkpoint they commit meanwhile is newer still and is the S3 resume point.
    assert failure["committed_step"] is not None and resumed >= failure["committed_step"]
    # The world resumed from the newest state, not older than that: the nodes' memory (the leaving
    # node's buddy stayed), or S3's newest commit where it is newer than every whole in-memory copy
    # (on a loaded machine copies slower than steps skip steps, and the save the notice asked for
    # can be the newer).
    assert failure["resume_step"] >= resumed, failure


def test_a_node_lost_mid_upload_resumes_from_the_commit_before(outcomes):
    outcome = outcomes["kill@checkpoint-write"]
    failure, victim = failure_and_victim(outcome)
    assert failure["failure_class"] == "INSTANCE_LOST" and outcome["nodes"][victim]["failure"] == "INSTANCE_LOST"

