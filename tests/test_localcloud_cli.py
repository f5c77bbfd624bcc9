"""`trainfleet local up`: a foreground local cloud that other processes use, stopped by Ctrl-C."""

import os
import signal
import subprocess
import sys

import boto3
import pytest


@pytest.mark.slow
def test_local_up_serves_until_interrupted():
    process = subprocess.Popen(
        [sys.executable, "-m", "trainfleet.cli", "local", "up", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first_line = process.stdout.readline()
        assert first_line.startswith("local cloud running at http://127.0.0.1:"), first_line
        endpoint = first_line.split(" at ")[1].strip()
        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name="us-east-1")
        sqs.create_queue(QueueName="from-another-process")
        assert any(url.endswith("/from-another-process") for url in sqs.list_queues()["QueueUrls"])

        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 0, output
    assert output.strip().endswith("local cloud stopped"), output
    assert "Traceback" not in output
