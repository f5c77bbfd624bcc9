"""What EC2's glue keeps beside moto's backend (its placement groups) and the error a launch is
refused with: the glue of capacity reservations and IAM's resource tags read them here, below
ec2.py, which consults them in turn."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


class InterfaceError(ValueError):
    """A launch EC2 refuses (its NetworkInterfaces, its instance profile), with the error code
    it answers."""

    def __init__(self, message: str, code: str = "InvalidParameterValue"):
        super().__init__(message)
        self.code = code


@dataclass
class PlacementGroup:
    """A placement group as DescribePlacementGroups reports it."""

    group_name: str
    strategy: str
    partition_count: int | None
    spread_level: str | None
    region: str
    account_id: str
    tags: dict[str, str] = field(default_factory=dict)
    group_id: str = field(default_factory=lambda: "pg-" + uuid.uuid4().hex[:17])
    state: str = "available"

    def describe(self) -> dict[str, Any]:
        described = {
            "GroupName": self.group_name, "GroupId": self.group_id, "State": self.state,
            "Strategy": self.strategy,
            "GroupArn": f"arn:aws:ec2:{self.region}:{self.account_id}:placement-group/{self.group_name}",
            "Tags": [{"Key": key, "Value": value} for key, value in self.tags.items()],
        }
        if self.partition_count is not None:
            described["PartitionCount"] = self.partition_count
        if self.spread_level is not None:
            described["SpreadLevel"] = self.spread_level
        return described


def placement_groups(backend: Any) -> dict[str, PlacementGroup]:
    if not hasattr(backend, "localcloud_placement_groups"):
        backend.localcloud_placement_groups = {}
    return backend.localcloud_placement_groups
