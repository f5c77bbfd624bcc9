"""Whether a run's nodes reach the AWS services they call from a subnet: AWS's routing rules for a
VPC, over plain data. The adapter (trainfleet/adapters/network.py) reads a subnet's network with
EC2's describe calls; Validate refuses a subnet from which a service cannot be reached, and the
local cloud routes every call of a node by the same rules (localcloud/glue/routes.py), so that a
network without a way out fails there as it fails on AWS.

    NODE_SERVICES                         the services a node calls, by endpoint name
    GATEWAY_SERVICES                      those AWS offers gateway endpoints for
    Rule, SecurityGroup, Route, Endpoint, NatGateway, SubnetNetwork    what EC2 says of a subnet's network
    public_ipv4(interfaces, associate, map_on_launch)      whether a launch gets a public address
    way_to(network, service, node_groups, public)          how a node gets there, or Blocked(why)
    unreachable_services(network, node_groups, public)     {service: why} for the node's services
    subnet_problems(network, node_groups, interfaces)      Validate's lines for one subnet

A node reaches a service's regional endpoint by the first of these that works:
1. a gateway endpoint of the service (S3 and DynamoDB alone have them) on its subnet's route table;
2. an interface endpoint of the service in its VPC with private DNS, so that the service's own
   name resolves to the endpoint (AWS requires the VPC's DNS support and DNS hostnames for it), whose
   security groups let HTTPS in from the node;
3. a default route (0.0.0.0/0) to a NAT gateway that leads to the internet: available, public (a
   private NAT gateway reaches only other networks), in a subnet whose own default route leads to
   an internet gateway;
4. a default route to an internet gateway, with a public IPv4 address on the node. EC2 gives one only
   to a launch with a single network interface: an EFA launch has one per network card (4 on p4d,
   32 on p5), so it has none.
Each way needs the node's own security groups to let HTTPS (TCP 443) out to it. Not modelled:
network ACLs (a VPC's default one allows everything), endpoint policies, a DNS server of one's own.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["NODE_SERVICES", "GATEWAY_SERVICES", "HTTPS_PORT", "Rule", "SecurityGroup", "Route", "Endpoint",
           "NatGateway", "SubnetNetwork", "Blocked", "public_ipv4", "way_to", "unreachable_services", "subnet_problems",
           "endpoint_service_name", "service_of_endpoint"]

NODE_SERVICES = {
    "s3": "S3",
    "dynamodb": "DynamoDB",
    "events": "EventBridge",
    "states": "Step Functions",
    "logs": "CloudWatch Logs",
}
"""What a node calls, by the name of the service's endpoint (and of its SigV4 signing scope): S3 for
its software, the launch spec, checkpoints and data; DynamoDB for the run record and its liveness
item; EventBridge for its reports; Step Functions for the training task's heartbeats; CloudWatch
Logs for its log. Nothing else: its credentials come from the instance metadata service, and
neither the agent nor the trainer calls EC2 or STS."""
GATEWAY_SERVICES = frozenset({"s3", "dynamodb"})
"""The services AWS offers gateway endpoints for (free, routed by the route table); every other
service's endpoint in a VPC is an interface endpoint."""
HTTPS_PORT = 443
_ANYWHERE = ipaddress.ip_network("0.0.0.0/0")


def endpoint_service_name(region: str, service: str) -> str:
    """AWS's name of a service's VPC endpoint service in a region: com.amazonaws.REGION.SERVICE."""
    return f"com.amazonaws.{region}.{service}"


def service_of_endpoint(service_name: str) -> str:
    """The service an endpoint service name stands for (com.amazonaws.us-east-1.s3 -> s3)."""
    return service_name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Rule:
    """One rule of a security group, in one direction."""

    protocol: str
    """"-1" (every protocol), "tcp", "udp", "icmp" or a protocol number."""
    from_port: int | None = None
    to_port: int | None = None
    cidrs: tuple[str, ...] = ()
    """IPv4 ranges the rule names."""
    groups: tuple[str, ...] = ()
    """Security groups the rule names (their members)."""
    prefix_lists: tuple[str, ...] = ()
    """Prefix lists the rule names (a gateway endpoint's service is one)."""

    def allows_https(self) -> bool:
        if self.protocol == "-1":
            return True
        if self.protocol not in ("tcp", "6"):
            return False
        return (self.from_port is None or self.from_port <= HTTPS_PORT) and (
            self.to_port is None or HTTPS_PORT <= self.to_port)

    def covers(self, network: str) -> bool:
        """Whether one of its ranges holds every address of `network` (a CIDR)."""
        wanted = ipaddress.ip_network(network, strict=False)
        return any(wanted.subnet_of(ipaddress.ip_network(cidr, strict=False)) for cidr in self.cidrs
                   if ipaddress.ip_network(cidr, strict=False).version == wanted.version)


