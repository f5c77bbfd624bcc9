"""The chaos matrix, process faults: kill, freeze and hang at every phase (`make chaos`; not in
`make test`, whose fast subset is test_chaos_fast.py). See localcloud.chaos for what each cell
must show. The matrix is split in modules so that two pytest workers share it."""

import pytest
from chaos_cells import cell_tests

from localcloud.chaos import MATRIX, Fault

pytestmark = pytest.mark.chaos

outcomes, test_the_cell_holds_every_promise = cell_tests(
    [cell.name for cell in MATRIX if cell.fault in (Fault.KILL, Fault.FREEZE, Fault.HANG)])
