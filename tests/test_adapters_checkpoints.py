"""The control plane's view of checkpoints in S3 (moto), written by the trainer's commit protocol."""

import uuid

import boto3
import pytest

from trainer.checkpoint_catalog import MARKER_NAME, Manifest, S3Store, shard_folder, step_dir_name, step_files
from trainfleet.adapters.checkpoints import CheckpointInvalid, latest_checkpoint, verify_checkpoint


@pytest.fixture
def s3_prefix(moto_endpoint):
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    return s3, f"s3://{bucket}/runs/r1/checkpoints"


def save(s3, uri: str, step: int, commit: bool = True, drop: str | None = None) -> None:
    """Write a checkpoint the way the trainer does: shards first, the marker last."""
    store = S3Store(uri, s3)
    folder = step_dir_name(step)
    objects = {f"{shard_folder(0)}/{folder}/__0_0.distcp": b"a" * 100,
               f"{shard_folder(1)}/{folder}/__1_0.distcp": b"b" * 80, f"{folder}/.metadata": b"m" * 10}
    for name, data in objects.items():
        s3.put_object(Bucket=store.bucket, Key=f"{store.prefix}{name}", Body=data)
    files = tuple(step_files(store, step).values())
    if drop:
        dropped = next(name for name in objects if name.endswith(drop))
        s3.delete_object(Bucket=store.bucket, Key=f"{store.prefix}{dropped}")
    if commit:
        store.create(folder, MARKER_NAME, Manifest(step=step, layout={"pp": 2, "dp": 1}, files=files).to_json())


def test_no_checkpoint_means_a_fresh_start(s3_prefix):
    s3, uri = s3_prefix
    assert latest_checkpoint(s3, uri) is None


def test_latest_is_the_newest_committed_and_whole_step(s3_prefix):
    s3, uri = s3_prefix
    save(s3, uri, 10)
    save(s3, uri, 20, drop="__1_0.distcp")  # committed, then a shard vanished
    save(s3, uri, 30, commit=False)  # still being written
    latest = latest_checkpoint(s3, uri)
    assert (latest.step, latest.uri) == (10, f"{uri}/step-000000010")
    assert latest.committed_at is not None
    assert verify_checkpoint(s3, uri, 10) == latest
    with pytest.raises(CheckpointInvalid, match="shards-1/step-000000020/__1_0.distcp is missing"):
        verify_checkpoint(s3, uri, 20)
    with pytest.raises(CheckpointInvalid, match="never committed"):
        verify_checkpoint(s3, uri, 30)
