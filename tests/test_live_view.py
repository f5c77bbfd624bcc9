"""The live view (trainfleet.operator.live_view) at the widths people read it at: a default terminal's and
a CI log's 80 columns, 120, and a wide 200. A value breaks between its parts, never inside one."""

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from live_view_sample import recovered_run
from localcloud.waiting import until
from trainfleet.operator.live_view import Parts, view

TESTS = Path(__file__).resolve().parent

WHOLE = ["step 60 of 60", "5.6630", "attempt 1 at 03:13:35", "5,663 tokens/s", "0.09 s/step", "step 60",
         "committed 03:13:36", "replaced i-0a1b2c3d4e5f60718 (INSTANCE_LOST)", "3 terminated", "64%", "34 s lost",
         "most to restart:INSTANCE_LOST: 19 s", "$0.00", "0.05 node-hours", "passed (attempt 1)",
         "fleet all-reduce 0.412 GB/s, floor 0.020 GB/s", "INSTANCE_LOST ended attempt 0", "detected after 3.0 s",
         "restarted", "resumed from step 20", "AwaitNodes 03:12:53", "Train 03:13:01", "Teardown 03:13:37", "Report 03:13:40",
         "Outcome 03:13:42"]
"""Every value of the sample, each of which must be read on one line."""


def rendered(width: int) -> list[str]:
    console = Console(width=width, record=True, file=open(os.devnull, "w"), color_system=None)
    console.print(view(recovered_run()))
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [80, 120, 200])
def test_every_value_is_read_whole_on_one_line_at_each_width(width):
    lines = rendered(width)
    assert max(len(line) for line in lines) <= width
    split = [value for value in WHOLE if not any(value in line for line in lines)]
    assert not split, "\n".join(lines)


def test_a_field_takes_one_line_where_the_width_allows_and_its_own_lines_where_not():
    wide, narrow = rendered(200), rendered(80)
    field = lambda lines, label: [line for line in lines if label in line]  # noqa: E731
    assert len(field(wide, "states")) == 1
    assert "AwaitNodes 03:12:53 → Train 03:13:01 → Teardown 03:13:37 → Report 03:13:40 → Outcome 03:13:42" in wide[
        next(i for i, line in enumerate(wide) if "states" in line)]
    at = next(i for i, line in enumerate(narrow) if "states" in line)
    assert narrow[at].rstrip(" │").endswith("→") and "Report 03:13:40" in narrow[at + 1]


def test_parts_break_only_between_parts():
    console = Console(width=18, record=True, file=open(os.devnull, "w"), color_system=None)
    console.print(Parts("one two", "three four", "five"))
    assert console.export_text().splitlines() == ["one two,", "three four, five"]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_view_in_a_real_80_by_24_terminal(tmp_path):
    """`trainfleet run status` prints on a terminal rich sizes itself: tmux's 80x24 pane."""
    session = f"live-view-{uuid.uuid4().hex[:8]}"
    done = tmp_path / "done"
    command = f"{sys.executable} {TESTS / 'live_view_sample.py'}; touch {done}; sleep 600"
    environment = {key: value for key, value in os.environ.items() if key not in ("COLUMNS", "LINES")}
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", "-c", str(TESTS), command],
                   check=True, env=environment)
    try:
        until(done.exists, lambda: None, what="the view printed in tmux", stall_s=300)
        screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], check=True, capture_output=True,
                                text=True).stdout.splitlines()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], check=False)
    assert screen[0].startswith("╭─ run local-demo-7d9d") and max(len(line) for line in screen) <= 80
    split = [value for value in WHOLE if not any(value in line for line in screen)]
    assert not split, "\n".join(screen)
