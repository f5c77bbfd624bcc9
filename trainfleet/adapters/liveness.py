"""Node liveness records in S3, and EC2's instance states and status checks: what Recover looks
at before it decides about a crash or a hang that no event pinned on a node (lifecycle.liveness).

    write_liveness(s3, bucket, run_name, record)       the agent, at each look at the control plane
    read_liveness(s3, bucket, run_name) -> [NodeLiveness]
    instance_troubles(ec2, instance_ids) -> {id: trouble}  leaving (its state) or status check "impaired"

One object per node, `runs/RUN/liveness/<instance>.json`, overwritten in place: a node's agent
is its only writer, and only the newest record matters.
"""

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainfleet.contracts import NodeLiveness
from trainfleet.lifecycle import IMPAIRED

__all__ = ["liveness_prefix", "write_liveness", "read_liveness", "instance_troubles"]

_READERS = 16
"""Parallel GETs when Recover reads a large fleet's records (512 nodes: 32 rounds)."""
_FILTER_VALUES = 200
"""Instance ids per DescribeInstances filter (EC2 takes up to 200 values per filter)."""
_STATUS_IDS = 100
"""Instance ids per DescribeInstanceStatus call (at most 100 named ids)."""


def liveness_prefix(run_name: str) -> str:
    return f"runs/{run_name}/liveness/"


def write_liveness(s3: Any, bucket: str, run_name: str, record: NodeLiveness) -> None:
    s3.put_object(Bucket=bucket, Key=f"{liveness_prefix(run_name)}{record.instance_id}.json",
                  Body=record.model_dump_json().encode(), ContentType="application/json")


def read_liveness(s3: Any, bucket: str, run_name: str) -> list[NodeLiveness]:
    """Every node's newest record (nodes that never reported have none)."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=liveness_prefix(run_name))
    keys = [item["Key"] for page in pages for item in page.get("Contents", [])]

    def read(key: str) -> NodeLiveness:
        return NodeLiveness.model_validate_json(s3.get_object(Bucket=bucket, Key=key)["Body"].read())

    with ThreadPoolExecutor(max_workers=_READERS) as pool:
        return list(pool.map(read, keys))


def instance_troubles(ec2: Any, instance_ids: list[str]) -> dict[str, str]:
    """instance id -> what EC2 reports wrong with it: its state when it is no longer pending or
    running (shutting-down, terminated, stopping, stopped: it is leaving, whether or not its
    state-change event has arrived yet), else lifecycle.IMPAIRED when its instance or system
    status check failed (a frozen or unreachable instance fails them; EC2 reports them about
    every minute). Instances without trouble, or that EC2 no longer knows, are left out."""
    troubles, running = {}, []
    for start in range(0, len(instance_ids), _FILTER_VALUES):
        # A filter, not InstanceIds: an instance EC2 no longer knows is no error here.
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "instance-id", "Values": instance_ids[start:start + _FILTER_VALUES]}])
        for instance in (instance for page in pages for reservation in page["Reservations"]
                         for instance in reservation["Instances"]):
            state = instance["State"]["Name"]
            if state == "running":
                running.append(instance["InstanceId"])
            elif state != "pending":
                troubles[instance["InstanceId"]] = state
    # Status checks by id (DescribeInstanceStatus documents no instance-id filter): only instances
    # just seen running, which EC2 knows.
    for start in range(0, len(running), _STATUS_IDS):
        statuses = ec2.describe_instance_status(InstanceIds=running[start:start + _STATUS_IDS])["InstanceStatuses"]
        troubles.update({status["InstanceId"]: IMPAIRED for status in statuses
                         if IMPAIRED in (status.get("InstanceStatus", {}).get("Status"),
                                         status.get("SystemStatus", {}).get("Status"))})
    return troubles
