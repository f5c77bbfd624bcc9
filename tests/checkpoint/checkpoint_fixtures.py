"""Fixtures for the checkpoint tests (imported by name: a conftest here would shadow tests/conftest.py)."""

import uuid

import boto3
import pytest


@pytest.fixture
def s3(moto_endpoint):
    return boto3.client("s3", endpoint_url=moto_endpoint)


@pytest.fixture
def bucket(s3):
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture
def run_uri(bucket):
    return f"s3://{bucket}/runs/test-run/checkpoints"


@pytest.fixture
def processes():
    """Processes a test starts; any still running at the end are killed."""
    started = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
