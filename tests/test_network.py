"""trainfleet.core.network: how a node of a subnet reaches each service it calls, by AWS's rules, and
Validate's lines when it cannot."""

from dataclasses import replace

import pytest

from trainfleet.core.network import (NODE_SERVICES, Blocked, Endpoint, NatGateway, Route, Rule, SecurityGroup,
                                     SubnetNetwork, public_ipv4, subnet_problems, unreachable_services, way_to)

NODES = "sg-0000000000000000a"
ENDPOINTS = "sg-0000000000000000b"
HTTPS_OUT = Rule("tcp", 443, 443, cidrs=("0.0.0.0/0",))
MEMBERS = Rule("-1", groups=(NODES,))


def network(**changes) -> SubnetNetwork:
    """A private subnet with no way out: no endpoint, no default route."""
    base = SubnetNetwork(
        subnet_id="subnet-0000000000000000a", zone="us-east-1a", cidr="10.0.0.0/18", vpc_id="vpc-0a",
        vpc_cidr="10.0.0.0/16", route_table_id="rtb-0a", routes=(Route("10.0.0.0/16", "local"),),
        dns_support=True, dns_hostnames=True,
        groups={NODES: SecurityGroup(NODES, "vpc-0a", ingress=(MEMBERS,), egress=(MEMBERS, HTTPS_OUT))})
    return replace(base, **changes)


def gateway(service: str, table: str = "rtb-0a") -> tuple[Endpoint, Route]:
    endpoint = Endpoint(f"vpce-{service}", service, "Gateway", route_table_ids=(table,))
    return endpoint, Route(f"pl-{service}", endpoint.endpoint_id)


def interface(service: str, private_dns: bool = True, groups: tuple[str, ...] = (NODES,)) -> Endpoint:
    return Endpoint(f"vpce-{service}", service, "Interface", private_dns=private_dns, group_ids=groups)


def stack_network() -> SubnetNetwork:
    """What template.yaml makes: gateway endpoints for S3 and DynamoDB on the table, interface
    endpoints with private DNS for the rest, all in the nodes' group."""
    s3, s3_route = gateway("s3")
    dynamodb, dynamodb_route = gateway("dynamodb")
    return network(endpoints=(s3, dynamodb, interface("events"), interface("states"), interface("logs")),
                   routes=network().routes + (s3_route, dynamodb_route))


def test_a_private_subnet_without_endpoints_reaches_nothing_and_says_what_it_lacks():
    blocked = unreachable_services(network(), [NODES], public=False)
    assert sorted(blocked) == sorted(NODE_SERVICES)
    assert "no gateway endpoint on its route table rtb-0a" in blocked["s3"]
    assert "no interface endpoint in vpc-0a" in blocked["events"]
    assert "no default route (0.0.0.0/0) in rtb-0a" in blocked["events"]


def test_the_stacks_network_reaches_every_service_by_its_endpoints():
    assert unreachable_services(stack_network(), [NODES], public=False) == {}
    assert way_to(stack_network(), "s3", [NODES], False) == "gateway endpoint vpce-s3"
    assert way_to(stack_network(), "events", [NODES], False) == "interface endpoint vpce-events"


def test_a_gateway_endpoint_serves_only_the_route_tables_it_is_on():
    s3, route = gateway("s3", table="rtb-other")
    assert isinstance(way_to(network(endpoints=(s3,)), "s3", [NODES], False), Blocked)


def test_an_interface_endpoint_needs_private_dns_and_the_vpcs_dns():
    without = network(endpoints=(interface("states", private_dns=False),))
    assert "has no private DNS" in way_to(without, "states", [NODES], False).why
    dns_off = network(endpoints=(interface("states"),), dns_hostnames=False)
    assert "DNS support or DNS hostnames off" in way_to(dns_off, "states", [NODES], False).why


def test_an_interface_endpoint_must_let_https_in_from_the_nodes():
    closed = network(endpoints=(interface("logs", groups=(ENDPOINTS,)),),
                     groups={**network().groups, ENDPOINTS: SecurityGroup(ENDPOINTS, "vpc-0a")})
    assert "let no HTTPS in from the nodes" in way_to(closed, "logs", [NODES], False).why
    by_range = replace(closed, groups={**closed.groups, ENDPOINTS: SecurityGroup(
        ENDPOINTS, "vpc-0a", ingress=(Rule("tcp", 443, 443, cidrs=("10.0.0.0/16",)),))})
    assert way_to(by_range, "logs", [NODES], False) == "interface endpoint vpce-logs"


