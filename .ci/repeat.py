"""The whole suite N times, each from a fresh clone of HEAD as CI runs it (`bash .ci/run`), one
after another: how long each took with its installs, which tests failed in any run and how often,
and the slowest tests. A test that fails once in N is a defect to find, not luck to wait out.

    make test-repeat N=3          (python3 .ci/repeat.py 3 [--keep DIR])
"""

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_once(folder: Path) -> tuple[float, int, list[tuple[str, str, float]]]:
    """Clone HEAD into `folder` and run CI there: (seconds, exit status, [(test, outcome, seconds)])."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(folder)], check=True)
    report = folder / "junit.xml"
    started = time.monotonic()
    with (folder / "ci.log").open("w") as log:
        status = subprocess.run(["bash", ".ci/run"], cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTEST_ADDOPTS": f"--junitxml={report}"}).returncode
    seconds = time.monotonic() - started
    return seconds, status, _outcomes(report) if report.exists() else []


def _outcomes(report: Path) -> list[tuple[str, str, float]]:
    found = []
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = "failed" if "failure" in kinds else "error" if "error" in kinds else \
            "skipped" if "skipped" in kinds else "passed"
        found.append((name, outcome, float(case.get("time") or 0)))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=int, nargs="?", default=3)
    parser.add_argument("--keep", type=Path, help="clone into this folder (its logs stay), not a temporary one")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="test-repeat-"))
    failures: collections.Counter[str] = collections.Counter()
    durations: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
    statuses = []
    for run in range(1, args.runs + 1):
        seconds, status, outcomes = run_once(root / f"run-{run}")
        statuses.append(status)
        failed = [name for name, outcome, _ in outcomes if outcome in ("failed", "error")]
        failures.update(failed)
        for name, _, took in outcomes:
            durations[name].append(took)
        print(f"run {run}: {'green' if status == 0 else f'RED (exit {status})'} in {seconds / 60:.1f} min, "
              f"{len(outcomes)} tests, {len(failed)} failed (log: {root / f'run-{run}' / 'ci.log'})", flush=True)
    print(f"\nfailures per test over {args.runs} runs:" if failures else f"\nno test failed in {args.runs} runs")
    for name, count in failures.most_common():
        print(f"  {count}/{args.runs}  {name}")
    print("\nslowest tests (mean seconds over the runs):")
    for name, took in sorted(durations.items(), key=lambda item: -sum(item[1]) / len(item[1]))[:10]:
        print(f"  {sum(took) / len(took):7.1f}  {name}")
    return 0 if not any(statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
