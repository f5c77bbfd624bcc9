"""trainfleet.adapters.network against the local cloud's EC2: the stack's node subnets in the zones
that offer a type, each subnet's network as the describe calls show it, and Validate's lines."""

import pytest

from test_adapters_ec2_fleet import make_spec
from trainfleet.adapters import network as adapter


@pytest.fixture
def vpc(local_cloud):
    ec2 = local_cloud.client("ec2")
    vpc_id = ec2.create_vpc(CidrBlock="10.30.0.0/16")["Vpc"]["VpcId"]
    ec2.modify_vpc_attribute(VpcId=vpc_id, EnableDnsHostnames={"Value": True})
    group = ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc_id]},
                                                  {"Name": "group-name", "Values": ["default"]}])[
        "SecurityGroups"][0]["GroupId"]
    return ec2, vpc_id, group


def subnet(ec2, vpc_id: str, cidr: str, zone: str) -> tuple[str, str]:
    subnet_id = ec2.create_subnet(VpcId=vpc_id, CidrBlock=cidr, AvailabilityZone=zone)["Subnet"]["SubnetId"]
    table = ec2.create_route_table(VpcId=vpc_id)["RouteTable"]["RouteTableId"]
    ec2.associate_route_table(SubnetId=subnet_id, RouteTableId=table)
    return subnet_id, table


def test_the_stacks_subnets_are_kept_in_the_zones_that_offer_the_type_in_order(vpc):
    ec2, vpc_id, group = vpc
    in_b, _ = subnet(ec2, vpc_id, "10.30.1.0/24", "us-east-1b")
    in_a, _ = subnet(ec2, vpc_id, "10.30.2.0/24", "us-east-1a")
    in_c, _ = subnet(ec2, vpc_id, "10.30.3.0/24", "us-east-1c")
    offered = {offering["Location"] for offering in ec2.describe_instance_type_offerings(
        LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": ["p5en.48xlarge"]}])[
        "InstanceTypeOfferings"]}
    kept = adapter.node_network(ec2, [in_b, in_a, in_c], [group], "p5en.48xlarge")
    assert kept.subnet_ids == [s for s, zone in ((in_b, "us-east-1b"), (in_a, "us-east-1a"), (in_c, "us-east-1c"))
                               if zone in offered] and kept.subnet_ids
    assert kept.security_group_ids == [group]
    elsewhere = [s for s, zone in ((in_b, "us-east-1b"), (in_a, "us-east-1a"), (in_c, "us-east-1c"))
                 if zone not in offered]
    with pytest.raises(adapter.NetworkNotFound, match=r"p5en.48xlarge is offered in .*none of the stack's node "
                                                      r"subnets is there .*NodeZones"):
        adapter.node_network(ec2, elsewhere, [group], "p5en.48xlarge")


def test_a_stack_without_a_node_network_and_unknown_ids_are_named(vpc):
    ec2, vpc_id, group = vpc
    with pytest.raises(adapter.NetworkNotFound, match="the stack names no node network"):
        adapter.node_network(ec2, [], [], "p5.48xlarge")
    with pytest.raises(adapter.NetworkNotFound, match="capacity.subnet_ids: InvalidSubnetID.NotFound"):
        adapter.subnet_networks(ec2, ["subnet-00000000000000000"], [group])
    known, _ = subnet(ec2, vpc_id, "10.30.4.0/24", "us-east-1a")
    with pytest.raises(adapter.NetworkNotFound, match="capacity.security_group_ids: InvalidGroup.NotFound"):
        adapter.subnet_networks(ec2, [known], ["sg-00000000000000000"])


def test_a_subnets_network_is_read_as_ec2_describes_it(local_cloud, vpc):
    ec2, vpc_id, group = vpc
    region = local_cloud.region
    own, table = subnet(ec2, vpc_id, "10.30.5.0/24", "us-east-1a")
    main_only = ec2.create_subnet(VpcId=vpc_id, CidrBlock="10.30.6.0/24", AvailabilityZone="us-east-1b")["Subnet"]
    s3 = ec2.create_vpc_endpoint(VpcId=vpc_id, ServiceName=f"com.amazonaws.{region}.s3",
                                 RouteTableIds=[table])["VpcEndpoint"]["VpcEndpointId"]
    logs = ec2.create_vpc_endpoint(VpcId=vpc_id, VpcEndpointType="Interface", SubnetIds=[own],
                                   SecurityGroupIds=[group],
                                   ServiceName=f"com.amazonaws.{region}.logs")["VpcEndpoint"]["VpcEndpointId"]
    read_own, read_main = adapter.subnet_networks(ec2, [own, main_only["SubnetId"]], [group])
    assert (read_own.route_table_id, read_own.zone, read_own.vpc_cidr) == (table, "us-east-1a", "10.30.0.0/16")
    assert read_main.route_table_id != table  # the VPC's main table
    assert (read_own.dns_support, read_own.dns_hostnames) == (True, True)
    kinds = {endpoint.endpoint_id: (endpoint.service, endpoint.kind, endpoint.private_dns)
             for endpoint in read_own.endpoints}
    assert kinds == {s3: ("s3", "Gateway", False), logs: ("logs", "Interface", True)}
    assert any(route.target == s3 and route.destination.startswith("pl-") for route in read_own.routes)
    assert read_own.groups[group].ingress[0].groups == (group,)


def test_validate_names_the_subnets_a_p5_node_could_not_reach_aws_from(vpc):
    ec2, vpc_id, group = vpc
    bare, _ = subnet(ec2, vpc_id, "10.30.7.0/24", "us-east-1a")
    problems = adapter.network_problems(ec2, make_spec("p5.48xlarge", subnet_ids=[bare], security_group_ids=[group]))
    assert len(problems) == 2
    assert all(line.startswith(f"capacity.subnet_ids: the nodes could not reach") and f"from {bare} (us-east-1a)"
               in line and line.endswith("EC2 gives none to a launch of 32 network interfaces)") for line in problems)
