"""The local instance metadata service, through plain HTTP, through botocore's own IMDS
client, and from inside a local fleet instance's process."""

import dataclasses
import json
import sys
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone

import botocore.session
import pytest
from botocore.utils import IMDSFetcher, IMDSRegionProvider, InstanceMetadataFetcher

from localcloud.imds import InstanceMetadata, InstanceMetadataServer, serve_fleet

NODE = InstanceMetadata(
    instance_id="i-0aaaaaaaaaaaaaaa1", instance_type="p4d.24xlarge", image_id="ami-12c6146b",
    local_ipv4="127.77.0.10", availability_zone="eu-west-1b", region="eu-west-1", account_id="123456789012",
    launch_time=datetime(2026, 11, 29, 20, 0, tzinfo=timezone.utc), tags={"run": "r-1", "role": "node"},
    tags_in_metadata=True)
OTHER = dataclasses.replace(NODE, instance_id="i-0bbbbbbbbbbbbbbb2", local_ipv4="127.77.0.11",
                            tags_in_metadata=False)


class FakeClock:
    """Token expiry is timed with this instead of the real clock."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def records():
    """The provider's data: tests replace a record to give it a notice or other options."""
    return {NODE.instance_id: NODE, OTHER.instance_id: OTHER}


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def server(records, clock):
    with InstanceMetadataServer(records.get, clock=clock) as running:
        yield running


def _request(server, instance_id, path, method="GET", headers=None):
    """(status, body, headers) of one request; error statuses are returned, not raised."""
    request = urllib.request.Request(f"{server.endpoint_for(instance_id)}/latest/{path}", method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), error.headers


def _token(server, instance_id=NODE.instance_id, ttl="60"):
    status, token, headers = _request(server, instance_id, "api/token", "PUT",
                                      {"X-aws-ec2-metadata-token-ttl-seconds": ttl})
    assert status == 200 and headers["X-aws-ec2-metadata-token-ttl-seconds"] == ttl
    return token


def _get(server, path, token, instance_id=NODE.instance_id):
    status, body, _ = _request(server, instance_id, path, headers={"X-aws-ec2-metadata-token": token})
    return status, body


# --- the token protocol ---------------------------------------------------------------------

def test_reads_need_a_token_for_the_same_instance_that_has_not_expired(server, clock):
    token = _token(server, ttl="60")
    assert _get(server, "meta-data/instance-id", token) == (200, NODE.instance_id)
    assert _request(server, NODE.instance_id, "meta-data/instance-id")[0] == 401  # no token
    assert _get(server, "meta-data/instance-id", "forged")[0] == 401
    assert _get(server, "meta-data/instance-id", token, instance_id=OTHER.instance_id)[0] == 401
    clock.now += 59
    assert _get(server, "meta-data/instance-id", token)[0] == 200
    clock.now += 2
    assert _get(server, "meta-data/instance-id", token)[0] == 401


@pytest.mark.parametrize("headers, status", [
    ({}, 400),
    ({"X-aws-ec2-metadata-token-ttl-seconds": "0"}, 400),
    ({"X-aws-ec2-metadata-token-ttl-seconds": "21601"}, 400),
    ({"X-aws-ec2-metadata-token-ttl-seconds": "ten"}, 400),
    ({"X-aws-ec2-metadata-token-ttl-seconds": "21600", "X-Forwarded-For": "10.0.0.1"}, 403),
])
def test_token_requests_are_checked(server, headers, status):
    assert _request(server, NODE.instance_id, "api/token", "PUT", headers)[0] == status


def test_token_path_takes_only_put(server):
    assert _request(server, NODE.instance_id, "api/token")[0] == 405


def test_optional_tokens_allow_token_less_reads_but_not_bad_tokens(server, records):
    records[NODE.instance_id] = dataclasses.replace(NODE, tokens_required=False)
    assert _request(server, NODE.instance_id, "meta-data/local-ipv4")[:2] == (200, NODE.local_ipv4)
    assert _get(server, "meta-data/local-ipv4", "forged")[0] == 401


