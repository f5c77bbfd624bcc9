"""A local node boots as the user data does on EC2: it copies the wheelhouse from
s3://BUCKET/artifacts/ with its instance profile's role before the agent starts. A node role
without read access there leaves the node without an agent, and its console says why."""

import json
import sys
import uuid
from pathlib import Path

import pytest

from localcloud.deploy import DeployRequest, deploy
from localcloud.imds import serve_fleet
from localcloud.node_boot import publish_artifacts

REPO = Path(__file__).resolve().parent.parent
AGENT = "print('agent started', flush=True)"


@pytest.fixture(autouse=True)
def deployed_functions_dropped():
    """The instances' state changes reach the deployed EventsFunction, which imports the
    deployed copy of `functions` in this process; later tests import the working tree's."""
    yield
    for module in [name for name in sys.modules if name == "functions" or name.startswith("functions.")]:
        del sys.modules[module]


def boot_one_node(cloud, outputs) -> str:
    """Launch one instance with the stack's instance profile; its console output once booted."""
    cloud.fleet.boot = lambda instance: [sys.executable, "-m", "localcloud.node_boot", sys.executable, "-c", AGENT]
    cloud.fleet.env_hooks.append(lambda instance: {"PYTHONPATH": str(REPO),
                                                   "TRAINFLEET_BUCKET": outputs["CheckpointBucketName"]})
    launched = cloud.client("ec2").run_instances(
        ImageId="ami-12c6146b", InstanceType="c5.large", MinCount=1, MaxCount=1,
        IamInstanceProfile={"Arn": outputs["NodeInstanceProfileArn"]},
        MetadataOptions={"HttpTokens": "required"})
    instance = cloud.fleet.get(launched["Instances"][0]["InstanceId"])

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
            outputs = deploy(DeployRequest(template=REPO / "template.yaml", endpoint=cloud.endpoint,
                                           stack_name=f"tf-{uuid.uuid4().hex[:8]}")).outputs
            publish_artifacts(cloud.client("s3"), outputs["CheckpointBucketName"])
            iam = cloud.client("iam")
            role = iam.get_instance_profile(InstanceProfileName=outputs["NodeInstanceProfileArn"].rsplit("/", 1)[1])[
                "InstanceProfile"]["Roles"][0]["RoleName"]
            if not artifacts_readable:  # the node role as it was: runs/ only
                document = iam.get_role_policy(RoleName=role, PolicyName="node-agent")["PolicyDocument"]
                for statement in document["Statement"]:
                    if statement["Action"] == "s3:GetObject":
                        statement["Resource"] = [r for r in statement["Resource"] if "/artifacts/" not in r]
                iam.put_role_policy(RoleName=role, PolicyName="node-agent", PolicyDocument=json.dumps(document))
            console = boot_one_node(cloud, outputs)
        finally:
            imds.stop()
    if artifacts_readable:
        assert "copied 1 artifacts" in console and "agent started" in console
    else:
        assert "agent started" not in console
        assert (f"User: arn:aws:sts::{cloud.account_id}:assumed-role/{role}/i-" in console
                and "is not authorized to perform: s3:GetObject on resource: "
                    f"arn:aws:s3:::{outputs['CheckpointBucketName']}/artifacts/README.txt" in console), console
