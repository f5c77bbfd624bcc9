"""The chaos cell `starved` (`make test` runs it): a healthy run whose instances get a quarter of
the CPU, beside whatever else the machine runs. Slow, never silent: it must succeed with no
failure booked and no restart (localcloud.chaos). A module of its own: its run takes several
times a healthy one's wall time while using little CPU, which another worker's files fill."""

from chaos_cells import cell_tests

outcomes, test_the_cell_holds_every_promise = cell_tests(["starved"])


def test_a_healthy_run_on_a_starved_machine_books_no_failure(outcomes):
    outcome = outcomes["starved"]
    assert outcome["report"]["failures"] == [] and outcome["run"]["restarts"] == 0
    assert outcome["states"][-1] == "RunSucceeded"
