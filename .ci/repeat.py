"""The whole suite N times, each from a fresh clone of HEAD as CI runs it (`bash .ci/run`), one
after another: how long each took with its installs, which tests failed in any run and how often,
and the slowest tests. A test that fails once in N is a defect to find, not luck to wait out.

With --loaded each run is `make test` alone while a busy loop keeps one core of the machine busy
the whole time, as a developer's machine has other work running: the suite must pass there too,
however long it takes (a product timeout that fires on a healthy but slow machine is a defect).

    make test-repeat N=3          (python3 .ci/repeat.py 3 [--keep DIR])
    make test-loaded              (python3 .ci/repeat.py 1 --loaded)
"""

import argparse
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from budget import outcomes

REPO = Path(__file__).resolve().parents[1]
BUSY_LOOP = [sys.executable, "-c", "while True: pass"]
"""One core kept busy: a plain loop, no I/O, never sleeping."""


def run_once(folder: Path, loaded: bool) -> tuple[float, int, list[tuple[str, str, float]]]:
    """Clone HEAD into `folder` and run CI there (or `make test` beside a busy loop): (seconds, exit
    status, [(test, outcome, seconds)])."""
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(folder)], check=True)
    report = folder / "build" / "junit.xml"
    command = (["bash", "-c", 'mkdir -p build && PYTEST_ADDOPTS="--junitxml=build/junit.xml" make test']
               if loaded else ["bash", ".ci/run"])
    started = time.monotonic()
    busy = subprocess.Popen(BUSY_LOOP) if loaded else None
    try:
        with (folder / "ci.log").open("w") as log:
            status = subprocess.run(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT).returncode
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    seconds = time.monotonic() - started
    return seconds, status, outcomes(report) if report.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=int, nargs="?", default=3)
    parser.add_argument("--keep", type=Path, help="clone into this folder (its logs stay), not a temporary one")
    parser.add_argument("--loaded", action="store_true", help="make test alone, a busy loop on one core beside it")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="test-repeat-"))
    failures: collections.Counter[str] = collections.Counter()
    durations: collections.defaultdict[str, list[float]] = collections.defaultdict(list)
    statuses = []
    for run in range(1, args.runs + 1):
        seconds, status, tests = run_once(root / f"run-{run}", args.loaded)
        statuses.append(status)
        failed = [name for name, outcome, _ in tests if outcome in ("failed", "error")]
        failures.update(failed)
        for name, _, took in tests:
            durations[name].append(took)
        print(f"run {run}: {'green' if status == 0 else f'RED (exit {status})'} in {seconds / 60:.1f} min, "
              f"{len(tests)} tests, {len(failed)} failed (log: {root / f'run-{run}' / 'ci.log'})", flush=True)
    print(f"\nfailures per test over {args.runs} runs:" if failures else f"\nno test failed in {args.runs} runs")
    for name, count in failures.most_common():
        print(f"  {count}/{args.runs}  {name}")
    print("\nslowest tests (mean seconds over the runs):")
    for name, took in sorted(durations.items(), key=lambda item: -sum(item[1]) / len(item[1]))[:10]:
        print(f"  {sum(took) / len(took):7.1f}  {name}")
    return 0 if not any(statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
