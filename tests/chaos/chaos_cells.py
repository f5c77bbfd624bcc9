"""Runs chaos cells (localcloud.chaos) in a process of their own: the local cloud imports the
deployed copy of `functions`, which this process must not have imported. One process, one local
stack, the cells one after another; each cell's outcome carries its `problems`."""

import json
import subprocess
import sys
from pathlib import Path

from localcloud.chaos import CELL_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]


def run_cells(names: list[str]) -> dict[str, dict]:
    """cell name -> outcome."""
    completed = subprocess.run([sys.executable, "-m", "localcloud.chaos", *names], cwd=REPO, capture_output=True,
                               text=True, timeout=CELL_TIMEOUT_S * len(names) + 300)
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


def cell_tests(names: list[str]) -> tuple:
    """A test module's fixture and test for these cells: one process runs them all (module scope),
    each cell is a test of its own that fails with what went wrong."""
    import pytest

    @pytest.fixture(scope="module")
    def outcomes() -> dict[str, dict]:
        return run_cells(names)

    # The first test waits for every cell (the module's fixture); pytest-timeout counts that.
    @pytest.mark.slow
    @pytest.mark.timeout(CELL_TIMEOUT_S * len(names) + 600)
    @pytest.mark.parametrize("cell", names)
    def test_the_cell_holds_every_promise(outcomes, cell):
        outcome = outcomes[cell]
        assert outcome["problems"] == [], verdict(outcome)

    return outcomes, test_the_cell_holds_every_promise
