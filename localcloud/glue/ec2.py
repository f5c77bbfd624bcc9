"""EC2 glue: instance lifecycle events, the local fleet, placement groups and EFA interfaces.

Patches to moto, each replacing something it lacks or drops:

- `EC2Backend.run_instances` (RunInstances, CreateFleet, Spot requests all go through it):
  instances now start `pending` and reach `running` after the boot delay, with "EC2 Instance
  State-change Notification" events, and become local fleet instances; their network
  interfaces keep InterfaceType and NetworkCardIndex (moto dropped both, and keyed interfaces
  by DeviceIndex alone, so the DeviceIndex-1 interfaces of several network cards overwrote one
  another); the launch template's NetworkInterfaces and Placement.GroupName apply (moto
  ignored them), also for CreateFleet, which did not pass the template on at all; so does its
  IamInstanceProfile (moto associated a profile only when RunInstances named one itself, so a
  fleet's instances had no role and no credentials in their instance metadata).
- `terminate_instances` / `stop_instances` / `start_instances`: shutting-down then terminated,
  stopping then stopped, pending then running, with events, ending or restarting processes.
- Placement groups: Create/Describe/DeletePlacementGroup did not exist (NotImplementedError);
  they now keep name, strategy, partition count, spread level and tags, and Describe takes EC2's
  filters (tag:<key>, tag-key, group-name, group-arn, state, strategy, spread-level; another is
  InvalidParameterValue); RunInstances into an unknown group fails with
  InvalidPlacementGroup.Unknown, as on AWS.
- `Attachment.network_card_index` was always 0; it is now the interface's card.
- Capacity Reservations and Capacity Blocks: glue/capacity_reservations.py (a launch into one
  is held to its terms and its free instances instead of the zone's capacity).
- Capacity: moto always has capacity. `LocalCloud.set_capacity(type, zone, n)` caps the
  instances of a type that may be alive (not terminated) in a zone at once. Beyond it,
  RunInstances fails with InsufficientInstanceCapacity; an on-demand CreateFleet (`instant`) launches what fits, or nothing when that is
  below OnDemandOptions.MinTargetCapacity, and lists the rest under `Errors` with ErrorCode
  InsufficientInstanceCapacity, as EC2 answers. Spot launches are not capped.
- vCPU quota: `LocalCloud.set_vcpu_quota(n)` caps the vCPUs of the account's on-demand
  instances not terminated or stopped (those shutting down count, as on EC2); beyond it a launch
  gets VcpuLimitExceeded, RunInstances as an error, an instant fleet in its Errors, launching
  what fits as for capacity.
- Instance status checks (DescribeInstanceStatus): moto always answered "ok". An instance the
  local fleet froze (`fleet.hang`) no longer answers, so, as EC2 reports an instance that stops
  responding, its instance status check is now "impaired" (reachability "failed").
- CreateFleet ClientToken: moto ignored it. As EC2 documents for idempotent requests, a
  repeated token with the same parameters now gets the first answer and launches nothing,
  and with other parameters fails with IdempotentParameterMismatch.
- Terminated instances: moto kept them for ever; EC2 forgets one about an hour after it
  terminated, and then answers InvalidInstanceID.NotFound for its id. `forget_terminated`
  (LocalCloud.forget_terminated_instances) does that at once, for all of them.
- GetConsoleOutput: moto answered a fixed sample boot log. A local instance's console is what
  its processes wrote (the node agent, the trainer), of which EC2 gives the latest 64 KB.

Instance types are checked against moto's catalogue (LocalCloud turns on moto's own
validation), and network interfaces as EC2 checks them (`interface_requests`): each card's
interface types and count, the type's EFA count, and AssociatePublicIpAddress on a launch with
several interfaces (InvalidParameterCombination, even set to false); such a launch gets no public
IPv4 address (moto gave its primary interface one in a subnet that maps them), and one that names
no security group gets its VPC's default group (moto gave it none). So is the instance profile:
one IAM does not have, or made under IAM_PROPAGATION_S ago (IAM is eventually consistent), is
InvalidParameterValue. RunInstances fails with the error; an instant CreateFleet lists it under
`Errors` and launches nothing, as EC2 answers.
"""

from __future__ import annotations

