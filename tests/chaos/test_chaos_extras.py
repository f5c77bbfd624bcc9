"""The chaos cells beyond the matrix: a second failure during recovery, duplicated and
out-of-order events, the restart budget spent, a crash loop, StopExecution mid-training
(`make chaos`). See localcloud.chaos."""

import pytest
from chaos_cells import cell_tests

from localcloud.chaos import EXTRAS

pytestmark = pytest.mark.chaos

outcomes, test_the_cell_holds_every_promise = cell_tests([cell.name for cell in EXTRAS])
