"""Waiting by progress (localcloud.waiting) and the timeout floors of a local run (localcloud.stack)."""

import itertools
import json
import sys
from pathlib import Path

import pytest

from localcloud import waiting
from localcloud.demo import DEMO_RUN_SPEC
from localcloud.stack import TIMEOUT_FLOORS_S, local_run_spec


@pytest.fixture(autouse=True)
def look_every_time(monkeypatch):
    monkeypatch.setattr(waiting, "LOOK_EVERY_S", 0.0)


def test_a_wait_goes_on_past_the_stall_limit_while_its_work_advances():
    counter, polls = itertools.count(), itertools.count()
    found = waiting.until(lambda: next(polls) == 40 and "done", lambda: next(counter), what="forty polls",
                          stall_s=0.05, poll_s=0.01)
    assert found == "done"


def test_a_wait_whose_work_stands_still_fails_naming_what_it_waited_for_and_the_last_it_saw():
    with pytest.raises(waiting.Stalled, match=r"while waiting for the end of run-1; last seen: \('Train', 7\)"):
        waiting.until(lambda: False, lambda: ("Train", 7), what="the end of run-1", stall_s=0.05, poll_s=0.01)


def demo_template() -> dict:
    return json.loads(DEMO_RUN_SPEC.read_text())


def test_the_demo_run_spec_keeps_the_local_floors():
    spec = local_run_spec(demo_template(), "demo-1", "bucket")
    assert spec["recovery"]["startup_timeout_seconds"] >= TIMEOUT_FLOORS_S["recovery.startup_timeout_seconds"]


def test_a_local_run_spec_below_the_floors_a_starved_machine_can_reach_is_refused_naming_each():
    template = demo_template()
    template["recovery"] |= {"startup_timeout_seconds": 200, "boot_timeout_seconds": 180}
    with pytest.raises(ValueError) as refused:
        local_run_spec(template, "demo-1", "bucket")
    assert "recovery.startup_timeout_seconds=200 is below the local floor of 300 s" in str(refused.value)
    assert "recovery.boot_timeout_seconds=180 is below the local floor of 300 s" in str(refused.value)
    assert "hang_timeout" not in str(refused.value)


STUCK_CLOUD = """
import threading
from localcloud.cloud import LocalCloud
starting = threading.Event()
threading.Thread(target=lambda: [print(".", end="", flush=True) for _ in iter(lambda: starting.wait(0.1), True)]).start()
cloud = LocalCloud().start()
starting.set()
print("local cloud up", flush=True)
threading.Event().wait()  # stuck: never prints again
"""
"""A local cloud that starts (printing while it does: the wait counts stillness only from then on)
and then stands still."""


@pytest.mark.slow
def test_a_stalled_local_cloud_process_is_killed_with_its_threads_stacks_and_output_in_the_error():
    with pytest.raises(waiting.Stalled) as stalled:
        waiting.run_captured([sys.executable, "-c", STUCK_CLOUD], what="the stuck cloud", stall_s=3.0,
                             cwd=Path(__file__).resolve().parent.parent)
    message = str(stalled.value)
    assert "while waiting for the stuck cloud" in message
    output, stacks = message.split("--- the end of its stderr:")
    assert output.rstrip().endswith("local cloud up")
    assert 'File "<string>", line 9 in <module>' in stacks  # the main thread, where it stands