import base64
import threading
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moto.ec2.exceptions import EC2ClientError, InvalidInstanceTypeError
from moto.ec2.models import EC2Backend, ec2_backends
from moto.ec2.models.elastic_network_interfaces import Attachment
from moto.ec2.models.fleets import Fleet
from moto.ec2.models.instance_types import INSTANCE_TYPES
from moto.ec2.models.instances import Instance, Reservation
from moto.ec2.responses import EC2Response
from moto.ec2.responses.fleets import Fleets
from moto.ec2.responses import instances as instances_responses
from moto.ec2.responses.instances import InstanceResponse
from moto.iam.exceptions import NotFoundException
from moto.core.responses import ActionResult
from moto.core.utils import utcnow
from moto.ec2.responses.general import General
from moto.ec2.utils import Base64EncodedString

from localcloud.glue import active_cloud
from localcloud.glue.ec2_state import InterfaceError, PlacementGroup, placement_groups

if TYPE_CHECKING:
    from localcloud.parts import Ec2Cloud, Place
    from localcloud.glue.capacity_reservations import CapacityReservation

STATE_CODES = {"pending": 0, "running": 16, "shutting-down": 32, "terminated": 48,
               "stopping": 64, "stopped": 80}
"""EC2's numeric state codes."""

PLACEMENT_STRATEGIES = ("cluster", "spread", "partition")


def ec2_backend(cloud: Place) -> Any:
    return ec2_backends[cloud.account_id][cloud.region]


def set_moto_state(cloud: Place, instance_id: str, state: str) -> None:
    instance = ec2_backend(cloud).get_instance(instance_id)
    instance._state.name = state
    instance._state.code = STATE_CODES[state]


def forget_terminated(cloud: Place) -> list[str]:
    """Drop every terminated instance from EC2's view, as EC2 does about an hour after an
    instance terminates: DescribeInstances no longer lists it, and naming it (TerminateInstances,
    DescribeInstances with InstanceIds) fails with InvalidInstanceID.NotFound. The ids dropped."""
    backend = ec2_backend(cloud)
    dropped = []
    with _fleet_creation_lock:
        for reservation_id, reservation in list(backend.reservations.items()):
            gone = [instance for instance in reservation.instances if instance.state == "terminated"]
            reservation.instances = [instance for instance in reservation.instances if instance not in gone]
            dropped += [instance.id for instance in gone]
            if not reservation.instances:
                del backend.reservations[reservation_id]
    return dropped


def set_private_ip(cloud: Place, instance_id: str, address: str) -> None:
    """Make `address` the primary private IPv4 address of the instance's primary interface."""
    primary = ec2_backend(cloud).get_instance(instance_id).nics[0]
    primary.private_ip_address = address
    primary.private_ip_addresses = [{"Primary": True, "PrivateIpAddress": address}]


# --- network interfaces ------------------------------------------------------------------

@dataclass(frozen=True)
class InterfaceRequest:
    """One network interface asked for in RunInstances or a launch template."""

    network_card_index: int
    """Which network card it sits on (p4d.24xlarge has 4, p5.48xlarge 32)."""
    device_index: int
    """Its device index on the instance; 0 is the primary interface."""
    interface_type: str
    """"interface" (ENA), "efa" or "efa-only"."""


