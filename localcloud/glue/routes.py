"""A node's calls to AWS go through its subnet's routes, as on AWS.

On AWS a node reaches a service only by a way its subnet's network gives it (trainfleet.core.network:
a gateway or interface endpoint, a NAT route, an internet route with a public address); without
one its packets go nowhere and its connection attempt times out. moto answers every caller. Here
an instance's processes send from the instance's own address (localcloud/instance_site binds their
sockets to it), so the front door (glue/faults.py) knows which instance a request comes from, and
`Routes.blocked(address, service)` (LocalCloud.routes) judges it by the rules Validate uses, over
EC2's view of the network: read through an internal client, the instance's subnet and groups once, its network at
most once every NETWORK_REREAD_S (a changed route table is felt within it, as AWS's routing takes
seconds to change too). An unreachable request is answered UNREACHABLE_STATUS with the reason in
UNREACHABLE_HEADER; the instance's SDK (instance_site) turns that into the connect timeout a
dropped packet gives it, after as long. Requests from any other address pass: the harness's, and
the functions', which AWS runs outside the VPC.

The trainer's S3 client (s3torchconnector's CRT, not Python) sends from the machine's address,
not the instance's: its requests are not routed.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainfleet.adapters.network import subnet_networks
from trainfleet.core.network import Blocked, SubnetNetwork, way_to

if TYPE_CHECKING:
    from localcloud.parts import Instance

__all__ = ["UNREACHABLE_STATUS", "UNREACHABLE_HEADER", "NETWORK_REREAD_S", "Routes"]

UNREACHABLE_STATUS = "504 Gateway Timeout"
UNREACHABLE_HEADER = "x-localcloud-unreachable"
"""The header of the front door's answer to a request its sender's network cannot carry: why."""
NETWORK_REREAD_S = 1.0


@dataclass(frozen=True)
class _Placement:
    """Where an instance sends from: its subnet, security groups and public address (fixed at launch)."""

    subnet_id: str
    group_ids: tuple[str, ...]
    public_ipv4: bool


class Routes:
    """One cloud's instances, their networks as last read, and whether a call of theirs goes through."""

    def __init__(self, at_address: Callable[[str], Instance | None], internal_client: Callable[[str], Any]):
        """`at_address`: the fleet's instance at a private address, if any; `internal_client`: a client
        whose calls are the cloud's own plumbing (read the instances' placements with it)."""
        self._at_address = at_address
        self._internal_client = internal_client
        self._lock = threading.Lock()
        self._ec2: Any = None
        self._placements: dict[str, _Placement | None] = {}
        self._networks: dict[tuple[str, tuple[str, ...]], tuple[float, SubnetNetwork]] = {}

    def blocked(self, address: str | None, service: str) -> str | None:
        """Why the instance at `address` cannot reach `service` (its SigV4 scope's name), or None
        when it can, or when `address` is no instance's."""
        instance = self._at_address(address) if address else None
        if instance is None:
            return None
        with self._lock:
            if self._ec2 is None:
                self._ec2 = self._internal_client("ec2")
            placement = self._placement(instance.instance_id)
            if placement is None:
                return None
            way = way_to(self._network(placement), service, placement.group_ids, placement.public_ipv4)
        return way.why if isinstance(way, Blocked) else None

    def _placement(self, instance_id: str) -> _Placement | None:
        if instance_id not in self._placements:
            reservations = self._ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
            instance = reservations[0]["Instances"][0] if reservations else {}
            self._placements[instance_id] = _Placement(
                instance["SubnetId"], tuple(group["GroupId"] for group in instance.get("SecurityGroups", [])),
                bool(instance.get("PublicIpAddress"))) if instance.get("SubnetId") else None
        return self._placements[instance_id]

    def _network(self, placement: _Placement) -> SubnetNetwork:
        key = (placement.subnet_id, placement.group_ids)
        read_at, network = self._networks.get(key, (-math.inf, None))
        if network is None or time.monotonic() - read_at > NETWORK_REREAD_S:
            network = subnet_networks(self._ec2, [placement.subnet_id], list(placement.group_ids))[0]
            self._networks[key] = (time.monotonic(), network)
        return network
