"""Reserved capacity: whether a run can use its Capacity Reservation, and when a Capacity Block
makes it stop.

A run that names a reservation (capacity.kind capacity-reservation or capacity-block) launches
only into it, and EC2 holds the launch to its terms: the instance type, the zone (a subnet
elsewhere is refused), the placement group it was made in (its own cluster group, never one the
run makes), its free instances, its dates. Allocate and Recover check them first
(reservation_problem), so a run that cannot fit says why instead of failing at CreateFleet or,
worse, waiting for capacity that will never come.

A Capacity Block ends on its end date, and EC2 begins terminating its instances
BLOCK_TERMINATION_LEAD before that (it warns on EventBridge ten minutes earlier still). A run
in a block stops on its own first: DEFERRED_LEAD before the terminations begin, every worker is
announced leaving (class CAPACITY_BLOCK_END), the emergency checkpoint is taken as for a Spot
warning (lifecycle.spot), and the recovery then ends the run, naming the step to resume from on
the next block.
"""

from dataclasses import dataclass
from datetime import datetime, timedelta

from trainfleet.core.lifecycle.spot import DEFERRED_LEAD
from trainfleet.core.records import FailureClass, FailureReport, RunRecord
from trainfleet.core.runspec import CapacityKind, RunSpec

BLOCK_TERMINATION_LEAD = timedelta(minutes=30)
"""How long before a Capacity Block's end date EC2 begins terminating its instances."""


@dataclass(frozen=True)
class Reservation:
    """A Capacity Reservation as DescribeCapacityReservations reports it (the fields a run needs)."""

    reservation_id: str
    instance_type: str
    availability_zone: str
    total: int
    """TotalInstanceCount."""
    available: int
    """AvailableInstanceCount: not taken by running instances."""
    state: str
    """active, expired, cancelled, pending, failed, scheduled, payment-pending ..."""
    capacity_block: bool
    """ReservationType capacity-block (a Capacity Block for ML) rather than default (an ODCR)."""
    start_at: datetime | None = None
    end_at: datetime | None = None
    """EndDate; None for an ODCR without one."""
    placement_group: str | None = None
    """The cluster placement group it was made in (from PlacementGroupArn), which every instance
    using it must be launched into; None when it has none."""

    @property
    def stop_by(self) -> datetime | None:
        """When a run must have stopped: EC2's terminations of a Capacity Block's instances begin."""
        return self.end_at - BLOCK_TERMINATION_LEAD if self.capacity_block and self.end_at else None


def reservation_problem(spec: RunSpec, reservation: Reservation, now: datetime) -> str | None:
    """Why the run cannot launch into its reservation now; None when it can."""
    named = f"{'Capacity Block' if reservation.capacity_block else 'Capacity Reservation'} {reservation.reservation_id}"
    wants_block = spec.capacity.kind is CapacityKind.CAPACITY_BLOCK
    if wants_block != reservation.capacity_block:
        return (f"{named} is {'a Capacity Block' if reservation.capacity_block else 'an On-Demand Capacity Reservation'}:"
                f" capacity.kind must be {'capacity-block' if reservation.capacity_block else 'capacity-reservation'}")
    if reservation.instance_type != spec.instance_type:
        return f"{named} holds {reservation.instance_type}, the run asks for {spec.instance_type}"
    if reservation.state != "active":
        when = (f" (it starts {reservation.start_at:%Y-%m-%d %H:%M} UTC)"
                if reservation.state == "scheduled" and reservation.start_at else "")
        return f"{named} is {reservation.state}, not active{when}"
    wanted = spec.node_count + spec.spare_count
    if reservation.total < wanted:
        return (f"{named} holds {reservation.total} instances; the run asks for {wanted} "
                f"({spec.node_count} nodes and {spec.spare_count} spares)")
    stop_by = reservation.stop_by
    if stop_by is not None and now >= stop_by - DEFERRED_LEAD:
        return (f"{named} ends at {reservation.end_at:%Y-%m-%d %H:%M} UTC and EC2 terminates its instances from "
                f"{stop_by:%H:%M}: too soon to train")
    return None


def block_end_due(run: RunRecord, now: datetime) -> bool:
    """Whether the run's Capacity Block ends soon enough that the run must stop now: checked on
    the run record alone, at each progress event, until a departure due by then is under way (a
    rebalance recommendation waiting for the next interval checkpoint is not)."""
    stop_by = run.capacity_stop_by
    if stop_by is None or now < stop_by - DEFERRED_LEAD:
        return False
    return run.departure_due_at is None or run.departure_due_at > stop_by


def block_end_report(run: RunRecord, worker_ids: list[str]) -> FailureReport:
    """The failure a Capacity Block's end makes of the current attempt: every worker leaves."""
    return FailureReport(
        failure_class=FailureClass.CAPACITY_BLOCK_END, attempt=run.attempt, instance_ids=sorted(worker_ids),
        message=f"the Capacity Block {run.spec.capacity.reservation_id} ends: EC2 terminates its instances from "
                f"{run.capacity_stop_by:%Y-%m-%d %H:%M} UTC")