def interface_requests(instance_type: str, specs: list[dict[str, Any]]) -> list[InterfaceRequest]:
    """Check NetworkInterfaces entries against the instance type's network cards, as EC2 does:
    each card's interface types and interface count, the type's EFA count, and a public address
    asked for on a launch with several interfaces (which EC2 refuses even when the answer is no).

    Raises InterfaceError naming the entry and field at fault."""
    catalogue = INSTANCE_TYPES.get(instance_type)
    if catalogue is None:
        raise InterfaceError(f"InstanceType: unknown instance type {instance_type!r}")
    if len(specs) > 1 and any("AssociatePublicIpAddress" in spec for spec in specs):
        raise InterfaceError("The associatePublicIPAddress parameter cannot be specified when launching with "
                             "multiple network interfaces.", "InvalidParameterCombination")
    network = catalogue["NetworkInfo"]
    cards = {card["NetworkCardIndex"]: card for card in network["NetworkCards"]}
    requests: list[InterfaceRequest] = []
    for position, spec in enumerate(specs):
        where = f"NetworkInterfaces[{position}]"
        try:
            card_index = int(spec.get("NetworkCardIndex", 0))
            device_index = int(spec.get("DeviceIndex", 0))
        except (TypeError, ValueError) as exc:
            raise InterfaceError(f"{where}: NetworkCardIndex and DeviceIndex must be integers: {exc}") from exc
        interface_type = spec.get("InterfaceType", "interface")
        if card_index not in cards:
            raise InterfaceError(f"{where}.NetworkCardIndex: {card_index} is out of range for "
                                 f"{instance_type} ({len(cards)} network card(s))")
        if interface_type not in cards[card_index]["InterfaceTypes"]:
            raise InterfaceError(f"{where}.InterfaceType: {interface_type!r} is not supported by "
                                 f"{instance_type} network card {card_index} "
                                 f"(supports {cards[card_index]['InterfaceTypes']})")
        request = InterfaceRequest(card_index, device_index, interface_type)
        if any((r.network_card_index, r.device_index) == (card_index, device_index) for r in requests):
            raise InterfaceError(f"{where}: NetworkCardIndex {card_index} with DeviceIndex "
                                 f"{device_index} is requested twice")
        on_card = sum(1 for r in requests if r.network_card_index == card_index) + 1
        if on_card > cards[card_index]["MaximumNetworkInterfaces"]:
            raise InterfaceError(f"{where}: network card {card_index} of {instance_type} takes at most "
                                 f"{cards[card_index]['MaximumNetworkInterfaces']} network interfaces")
        requests.append(request)
    efa = sum(1 for r in requests if r.interface_type in ("efa", "efa-only"))
    efa_limit = network.get("EfaInfo", {}).get("MaximumEfaInterfaces", 0)
    if efa > efa_limit:
        raise InterfaceError(f"NetworkInterfaces: {efa} EFA interfaces requested; {instance_type} "
                             f"supports at most {efa_limit}")
    if requests and not any(r.network_card_index == 0 and r.device_index == 0 for r in requests):
        raise InterfaceError("NetworkInterfaces: the primary interface (NetworkCardIndex 0, "
                             "DeviceIndex 0) is missing")
    return requests


def _attach_interfaces(backend: Any, instance: Any, requests: list[InterfaceRequest]) -> None:
    """Give the instance the interfaces asked for (moto made only the card-0 ones)."""
    for request in requests:
        if request.network_card_index == 0 and request.device_index in instance.nics:
            eni = instance.nics[request.device_index]
        else:
            eni = backend.create_network_interface(
                instance.nics[0].subnet, None, device_index=request.device_index,
                delete_on_termination=True,
                description=f"network card {request.network_card_index}")
            instance.attach_eni(eni, request.device_index)
            # moto keys interfaces by DeviceIndex; other cards reuse DeviceIndex 1, so key
            # those by (card, device) to keep them all.
            instance.nics.pop(request.device_index)
            instance.nics[(request.network_card_index, request.device_index)] = eni
        eni.interface_type = request.interface_type
        eni.network_card_index = request.network_card_index
    if len(requests) > 1:  # EC2 gives no public IPv4 address to a launch of several interfaces
        instance.nics[0].public_ip = None


_attachment_init = Attachment.__init__


def _attachment_init_with_card(self: Attachment, eni: Any) -> None:
    _attachment_init(self, eni)
    self.network_card_index = getattr(eni, "network_card_index", 0)


# --- placement groups (kept in ec2_state.py) -----------------------------------------------

def _unknown_group(name: str) -> EC2ClientError:
    return EC2ClientError("InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown.")


def create_placement_group(self: EC2Response) -> ActionResult:
    name = self._get_param("GroupName")
    strategy = self._get_param("Strategy")
    partition_count = self._get_int_param("PartitionCount")
    spread_level = self._get_param("SpreadLevel")
    if not name:
        raise EC2ClientError("MissingParameter", "The request must contain the parameter GroupName")
    if strategy not in PLACEMENT_STRATEGIES:
        raise EC2ClientError("InvalidParameterValue",
                             f"Strategy: {strategy!r} is not one of {', '.join(PLACEMENT_STRATEGIES)}")
    if partition_count is not None and strategy != "partition":
        raise EC2ClientError("InvalidParameterCombination",
                             "PartitionCount is only valid with the partition strategy")
    groups = placement_groups(self.ec2_backend)
    if name in groups:
        raise EC2ClientError("InvalidPlacementGroup.Duplicate",
                             f"The Placement Group '{name}' already exists.")
    tags = self._parse_tag_specification().get("placement-group", {})
    self.error_on_dryrun()
    group = PlacementGroup(name, strategy, partition_count, spread_level, self.region,
                           self.current_account, tags)
    groups[name] = group
    return ActionResult({"PlacementGroup": group.describe()})


