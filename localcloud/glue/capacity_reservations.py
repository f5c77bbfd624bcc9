"""EC2 Capacity Reservations, which moto lacks: On-Demand Capacity Reservations and Capacity
Blocks for ML.

- CreateCapacityReservation (an ODCR, optionally in a cluster placement group: PlacementGroupArn)
  and DescribeCapacityReservations (by id; an unknown id is
  InvalidCapacityReservationId.NotFound). `LocalCloud.create_capacity_block` stands for buying
  a Capacity Block (PurchaseCapacityBlock takes an offering from DescribeCapacityBlockOfferings,
  which the local cloud does not sell): a reservation of type capacity-block with an end date.
- A launch that targets a reservation (the launch template's CapacityReservationSpecification)
  is held to EC2's documented terms, `launch_terms`: the reservation exists and is active, has
  the instance type, lies in the subnet's zone, and, made in a cluster placement group, is used
  only by instances launched into that group; a Capacity Block only by a launch with market
  type capacity-block, which in turn needs one. The reservation's free instances bind the
  launch instead of the zone's capacity (ReservationCapacityExceeded beyond them), and the
  instances count against it until they terminate.
- EC2 begins terminating a Capacity Block's instances 30 minutes before its end; the local
  cloud does not run that clock (a run's own stop comes before it: lifecycle.reservation).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from moto.core.responses import ActionResult
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.responses import EC2Response

from localcloud.glue.ec2_state import InterfaceError, placement_groups


@dataclass
class CapacityReservation:
    """A Capacity Reservation as DescribeCapacityReservations reports it."""

    instance_type: str
    availability_zone: str
    total: int
    region: str
    account_id: str
    capacity_block: bool = False
    end_date: datetime | None = None
    placement_group: str | None = None
    """The name of the cluster placement group it was made in."""
    match_criteria: str = "open"
    start_date: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    reservation_id: str = field(default_factory=lambda: "cr-" + uuid.uuid4().hex[:17])

    def state(self, now: datetime) -> str:
        if now < self.start_date:
            return "scheduled"
        return "expired" if self.end_date and now >= self.end_date else "active"

    def used(self, backend: Any) -> int:
        return sum(1 for instance in backend.all_instances()
                   if getattr(instance, "localcloud_reservation", None) == self.reservation_id
                   and instance.state != "terminated")

    def describe(self, backend: Any) -> dict[str, Any]:
        arn_prefix = f"arn:aws:ec2:{self.region}:{self.account_id}"
        described = {
            "CapacityReservationId": self.reservation_id, "OwnerId": self.account_id,
            "CapacityReservationArn": f"{arn_prefix}:capacity-reservation/{self.reservation_id}",
            "InstanceType": self.instance_type, "InstancePlatform": "Linux/UNIX",
            "AvailabilityZone": self.availability_zone, "Tenancy": "default",
            "TotalInstanceCount": self.total, "AvailableInstanceCount": max(0, self.total - self.used(backend)),
            "State": self.state(datetime.now(timezone.utc)), "StartDate": self.start_date,
            "EndDateType": "limited" if self.end_date else "unlimited",
            "InstanceMatchCriteria": self.match_criteria, "CreateDate": self.start_date,
            "ReservationType": "capacity-block" if self.capacity_block else "default",
        }
        if self.end_date:
            described["EndDate"] = self.end_date
        if self.placement_group:
            described["PlacementGroupArn"] = f"{arn_prefix}:placement-group/{self.placement_group}"
        return described


def capacity_reservations(backend: Any) -> dict[str, CapacityReservation]:
    if not hasattr(backend, "localcloud_capacity_reservations"):
        backend.localcloud_capacity_reservations = {}
    return backend.localcloud_capacity_reservations


def add_reservation(backend: Any, reservation: CapacityReservation) -> str:
    """Record a reservation (checked as CreateCapacityReservation checks it); its id."""
    if reservation.total < 1:
        raise EC2ClientError("InvalidParameterValue", f"InstanceCount must be at least 1, got {reservation.total}")
    if reservation.placement_group is not None:
        group = placement_groups(backend).get(reservation.placement_group)
        if group is None or group.strategy != "cluster":
            raise EC2ClientError("InvalidParameterValue", f"PlacementGroupArn: {reservation.placement_group} is not "
                                                          "a cluster placement group of this account")
    capacity_reservations(backend)[reservation.reservation_id] = reservation
    return reservation.reservation_id


def create_capacity_reservation(self: EC2Response) -> ActionResult:
    end = self._get_param("EndDate")
    group_arn = self._get_param("PlacementGroupArn")
    reservation = CapacityReservation(
        instance_type=self._get_param("InstanceType"), availability_zone=self._get_param("AvailabilityZone"),
        total=self._get_int_param("InstanceCount"), region=self.region, account_id=self.current_account,
        end_date=datetime.fromisoformat(end.replace("Z", "+00:00")) if end else None,
        placement_group=group_arn.rsplit("/", 1)[-1] if group_arn else None,
        match_criteria=self._get_param("InstanceMatchCriteria") or "open")
    self.error_on_dryrun()
    add_reservation(self.ec2_backend, reservation)
    return ActionResult({"CapacityReservation": reservation.describe(self.ec2_backend)})


def describe_capacity_reservations(self: EC2Response) -> ActionResult:
    reservations = capacity_reservations(self.ec2_backend)
    ids = self._get_param("CapacityReservationIds", [])
    for reservation_id in ids:
        if reservation_id not in reservations:
            raise _unknown(reservation_id)
    selected = [reservation for reservation in reservations.values() if not ids or reservation.reservation_id in ids]
    return ActionResult({"CapacityReservations": [reservation.describe(self.ec2_backend) for reservation in selected]})


def _unknown(reservation_id: str) -> EC2ClientError:
    return EC2ClientError("InvalidCapacityReservationId.NotFound", _not_found(reservation_id))


def _not_found(reservation_id: str) -> str:
    return f"The capacity reservation ID '{reservation_id}' does not exist"


def launch_terms(backend: Any, template: dict[str, Any], instance_type: str, zone: str,
                 group: str | None) -> CapacityReservation | None:
    """The reservation a launch targets, checked against EC2's terms (InterfaceError, with EC2's
    code, for one it breaks); None when it targets none."""
    target = ((template.get("CapacityReservationSpecification") or {}).get("CapacityReservationTarget") or {})
    reservation_id = target.get("CapacityReservationId")
    block_market = (template.get("InstanceMarketOptions") or {}).get("MarketType") == "capacity-block"
    if reservation_id is None:
        if block_market:
            raise InterfaceError("MarketType capacity-block needs a CapacityReservationId of a Capacity Block",
                                 "InvalidParameterCombination")
        return None
    reservation = capacity_reservations(backend).get(reservation_id)
    if reservation is None:
        raise InterfaceError(_not_found(reservation_id), "InvalidCapacityReservationId.NotFound")
    state = reservation.state(datetime.now(timezone.utc))
    if state != "active":
        raise InterfaceError(f"Capacity Reservation {reservation_id} is {state}")
    if reservation.capacity_block and not block_market:
        raise InterfaceError(f"{reservation_id} is a Capacity Block: launch with MarketType capacity-block",
                             "InvalidParameterCombination")
    if block_market and not reservation.capacity_block:
        raise InterfaceError(f"{reservation_id} is not a Capacity Block, which MarketType capacity-block needs",
                             "InvalidParameterCombination")
    for what, reserved, asked in (("instance type", reservation.instance_type, instance_type),
                                  ("Availability Zone", reservation.availability_zone, zone)):
        if reserved != asked:
            raise InterfaceError(f"Capacity Reservation {reservation_id} is for {what} {reserved}, not {asked}",
                                 "InvalidParameterCombination")
    if reservation.placement_group != (group or None) and reservation.placement_group is not None:
        raise InterfaceError(f"Capacity Reservation {reservation_id} is in placement group "
                             f"{reservation.placement_group}: launch into it, not {group or 'none'}",
                             "InvalidParameterCombination")
    return reservation


def apply() -> None:
    EC2Response.create_capacity_reservation = create_capacity_reservation
    EC2Response.describe_capacity_reservations = describe_capacity_reservations
