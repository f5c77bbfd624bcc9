"""How a local instance of a trainfleet run boots: what the node user data does that touches AWS,
before it starts the agent. The agent's settings are those the user data writes
(trainfleet/adapters/ec2_fleet.py node_user_data); the wheelhouse is copied from
s3://BUCKET/artifacts/ with the instance's own role (the user data's `aws s3 cp --recursive`,
with as many tries). There is no Python unpacked and no pip install here: the local instance
runs the agent from this tree.

    boot_as_nodes(cloud, local_settings)     # the fleet boots trainfleet's instances so
    python -m localcloud.node_boot AGENT_ARGV...     (what each such instance runs)

A copy that fails is reported as the user data reports a failed step: to the console, and to
the control plane as NodeUnhealthy with a failed BOOT_CHECK naming the step and the error (the
run ends with that reason, not with a node lost). The instance stays up without an agent, as
after a failed user data script on EC2. Instances whose user data is not a trainfleet node's run
it as cloud-init would (localcloud.fleet.boot_user_data).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localcloud.cloud import LocalCloud
    from localcloud.fleet import LocalInstance

ARTIFACTS = "artifacts/"
MARKER = "artifacts/README.txt"
REPO = Path(__file__).resolve().parent.parent
NODE_MODULES = ["localcloud.node_boot", "node.agent", "node.standin"]
"""What a node's warm image imports: the boot, the agent and the stand-in trainer (a thread of it)."""
TRAINER_MODULES = ["node.health", "node.torchrun", "trainer.worker", "trainer.train"]
"""And where nodes run the real trainer: preflight, torchrun and the ranks, each run in place."""


def publish_artifacts(s3: Any, bucket: str) -> None:
    """What the deployment publishes for the nodes to install (locally a marker: the agent runs
    from this tree), as `make artifacts BUCKET=...` does on AWS."""
    s3.put_object(Bucket=bucket, Key=MARKER, Body=b"trainfleet wheelhouse (local cloud: the agent runs from the tree)\n")


def boot_as_nodes(cloud: LocalCloud, local_settings: Callable[[LocalInstance], dict[str, str]] = lambda _: {},
                  *, real_trainer: bool = True) -> None:
    """Boot every instance whose user data is a trainfleet node's as that node: the settings its
    user data writes, plus `local_settings` (paces and limits for this machine), and the agent
    started by `main` below; forked from a warm image that imported the agent (and with
    `real_trainer`, the trainer's processes, run in place)."""
    from localcloud.fleet import boot_user_data
    from trainfleet.adapters.ec2_fleet import user_data_settings

    def boot(instance: LocalInstance) -> list[str] | None:
        if user_data_settings(instance.user_data) is None:
            return boot_user_data(instance)
        return [sys.executable, "-m", "localcloud.node_boot", sys.executable, "-m", "node.agent"]

    def environment(instance: LocalInstance) -> dict[str, str]:
        settings = user_data_settings(instance.user_data)
        if settings is None:
            return {}
        return settings | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"} | local_settings(instance)

    cloud.fleet.boot = boot
    cloud.fleet.env_hooks.append(environment)
    cloud.fleet.use_warm_image(NODE_MODULES + (TRAINER_MODULES if real_trainer else []))


def copy_objects(s3: Any, bucket: str, prefix: str, into: Path) -> list[str]:
    """`aws s3 cp --recursive s3://BUCKET/PREFIX INTO`: list the prefix, get each object; the keys."""
    copied = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            target = into / item["Key"][len(prefix):]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read())
            copied.append(item["Key"])
    return copied


def report_boot_failure(reason: str, detail: str) -> None:
    """What the user data does when a step fails: NodeUnhealthy with a failed BOOT_CHECK, sent as
    this instance with its own role (a failure to send it is printed: the console still says why)."""
    import boto3
    from botocore.config import Config

    from node.agent import MetadataClient
    from trainfleet.adapters.ec2_fleet import BOOT_COPY_ATTEMPTS
    from trainfleet.core.events import BOOT_CHECK, HealthCheckResult, NodeUnhealthy, put_events_entry

    try:
        identity = MetadataClient().identity()
        events = boto3.client("events", config=Config(region_name=identity.region, retries={
            "mode": "standard", "max_attempts": BOOT_COPY_ATTEMPTS}))
        report = NodeUnhealthy(run_name=os.environ["TRAINFLEET_RUN_NAME"], attempt=0,
                               instance_id=identity.instance_id, reason=reason,
                               checks=[HealthCheckResult(name=BOOT_CHECK, passed=False, detail=detail)])
        events.put_events(Entries=[put_events_entry(report, os.environ["TRAINFLEET_EVENT_BUS"], identity.arn)])
    except Exception as error:  # whatever kept it from being sent: the console is the last word
        print(f"node boot: the failure could not be reported: {error}", flush=True)


def main(agent_argv: list[str]) -> None:
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    from localcloud.in_place import exec_in_place, runnable
    from localcloud.warm_image import forked_from_image
    from trainfleet.adapters.ec2_fleet import BOOT_COPY_ATTEMPTS

    bucket = os.environ["TRAINFLEET_BUCKET"]
    s3 = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": BOOT_COPY_ATTEMPTS}))
    try:
        copied = copy_objects(s3, bucket, ARTIFACTS, Path("wheels"))
    except (BotoCoreError, ClientError) as error:
        step = f"copying s3://{bucket}/{ARTIFACTS}"
        print(f"node boot failed: {step} failed: {error}; the agent is not started", flush=True)
        report_boot_failure(f"bootstrap failed at: {step}", str(error))
        while True:  # the instance stays up without an agent, as after a failed user data script
            time.sleep(3600)
    print(f"node boot: copied {len(copied)} artifacts from s3://{bucket}/{ARTIFACTS}; starting the agent", flush=True)
    if forked_from_image() and runnable(agent_argv):
        exec_in_place(agent_argv)  # the image has the agent loaded
    os.execvp(agent_argv[0], agent_argv)


if __name__ == "__main__":
    main(sys.argv[1:])