def describe_placement_groups(self: EC2Response) -> ActionResult:
    groups = placement_groups(self.ec2_backend)
    names = self._get_param("GroupNames", [])
    ids = self._get_param("GroupIds", [])
    for name in names:
        if name not in groups:
            raise _unknown_group(name)
    filters = self._filters_from_querystring()
    for name in filters:
        if name not in PLACEMENT_GROUP_FILTERS and name != "tag-key" and not name.startswith("tag:"):
            raise EC2ClientError("InvalidParameterValue", f"The filter '{name}' is invalid")
    selected = [group for group in groups.values()
                if (not names or group.group_name in names) and (not ids or group.group_id in ids)
                and all(_matches(group, name, values) for name, values in filters.items())]
    return ActionResult({"PlacementGroups": [group.describe() for group in selected]})


PLACEMENT_GROUP_FILTERS = {"group-name": "GroupName", "group-arn": "GroupArn", "state": "State",
                           "strategy": "Strategy", "spread-level": "SpreadLevel"}
"""DescribePlacementGroups' filters besides tag:<key> and tag-key, and the fields they match."""


def _matches(group: PlacementGroup, name: str, values: list[str]) -> bool:
    """Whether the group passes one filter: any of its values (filters of a request all hold)."""
    if name.startswith("tag:"):
        return group.tags.get(name[len("tag:"):]) in values
    if name == "tag-key":
        return any(key in values for key in group.tags)
    return group.describe().get(PLACEMENT_GROUP_FILTERS[name]) in values


def delete_placement_group(self: EC2Response) -> ActionResult:
    name = self._get_param("GroupName")
    groups = placement_groups(self.ec2_backend)
    if name not in groups:
        raise _unknown_group(name)
    in_use = [instance.id for instance in self.ec2_backend.all_instances()
              if instance.placement.group_name == name and instance.state != "terminated"]
    if in_use:
        raise EC2ClientError("InvalidPlacementGroup.InUse",
                             f"The Placement Group '{name}' is in use by {', '.join(in_use)}.")
    self.error_on_dryrun()
    del groups[name]
    return ActionResult({})


# --- capacity ----------------------------------------------------------------------------

_capacity_lock = threading.Lock()
"""Held from the capacity check until the instances exist, so concurrent launches cannot both
take the last free slot."""


def _request_zone(backend: Any, kwargs: dict[str, Any]) -> str:
    """The zone a launch lands in, by moto's own rule: the subnet's, the placement's, else `<region>a`."""
    if kwargs.get("subnet_id"):
        return backend.get_subnet(kwargs["subnet_id"]).availability_zone
    return kwargs.get("placement") or backend.region_name + "a"


def free_capacity(cloud: Ec2Cloud, backend: Any, instance_type: str, zone: str) -> int | None:
    """Instances of the type that may still launch in the zone; None when it is not capped."""
    limit = cloud.capacity_limits.get((instance_type, zone))
    if limit is None:
        return None
    alive = sum(1 for instance in backend.all_instances()
                if instance.instance_type == instance_type and instance.placement.zone == zone
                and instance.state != "terminated")
    return max(0, limit - alive)


def free_vcpu_instances(cloud: Ec2Cloud, backend: Any, instance_type: str) -> int | None:
    """Instances of the type the account's On-Demand vCPU quota still admits; None when unset."""
    if cloud.vcpu_quota is None:
        return None
    used = sum(INSTANCE_TYPES[instance.instance_type]["VCpuInfo"]["DefaultVCpus"]
               for instance in backend.all_instances()
               if instance.state not in ("terminated", "stopped") and getattr(instance, "lifecycle", None) != "spot")
    return max(0, cloud.vcpu_quota - used) // INSTANCE_TYPES[instance_type]["VCpuInfo"]["DefaultVCpus"]


def _vcpu_message(cloud: Ec2Cloud) -> str:
    return (f"You have requested more vCPU capacity than your current vCPU limit of {cloud.vcpu_quota} allows for "
            "the instance bucket that the specified instance type belongs to. Please visit "
            "the Service Quotas console to request an adjustment to this limit.")


def _insufficient_message(instance_type: str, zone: str) -> str:
    return (f"We currently do not have sufficient {instance_type} capacity in the Availability Zone "
            f"you requested ({zone}).")


def _fleet_grant(fleet: Fleet, count: int, free: int) -> int:
    """How many of `count` an on-demand instant fleet launches now: what fits, or none when the
    fleet would stay below its MinTargetCapacity."""
    granted = min(count, free)
    minimum = int((fleet.on_demand_options or {}).get("MinTargetCapacity") or 0)
    return granted if len(fleet.on_demand_instances) + granted >= minimum else 0


