"""The network a run's nodes launch into, as EC2's describe calls show it; trainfleet.core.network
judges it.

    node_network(ec2, subnet_ids, group_ids, instance_type) -> NodeNetwork
        the stack's node subnets in the zones that offer the instance type, with its groups
    subnet_networks(ec2, subnet_ids, node_group_ids) -> list[SubnetNetwork]
        each subnet's routes, its VPC's endpoints, DNS and NAT gateways, the groups that matter
    network_problems(ec2, spec) -> list[str]
        Validate's lines: the RunSpec's subnets the nodes could not reach AWS from

Describe calls take no resource-level permissions (template.yaml's Validate policy lists them).
"""

from __future__ import annotations

from typing import Any

from trainfleet.adapters.ec2_fleet import efa_network_interfaces
from trainfleet.core.network import (Endpoint, NatGateway, Route, Rule, SecurityGroup, SubnetNetwork,
                                     service_of_endpoint, subnet_problems)
from trainfleet.core.runspec import NodeNetwork, RunSpec

__all__ = ["NetworkNotFound", "node_network", "subnet_networks", "network_problems"]


class NetworkNotFound(ValueError):
    """The RunSpec or the stack names subnets or security groups EC2 does not know, or the stack's
    subnets lie in no zone that offers the instance type; the message says which."""


def _described(ec2: Any, action: str, what: str, **request: Any) -> dict[str, Any]:
    """EC2's answer; NetworkNotFound naming `what` when it knows no subnet or group asked for."""
    try:
        return getattr(ec2, action)(**request)
    except ec2.exceptions.ClientError as error:
        code = error.response["Error"]["Code"]
        if code.startswith(("InvalidSubnetID", "InvalidGroup")):
            raise NetworkNotFound(f"{what}: {code}: {error.response['Error'].get('Message', '')}") from None
        raise


def node_network(ec2: Any, subnet_ids: list[str], group_ids: list[str], instance_type: str) -> NodeNetwork:
    """The stack's node subnets (in the order given) in the zones that offer `instance_type`, and
    its node security groups. A type EC2 offers in no zone is left for validation to name."""
    if not subnet_ids or not group_ids:
        raise NetworkNotFound("capacity: the RunSpec names no subnet_ids and security_group_ids, and the stack "
                              "names no node network to take them from (its outputs NodeSubnetIds, "
                              "NodeSecurityGroupIds): name them, or deploy the stack again")
    subnets = _described(ec2, "describe_subnets", "the stack's node subnets", SubnetIds=subnet_ids)["Subnets"]
    zone_of = {subnet["SubnetId"]: subnet["AvailabilityZone"] for subnet in subnets}
    offerings = ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}])
    offered = {offering["Location"] for offering in offerings["InstanceTypeOfferings"]}
    usable = [subnet_id for subnet_id in subnet_ids if not offered or zone_of[subnet_id] in offered]
    if not usable:
        raise NetworkNotFound(
            f"capacity: {instance_type} is offered in {', '.join(sorted(offered))}, and none of the stack's node "
            f"subnets is there ({', '.join(f'{subnet} in {zone_of[subnet]}' for subnet in subnet_ids)}): name "
            "capacity.subnet_ids and capacity.security_group_ids, or deploy the stack with NodeZones (or "
            "NodeSubnetIds) in those zones")
    return NodeNetwork(usable, list(group_ids))


def _rules(permissions: list[dict[str, Any]]) -> tuple[Rule, ...]:
    return tuple(Rule(protocol=str(permission.get("IpProtocol", "-1")), from_port=permission.get("FromPort"),
                      to_port=permission.get("ToPort"),
                      cidrs=tuple(item["CidrIp"] for item in permission.get("IpRanges", [])),
                      groups=tuple(item["GroupId"] for item in permission.get("UserIdGroupPairs", [])),
                      prefix_lists=tuple(item["PrefixListId"] for item in permission.get("PrefixListIds", [])))
                 for permission in permissions)


def _vpc_attribute(ec2: Any, vpc_id: str, attribute: str) -> bool:
    answer = ec2.describe_vpc_attribute(VpcId=vpc_id, Attribute=attribute)
    return bool(answer[attribute[0].upper() + attribute[1:]]["Value"])


def _route(route: dict[str, Any]) -> Route:
    destination = route.get("DestinationCidrBlock") or route.get("DestinationPrefixListId") or ""
    target = (route.get("GatewayId") or route.get("NatGatewayId") or route.get("VpcPeeringConnectionId")
              or route.get("TransitGatewayId") or route.get("NetworkInterfaceId") or route.get("InstanceId") or "")
    return Route(destination=destination, target=target, active=route.get("State", "active") != "blackhole")


