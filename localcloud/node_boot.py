"""What a node's user data does that touches AWS, before it starts the agent: copy the wheelhouse
from s3://BUCKET/artifacts/ with the instance's own role (trainfleet/adapters/ec2_fleet.py
node_user_data runs `aws s3 cp --recursive`, with as many tries). There is no pip install here: the local instance
runs the agent from this tree.

    python -m localcloud.node_boot AGENT_ARGV...     (TRAINFLEET_BUCKET names the bucket)

A copy that fails leaves the instance running without an agent, as a failed user data script
does on EC2: the reason goes to the console log, and the run's boot timeout reports the node
that never registered.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

ARTIFACTS = "artifacts/"
MARKER = "artifacts/README.txt"


def publish_artifacts(s3: Any, bucket: str) -> None:
    """What the deployment publishes for the nodes to install (locally a marker: the agent runs
    from this tree)."""
    s3.put_object(Bucket=bucket, Key=MARKER, Body=b"trainfleet wheelhouse (local cloud: the agent runs from the tree)\n")


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
        print(f"node boot failed: copying s3://{bucket}/{ARTIFACTS} failed: {error}; "
              f"the agent is not started", flush=True)
        while True:  # the instance stays up without an agent, as after a failed user data script
            time.sleep(3600)
    print(f"node boot: copied {len(copied)} artifacts from s3://{bucket}/{ARTIFACTS}; starting the agent", flush=True)
    if forked_from_image() and runnable(agent_argv):
        exec_in_place(agent_argv)  # the image has the agent loaded
    os.execvp(agent_argv[0], agent_argv)


if __name__ == "__main__":
    main(sys.argv[1:])
