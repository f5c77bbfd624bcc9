"""What a suite run took: its wall time, its ten slowest tests (from pytest's JUnit report), and a
warning when `make test` took longer than its budget. A warning, not a failure: the machine is
noisy, but a suite that grows slow is seen in the change that made it slow. `.ci/run` calls it
after `make test`; `.ci/repeat.py` reads the same report.

    python3 .ci/budget.py build/junit.xml SECONDS
"""

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

BUDGET_S = 8 * 60
"""`make test` from a fresh clone, its installs included, on 2 cores with nothing else running."""
SLOWEST = 10


def outcomes(report: Path) -> list[tuple[str, str, float]]:
    """(test, outcome, seconds) for every test of a JUnit report; a test's seconds include its
    setup, so the first test of a module that starts a local run carries the run."""
    found = []
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = "failed" if "failure" in kinds else "error" if "error" in kinds else \
            "skipped" if "skipped" in kinds else "passed"
        found.append((name, outcome, float(case.get("time") or 0)))
    return found


def main(report: Path, seconds: float) -> None:
    print(f"make test, installs included: {seconds:.0f} s")
    if report.exists():
        print(f"the {SLOWEST} slowest tests (seconds, setup included):")
        for name, _, took in sorted(outcomes(report), key=lambda outcome: -outcome[2])[:SLOWEST]:
            print(f"  {took:7.1f}  {name}")
    if seconds > BUDGET_S:
        print(f"WARNING: make test took {seconds:.0f} s, over its budget of {BUDGET_S} s (8 minutes on 2 cores, "
              f"installs included): TRAINFLEET_TEST_TIMELINE=/tmp/timeline make test && python3 .ci/timeline.py "
              f"/tmp/timeline shows where the time went")


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
