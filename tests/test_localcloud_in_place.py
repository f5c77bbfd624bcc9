"""Commands run in place in a warm image's processes (localcloud/in_place.py): to their starter and
to themselves, the process an exec would have made."""

import json
import os
import sys
from pathlib import Path

import pytest

from localcloud.warm_image import WarmImage

# What a command run in place reports about itself, or does: `python -m probe ACTION ...`.
PROBE = """
import atexit, json, os, sys, threading, time
action, *rest = sys.argv[1:]
if action == "report":
    print(json.dumps({"cwd": os.getcwd(), "who": os.environ.get("WHO"), "parent": os.getppid(),
                      "name": open("/proc/self/comm").read().strip(), "own_session": os.getsid(0) == os.getpid(),
                      "argv": sys.argv[1:], "forked": "localcloud.warm_image" in open("/proc/self/cmdline").read()}))
    sys.exit(int(rest[0]))
if action == "raise":
    raise RuntimeError("probe failed")
if action == "exit-message":
    sys.exit("probe says bye")
if action == "sleep":
    time.sleep(600)
if action == "finish":
    record = open(rest[0], "a")
    threading.Thread(target=lambda: (time.sleep(0.2), record.write("thread\\n"), record.flush())).start()
    atexit.register(lambda: record.write("atexit\\n"))
"""

# The starter: a process of the image, as an agent is, starting probes with subprocess.
DRIVER = """
import atexit, json, os, select, signal, subprocess, sys
python, out = sys.executable, {}
atexit.register(lambda: open("driver-atexit", "a").write(f"{os.getpid()}\\n"))
signal.signal(signal.SIGTERM, lambda *_: None)

done = subprocess.run([python, "-m", "probe", "report", "5"], capture_output=True, text=True, cwd="work",
                      env={"WHO": "rank", "PYTHONPATH": os.getcwd()}, start_new_session=True)
out["report"] = {"status": done.returncode, "facts": json.loads(done.stdout), "starter": os.getpid()}
out["imported_before"] = subprocess.run([python, "-m", "json.tool", "--help"], capture_output=True, text=True).stderr
for action in ("raise", "exit-message"):
    done = subprocess.run([python, "-m", "probe", action], capture_output=True, text=True)
    out[action] = {"status": done.returncode, "stderr": done.stderr}

reading, writing = os.pipe()
sleeper = subprocess.Popen([python, "-m", "probe", "sleep"])
os.close(writing)
out["pipe_released"] = select.select([reading], [], [], 60)[0] == [reading] and os.read(reading, 1) == b""
sleeper.terminate()
out["terminated"] = sleeper.wait()

out["finish"] = subprocess.run([python, "-m", "probe", "finish", "finish.log"]).returncode
out["finish_log"] = open("finish.log").read()
out["exec"] = subprocess.run([python, "-X", "dev", "-c", "print(open('/proc/self/cmdline').read().split(chr(0))[1:3])"],
                             capture_output=True, text=True).stdout.strip()
try:
    subprocess.run([python, "-m", "probe", "report", "0"], cwd="no-such-folder")
except FileNotFoundError as error:
    out["missing_folder"] = str(error)
json.dump(out, open("results.json", "w"))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("in-place")
    (folder / "probe.py").write_text(PROBE)
    (folder / "driver.py").write_text(DRIVER)
    (folder / "work").mkdir()
    image = WarmImage.start(["json", "json.tool", "subprocess"])
    try:
        driver = image.fork([sys.executable, "-m", "driver"], folder, {"PYTHONPATH": str(folder)},
                            folder / "console.log")
        assert driver.wait(600) == 0, (folder / "console.log").read_text()
    finally:
        image.stop()
    return folder, json.loads((folder / "results.json").read_text())


def test_a_command_run_in_place_is_a_forked_child_with_its_folder_environment_session_and_name(results):
    folder, out = results
    facts = out["report"]["facts"]
    assert out["report"]["status"] == 5
    assert facts["forked"] and facts["parent"] == out["report"]["starter"]
    assert facts["cwd"] == str(folder / "work") and facts["who"] == "rank" and facts["own_session"]
    assert facts["name"] == "probe" and facts["argv"] == ["report", "5"]


def test_it_ends_as_the_interpreter_would_on_an_error_or_an_exit_message(results):
    _, out = results
    assert out["raise"]["status"] == 1 and "RuntimeError: probe failed" in out["raise"]["stderr"]
    assert out["exit-message"] == {"status": 1, "stderr": "probe says bye\n"}


def test_a_module_the_image_imported_runs_without_runpys_warning_as_in_a_new_interpreter(results):
    """A node's `python -m node.torchrun` says nothing of it: nor does the same command in place."""
    _, out = results
    assert out["imported_before"] == ""


def test_it_holds_none_of_its_starters_descriptors_and_none_of_its_signal_handlers(results):
    _, out = results
    assert out["pipe_released"]  # the starter's end closed: EOF, the child holds no copy
    assert out["terminated"] == -15  # the starter ignores SIGTERM; a new interpreter does not


def test_it_joins_its_threads_and_runs_its_own_exit_functions_not_its_starters(results):
    folder, out = results
    assert out["finish"] == 0 and out["finish_log"] == "thread\natexit\n"
    starters = (folder / "driver-atexit").read_text().split()
    assert len(starters) == 1 and int(starters[0]) == out["report"]["starter"]


def test_other_commands_are_execd_and_a_missing_folder_is_refused_as_popen_refuses_it(results):
    _, out = results
    assert out["exec"] == "['-X', 'dev']"
    assert "no-such-folder" in out["missing_folder"] or "No such file" in out["missing_folder"]
