"""The chaos cells beyond the matrix: a second failure during recovery, duplicated and
out-of-order events, the restart budget spent, a crash loop, StopExecution mid-training, a
starved machine, a Spot notice near the run's end (`make chaos`). See localcloud.chaos."""

import pytest
from chaos_cells import TOGETHER, cell_tests

from localcloud.chaos import EXTRAS

pytestmark = pytest.mark.chaos

outcomes, test_the_cell_holds_every_promise = cell_tests([cell.name for cell in EXTRAS], together=TOGETHER)


def test_a_healthy_run_on_a_starved_machine_books_no_failure(outcomes):
    outcome = outcomes["starved"]
    assert outcome["report"]["failures"] == [] and outcome["run"]["restarts"] == 0
    assert outcome["states"][-1] == "RunSucceeded"
