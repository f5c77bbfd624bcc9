"""`trainfleet local up`: a foreground local cloud that other processes use, stopped by Ctrl-C."""

import json
import os
import signal
import subprocess
import sys

import boto3
import pytest

from localcloud.waiting import run_captured, until


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


@pytest.mark.slow
def test_local_up_serves_until_interrupted():
    # Started as a script's background job is: with SIGINT ignored, which exec keeps.
    process = subprocess.Popen(
        ["sh", "-c", 'trap "" INT; exec "$0" "$@"', sys.executable, "-m", "trainfleet.cli", "local", "up", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first_line = process.stdout.readline()
        assert first_line.startswith("local cloud running at http://127.0.0.1:"), first_line
        endpoint = first_line.split(" at ")[1].strip()
        # What it prints next is pasted into a shell as it is: it points the AWS SDKs at it.
        exports = []
        while (line := process.stdout.readline()).startswith("export "):
            exports.append(line)
        assert len(exports) == 6 and line.startswith("# instance metadata on port "), (exports, line)
        pasted = subprocess.run(["sh", "-c", "".join(exports) + 'echo "$AWS_ENDPOINT_URL $AWS_REGION"'],
                                capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
        assert pasted.stdout.split() == [endpoint, "us-east-1"], pasted
        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
        sqs.create_queue(QueueName="from-another-process")
        assert any(url.endswith("/from-another-process") for url in sqs.list_queues()["QueueUrls"])

        process.send_signal(signal.SIGINT)
        # Stopping under load can take long: waited for while its threads end one by one (not its
        # CPU time: an idle server's threads use some, and a Ctrl-C it missed went unnoticed).
        until(lambda: process.poll() is not None, lambda: threads(process.pid),
              what="local up to stop after Ctrl-C (its threads ending are its progress)", stall_s=120)
        output = process.stdout.read()
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 0, output
    assert output.strip().endswith("local cloud stopped"), output
    assert "Traceback" not in output


def chaos(capsys, *argv: str) -> tuple[int, dict | str]:
    """Run `trainfleet chaos ...`; its exit code and its answer (JSON) or its error line."""
    from trainfleet.cli import main

    code = main(["chaos", *argv])
    output = capsys.readouterr()
    return code, json.loads(output.out) if code == 0 else output.err.strip()


def test_chaos_injects_faults_into_a_running_local_cloud(local_cloud, capsys):
    from localcloud_helpers import process_state, start_fake_node

    instance_id, pids = start_fake_node(local_cloud, tags={"trainfleet:run": "run-a"})
    endpoint = ["--endpoint", local_cloud.endpoint]

    code, answer = chaos(capsys, "hang", "run-a", instance_id, *endpoint)
    assert code == 0 and answer["pid"] == pids["trainer"][0] and answer["fault"] == "hang", answer
    local_cloud.wait_until(lambda: process_state(pids["trainer"][0]) == "T", "the rank to stop")

    code, answer = chaos(capsys, "crash", "run-a", instance_id, *endpoint)
    assert code == 0 and answer["pid"] == pids["trainer"][0], answer  # a stopped rank dies too
    local_cloud.wait_until(lambda: process_state(pids["trainer"][0]) in {"Z", "X"}, "the rank to die")

    code, answer = chaos(capsys, "rebalance", "run-a", instance_id, *endpoint)
    assert code == 0 and local_cloud.fleet.get(instance_id).rebalance_notice, answer

    code, answer = chaos(capsys, "freeze", "run-a", instance_id, *endpoint)
    assert code == 0 and local_cloud.fleet.get(instance_id).hung, answer
    local_cloud.wait_until(lambda: process_state(pids["agent"][0]) == "T", "the agent to stop")

    code, answer = chaos(capsys, "throttle", "run-a", "dynamodb", "--seconds", "30", *endpoint)
    assert code == 0 and answer["service"] == "dynamodb", answer
    assert local_cloud.request_faults["dynamodb"].answer == "throttle"

    code, answer = chaos(capsys, "kill", "run-a", instance_id, *endpoint)
    assert code == 0, answer
    local_cloud.fleet.wait_for_state(instance_id, "terminated")


def test_chaos_refuses_an_instance_of_another_run_and_names_both(local_cloud, capsys):
    instance_id = local_cloud.client("ec2").run_instances(
        ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1, MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "trainfleet:run", "Value": "run-b"}]}],
    )["Instances"][0]["InstanceId"]
    endpoint = ["--endpoint", local_cloud.endpoint]

    code, error = chaos(capsys, "spot", "run-a", instance_id, *endpoint)
    assert code == 2 and error == (f"trainfleet chaos: instance {instance_id} is not one of run run-a: "
                                   f"its trainfleet:run tag is 'run-b'")
    code, error = chaos(capsys, "kill", "run-a", "i-0123456789abcdef0", *endpoint)
    assert code == 2 and "run run-a has no instance i-0123456789abcdef0" in error
    code, error = chaos(capsys, "error", "run-a", "sqs", "--seconds", "5", *endpoint)
    assert code == 2 and "service must be one of" in error
    code, error = chaos(capsys, "throttle", "run-a", "s3", *endpoint)
    assert code == 2 and error == "trainfleet chaos: throttle needs --seconds N"
    local_cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])


def test_the_chaos_command_reaches_the_endpoint_from_another_process(local_cloud):
    completed = run_captured(
        [sys.executable, "-m", "trainfleet.cli", "chaos", "error", "run-a", "s3", "--seconds", "30"],
        what="trainfleet chaos", env=os.environ | {"AWS_ENDPOINT_URL": local_cloud.endpoint})

    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["done"] == "every request to s3 answers its internal error for 30 s"
    assert local_cloud.request_faults["s3"].answer == "error"


def test_the_chaos_route_answers_json_errors_for_what_is_not_a_fault_request(local_cloud):
    import urllib.error
    import urllib.request

    url = local_cloud.endpoint + "/_localcloud/chaos"
    for request, status in ((urllib.request.Request(url), 405),
                            (urllib.request.Request(url, data=b"{not json", method="POST"), 400),
                            (urllib.request.Request(url, data=b'{"fault": "melt", "run": "r", "target": "i-1"}',
                                                    method="POST"), 400)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == status and "error" in json.loads(refused.value.read())
