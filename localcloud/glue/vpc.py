"""EC2 glue: VPCs as EC2 makes them, and VPC endpoints refused as EC2 refuses them.

moto 5.2.5 gives a new VPC's default security group no inbound rule; EC2's lets all traffic in from
its own members (and all out, which moto has). moto's default VPC has no internet gateway; EC2's
has one, the main route table's default route (0.0.0.0/0) leading to it, so that an instance
given a public address there reaches the internet and AWS's public endpoints
(trainfleet.core.network, glue/routes.py): `prepare_default_vpc` makes them as a cloud starts.

moto's CreateVpcEndpoint creates whatever it is asked for. EC2 refuses, and so does this:

- a service name that no endpoint service of the region has (InvalidServiceName);
- an endpoint type the service does not offer: a gateway endpoint for anything but S3 and
  DynamoDB (InvalidParameter, naming the types it offers);
- an interface endpoint with private DNS (the API's default) in a VPC whose DNS support or DNS
  hostnames is off: the private hosted zone needs both (InvalidParameter);
- an interface endpoint with two subnets in one Availability Zone (DuplicateSubnetsInSameZone).

And it records what EC2 answers where moto records nothing: the type of an endpoint created without
one is Gateway (the API's default), and a gateway endpoint has no private DNS.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moto.ec2.exceptions import EC2ClientError
from moto.ec2.models import EC2Backend

from localcloud.glue import active_cloud
from localcloud.glue.ec2 import ec2_backend

if TYPE_CHECKING:
    from localcloud.parts import Place

_moto_create_vpc = EC2Backend.create_vpc
_moto_create_vpc_endpoint = EC2Backend.create_vpc_endpoint


def _create_vpc(self: Any, *args: Any, **kwargs: Any) -> Any:
    vpc = _moto_create_vpc(self, *args, **kwargs)
    if active_cloud() is not None:
        _let_members_in(self, vpc.id)
    return vpc


def _let_members_in(backend: Any, vpc_id: str) -> None:
    group = backend.get_security_group_from_name("default", vpc_id=vpc_id)
    if group is not None and not group.ingress_rules:
        backend.authorize_security_group_ingress(group.id, "-1", None, None, [],
                                                 source_groups=[{"GroupId": group.id}], vpc_id=vpc_id)


def prepare_default_vpc(cloud: Place) -> None:
    """The cloud's region's default VPC as EC2 makes it (moto may have made it before the cloud
    started, in this process): its internet gateway and default route, its default group's rule."""
    backend = ec2_backend(cloud)
    vpc = backend.get_default_vpc()
    if vpc is None:
        return
    _let_members_in(backend, vpc.id)
    if backend.describe_internet_gateways(filters={"attachment.vpc-id": [vpc.id]}):
        return
    gateway = backend.create_internet_gateway()
    backend.attach_internet_gateway(gateway.id, vpc.id)
    (main,) = backend.describe_route_tables(filters={"vpc-id": [vpc.id], "association.main": ["true"]})
    backend.create_route(main.id, "0.0.0.0/0", gateway_id=gateway.id)


def _offered_types(backend: Any, service_name: str) -> list[str]:
    services = backend._collect_default_endpoint_services(backend.account_id, backend.region_name)
    return sorted({kind["ServiceType"] for service in services if service["ServiceName"] == service_name
                   for kind in service["ServiceType"]})


def _create_vpc_endpoint(self: Any, vpc_id: str, service_name: str, endpoint_type: str | None, *args: Any,
                         **kwargs: Any) -> Any:
    if active_cloud() is None:
        return _moto_create_vpc_endpoint(self, vpc_id, service_name, endpoint_type, *args, **kwargs)
    kind = endpoint_type or "Gateway"
    offered = _offered_types(self, service_name)
    if not offered:
        raise EC2ClientError("InvalidServiceName", f"The Vpc Endpoint Service '{service_name}' does not exist")
    if kind not in offered:
        raise EC2ClientError("InvalidParameter", f"Endpoint type ({kind}) does not match available service "
                                                 f"types ({offered}).")
    vpc = self.get_vpc(vpc_id)
    if kind == "Interface":
        if kwargs.get("private_dns_enabled", True) and not (vpc.enable_dns_support and vpc.enable_dns_hostnames):
            raise EC2ClientError("InvalidParameter", "Enabling private DNS requires both enableDnsSupport and "
                                                     f"enableDnsHostnames VPC attributes set to true for {vpc_id}")
        zones: dict[str, str] = {}
        for subnet_id in kwargs.get("subnet_ids") or []:
            zone = self.get_subnet(subnet_id).availability_zone
            if zone in zones:
                raise EC2ClientError("DuplicateSubnetsInSameZone",
                                     f"Found another VPC endpoint subnet in the availability zone of {subnet_id}. "
                                     "VPC endpoint subnets should be in different availability zones supported by "
                                     "the VPC endpoint service.")
            zones[zone] = subnet_id
    else:
        kwargs["private_dns_enabled"] = False
    return _moto_create_vpc_endpoint(self, vpc_id, service_name, kind, *args, **kwargs)


def apply() -> None:
    EC2Backend.create_vpc = _create_vpc
    EC2Backend.create_vpc_endpoint = _create_vpc_endpoint