def _endpoint(endpoint: dict[str, Any]) -> Endpoint:
    return Endpoint(endpoint_id=endpoint["VpcEndpointId"], service=service_of_endpoint(endpoint["ServiceName"]),
                    kind=endpoint.get("VpcEndpointType", "Gateway"),
                    available=endpoint.get("State", "available").lower() == "available",
                    route_table_ids=tuple(endpoint.get("RouteTableIds", [])),
                    private_dns=bool(endpoint.get("PrivateDnsEnabled")),
                    group_ids=tuple(group["GroupId"] for group in endpoint.get("Groups", [])))


def _nat_gateway(gateway: dict[str, Any], table: dict[str, Any]) -> NatGateway:
    """A NAT gateway as EC2 describes it, with its own subnet's route table."""
    routes = [_route(route) for route in table.get("Routes", [])]
    return NatGateway(gateway["NatGatewayId"], gateway["SubnetId"], available=gateway["State"] == "available",
                      public=gateway.get("ConnectivityType", "public") == "public",
                      internet_route=any(route.active and route.destination == "0.0.0.0/0"
                                         and route.target.startswith("igw-") for route in routes))


def subnet_networks(ec2: Any, subnet_ids: list[str], node_group_ids: list[str]) -> list[SubnetNetwork]:
    """Each subnet's network, in the order given."""
    subnets = {subnet["SubnetId"]: subnet for subnet in _described(
        ec2, "describe_subnets", "capacity.subnet_ids", SubnetIds=subnet_ids)["Subnets"]}
    vpc_ids = sorted({subnet["VpcId"] for subnet in subnets.values()})
    vpc_filter = [{"Name": "vpc-id", "Values": vpc_ids}]
    vpcs = {vpc["VpcId"]: vpc for vpc in ec2.describe_vpcs(VpcIds=vpc_ids)["Vpcs"]}
    dns = {vpc_id: (_vpc_attribute(ec2, vpc_id, "enableDnsSupport"), _vpc_attribute(ec2, vpc_id, "enableDnsHostnames"))
           for vpc_id in vpc_ids}
    tables = [table for page in ec2.get_paginator("describe_route_tables").paginate(Filters=vpc_filter)
              for table in page["RouteTables"]]
    endpoints = [endpoint for page in ec2.get_paginator("describe_vpc_endpoints").paginate(Filters=vpc_filter)
                 for endpoint in page["VpcEndpoints"]]
    nat_gateways = [gateway for page in ec2.get_paginator("describe_nat_gateways").paginate(Filter=vpc_filter)
                    for gateway in page["NatGateways"]]
    group_ids = sorted(set(node_group_ids) | {group["GroupId"] for endpoint in endpoints
                                              for group in endpoint.get("Groups", [])})
    groups = {group["GroupId"]: SecurityGroup(group["GroupId"], group.get("VpcId", ""),
                                              _rules(group.get("IpPermissions", [])),
                                              _rules(group.get("IpPermissionsEgress", [])))
              for group in _described(ec2, "describe_security_groups", "capacity.security_group_ids",
                                      GroupIds=group_ids)["SecurityGroups"]}

    def table_of(subnet: dict[str, Any]) -> dict[str, Any]:
        associated = [table for table in tables for association in table.get("Associations", [])
                      if association.get("SubnetId") == subnet["SubnetId"]]
        main = [table for table in tables if table["VpcId"] == subnet["VpcId"]
                and any(association.get("Main") for association in table.get("Associations", []))]
        return (associated or main)[0]

    networks = []
    for subnet_id in subnet_ids:
        subnet = subnets[subnet_id]
        vpc_id = subnet["VpcId"]
        table = table_of(subnet)
        networks.append(SubnetNetwork(
            subnet_id=subnet_id, zone=subnet["AvailabilityZone"], cidr=subnet["CidrBlock"], vpc_id=vpc_id,
            vpc_cidr=vpcs[vpc_id]["CidrBlock"], route_table_id=table["RouteTableId"],
            routes=tuple(_route(route) for route in table.get("Routes", [])),
            dns_support=dns[vpc_id][0], dns_hostnames=dns[vpc_id][1],
            map_public_ip_on_launch=bool(subnet.get("MapPublicIpOnLaunch")),
            endpoints=tuple(_endpoint(endpoint) for endpoint in endpoints if endpoint["VpcId"] == vpc_id),
            nat_gateways={gateway["NatGatewayId"]: _nat_gateway(gateway, table_of(gateway))
                          for gateway in nat_gateways if gateway["VpcId"] == vpc_id},
            groups=groups))
    return networks


def network_problems(ec2: Any, spec: RunSpec) -> list[str]:
    """Each subnet of the RunSpec from which the nodes could not reach a service they call, and
    the services (trainfleet.core.network.subnet_problems), as the run's launch would put them
    there: its interfaces, no public IPv4 address asked for (adapters.ec2_fleet)."""
    groups = spec.capacity.security_group_ids
    interfaces = efa_network_interfaces(spec.facts, groups)
    associate = interfaces[0].get("AssociatePublicIpAddress")
    return [problem for network in subnet_networks(ec2, spec.capacity.subnet_ids, groups)
            for problem in subnet_problems(network, groups, len(interfaces), associate)]