def test_disabled_endpoint_and_unknown_instances(server, records):
    records[NODE.instance_id] = dataclasses.replace(NODE, endpoint_enabled=False)
    assert _request(server, NODE.instance_id, "api/token", "PUT",
                    {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[0] == 403
    assert _request(server, "i-0ffffffffffffffff", "api/token", "PUT",
                    {"X-aws-ec2-metadata-token-ttl-seconds": "60"})[0] == 404


# --- what is served -------------------------------------------------------------------------

def test_identity_and_placement(server):
    token = _token(server)
    assert _get(server, "meta-data/instance-type", token) == (200, "p4d.24xlarge")
    assert _get(server, "meta-data/local-ipv4", token) == (200, "127.77.0.10")
    assert _get(server, "meta-data/placement/availability-zone", token) == (200, "eu-west-1b")
    assert _get(server, "meta-data/placement/region", token) == (200, "eu-west-1")
    assert _get(server, "meta-data/placement/", token) == (200, "availability-zone\nregion")
    assert "placement/" in _get(server, "meta-data/", token)[1].split("\n")
    assert _get(server, "meta-data/no-such-thing", token)[0] == 404
    status, body = _get(server, "dynamic/instance-identity/document", token)
    document = json.loads(body)
    assert status == 200
    assert {key: document[key] for key in ("instanceId", "instanceType", "availabilityZone", "region",
                                          "privateIp", "accountId", "imageId", "pendingTime")} == {
        "instanceId": NODE.instance_id, "instanceType": "p4d.24xlarge", "availabilityZone": "eu-west-1b",
        "region": "eu-west-1", "privateIp": "127.77.0.10", "accountId": "123456789012",
        "imageId": "ami-12c6146b", "pendingTime": "2026-11-29T20:00:00Z"}


def test_tags_only_when_the_instance_allows_them(server):
    assert _get(server, "meta-data/tags/instance", _token(server)) == (200, "run\nrole")
    assert _get(server, "meta-data/tags/instance/run", _token(server)) == (200, "r-1")
    other_token = _token(server, OTHER.instance_id)
    assert _get(server, "meta-data/tags/instance", other_token, OTHER.instance_id)[0] == 404


def test_spot_and_rebalance_notices_appear_when_given(server, records):
    token = _token(server)
    assert _get(server, "meta-data/spot/instance-action", token)[0] == 404
    assert _get(server, "meta-data/events/recommendations/rebalance", token)[0] == 404
    records[NODE.instance_id] = dataclasses.replace(
        NODE, spot_action={"action": "terminate", "time": "2026-11-29T21:02:00Z"},
        rebalance_notice={"noticeTime": "2026-11-29T20:58:00Z"})
    status, body, headers = _request(server, NODE.instance_id, "meta-data/spot/instance-action",
                                     headers={"X-aws-ec2-metadata-token": token})
    assert (status, json.loads(body)) == (200, {"action": "terminate", "time": "2026-11-29T21:02:00Z"})
    assert headers["Content-Type"] == "application/json"
    assert json.loads(_get(server, "meta-data/events/recommendations/rebalance", token)[1]) == {
        "noticeTime": "2026-11-29T20:58:00Z"}


def test_instance_profile_credentials_only_with_a_profile(server, records):
    token = _token(server)
    assert _get(server, "meta-data/iam/info", token)[0] == 404
    records[NODE.instance_id] = dataclasses.replace(
        NODE, instance_profile_arn="arn:aws:iam::123456789012:instance-profile/nodes",
        instance_profile_id="AIPAEXAMPLE", role_name="node-role")
    assert json.loads(_get(server, "meta-data/iam/info", token)[1])["InstanceProfileArn"] == (
        "arn:aws:iam::123456789012:instance-profile/nodes")
    assert _get(server, "meta-data/iam/security-credentials/", token) == (200, "node-role")
    first = json.loads(_get(server, "meta-data/iam/security-credentials/node-role", token)[1])
    again = json.loads(_get(server, "meta-data/iam/security-credentials/node-role", token)[1])
    assert first == again and first["Code"] == "Success" and first["AccessKeyId"].startswith("ASIA")


# --- botocore's own client ------------------------------------------------------------------

class MetadataReader(IMDSFetcher):
    """botocore's IMDS fetcher (token, retries, headers) reading any path."""

    def read(self, path):
        token = self._fetch_metadata_token()
        return self._get_request(path, None, token).text


def test_botocore_credential_fetcher_gets_the_role_credentials(server, records):
    records[NODE.instance_id] = dataclasses.replace(
        NODE, instance_profile_arn="arn:aws:iam::123456789012:instance-profile/nodes", role_name="node-role")
    fetcher = InstanceMetadataFetcher(
        timeout=2, num_attempts=1, config={"ec2_metadata_service_endpoint": server.endpoint_for(NODE.instance_id)})
    credentials = fetcher.retrieve_iam_role_credentials()
    assert credentials["role_name"] == "node-role"
    assert credentials["access_key"].startswith("ASIA") and credentials["token"]
    expiry = datetime.strptime(credentials["expiry_time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert expiry > datetime.now(timezone.utc)


def test_botocore_reads_through_the_endpoint_variable(server, monkeypatch):
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.endpoint_for(NODE.instance_id))
    session = botocore.session.Session()
    # The region provider is what boto3 falls back on for the region on an instance.
    assert IMDSRegionProvider(session).provide() == "eu-west-1"
    endpoint = session.get_config_variable("ec2_metadata_service_endpoint")
    reader = MetadataReader(timeout=2, num_attempts=1, config={"ec2_metadata_service_endpoint": endpoint})
    assert reader.read("latest/meta-data/instance-id") == NODE.instance_id
    assert json.loads(reader.read("latest/dynamic/instance-identity/document"))["region"] == "eu-west-1"


# --- inside a local fleet instance ----------------------------------------------------------

# What a node agent does at boot: learn who and where it is, then watch for a Spot notice.
AGENT = r"""
import time
import botocore.session
from botocore.utils import IMDSFetcher

class Reader(IMDSFetcher):
    def read(self, path):
        response = self._get_request(path, None, self._fetch_metadata_token())
        return response.text

# The session reads AWS_EC2_METADATA_SERVICE_ENDPOINT, as boto3's does on an instance.
endpoint = botocore.session.Session().get_config_variable("ec2_metadata_service_endpoint")
reader = Reader(timeout=2, num_attempts=2, config={"ec2_metadata_service_endpoint": endpoint})
for path in ("instance-id", "instance-type", "placement/availability-zone", "iam/security-credentials/",
             "tags/instance/run"):
    print(path, reader.read("latest/meta-data/" + path), flush=True)

def wait_for(path):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            return reader.read("latest/meta-data/" + path)
        except Exception:  # 404 until the notice is given
            time.sleep(0.1)

print("rebalance", wait_for("events/recommendations/rebalance"), flush=True)
print("spot", wait_for("spot/instance-action"), flush=True)
time.sleep(60)  # the interruption ends this process
"""


@pytest.mark.slow
def test_a_fleet_instance_reads_its_metadata_and_its_spot_notice(tmp_path, monkeypatch):
    from localcloud import LocalCloud
    from localcloud.glue import ec2 as ec2_glue

    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 0.0)  # the profile made below is visible at once

    with LocalCloud(time_scale=0.02, boot_seconds=0.5, shutdown_grace_seconds=1.0) as cloud:
        imds = serve_fleet(cloud)
        try:
            cloud.fleet.boot = lambda instance: [sys.executable, "-c", AGENT]
            iam = cloud.client("iam")
            role, profile = f"imds-node-{uuid.uuid4().hex[:8]}", f"imds-nodes-{uuid.uuid4().hex[:8]}"
            iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps(
                {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                         "Principal": {"Service": "ec2.amazonaws.com"}}]}))
            iam.create_instance_profile(InstanceProfileName=profile)
            iam.add_role_to_instance_profile(InstanceProfileName=profile, RoleName=role)
            launched = cloud.client("ec2").run_instances(
                ImageId="ami-12c6146b", InstanceType="p4d.24xlarge", MinCount=1, MaxCount=1,
                IamInstanceProfile={"Name": profile},
                MetadataOptions={"HttpTokens": "required", "InstanceMetadataTags": "enabled"},
                TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "run", "Value": "r-7"}]}])
            instance_id = launched["Instances"][0]["InstanceId"]
            instance = cloud.fleet.get(instance_id)

            def console():
                return instance.console_log.read_text() if instance.console_log.exists() else ""

            cloud.wait_until(lambda: "tags/instance/run" in console(), "the instance to read its metadata")
            lines = dict(line.split(" ", 1) for line in console().splitlines())
            assert lines["instance-id"] == instance_id
            assert lines["instance-type"] == "p4d.24xlarge"
            assert lines["placement/availability-zone"].startswith(cloud.region)
            assert lines["tags/instance/run"] == "r-7"
            assert lines["iam/security-credentials/"] == role

            cloud.inject_rebalance(instance_id)
            cloud.wait_until(lambda: "rebalance " in console(), "the instance to see its rebalance notice")
            assert json.loads(console().split("rebalance ", 1)[1].splitlines()[0]) == instance.rebalance_notice
            cloud.inject_spot_interruption(instance_id)
            cloud.wait_until(lambda: "spot " in console(), "the instance to see its Spot notice")
            notice = json.loads(console().split("spot ", 1)[1].splitlines()[0])
            assert notice == instance.spot_action and notice["action"] == "terminate"
        finally:
            imds.stop()


def test_the_metadata_service_answers_while_the_ec2_api_is_failing(local_cloud):
    """On EC2 the host serves the instance metadata: an EC2 API outage does not reach it. The
    local service reads EC2's view of an instance through the endpoint, unfailed and uncounted."""
    from localcloud.imds import fleet_records

    launched = local_cloud.client("ec2").run_instances(ImageId="ami-12c6146b", InstanceType="c5.large",
                                                         MinCount=1, MaxCount=1)
    instance_id = launched["Instances"][0]["InstanceId"]
    def ec2_requests() -> int:  # other requests of this process's local cloud (a queue's poller) are not its
        return sum(count for (service, _), count in local_cloud.requests.items() if service == "ec2")

    counted = ec2_requests()
    local_cloud.fail_requests("ec2", 60, "error")
    try:
        record = fleet_records(local_cloud)(instance_id)
    finally:
        local_cloud.stop_failing_requests()
    assert record is not None and record.instance_type == "c5.large"
    assert ec2_requests() == counted
