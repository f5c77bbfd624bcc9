"""Node liveness records in S3 and EC2's instance status checks: what Recover looks at before it
decides about a crash or a hang that no event pinned on a node (lifecycle.liveness).

    write_liveness(s3, bucket, run_name, record)       the agent, at each look at the control plane
    read_liveness(s3, bucket, run_name) -> [NodeLiveness]
    impaired_instances(ec2, instance_ids) -> frozenset  instance or system status check "impaired"

One object per node, `runs/RUN/liveness/<instance>.json`, overwritten in place: a node's agent
is its only writer, and only the newest record matters.
"""

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainfleet.contracts import NodeLiveness

__all__ = ["liveness_prefix", "write_liveness", "read_liveness", "impaired_instances"]

_READERS = 16
"""Parallel GETs when Recover reads a large fleet's records (512 nodes: 32 rounds)."""
_STATUS_BATCH = 200
"""Instance ids per DescribeInstanceStatus filter (EC2 takes up to 200 values per filter)."""


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


def impaired_instances(ec2: Any, instance_ids: list[str]) -> frozenset[str]:
    """Instances whose instance or system status check EC2 reports impaired (a frozen or
    unreachable instance fails them; EC2 reports them about every minute)."""
    impaired = set()
    for start in range(0, len(instance_ids), _STATUS_BATCH):
        # A filter, not InstanceIds: an instance EC2 no longer knows is no error here.
        pages = ec2.get_paginator("describe_instance_status").paginate(
            Filters=[{"Name": "instance-id", "Values": instance_ids[start:start + _STATUS_BATCH]}],
            IncludeAllInstances=True)
        for page in pages:
            impaired.update(status["InstanceId"] for status in page["InstanceStatuses"]
                            if "impaired" in (status.get("InstanceStatus", {}).get("Status"),
                                              status.get("SystemStatus", {}).get("Status")))
    return frozenset(impaired)
