"""The test files of one suite run, laid out per pytest worker: when each began and ended, and
when each worker ran out of files, and the CPU each file used (tests/conftest.py writes the timeline when
TRAINFLEET_TEST_TIMELINE names a file).

    TRAINFLEET_TEST_TIMELINE=/tmp/timeline make test && python3 .ci/timeline.py /tmp/timeline
"""

import sys
from collections import defaultdict


SHORTEST_S = 10.0
"""Files shorter than this are counted, not listed."""


def main(path: str) -> None:
    spans: dict[tuple[str, str], tuple[float, float]] = {}
    cpu: dict[str, float] = defaultdict(float)
    with open(path) as timeline:
        for line in timeline:
            worker, file, start, end, seconds = line.split()
            earlier = spans.get((worker, file), (float(start), float(end)))
            spans[(worker, file)] = (min(earlier[0], float(start)), max(earlier[1], float(end)))
            cpu[file] += float(seconds)
    began = min(start for start, _ in spans.values())
    by_worker: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for (worker, file), (start, end) in spans.items():
        by_worker[worker].append((start - began, end - began, file))
    for worker, files in sorted(by_worker.items()):
        files.sort()
        print(f"{worker}: {len(files)} files, done at {files[-1][1]:.0f} s")
        for start, end, file in files:
            if end - start >= SHORTEST_S:
                print(f"  {start:6.0f} {end:6.0f} {end - start:5.0f} s {cpu[file]:5.0f} s CPU  {file}")
    print(f"CPU of all files: {sum(cpu.values()):.0f} s; the most:")
    for file, seconds in sorted(cpu.items(), key=lambda item: -item[1])[:15]:
        print(f"  {seconds:5.0f} s  {file}")


if __name__ == "__main__":
    main(sys.argv[1])