@dataclass(frozen=True)
class SecurityGroup:
    group_id: str
    vpc_id: str = ""
    ingress: tuple[Rule, ...] = ()
    egress: tuple[Rule, ...] = ()


@dataclass(frozen=True)
class Route:
    """One route of a route table."""

    destination: str
    """A CIDR, or a prefix list id (pl-...: a gateway endpoint's service)."""
    target: str
    """local, igw-..., nat-..., vpce-..., or whatever else a route may point at."""
    active: bool = True
    """False for a blackhole (its target is gone)."""


@dataclass(frozen=True)
class Endpoint:
    """A VPC endpoint of the subnet's VPC."""

    endpoint_id: str
    service: str
    """The service, by its endpoint name (s3, events, ...)."""
    kind: str
    """Gateway or Interface."""
    available: bool = True
    route_table_ids: tuple[str, ...] = ()
    """A gateway endpoint's route tables."""
    private_dns: bool = False
    """An interface endpoint's private DNS: the service's own name resolves to the endpoint."""
    group_ids: tuple[str, ...] = ()
    """An interface endpoint's security groups."""


@dataclass(frozen=True)
class NatGateway:
    """A NAT gateway of the subnet's VPC."""

    nat_gateway_id: str
    subnet_id: str
    available: bool = True
    public: bool = True
    """ConnectivityType public; a private NAT gateway has no way to the internet."""
    internet_route: bool = True
    """Its own subnet's route table has a default route (0.0.0.0/0) to an internet gateway."""


@dataclass(frozen=True)
class SubnetNetwork:
    """What decides where a subnet's traffic goes."""

    subnet_id: str
    zone: str
    cidr: str
    vpc_id: str
    vpc_cidr: str
    route_table_id: str
    """The table the subnet is associated with, or its VPC's main table."""
    routes: tuple[Route, ...] = ()
    dns_support: bool = True
    dns_hostnames: bool = False
    map_public_ip_on_launch: bool = False
    endpoints: tuple[Endpoint, ...] = ()
    """Every endpoint of the VPC."""
    nat_gateways: Mapping[str, NatGateway] = field(default_factory=dict)
    """The VPC's NAT gateways, by id."""
    groups: Mapping[str, SecurityGroup] = field(default_factory=dict)
    """The security groups that matter, by id: the nodes' and the interface endpoints'."""


@dataclass(frozen=True)
class Blocked:
    """No way to the service; `why` says what was looked for."""

    why: str


def public_ipv4(interfaces: int, associate: bool | None, map_public_ip_on_launch: bool) -> bool:
    """Whether EC2 gives a launch a public IPv4 address: only a launch of one network interface,
    which asks for one or leaves it to a subnet that maps one on launch."""
    return interfaces == 1 and (associate if associate is not None else map_public_ip_on_launch)


def _lets_https_out(network: SubnetNetwork, node_groups: Iterable[str], *, to_cidr: str | None = None,
                    to_groups: Iterable[str] = (), to_prefix_list: str | None = None) -> bool:
    to_groups = set(to_groups)
    for group_id in node_groups:
        group = network.groups.get(group_id)
        for rule in group.egress if group else ():
            if not rule.allows_https():
                continue
            if (to_cidr and rule.covers(to_cidr)) or to_groups & set(rule.groups) or (
                    to_prefix_list and to_prefix_list in rule.prefix_lists):
                return True
    return False


def _lets_https_in(network: SubnetNetwork, endpoint: Endpoint, node_groups: Iterable[str]) -> bool:
    node_groups = set(node_groups)
    for group_id in endpoint.group_ids:
        group = network.groups.get(group_id)
        for rule in group.ingress if group else ():
            if rule.allows_https() and (node_groups & set(rule.groups) or rule.covers(network.cidr)):
                return True
    return False


def _default_route(network: SubnetNetwork) -> Route | None:
    return next((route for route in network.routes if route.active and route.destination == str(_ANYWHERE)), None)


def _nat_problem(nat: NatGateway | None) -> str | None:
    """Why a NAT gateway does not lead to the internet, else None."""
    if nat is None or not nat.available:
        return "which is not available"
    if not nat.public:
        return "a private NAT gateway, which leads to no internet"
    if not nat.internet_route:
        return f"whose subnet {nat.subnet_id} has no default route to an internet gateway"
    return None