def test_the_nodes_groups_must_let_https_out():
    no_egress = replace(stack_network(), groups={NODES: SecurityGroup(NODES, "vpc-0a", ingress=(MEMBERS,))})
    blocked = unreachable_services(no_egress, [NODES], public=False)
    assert sorted(blocked) == sorted(NODE_SERVICES)
    assert "let no HTTPS out" in blocked["s3"]


def test_a_nat_route_reaches_every_service_when_its_gateway_leads_to_the_internet():
    routes = network().routes + (Route("0.0.0.0/0", "nat-0a"),)
    nat = NatGateway("nat-0a", "subnet-0000000000000000p")
    assert unreachable_services(network(routes=routes, nat_gateways={"nat-0a": nat}), [NODES], public=False) == {}
    for gateway, why in ((None, "which is not available"), (replace(nat, available=False), "which is not available"),
                         (replace(nat, public=False), "a private NAT gateway, which leads to no internet"),
                         (replace(nat, internet_route=False), "whose subnet subnet-0000000000000000p has no "
                                                              "default route to an internet gateway")):
        blocked = unreachable_services(network(routes=routes, nat_gateways={"nat-0a": gateway} if gateway else {}),
                                       [NODES], public=False)
        assert set(blocked) == set(NODE_SERVICES) and f"NAT gateway nat-0a, {why}" in blocked["dynamodb"], gateway


def test_an_internet_route_serves_only_a_node_with_a_public_address():
    public_subnet = network(routes=network().routes + (Route("0.0.0.0/0", "igw-0a"),), map_public_ip_on_launch=True)
    assert unreachable_services(public_subnet, [NODES], public=True) == {}
    assert "internet gateway igw-0a, which nodes without a public IPv4 address" in (
        unreachable_services(public_subnet, [NODES], public=False)["states"])


@pytest.mark.parametrize("interfaces, associate, mapped, expected", [
    (1, None, True, True), (1, None, False, False), (1, True, False, True), (1, False, True, False),
    (4, None, True, False), (32, None, True, False),
])
def test_ec2_gives_a_public_address_only_to_a_launch_of_one_interface(interfaces, associate, mapped, expected):
    assert public_ipv4(interfaces, associate, mapped) is expected


def test_validate_names_the_subnet_the_services_and_why_an_efa_node_has_no_address():
    public_subnet = network(routes=network().routes + (Route("0.0.0.0/0", "igw-0a"),), map_public_ip_on_launch=True)
    gateways, interfaces = subnet_problems(public_subnet, [NODES], interfaces=32, associate_public_ip=None)
    assert gateways.startswith("capacity.subnet_ids: the nodes could not reach S3 (s3), DynamoDB (dynamodb) from "
                               "subnet-0000000000000000a (us-east-1a): no gateway endpoint on its route table rtb-0a; "
                               "its default route leads to internet gateway igw-0a, which nodes without a public "
                               "IPv4 address cannot use")
    assert interfaces.startswith("capacity.subnet_ids: the nodes could not reach EventBridge (events), Step Functions "
                                 "(states), CloudWatch Logs (logs) from subnet-0000000000000000a (us-east-1a): no "
                                 "interface endpoint in vpc-0a")
    for line in (gateways, interfaces):
        assert line.endswith("(the nodes have no public IPv4 address: EC2 gives none to a launch of 32 network "
                             "interfaces)")
    assert subnet_problems(public_subnet, [NODES], interfaces=1, associate_public_ip=None) == []
    assert subnet_problems(stack_network(), [NODES], interfaces=32, associate_public_ip=None) == []


def test_validate_groups_services_by_reason():
    s3, route = gateway("s3")
    lines = subnet_problems(network(endpoints=(s3,), routes=network().routes + (route,)), [NODES], 4, None)
    assert len(lines) == 2
    assert "DynamoDB (dynamodb) from" in lines[0] and "no gateway endpoint" in lines[0]
    assert "EventBridge (events), Step Functions (states), CloudWatch Logs (logs) from" in lines[1]


def test_security_groups_of_another_vpc_are_named():
    elsewhere = replace(stack_network(), groups={NODES: SecurityGroup(NODES, "vpc-other")})
    assert subnet_problems(elsewhere, [NODES], 4, None) == [
        f"capacity.security_group_ids: {NODES} not in vpc-0a, the VPC of subnet-0000000000000000a: a node's "
        "security groups must be in its subnet's VPC"]
