"""The chaos matrix, process faults: kill, freeze and hang at every phase (`make chaos`; not in
`make test`, whose subset is test_chaos_fast.py). See localcloud.chaos
for what each cell must show. The matrix is split in modules so that two pytest workers share it."""

import pytest
from chaos_cells import TOGETHER, cell_tests

from localcloud.chaos import MATRIX, Fault

pytestmark = pytest.mark.chaos

outcomes, test_the_cell_holds_every_promise = cell_tests(
    [cell.name for cell in MATRIX if cell.fault in (Fault.KILL, Fault.FREEZE, Fault.HANG)], together=TOGETHER)


def test_a_frozen_instance_is_a_hang_blamed_on_it_alone(outcomes):
    """No EC2 event, no word from its agent: the Train task's heartbeat stops, and Recover names
    the frozen node (status check impaired, agent silent) on this first failure."""
    outcome = outcomes["freeze@training"]
    (failure,) = outcome["report"]["failures"]
    (injection,) = outcome["injections"]
    assert failure["failure_class"] == "HANG"
    assert {instance: node["failure"] for instance, node in outcome["nodes"].items() if node["failure"]} == {
        injection["target"]: "HANG"}
