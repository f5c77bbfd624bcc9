"""The node user data as EC2 runs it, run by a local instance: bash, the same script, the image's
AWS CLI, the instance's own role. A step that fails every try is reported as NodeUnhealthy with
the step and its output (and printed to the console); the node is replaced, and several failing
at one step end the run (test_lifecycle)."""

import json

from localcloud.glue import ec2 as ec2_glue
from localcloud.imds import serve_fleet
from localcloud.node_boot import publish_artifacts
from localcloud_helpers import event_sink, receive, unique
from trainfleet.adapters.ec2_fleet import BOOT_STEP_TRIES, node_user_data
from trainfleet.core.events import BOOT_CHECK, NodeUnhealthy, event_sender
from trainfleet.core.settings import Settings

NODE_POLICY = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket", "events:PutEvents"], "Resource": "*"}]}


def node_profile(cloud) -> str:
    """An instance profile whose role may read the bucket and put events; its ARN."""
    iam, name = cloud.client("iam"), unique("node")
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
                                                     "Action": "sts:AssumeRole"}]}
    iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))
    iam.put_role_policy(RoleName=name, PolicyName="node", PolicyDocument=json.dumps(NODE_POLICY))
    profile = iam.create_instance_profile(InstanceProfileName=name)["InstanceProfile"]["Arn"]
    iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    return profile


def test_a_bootstrap_step_that_fails_every_try_is_reported_with_its_output(local_cloud, monkeypatch):
    """Artifacts that are no archives: the unpacking step fails every try (each after a wait);
    its output, the step's name, its tries and the instance reach the control plane's bus within
    the boot, and the console."""
    s3, bucket = local_cloud.client("s3"), unique("bucket")
    s3.create_bucket(Bucket=bucket)
    publish_artifacts(s3, bucket)  # placeholders, in every copy
    # The waits between tries as short as the script allows: a second, doubling.
    local_cloud.fleet.env_hooks.append(lambda instance: {"TRAINFLEET_BOOT_RETRY_S": "1"})
    sink = event_sink(local_cloud, {"source": [{"prefix": "trainfleet/"}], "detail-type": ["NodeUnhealthy"]})
    settings = Settings(run_table="runs", liveness_table="liveness", bucket=bucket, event_bus="default",
                        stack_name="trainfleet", node_policy_arn="arn:aws:iam::123456789012:policy/unused")
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 0.0)  # the profile made just now is visible
    imds = serve_fleet(local_cloud)
    try:
        launched = local_cloud.client("ec2").run_instances(
            ImageId="ami-12c6146b", InstanceType="c5.large", MinCount=1, MaxCount=1,
            UserData=node_user_data("boot-run", settings), MetadataOptions={"HttpTokens": "required"},
            IamInstanceProfile={"Arn": node_profile(local_cloud)})
        instance_id = launched["Instances"][0]["InstanceId"]
        (event,) = receive(local_cloud, sink, 1)
    finally:
        imds.stop()
    report = NodeUnhealthy.model_validate(event["detail"])
    assert (report.run_name, report.instance_id) == ("boot-run", instance_id)
    assert event_sender(event["source"]) == instance_id, "sent as the instance itself"
    assert report.reason == f"bootstrap failed at: unpacking the artifacts (exit 2, {BOOT_STEP_TRIES} tries)"
    (check,) = report.checks
    assert check.name == BOOT_CHECK and not check.passed
    assert "download: s3://" in check.detail and "gzip: stdin: not in gzip format" in check.detail, check.detail
    console = local_cloud.fleet.get(instance_id).console_log.read_text()
    assert [f"trainfleet: unpacking the artifacts failed (exit 2), try {n} of {BOOT_STEP_TRIES}" in console
            for n in range(1, BOOT_STEP_TRIES)] == [True] * (BOOT_STEP_TRIES - 1)
    assert f"trainfleet: bootstrap failed at: unpacking the artifacts (exit 2, {BOOT_STEP_TRIES} tries)" in console
