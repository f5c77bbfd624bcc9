"""The local S3's requests as heard (localcloud.glue.s3.listen): what the spares run and the chaos
cells judge a recovery path by. An object stored is one write, whichever way it came; only a
GetObject is a read. moto looks a key up for every request that names one, and a checkpoint
shard's multipart upload completing after a node was lost was once heard as a read of it."""

import pytest

from localcloud.glue import s3 as s3_requests
from localcloud_helpers import unique


@pytest.fixture
def heard(local_cloud):
    s3 = local_cloud.client("s3")
    bucket = unique("heard")
    s3.create_bucket(Bucket=bucket)
    requests: list[tuple[str, str]] = []
    with s3_requests.listen(lambda kind, key, body: requests.append((kind, key))):
        yield s3, bucket, requests


def test_a_multipart_upload_is_one_write_and_no_read(heard):
    s3, bucket, requests = heard
    upload = s3.create_multipart_upload(Bucket=bucket, Key="shards-0/step-20/__0_0.distcp")["UploadId"]
    parts = [{"PartNumber": number, "ETag": s3.upload_part(
        Bucket=bucket, Key="shards-0/step-20/__0_0.distcp", UploadId=upload, PartNumber=number,
        Body=b"x" * (5 * 2**20 if number == 1 else 10))["ETag"]} for number in (1, 2)]
    assert requests == []
    s3.complete_multipart_upload(Bucket=bucket, Key="shards-0/step-20/__0_0.distcp", UploadId=upload,
                                 MultipartUpload={"Parts": parts})
    assert requests == [("write", "shards-0/step-20/__0_0.distcp")]


def test_a_put_conditional_or_not_is_one_write_and_a_head_is_nothing(heard):
    s3, bucket, requests = heard
    s3.put_object(Bucket=bucket, Key="step-20/commit.json", Body=b"{}", IfNoneMatch="*")
    s3.put_object(Bucket=bucket, Key="step-20/.metadata", Body=b"meta")
    s3.head_object(Bucket=bucket, Key="step-20/.metadata")
    assert requests == [("write", "step-20/commit.json"), ("write", "step-20/.metadata")]


def test_a_get_whole_or_ranged_is_one_read(heard):
    s3, bucket, requests = heard
    s3.put_object(Bucket=bucket, Key="step-20/.metadata", Body=b"metadata")
    requests.clear()
    assert s3.get_object(Bucket=bucket, Key="step-20/.metadata")["Body"].read() == b"metadata"
    assert s3.get_object(Bucket=bucket, Key="step-20/.metadata", Range="bytes=0-3")["Body"].read() == b"meta"
    assert requests == [("read", "step-20/.metadata")] * 2