_fleet_token_lock = threading.Lock()
"""Held from the token lookup until the answer is kept, so one token launches one fleet."""


def _fleet_answers(backend: Any) -> dict[str, tuple[dict[str, Any], ActionResult]]:
    """CreateFleet answers by ClientToken, each with the other parameters of its request."""
    if not hasattr(backend, "localcloud_fleet_answers"):
        backend.localcloud_fleet_answers = {}
    return backend.localcloud_fleet_answers


FLEET_TARGET_CAPACITY_QUOTA = 10_000
"""EC2's quota on the target capacity of one EC2 Fleet (EC2 Fleet quotas, user guide)."""


def _create_fleet_response(self: Fleets) -> ActionResult:
    target = int(self._get_param("TargetCapacitySpecification", {}).get("TotalTargetCapacity") or 0)
    if target > FLEET_TARGET_CAPACITY_QUOTA:
        raise EC2ClientError("InvalidParameterValue", f"TotalTargetCapacity {target} is above the "
                                                      f"{FLEET_TARGET_CAPACITY_QUOTA:,} an EC2 Fleet may target")
    token = self._get_param("ClientToken")
    if not token:
        return _create_fleet_with_errors(self)
    request = {key: value for key, value in self._get_params().items() if key != "ClientToken"}
    with _fleet_token_lock:
        answers = _fleet_answers(self.ec2_backend)
        if token in answers:
            first_request, answer = answers[token]
            if request != first_request:
                raise EC2ClientError("IdempotentParameterMismatch",
                                     f"ClientToken {token!r} was used by a CreateFleet with other parameters")
            return answer
        answer = _create_fleet_with_errors(self)
        answers[token] = (request, answer)
        return answer


_fleet_creation_lock = threading.RLock()
"""Held while moto creates a fleet. Its instances stay pending until CreateFleet has answered
(`after_fleet_creation`), as on EC2, where a fleet's instances boot for tens of seconds while
the call answers in a few: booting agents would otherwise crowd the local endpoint the call
itself runs on (512 nodes took minutes to allocate). And an instance is no one's to end before
then (moto's terminate of one fails on the fleet it has not recorded yet)."""


def after_fleet_creation() -> None:
    """Return once no CreateFleet is under way."""
    with _fleet_creation_lock:
        pass


def _create_fleet_with_errors(self: Fleets) -> ActionResult:
    _request.fleet_errors = []
    try:
        with _fleet_creation_lock:
            result = _moto_create_fleet_response(self)
        if _request.fleet_errors:
            result.result["Errors"] = _request.fleet_errors
        return result
    finally:
        _request.fleet_errors = []


# --- instance lifecycle ------------------------------------------------------------------

_request = threading.local()
"""What the RunInstances request or the CreateFleet under way said that moto drops."""

_moto_run_instances_response = InstanceResponse.run_instances
_moto_run_instances = EC2Backend.run_instances
_moto_filter_iam_instance_profiles = instances_responses.filter_iam_instance_profiles
_moto_terminate = EC2Backend.terminate_instances
_moto_stop = EC2Backend.stop_instances
_moto_start = EC2Backend.start_instances
_moto_fleet_init = Fleet.__init__
_moto_fleet_instances = Fleet.instances
_moto_create_fleet_response = Fleets.create_fleet
_moto_request_spot_instances = EC2Backend.request_spot_instances


def _run_instances_response(self: InstanceResponse) -> ActionResult:
    _request.placement_group = self._get_param("Placement.GroupName")
    try:
        return _moto_run_instances_response(self)
    finally:
        _request.placement_group = None


def _fleet_init(self: Fleet, ec2_backend: Any, fleet_id: str, on_demand_options: dict[str, Any],
                spot_options: dict[str, Any], target: dict[str, Any], *args: Any) -> None:
    # moto launches only on-demand and spot targets: a Capacity Block fleet launched nothing. Its
    # instances launch as on-demand ones do (the template names the block) and are reported
    # with the lifecycle capacity-block, as EC2 reports them.
    self.localcloud_lifecycle = "capacity-block" if target.get("DefaultTargetCapacityType") == "capacity-block" else None
    if spot_options is not None and "AllocationStrategy" not in spot_options:
        # Optional in EC2's SpotOptionsRequest (lowest-price when not given); moto requires it.
        spot_options = {**spot_options, "AllocationStrategy": "lowest-price"}
    if self.localcloud_lifecycle:
        target = {**target, "DefaultTargetCapacityType": "on-demand"}
    _request.fleet = self
    try:
        _moto_fleet_init(self, ec2_backend, fleet_id, on_demand_options, spot_options, target, *args)
    finally:
        _request.fleet = None


