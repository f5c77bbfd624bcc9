"""S3 in the local cloud lists as S3 does: in a versioned bucket (the stack's is one), a key whose
current version is a delete marker is listed nowhere, neither itself nor under a common prefix.
So `trainfleet checkpoint list` shows the steps retention kept, not the ones it pruned."""

import uuid

from test_adapters_checkpoints import save
from trainer import checkpoint_catalog as catalog


def versioned_bucket(cloud) -> tuple[object, str]:
    s3, bucket = cloud.client("s3"), f"versioned-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    return s3, bucket


def test_a_deleted_keys_prefix_is_no_common_prefix(local_cloud):
    s3, bucket = versioned_bucket(local_cloud)
    for key in ("runs/a/step-1/x", "runs/a/step-2/x", "runs/a/step-2/y", "runs/a/top"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    s3.delete_object(Bucket=bucket, Key="runs/a/step-1/x")
    s3.delete_object(Bucket=bucket, Key="runs/a/step-2/x")
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="runs/a/", Delimiter="/")
    assert [prefix["Prefix"] for prefix in listed["CommonPrefixes"]] == ["runs/a/step-2/"]
    assert [item["Key"] for item in listed["Contents"]] == ["runs/a/top"]
    versions = s3.list_object_versions(Bucket=bucket, Prefix="runs/a/step-1/")
    assert len(versions["DeleteMarkers"]) == 1 and len(versions["Versions"]) == 1, "the data is still kept"


def test_checkpoint_list_shows_the_steps_kept_not_those_pruned(local_cloud, capsys):
    from trainfleet.cli import main

    s3, bucket = versioned_bucket(local_cloud)
    uri = f"s3://{bucket}/runs/pruned/checkpoints"
    for step in (10, 20, 30, 40):
        save(s3, uri, step)
    catalog.prune(catalog.open_store(uri, s3), keep_last=2)
    assert main(["checkpoint", "list", uri]) == 0
    listing = capsys.readouterr().out
    steps = [line.split()[:2] for line in listing.splitlines() if line.split() and line.split()[0].isdigit()]
    assert steps == [["40", "committed"], ["30", "committed"]], listing
