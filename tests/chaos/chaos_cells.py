"""Runs chaos cells (localcloud.chaos) in a process of their own: the local cloud imports the
deployed copy of `functions`, which this process must not have imported. One process, one local
stack, the cells one after another or side by side; each cell's outcome carries its `problems`.
The process is waited for while it narrates (localcloud.waiting), never for a fixed time."""

import json
import sys
from pathlib import Path

from localcloud.waiting import run_captured

REPO = Path(__file__).resolve().parents[2]
TOGETHER = 3
"""Cells a module's process runs side by side (`make chaos` runs two modules at once): most of a
cell's time is a wait for the product to tell a fault (a hang timeout, a frozen node's boot
timeout, minutes), which one after another made the matrix of process faults alone run past 47
minutes. Cells whose faults reach every run run alone (localcloud.chaos Cell.faults_every_run)."""


def run_cells(names: list[str], together: int = 1) -> dict[str, dict]:
    """cell name -> outcome; `together` cells at once."""
    completed = run_captured([sys.executable, "-m", "localcloud.chaos", f"--together={together}", *names],
                             what=f"the chaos cells {names}", cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-8000:]
    outcomes = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    return {outcome["cell"]: outcome | {"narration": completed.stderr} for outcome in outcomes}


def verdict(outcome: dict) -> str:
    """What to read when a cell fails: its problems and how the run went."""
    said = [line for line in outcome["narration"].splitlines() if outcome["run_name"] in line or "during" in line]
    failures = [f"failure: {failure['failure_class']} {failure.get('instance_ids')}: {failure.get('message')}"
                for failure in outcome["report"]["failures"]]
    failures += [f"blamed: {instance_id}: {node['failure']}: {node['reason']}"
                 for instance_id, node in outcome["nodes"].items() if node["failure"]]
    return "\n".join(outcome["problems"] + [f"states: {outcome['states']}"] + failures + said[-40:])


def cell_tests(names: list[str], together: int = 1) -> tuple:
    """A test module's fixture and test for these cells: one process runs them all (module scope),
    `together` at once, each cell is a test of its own that fails with what went wrong."""
    import pytest

    @pytest.fixture(scope="module")
    def outcomes() -> dict[str, dict]:
        return run_cells(names, together)

    @pytest.mark.slow
    @pytest.mark.parametrize("cell", names)
    def test_the_cell_holds_every_promise(outcomes, cell):
        outcome = outcomes[cell]
        assert outcome["problems"] == [], verdict(outcome)

    return outcomes, test_the_cell_holds_every_promise