def _fleet_instances(self: Fleet) -> list[dict[str, Any]] | None:
    instances = _moto_fleet_instances.fget(self)
    lifecycle = getattr(self, "localcloud_lifecycle", None)
    return instances if not lifecycle or instances is None else [{**item, "Lifecycle": lifecycle} for item in instances]


def _fleet_launch_template(backend: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(launch template spec, template data merged with overrides) of the fleet spec that
    this run_instances call serves, found by instance type and subnet."""
    fleet = getattr(_request, "fleet", None)
    if fleet is None:
        return {}, {}
    for spec in fleet.launch_specs:
        if spec.instance_type == kwargs.get("instance_type") and spec.subnet_id == kwargs.get("subnet_id"):
            template_spec = spec.launch_template_spec
            data = dict(backend._get_template_from_args(template_spec).data)
            data.update(spec.overrides or {})
            return template_spec, data
    return {}, {}


def _run_instances(self: Any, image_id: str, count: int, user_data: Any,
                   security_group_names: list[str], **kwargs: Any) -> Any:
    cloud = active_cloud()
    if cloud is None:
        return _moto_run_instances(self, image_id, count, user_data, security_group_names, **kwargs)
    template_spec, template = _fleet_launch_template(self, kwargs)
    if kwargs.get("launch_template"):
        template_spec = kwargs["launch_template"]
        template = self._get_template_from_args(template_spec).data
    group = (getattr(_request, "placement_group", None)
             or (template.get("Placement") or {}).get("GroupName"))
    if group and group not in placement_groups(self):
        raise _unknown_group(group)
    instance_type = kwargs.get("instance_type")
    if kwargs.get("is_instance_type_default") and template.get("InstanceType"):
        instance_type = template["InstanceType"]
    instance_type = instance_type or "m1.small"
    if instance_type not in INSTANCE_TYPES:
        raise InvalidInstanceTypeError(instance_type)
    specs = kwargs.get("nics") or template.get("NetworkInterfaces") or []
    # Imported here: the reservations module builds on this one's interface errors and groups.
    from localcloud.glue.capacity_reservations import launch_terms

    try:
        reservation = launch_terms(self, template, instance_type, _request_zone(self, kwargs), group)
        requests = interface_requests(instance_type, specs)
        check_instance_profile(cloud, kwargs.get("iam_instance_profile_arn") or kwargs.get("iam_instance_profile_name")
                               or (template.get("IamInstanceProfile") or {}).get("Arn")
                               or (template.get("IamInstanceProfile") or {}).get("Name"))
    except InterfaceError as exc:
        if getattr(_request, "fleet", None) is None:
            raise EC2ClientError(exc.code, str(exc)) from exc
        # An instant fleet answers a launch it cannot make in its Errors, launching nothing.
        spot = kwargs.get("lifecycle") == "spot"
        _fleet_error(template_spec, "spot" if spot else "on-demand", exc.code, str(exc))
        if spot:
            raise _SpotLaunchRefused from exc
        return Reservation(f"r-{uuid.uuid4().hex[:17]}", cloud.account_id)
    if kwargs.get("nics"):  # moto builds card-0 interfaces; the glue adds the other cards
        kwargs["nics"] = [spec for spec in kwargs["nics"] if int(spec.get("NetworkCardIndex", 0)) == 0]
    with _capacity_lock:
        launched = _launch_within_capacity(self, cloud, instance_type, template_spec, image_id, count,
                                           user_data, security_group_names, kwargs, reservation)
    for instance in launched.instances:
        instance.localcloud_reservation = reservation.reservation_id if reservation else None
        _attach_interfaces(self, instance, requests)
        # The instance's groups are its primary interface's (moto left a template's out), else its VPC's default.
        named = next((spec.get("Groups") for spec in specs if int(spec.get("NetworkCardIndex", 0)) == 0
                      and int(spec.get("DeviceIndex", 0)) == 0 and spec.get("Groups")), None)
        primary = instance.nics[0]
        if named:
            instance.security_groups = [self.get_security_group_from_id(group_id) for group_id in named]
        elif not instance.security_groups and primary.subnet is not None:
            default = self.get_security_group_from_name("default", vpc_id=primary.subnet.vpc_id)
            instance.security_groups = [default] if default else []
        instance.placement.group_name = group or ""
        profile = template.get("IamInstanceProfile") or {}
        if profile and not (kwargs.get("iam_instance_profile_name") or kwargs.get("iam_instance_profile_arn")):
            self.associate_iam_instance_profile(instance_id=instance.id, iam_instance_profile_name=profile.get("Name"),
                                                iam_instance_profile_arn=profile.get("Arn"))
        if template_spec and not kwargs.get("launch_template"):
            template_version = self._get_template_from_args(template_spec)
            instance.add_tags({"aws:ec2launchtemplate:id": template_version.template.id,
                               "aws:ec2launchtemplate:version": str(template_version.number)})
        cloud.fleet.launched(instance)
    return launched


IAM_PROPAGATION_S = 5.0
"""Seconds (scaled, LocalCloud.scaled) before EC2 sees a new instance profile. IAM documents its
changes as eventually consistent, taking seconds to reach other services: a launch naming a
profile made just before is refused as invalid, and must be tried again."""


def check_instance_profile(cloud: Ec2Cloud, profile: str | None) -> None:
    """Raise InterfaceError (InvalidParameterValue, EC2's words) for a launch's instance profile
    (an ARN or a name) that IAM does not have, or made under IAM_PROPAGATION_S ago."""
    if not profile:
        return
    from localcloud.glue.iam import instance_profile_named

    found = instance_profile_named(cloud.account_id, profile.rsplit("/", 1)[-1])
    young = found is not None and (utcnow() - found.create_date).total_seconds() < cloud.scaled(IAM_PROPAGATION_S)
    if found is None or young:
        raise InterfaceError(_invalid_profile(profile))


def _invalid_profile(profile: str) -> str:
    """EC2's InvalidParameterValue message for an instance profile (ARN or name) it does not know."""
    by_arn = profile.startswith("arn:")
    return (f"Value ({profile}) for parameter iamInstanceProfile.{'arn' if by_arn else 'name'} is invalid. "
            f"Invalid IAM Instance Profile {'ARN' if by_arn else 'name'}")


def _filter_iam_instance_profiles(account_id: str, partition: str, iam_instance_profile_arn: str | None,
                                  iam_instance_profile_name: str | None) -> Any:
    # moto's RunInstances looks the profile up first and answers IAM's NoSuchEntity; EC2 answers
    # InvalidParameterValue.
    try:
        return _moto_filter_iam_instance_profiles(account_id, partition, iam_instance_profile_arn,
                                                  iam_instance_profile_name)
    except NotFoundException:
        if active_cloud() is None:
            raise
        raise EC2ClientError("InvalidParameterValue",
                             _invalid_profile(iam_instance_profile_arn or iam_instance_profile_name or "")) from None


class _SpotLaunchRefused(Exception):
    """A fleet's Spot launch that EC2 answers in the fleet's Errors (recorded there): moto makes a
    Spot request for each instance and takes the instance of every launch (an empty one failed
    the whole CreateFleet with moto's IndexError, a 500), so the requests end there, none made."""


def _request_spot_instances(self: Any, *args: Any, **kwargs: Any) -> list[Any]:
    try:
        return _moto_request_spot_instances(self, *args, **kwargs)
    except _SpotLaunchRefused:
        return []  # a refused launch refuses them all: they share one template and profile


def _fleet_error(template_spec: dict[str, Any], lifecycle: str, code: str, message: str) -> None:
    """One entry of the CreateFleet under way's `Errors`, as EC2 lists a launch it could not make."""
    _request.fleet_errors.append({"LaunchTemplateAndOverrides": {"LaunchTemplateSpecification": template_spec},
                                  "Lifecycle": lifecycle, "ErrorCode": code, "ErrorMessage": message})


def _launch_within_capacity(backend: Any, cloud: Ec2Cloud, instance_type: str, template_spec: dict[str, Any],
                            image_id: str, count: int, user_data: Any, security_group_names: list[str],
                            kwargs: dict[str, Any], reservation: CapacityReservation | None) -> Any:
    """moto's launch, held to the zone's capacity (a reservation's free instances instead, for a
    launch into one) and the account's vCPU quota (see the module docstring)."""
    zone = _request_zone(backend, kwargs)
    spot = kwargs.get("lifecycle") == "spot"
    if reservation is not None:
        free = reservation.total - reservation.used(backend)
        limits = [(free, "ReservationCapacityExceeded",
                   f"The Capacity Reservation {reservation.reservation_id} has {free} instance(s) free")]
    else:
        limits = [] if spot else [(free_capacity(cloud, backend, instance_type, zone), "InsufficientInstanceCapacity",
                                   _insufficient_message(instance_type, zone))]
    if not spot and not (reservation and reservation.capacity_block):  # Capacity Blocks take no On-Demand quota
        limits.append((free_vcpu_instances(cloud, backend, instance_type), "VcpuLimitExceeded", _vcpu_message(cloud)))
    binding = min(((free, code, message) for free, code, message in limits if free is not None and free < count),
                  default=None, key=lambda limit: limit[0])
    fleet = getattr(_request, "fleet", None)
    if binding is None:
        granted = count
    elif fleet is None:
        raise EC2ClientError(binding[1], binding[2])
    else:
        granted = _fleet_grant(fleet, count, binding[0])
        _fleet_error(template_spec, "on-demand", binding[1], binding[2])
    if granted == 0:
        return Reservation(f"r-{uuid.uuid4().hex[:17]}", cloud.account_id)  # nothing launched, nothing recorded
    return _moto_run_instances(backend, image_id, granted, user_data, security_group_names, **kwargs)


def _known(cloud: Ec2Cloud, instance_id: str) -> bool:
    try:
        cloud.fleet.get(instance_id)
    except KeyError:
        return False
    return True


def _terminate_instances(self: Any, instance_ids: list[str]) -> Any:
    cloud = active_cloud()
    with _fleet_creation_lock:
        ended = _moto_terminate(self, instance_ids)
    if cloud is not None:
        for instance, previous in ended:
            if previous.name not in {"shutting-down", "terminated"} and _known(cloud, instance.id):
                cloud.fleet.ending(instance.id, "terminated")
    return ended


def _stop_instances(self: Any, instance_ids: list[str]) -> Any:
    cloud = active_cloud()
    stopped = _moto_stop(self, instance_ids)
    if cloud is not None:
        for instance, previous in stopped:
            if previous.name in {"pending", "running"} and _known(cloud, instance.id):
                cloud.fleet.ending(instance.id, "stopped")
    return stopped


def _start_instances(self: Any, instance_ids: list[str]) -> Any:
    cloud = active_cloud()
    started = _moto_start(self, instance_ids)
    if cloud is not None:
        for instance, previous in started:
            if previous.name == "stopped" and _known(cloud, instance.id):
                cloud.fleet.started(instance.id)
    return started


_moto_instance_status = Instance.instance_status


def _instance_status(self: Instance) -> dict[str, Any]:
    cloud = active_cloud()
    if cloud is None or not _known(cloud, self.id) or not cloud.fleet.get(self.id).hung:
        return _moto_instance_status.fget(self)
    return {"Status": "impaired", "Details": [{"Name": "reachability", "Status": "failed"}]}


CONSOLE_OUTPUT_BYTES = 64 * 1024
"""GetConsoleOutput's size: the latest 64 KB of the console."""
_moto_console_output = General.get_console_output


def _console_output(self: EC2Response) -> ActionResult:
    cloud = active_cloud()
    instance_id = self._get_param("InstanceId")
    if cloud is None or not _known(cloud, instance_id):
        return _moto_console_output(self)
    self.ec2_backend.get_instance(instance_id)  # an unknown id fails as EC2 fails it
    log = cloud.fleet.get(instance_id).console_log
    tail = log.read_bytes()[-CONSOLE_OUTPUT_BYTES:] if log.exists() else b""
    return ActionResult({"InstanceId": instance_id, "Timestamp": utcnow(),
                         "Output": Base64EncodedString.from_encoded_bytes(base64.b64encode(tail))})


def apply() -> None:
    Instance.instance_status = property(_instance_status)
    EC2Response.create_placement_group = create_placement_group
    EC2Response.describe_placement_groups = describe_placement_groups
    EC2Response.delete_placement_group = delete_placement_group
    EC2Response.get_console_output = _console_output
    InstanceResponse.run_instances = _run_instances_response
    instances_responses.filter_iam_instance_profiles = _filter_iam_instance_profiles
    Fleet.__init__ = _fleet_init
    Fleet.instances = property(_fleet_instances)
    Fleets.create_fleet = _create_fleet_response
    EC2Backend.run_instances = _run_instances
    EC2Backend.request_spot_instances = _request_spot_instances
    EC2Backend.terminate_instances = _terminate_instances
    EC2Backend.stop_instances = _stop_instances
    EC2Backend.start_instances = _start_instances
    Attachment.__init__ = _attachment_init_with_card
