"""The chaos matrix, announced and control-plane faults: a Spot notice, an AWS Health event and
the whole control plane throttling, at every phase (`make chaos`). See localcloud.chaos."""

import pytest
from chaos_cells import TOGETHER, cell_tests

from localcloud.chaos import MATRIX, Fault

pytestmark = pytest.mark.chaos

outcomes, test_the_cell_holds_every_promise = cell_tests(
    [cell.name for cell in MATRIX if cell.fault in (Fault.SPOT, Fault.HEALTH, Fault.THROTTLE)], together=TOGETHER)
