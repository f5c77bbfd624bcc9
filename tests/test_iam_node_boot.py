"""A local node boots as the user data does on EC2: with the settings its user data writes, it
copies the wheelhouse from s3://BUCKET/artifacts/ with its instance profile's role before the
agent starts. A node role without read access there leaves the node without an agent once every try failed;
its console says why, and so does the NodeUnhealthy it sends, as the user data's failed step does."""

import json
import sys
import uuid
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from localcloud.deploy import DeployRequest, deploy
from localcloud.imds import serve_fleet
from localcloud.node_boot import publish_artifacts
from localcloud_helpers import event_sink, forget_functions, receive
from trainfleet.adapters.ec2_fleet import BOOT_STEP_TRIES, node_user_data, user_data_settings
from trainfleet.adapters.node_roles import ensure_node_profile
from trainfleet.core.events import BOOT_CHECK, NodeUnhealthy
from trainfleet.core.settings import Settings

REPO = Path(__file__).resolve().parent.parent
AGENT = "print('agent started', flush=True)"


@pytest.fixture(autouse=True)
def deployed_functions_dropped():
    """The instances' state changes reach the deployed EventsFunction, which imports the
    deployed copy of `functions` in this process; later tests import the working tree's."""
    yield
    forget_functions()


def boot_one_node(cloud, outputs, stack_name: str, profile_arn: str) -> str:
    """Launch one instance of run "boot" with its instance profile and user data; its console
    output once booted."""
    settings = Settings(run_table=outputs["RunTableName"], liveness_table=outputs["LivenessTableName"],
                        bucket=outputs["CheckpointBucketName"], event_bus=outputs["AgentEventBusName"],
                        stack_name=stack_name, node_policy_arn=outputs["NodePolicyArn"])
    cloud.fleet.boot = lambda instance: [sys.executable, "-m", "localcloud.node_boot", sys.executable, "-c", AGENT]
    # The waits between a failed step's tries short: a denial fails every try alike.
    cloud.fleet.env_hooks.append(lambda instance: user_data_settings(instance.user_data) | {
        "PYTHONPATH": str(REPO), "TRAINFLEET_BOOT_RETRY_S": "0.1"})
    launched = []

    def launch() -> bool:  # EC2 sees a new instance profile once IAM has propagated it
        try:
            launched.extend(cloud.client("ec2").run_instances(
                ImageId="ami-12c6146b", InstanceType="c5.large", MinCount=1, MaxCount=1,
                UserData=node_user_data("boot", settings), IamInstanceProfile={"Arn": profile_arn},
                MetadataOptions={"HttpTokens": "required"}, SubnetId=outputs["NodeSubnetIds"].split(",")[0],
                SecurityGroupIds=[outputs["NodeSecurityGroupIds"]])["Instances"])
        except ClientError as refused:
            if "Invalid IAM Instance Profile" not in str(refused):
                raise
        return bool(launched)

    cloud.wait_until(launch, "EC2 to launch with the run's new instance profile")
    instance = cloud.fleet.get(launched[0]["InstanceId"])

    def console() -> str:
        return instance.console_log.read_text() if instance.console_log.exists() else ""

    cloud.wait_until(lambda: "node boot" in console(), "the node boot to report")
    cloud.wait_until(lambda: "agent started" in console() or "failed" in console(), "the agent or a failure")
    return console()


@pytest.mark.parametrize("artifacts_readable", [True, False])
def test_the_node_installs_from_artifacts_with_its_own_role(artifacts_readable):
    from localcloud import LocalCloud

    with LocalCloud(time_scale=0.02, boot_seconds=0.5, shutdown_grace_seconds=1.0) as cloud:
        imds = serve_fleet(cloud)
        try:
            stack_name = f"tf-{uuid.uuid4().hex[:8]}"
            outputs = deploy(DeployRequest(template=REPO / "template.yaml", endpoint=cloud.endpoint,
                                           stack_name=stack_name)).outputs
            publish_artifacts(cloud.client("s3"), outputs["CheckpointBucketName"])
            iam = cloud.client("iam")
            policy_arn = outputs["NodePolicyArn"]
            if not artifacts_readable:  # the node policy as it was: runs/ only
                policy = iam.get_policy(PolicyArn=policy_arn)["Policy"]
                document = iam.get_policy_version(PolicyArn=policy_arn, VersionId=policy["DefaultVersionId"])[
                    "PolicyVersion"]["Document"]
                for statement in document["Statement"]:
                    if statement["Action"] == "s3:GetObject" and isinstance(statement["Resource"], list):
                        statement["Resource"] = [r for r in statement["Resource"] if "/artifacts/" not in r]
                policy_arn = iam.create_policy(PolicyName=f"{stack_name}-runs-only",
                                               PolicyDocument=json.dumps(document))["Policy"]["Arn"]
            profile_arn = ensure_node_profile(iam, "boot", stack_name, policy_arn)
            sink = event_sink(cloud, {"detail-type": ["NodeUnhealthy"]}, bus=outputs["AgentEventBusName"])
            console = boot_one_node(cloud, outputs, stack_name, profile_arn)
            reports = [] if artifacts_readable else receive(cloud, sink, 1)
        finally:
            imds.stop()
    if artifacts_readable:
        assert "node boot: copied artifacts/" in console and "in 1 tries" in console and "agent started" in console
        return
    assert "agent started" not in console
    # The CLI asks for the object's size first: S3 answers a HEAD it refuses with 403 and no body.
    denied = "An error occurred (403) when calling the HeadObject operation: Forbidden"
    assert denied in console, console
    (event,) = reports
    report = NodeUnhealthy.model_validate(event["detail"])
    assert report.run_name == "boot"
    assert report.reason == f"bootstrap failed at: copying the artifacts (exit 1, {BOOT_STEP_TRIES} tries)"
    (check,) = report.checks
    assert check.name == BOOT_CHECK and not check.passed and denied in check.detail
