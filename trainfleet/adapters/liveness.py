"""Node liveness records in DynamoDB, and EC2's instance states and status checks: what Recover
looks at before it decides about a crash or a hang that no event pinned on a node
(lifecycle.liveness).

    write_liveness(dynamodb, table, run_name, record)    the agent, at each look at the control plane
    read_liveness(dynamodb, table, run_name) -> [NodeLiveness]
    instance_troubles(ec2, instance_ids) -> {id: trouble}  leaving (its state) or status check "impaired"

One item a node in the liveness table (pk `run`, sk `instance`), overwritten in place: a node's
agent is its only writer, and only the newest record matters. A write is one WCU (the record is
far under 1 KB); Recover reads a run's records with one Query (512 nodes: about 100 KB, one page
of DynamoDB's 1 MB). Items expire LIVENESS_TTL_S after their last write (DynamoDB's TTL).
"""

import time
from typing import Any

from trainfleet.core.lifecycle import IMPAIRED
from trainfleet.core.records import NodeLiveness

__all__ = ["write_liveness", "read_liveness", "instance_troubles", "LIVENESS_TTL_S"]

LIVENESS_TTL_S = 86_400
"""How long a liveness record outlives its last write: a day, far past any run's use of it."""
_FILTER_VALUES = 200
"""Instance ids per DescribeInstances filter (EC2 takes up to 200 values per filter)."""
_STATUS_IDS = 100
"""Instance ids per DescribeInstanceStatus call (at most 100 named ids)."""


def write_liveness(dynamodb: Any, table: str, run_name: str, record: NodeLiveness) -> None:
    dynamodb.put_item(TableName=table, Item={
        "run": {"S": run_name}, "instance": {"S": record.instance_id},
        "record": {"S": record.model_dump_json()}, "expires_at": {"N": str(int(time.time()) + LIVENESS_TTL_S)}})


def read_liveness(dynamodb: Any, table: str, run_name: str) -> list[NodeLiveness]:
    """Every node's newest record (nodes that never reported have none)."""
    pages = dynamodb.get_paginator("query").paginate(
        TableName=table, ConsistentRead=True, KeyConditionExpression="#run = :run",
        ExpressionAttributeNames={"#run": "run"}, ExpressionAttributeValues={":run": {"S": run_name}})
    return [NodeLiveness.model_validate_json(item["record"]["S"]) for page in pages for item in page["Items"]]


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
