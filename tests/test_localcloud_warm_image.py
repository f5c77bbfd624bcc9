"""Instances booted from a warm image (localcloud/warm_image.py): the same instance to the fleet,
its faults and EC2, as one started afresh."""

import json
import os
import sys
import time
from pathlib import Path

import pytest

from localcloud.warm_image import WarmImage

IMAGE = "ami-12c6146b"
# booted.json appears whole (written aside, then renamed): a reader that sees it reads all of it.
NODE_SCRIPT = ("import json, os, pathlib, sys, time\n"
               "pathlib.Path('booted.part').write_text(json.dumps({'pid': os.getpid(), 'pgid': os.getpgid(0),\n"
               "    'cwd': os.getcwd(), 'argv': sys.argv, 'id': os.environ['LOCALCLOUD_INSTANCE_ID']}))\n"
               "os.replace('booted.part', 'booted.json')\n"
               "print('node up', flush=True)\n"
               "time.sleep(float(sys.argv[1]))\n"
               "sys.exit(3)\n")


@pytest.fixture
def image():
    image = WarmImage.start(["json"])
    yield image
    image.stop()


def test_a_fork_runs_the_command_in_its_folder_with_its_environment_and_console(image, tmp_path):
    code = "import os, sys; print(os.environ['WHO'], os.getcwd(), sys.argv[1:]); sys.exit(7)"
    child = image.fork([sys.executable, "-c", code, "a", "b"], tmp_path, {"WHO": "node-1"}, tmp_path / "console.log")
    assert child.wait(20) == 7
    assert (tmp_path / "console.log").read_text() == f"node-1 {tmp_path} ['a', 'b']\n"


def test_a_module_that_fails_exits_1_with_its_traceback(image, tmp_path):
    child = image.fork([sys.executable, "-m", "no_such_module_here"], tmp_path, {}, tmp_path / "console.log")
    assert child.wait(20) == 1
    assert "No module named no_such_module_here" in (tmp_path / "console.log").read_text()


def test_only_python_commands_are_forked(image):
    assert image.serves([sys.executable, "-m", "node.agent"])
    assert image.serves([sys.executable, "-c", "pass"])
    assert not image.serves(["/bin/sh", "-c", "true"])
    assert not image.serves([sys.executable, "script.py"])


def launch(cloud) -> str:
    return cloud.client("ec2").run_instances(ImageId=IMAGE, InstanceType="t3.micro", MinCount=1,
                                             MaxCount=1)["Instances"][0]["InstanceId"]


def booted(cloud, instance_id: str) -> dict:
    marker = cloud.fleet.get(instance_id).workdir / "booted.json"
    cloud.wait_until(marker.exists, "the node process to boot")
    return json.loads(marker.read_text())


@pytest.mark.slow
def test_an_instance_forked_from_the_image_is_its_own_process_group_and_dies_with_it(local_cloud):
    local_cloud.fleet.use_warm_image(["json"])
    local_cloud.fleet.boot = lambda instance: [sys.executable, "-c", NODE_SCRIPT, "120"]
    instance_id = launch(local_cloud)
    node = booted(local_cloud, instance_id)
    instance = local_cloud.fleet.get(instance_id)

    assert node["pid"] == node["pgid"] == instance.process.pid
    assert node["cwd"] == str(instance.workdir) and node["id"] == instance_id
    local_cloud.fleet.hang(instance_id)
    # SIGSTOP takes effect when the kernel next schedules the process: not always before the read.
    local_cloud.wait_until(lambda: Path(f"/proc/{node['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", "the instance's process to stop")
    local_cloud.fleet.resume(instance_id)
    local_cloud.fleet.kill(instance_id)
    local_cloud.fleet.wait_for_state(instance_id, "terminated")
    described = local_cloud.client("ec2").describe_instances(InstanceIds=[instance_id])
    assert described["Reservations"][0]["Instances"][0]["StateReason"]["Code"] == "Client.InstanceInitiatedShutdown"
    with pytest.raises(ProcessLookupError):
        os.kill(node["pid"], 0)


@pytest.mark.slow
def test_a_forked_instance_that_exits_terminates_and_one_terminated_is_ended(local_cloud):
    local_cloud.fleet.use_warm_image(["json"])
    local_cloud.fleet.boot = lambda instance: [sys.executable, "-c", NODE_SCRIPT,
                                               "0" if instance.tags.get("quick") else "120"]
    ec2 = local_cloud.client("ec2")
    quick = ec2.run_instances(ImageId=IMAGE, InstanceType="t3.micro", MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": "quick", "Value": "1"}]}])["Instances"][0]["InstanceId"]
    slow = launch(local_cloud)
    local_cloud.fleet.wait_for_state(quick, "terminated")
    assert local_cloud.fleet.get(quick).process is None
    assert "node up" in local_cloud.fleet.get(quick).console_log.read_text()

    pid = booted(local_cloud, slow)["pid"]
    started = time.monotonic()
    ec2.terminate_instances(InstanceIds=[slow])
    local_cloud.fleet.wait_for_state(slow, "terminated")
    assert time.monotonic() - started < local_cloud.config.shutdown_grace_seconds  # SIGTERM ended it
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