def way_to(network: SubnetNetwork, service: str, node_groups: Iterable[str], public: bool) -> str | Blocked:
    """How a node of the subnet, in `node_groups`, with a public IPv4 address or not, reaches
    `service`: a few words naming the way, or Blocked saying what was looked for and not found."""
    node_groups = tuple(node_groups)
    tried: list[str] = []
    endpoints = [endpoint for endpoint in network.endpoints if endpoint.service == service and endpoint.available]
    for endpoint in endpoints:
        if endpoint.kind == "Gateway":
            if network.route_table_id not in endpoint.route_table_ids:
                continue
            prefix_list = next((route.destination for route in network.routes
                                if route.target == endpoint.endpoint_id and route.active), None)
            if _lets_https_out(network, node_groups, to_cidr=str(_ANYWHERE), to_prefix_list=prefix_list):
                return f"gateway endpoint {endpoint.endpoint_id}"
            tried.append(f"the nodes' security groups let no HTTPS out to its gateway endpoint {endpoint.endpoint_id}")
        elif endpoint.kind == "Interface":
            if not endpoint.private_dns:
                tried.append(f"its interface endpoint {endpoint.endpoint_id} has no private DNS, so the service's "
                             "name does not lead there")
            elif not (network.dns_support and network.dns_hostnames):
                tried.append(f"{network.vpc_id} has DNS support or DNS hostnames off, which its interface endpoint "
                             f"{endpoint.endpoint_id}'s private DNS needs")
            elif not _lets_https_in(network, endpoint, node_groups):
                tried.append(f"its interface endpoint {endpoint.endpoint_id}'s security groups let no HTTPS in "
                             "from the nodes")
            elif not _lets_https_out(network, node_groups, to_cidr=network.vpc_cidr, to_groups=endpoint.group_ids):
                tried.append(f"the nodes' security groups let no HTTPS out to its interface endpoint "
                             f"{endpoint.endpoint_id}")
            else:
                return f"interface endpoint {endpoint.endpoint_id}"
    if not tried:
        tried.append(f"no gateway endpoint on its route table {network.route_table_id}" if service in GATEWAY_SERVICES
                     else f"no interface endpoint in {network.vpc_id}")
    default = _default_route(network)
    out_anywhere = _lets_https_out(network, node_groups, to_cidr=str(_ANYWHERE))
    if default is not None and default.target.startswith("nat-"):
        if problem := _nat_problem(network.nat_gateways.get(default.target)):
            tried.append(f"its default route leads to NAT gateway {default.target}, {problem}")
        elif not out_anywhere:
            tried.append("the nodes' security groups let no HTTPS out through its NAT route")
        else:
            return f"NAT gateway {default.target}"
    elif default is not None and default.target.startswith("igw-"):
        if not public:
            tried.append(f"its default route leads to internet gateway {default.target}, which nodes without "
                         "a public IPv4 address cannot use")
        elif not out_anywhere:
            tried.append("the nodes' security groups let no HTTPS out to the internet")
        else:
            return f"internet gateway {default.target}"
    else:
        tried.append(f"no default route (0.0.0.0/0) in {network.route_table_id} to a NAT or internet gateway")
    return Blocked("; ".join(tried))


def unreachable_services(network: SubnetNetwork, node_groups: Iterable[str], public: bool,
                         services: Iterable[str] = NODE_SERVICES) -> dict[str, str]:
    """{service: why} for each of `services` a node of the subnet cannot reach."""
    node_groups = tuple(node_groups)
    ways = {service: way_to(network, service, node_groups, public) for service in services}
    return {service: way.why for service, way in ways.items() if isinstance(way, Blocked)}


def subnet_problems(network: SubnetNetwork, node_groups: Iterable[str], interfaces: int,
                    associate_public_ip: bool | None) -> list[str]:
    """Validate's lines for a subnet a run may launch into: one per reason, naming the subnet and
    the services it leaves out of reach (none when the nodes reach every one)."""
    elsewhere = [group_id for group_id in node_groups if group_id in network.groups
                 and network.groups[group_id].vpc_id not in ("", network.vpc_id)]
    if elsewhere:  # EC2 refuses such a launch
        return [f"capacity.security_group_ids: {', '.join(elsewhere)} not in {network.vpc_id}, the VPC of "
                f"{network.subnet_id}: a node's security groups must be in its subnet's VPC"]
    public = public_ipv4(interfaces, associate_public_ip, network.map_public_ip_on_launch)
    blocked = unreachable_services(network, node_groups, public)
    by_reason: dict[str, list[str]] = {}
    for service, why in blocked.items():
        by_reason.setdefault(why, []).append(f"{NODE_SERVICES[service]} ({service})")
    address = ("" if public else
               f" (the nodes have no public IPv4 address: EC2 gives none to a launch of {interfaces} network "
               "interfaces)" if interfaces > 1 else " (the nodes have no public IPv4 address: their launch asks for none)")
    return [f"capacity.subnet_ids: the nodes could not reach {', '.join(services)} from {network.subnet_id} "
            f"({network.zone}): {why}{address}" for why, services in by_reason.items()]
