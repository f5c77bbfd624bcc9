"""Node liveness records in DynamoDB, and EC2's instance states and status checks: what Recover
looks at before it decides about a crash or a hang that no event pinned on a node
(lifecycle.liveness).

    write_liveness(dynamodb, table, run_name, instance_arn, record)    the agent, at each look
    read_liveness(dynamodb, table, run_name, instance_arns) -> [NodeLiveness]
    instance_troubles(ec2, instance_ids) -> {id: trouble}  leaving (its state) or status check "impaired"

One item a node in the liveness table, keyed `RUN#INSTANCE-ARN` and overwritten in place: a
node's agent is its only writer, and only the newest record matters. The key is the node's own
identity because IAM can bind only a partition key (dynamodb:LeadingKeys) to the caller: the node
role allows PutItem on `${aws:PrincipalTag/trainfleet:run}#${ec2:SourceInstanceARN}` alone, so a
node can write no peer's record (a forged one could get the peer blamed and terminated). A write
is one WCU (the record is far under 1 KB); Recover reads the records of the run's nodes it knows
with BatchGetItem, strongly consistent (512 nodes: 6 calls, 512 RCU, a few times a day). Items
expire LIVENESS_TTL_S after their last write (DynamoDB's TTL).
"""

import time
from typing import Any

from trainfleet.core.lifecycle import IMPAIRED
from trainfleet.core.records import NodeLiveness

__all__ = ["liveness_key", "write_liveness", "read_liveness", "instance_troubles", "LIVENESS_TTL_S"]

LIVENESS_TTL_S = 86_400
"""How long a liveness record outlives its last write: a day, far past any run's use of it."""
_BATCH_KEYS = 100
"""Keys per BatchGetItem (DynamoDB takes at most 100)."""
_UNPROCESSED_PAUSE_S = 0.05
"""First pause before asking again for keys DynamoDB left unprocessed (it doubles)."""
_FILTER_VALUES = 200
"""Instance ids per DescribeInstances filter (EC2 takes up to 200 values per filter)."""
_STATUS_IDS = 100
"""Instance ids per DescribeInstanceStatus call (at most 100 named ids)."""


def liveness_key(run_name: str, instance_arn: str) -> dict[str, Any]:
    """The item key of a node's record: what the node role's PutItem condition names."""
    return {"node": {"S": f"{run_name}#{instance_arn}"}}


def write_liveness(dynamodb: Any, table: str, run_name: str, instance_arn: str, record: NodeLiveness) -> None:
    dynamodb.put_item(TableName=table, Item={
        **liveness_key(run_name, instance_arn), "record": {"S": record.model_dump_json()},
        "expires_at": {"N": str(int(time.time()) + LIVENESS_TTL_S)}})


def read_liveness(dynamodb: Any, table: str, run_name: str, instance_arns: list[str]) -> list[NodeLiveness]:
    """The newest record of each of the nodes (nodes that never reported have none)."""
    keys = [liveness_key(run_name, arn) for arn in dict.fromkeys(instance_arns)]
    found: list[NodeLiveness] = []
    for start in range(0, len(keys), _BATCH_KEYS):
        wanted, pause = {table: {"Keys": keys[start:start + _BATCH_KEYS], "ConsistentRead": True}}, _UNPROCESSED_PAUSE_S
        while wanted:
            answer = dynamodb.batch_get_item(RequestItems=wanted)
            found += [NodeLiveness.model_validate_json(item["record"]["S"]) for item in answer["Responses"].get(table, [])]
            wanted = answer.get("UnprocessedKeys") or {}
            if wanted:  # throttled in part: DynamoDB asks for the rest again, after a pause
                time.sleep(pause)
                pause *= 2
    return found


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
