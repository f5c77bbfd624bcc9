"""How a local instance of a trainfleet run boots: what the node user data does that touches AWS,
before it starts the agent. The agent's settings are those the user data writes
(trainfleet/adapters/ec2_fleet.py node_user_data); the artifacts are copied from the instance's
copy of them, s3://BUCKET/artifacts/NN/ (ec2_fleet.artifact_copy), with the instance's own role,
two named objects, each asked for as the AWS CLI asks (a HEAD, then its GET), each request tried
as often, and the step tried as often with as long waits (TRAINFLEET_BOOT_RETRY_S sets the first,
as on EC2). There is no Python unpacked and no pip install here: the local instance runs the agent
from this tree.

    boot_as_nodes(cloud, local_settings)     # the fleet boots trainfleet's instances so
    python -m localcloud.node_boot AGENT_ARGV...     (what each such instance runs)

A copy that fails every try is reported as the user data reports a failed step: to the console,
and to the control plane as NodeUnhealthy with a failed BOOT_CHECK, the reason naming the step
(the node is replaced as a sick one). The instance stays up without an agent, as after a failed
user data script on EC2. Instances whose user data is not a trainfleet node's run
it as cloud-init would (localcloud.fleet.boot_user_data).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localcloud.cloud import LocalCloud
    from localcloud.fleet import LocalInstance

REPO = Path(__file__).resolve().parent.parent
NODE_MODULES = ["localcloud.node_boot", "node.agent", "node.standin"]
"""What a node's warm image imports: the boot, the agent and the stand-in trainer (a thread of it)."""
TRAINER_MODULES = ["node.health", "node.torchrun", "trainer.worker", "trainer.train"]
"""And where nodes run the real trainer: preflight, torchrun and the ranks, each run in place."""


def publish_artifacts(s3: Any, bucket: str) -> None:
    """What `make artifacts BUCKET=...` publishes for the nodes to install, in each of its copies
    (locally placeholders: the agent runs from this tree)."""
    from trainfleet.adapters.ec2_fleet import ARTIFACT_COPIES, NODE_PYTHON_ARTIFACT, NODE_WHEELHOUSE_ARTIFACT

    for copy in range(ARTIFACT_COPIES):
        for name in (NODE_PYTHON_ARTIFACT, NODE_WHEELHOUSE_ARTIFACT):
            s3.put_object(Bucket=bucket, Key=f"artifacts/{copy:02d}/{name}",
                          Body=b"trainfleet artifact (local cloud: the agent runs from the tree)\n")


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


def copy_artifacts(s3: Any, bucket: str, instance_id: str, into: Path) -> list[str]:
    """The user data's copy: the instance's copy of the two artifacts, each a HEAD and a GET (an
    object below the CLI's part size is one GET); the keys copied."""
    from trainfleet.adapters.ec2_fleet import NODE_PYTHON_ARTIFACT, NODE_WHEELHOUSE_ARTIFACT, artifact_copy

    into.mkdir(parents=True, exist_ok=True)
    keys = [f"{artifact_copy(instance_id)}{name}" for name in (NODE_PYTHON_ARTIFACT, NODE_WHEELHOUSE_ARTIFACT)]
    for key in keys:
        s3.head_object(Bucket=bucket, Key=key)
        (into / key.rsplit("/", 1)[1]).write_bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    return keys


class BootStepFailed(Exception):
    """A bootstrap step that failed every try."""

    def __init__(self, tries: int, error: Exception):
        super().__init__(str(error))
        self.tries = tries


def retried(step: Callable[[], Any], tries: int, first_wait_s: float) -> tuple[Any, int]:
    """`step()` until it returns, `tries` times at most, with the user data's waits between (double
    each time, at most BOOT_RETRY_MAX_S, drawn from their upper half); its result and the tries
    taken, or BootStepFailed with the last try's AWS error."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainfleet.adapters.ec2_fleet import BOOT_RETRY_MAX_S

    attempt, wait = 1, first_wait_s
    while True:
        try:
            return step(), attempt
        except (BotoCoreError, ClientError) as error:
            if attempt == tries:
                raise BootStepFailed(attempt, error) from error
            print(f"node boot: try {attempt} of {tries} failed: {error}", flush=True)
            time.sleep(wait * (0.5 + random.random() / 2))
            attempt, wait = attempt + 1, min(wait * 2, BOOT_RETRY_MAX_S)


def report_boot_failure(reason: str, detail: str) -> None:
    """What the user data does when a step fails: NodeUnhealthy with a failed BOOT_CHECK, sent as
    this instance with its own role (a failure to send it is printed: the console still says why)."""
    import boto3
    from botocore.config import Config

    from node.metadata import MetadataClient
    from trainfleet.adapters.ec2_fleet import BOOT_REQUEST_ATTEMPTS
    from trainfleet.core.events import BOOT_CHECK, HealthCheckResult, NodeUnhealthy, put_events_entry

    try:
        identity = MetadataClient().identity()
        events = boto3.client("events", config=Config(region_name=identity.region, retries={
            "mode": "standard", "max_attempts": BOOT_REQUEST_ATTEMPTS}))
        report = NodeUnhealthy(run_name=os.environ["TRAINFLEET_RUN_NAME"], attempt=0,
                               instance_id=identity.instance_id, reason=reason,
                               checks=[HealthCheckResult(name=BOOT_CHECK, passed=False, detail=detail)])
        events.put_events(Entries=[put_events_entry(report, os.environ["TRAINFLEET_EVENT_BUS"], identity.arn)])
    except Exception as error:  # whatever kept it from being sent: the console is the last word
        print(f"node boot: the failure could not be reported: {error}", flush=True)


def main(agent_argv: list[str]) -> None:
    import boto3
    from botocore.config import Config

    from localcloud.in_place import exec_in_place, runnable
    from localcloud.warm_image import forked_from_image
    from trainfleet.adapters.ec2_fleet import BOOT_REQUEST_ATTEMPTS, BOOT_RETRY_S, BOOT_STEP_TRIES
    from trainfleet.core.events import BOOT_FAILED_AT, BOOT_STEPS

    bucket = os.environ["TRAINFLEET_BUCKET"]
    s3 = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": BOOT_REQUEST_ATTEMPTS}))
    step = BOOT_STEPS[2]  # copying the artifacts: the one step of the user data that calls AWS before the agent
    try:
        copied, tries = retried(lambda: copy_artifacts(s3, bucket, os.environ["LOCALCLOUD_INSTANCE_ID"], Path("wheels")),
                                BOOT_STEP_TRIES, float(os.environ.get("TRAINFLEET_BOOT_RETRY_S", BOOT_RETRY_S)))
    except BootStepFailed as error:
        reason = f"{BOOT_FAILED_AT}{step} (exit 1, {error.tries} tries)"
        print(f"node boot failed: {reason}: {error}; the agent is not started", flush=True)
        report_boot_failure(reason, str(error))
        while True:  # the instance stays up without an agent, as after a failed user data script
            time.sleep(3600)
    print(f"node boot: copied {', '.join(copied)} in {tries} tries; starting the agent", flush=True)
    if forked_from_image() and runnable(agent_argv):
        exec_in_place(agent_argv)  # the image has the agent loaded
    os.execvp(agent_argv[0], agent_argv)


if __name__ == "__main__":
    main(sys.argv[1:])
