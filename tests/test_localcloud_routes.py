"""The local cloud's network as EC2 has it: VPC endpoints refused where EC2 refuses them, and an
instance's calls carried only where its subnet's network leads (glue/routes.py): from a subnet
with no endpoint, no NAT route and no public address a call fails as a dropped packet fails it on
EC2, with a connect timeout."""

import ast
import json
import sys

import botocore.exceptions
import pytest

from localcloud.fleet import INSTANCE_SITE
from localcloud.glue.routes import UNREACHABLE_HEADER

PROBE = """
import json, time, boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
config = Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=20)
calls = {"s3": lambda c: c.list_buckets(), "dynamodb": lambda c: c.list_tables(),
         "events": lambda c: c.list_event_buses(), "states": lambda c: c.list_state_machines(),
         "ec2": lambda c: c.describe_availability_zones(), "ssm": lambda c: c.describe_parameters()}
results = {}
for service, call in calls.items():
    client = boto3.client("stepfunctions" if service == "states" else service, config=config,
                          aws_access_key_id="instance", aws_secret_access_key="instance")
    started = time.monotonic()
    try:
        call(client)
        results[service] = ["reached", 0]
    except ClientError:  # the service's own answer: it was reached
        results[service] = ["reached", 0]
    except BotoCoreError as error:
        results[service] = [type(error).__name__, time.monotonic() - started]
print("PROBE " + json.dumps(results), flush=True)
time.sleep(60)
"""


def vpc_with_dns(ec2) -> str:
    vpc = ec2.create_vpc(CidrBlock="10.9.0.0/16")["Vpc"]["VpcId"]
    ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})
    return vpc


def subnet_with_table(ec2, vpc: str, cidr: str, zone: str = "us-east-1a") -> tuple[str, str]:
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock=cidr, AvailabilityZone=zone)["Subnet"]["SubnetId"]
    table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
    ec2.associate_route_table(SubnetId=subnet, RouteTableId=table)
    return subnet, table


def default_group(ec2, vpc: str) -> str:
    return ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                                 {"Name": "group-name", "Values": ["default"]}])[
        "SecurityGroups"][0]["GroupId"]


def refused(call, code: str, message: str) -> None:
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        call()
    assert caught.value.response["Error"]["Code"] == code
    assert message in caught.value.response["Error"]["Message"]


def test_ec2_refuses_endpoints_as_aws_does(local_cloud):
    ec2 = local_cloud.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.8.0.0/16")["Vpc"]["VpcId"]  # DNS hostnames off, as EC2 creates a VPC
    (a, table), (b, _) = subnet_with_table(ec2, vpc, "10.8.0.0/24"), subnet_with_table(ec2, vpc, "10.8.1.0/24")
    region = local_cloud.region
    refused(lambda: ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=f"com.amazonaws.{region}.nothing"),
            "InvalidServiceName", f"The Vpc Endpoint Service 'com.amazonaws.{region}.nothing' does not exist")
    refused(lambda: ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=f"com.amazonaws.{region}.events",
                                            RouteTableIds=[table]),
            "InvalidParameter", "Endpoint type (Gateway) does not match available service types (['Interface'])")
    refused(lambda: ec2.create_vpc_endpoint(VpcId=vpc, VpcEndpointType="Interface", SubnetIds=[a],
                                            ServiceName=f"com.amazonaws.{region}.states"),
            "InvalidParameter", "Enabling private DNS requires both enableDnsSupport and enableDnsHostnames")
    ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})
    same_zone = ec2.create_subnet(VpcId=vpc, CidrBlock="10.8.2.0/24", AvailabilityZone="us-east-1a")["Subnet"]
    refused(lambda: ec2.create_vpc_endpoint(VpcId=vpc, VpcEndpointType="Interface", SubnetIds=[a, same_zone["SubnetId"]],
                                            ServiceName=f"com.amazonaws.{region}.states"),
            "DuplicateSubnetsInSameZone", f"Found another VPC endpoint subnet in the availability zone of")
    interface = ec2.create_vpc_endpoint(VpcId=vpc, VpcEndpointType="Interface", SubnetIds=[a],
                                        ServiceName=f"com.amazonaws.{region}.states")["VpcEndpoint"]
    gateway = ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=f"com.amazonaws.{region}.s3",
                                      RouteTableIds=[table])["VpcEndpoint"]
    assert (interface["VpcEndpointType"], interface["PrivateDnsEnabled"]) == ("Interface", True)
    assert (gateway["VpcEndpointType"], gateway["PrivateDnsEnabled"]) == ("Gateway", False)
    assert b  # a second zone's subnet took an interface endpoint's place without complaint above


def probe_from(cloud, subnet: str, group: str) -> dict:
    ec2 = cloud.client("ec2")
    cloud.fleet.boot = lambda instance: [sys.executable, "-c", PROBE]
    instance_id = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1, MaxCount=1,
                                    SubnetId=subnet, SecurityGroupIds=[group])["Instances"][0]["InstanceId"]
    console = cloud.fleet.get(instance_id).workdir / "console.log"

    def answered() -> str | None:
        lines = console.read_text().splitlines() if console.exists() else []
        return next((line for line in lines if line.startswith("PROBE ")), None)

    cloud.wait_until(answered, f"the probe on {instance_id}")
    return json.loads(answered().removeprefix("PROBE "))


def test_an_instance_reaches_only_what_its_subnets_routes_and_endpoints_lead_to(local_cloud):
    ec2, region = local_cloud.client("ec2"), local_cloud.region
    vpc = vpc_with_dns(ec2)
    group = default_group(ec2, vpc)  # in from its members, out anywhere
    routed, table = subnet_with_table(ec2, vpc, "10.9.0.0/24")
    bare, _ = subnet_with_table(ec2, vpc, "10.9.1.0/24", zone="us-east-1b")
    ec2.create_vpc_endpoint(VpcId=vpc, ServiceName=f"com.amazonaws.{region}.s3", RouteTableIds=[table])
    ec2.create_vpc_endpoint(VpcId=vpc, VpcEndpointType="Interface", ServiceName=f"com.amazonaws.{region}.events",
                            SubnetIds=[bare], SecurityGroupIds=[group])

    from_routed = probe_from(local_cloud, routed, group)
    assert from_routed["s3"] == ["reached", 0]  # its route table has the gateway endpoint
    assert from_routed["events"] == ["reached", 0]  # an interface endpoint serves the whole VPC
    for service in ("dynamodb", "states", "ec2", "ssm"):  # no endpoint, no NAT route
        error, seconds = from_routed[service]
        assert error == "ConnectTimeoutError" and seconds >= 1.0, (service, from_routed)

    from_bare = probe_from(local_cloud, bare, group)
    assert from_bare["s3"][0] == "ConnectTimeoutError"  # not on its route table
    assert from_bare["events"] == ["reached", 0]
    assert from_bare["ec2"][0] == from_bare["ssm"][0] == "ConnectTimeoutError"
    assert local_cloud.failed_requests[("dynamodb", "unreachable")] >= 2
    assert local_cloud.failed_requests[("ec2", "unreachable")] >= 2

    # A NAT gateway carries every service once its own subnet routes to an internet gateway. (Each
    # probe from a new subnet: a network is read afresh at most every NETWORK_REREAD_S.)
    nat_home, nat_home_table = subnet_with_table(ec2, vpc, "10.9.2.0/24", zone="us-east-1c")
    nat = ec2.create_nat_gateway(SubnetId=nat_home, AllocationId=ec2.allocate_address(Domain="vpc")["AllocationId"])
    nat_id = nat["NatGateway"]["NatGatewayId"]
    local_cloud.wait_until(lambda: ec2.describe_nat_gateways(NatGatewayIds=[nat_id])["NatGateways"][0]["State"]
                           == "available", f"NAT gateway {nat_id}")
    behind_nat, nat_table = subnet_with_table(ec2, vpc, "10.9.3.0/24")
    ec2.create_route(RouteTableId=nat_table, DestinationCidrBlock="0.0.0.0/0", NatGatewayId=nat_id)
    nat_without_internet = probe_from(local_cloud, behind_nat, group)
    assert nat_without_internet["dynamodb"][0] == nat_without_internet["ec2"][0] == "ConnectTimeoutError"

    internet = ec2.create_internet_gateway()["InternetGateway"]["InternetGatewayId"]
    ec2.attach_internet_gateway(InternetGatewayId=internet, VpcId=vpc)
    ec2.create_route(RouteTableId=nat_home_table, DestinationCidrBlock="0.0.0.0/0", GatewayId=internet)
    also_behind_nat = ec2.create_subnet(VpcId=vpc, CidrBlock="10.9.4.0/24", AvailabilityZone="us-east-1a")["Subnet"]
    ec2.associate_route_table(SubnetId=also_behind_nat["SubnetId"], RouteTableId=nat_table)
    through_nat = probe_from(local_cloud, also_behind_nat["SubnetId"], group)
    assert all(result == ["reached", 0] for result in through_nat.values()), through_nat


def test_a_new_vpcs_default_group_lets_its_members_in(local_cloud):
    ec2 = local_cloud.client("ec2")
    (group,) = ec2.describe_security_groups(GroupIds=[default_group(ec2, vpc_with_dns(ec2))])["SecurityGroups"]
    assert [(rule["IpProtocol"], [pair["GroupId"] for pair in rule["UserIdGroupPairs"]])
            for rule in group["IpPermissions"]] == [("-1", [group["GroupId"]])]


def test_the_instance_site_and_the_cloud_name_one_header():
    site = ast.parse((INSTANCE_SITE / "sitecustomize.py").read_text())
    assigned = {node.targets[0].id: node.value.value for node in site.body
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    assert assigned["UNREACHABLE_HEADER"] == UNREACHABLE_HEADER


def test_the_default_vpc_routes_to_an_internet_gateway_and_only_a_one_interface_launch_gets_an_address(local_cloud):
    """As EC2's: a single-interface instance in a default subnet reaches AWS; an EFA one there
    gets no public IPv4 address, and so no way out."""
    ec2 = local_cloud.client("ec2")
    vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    (main,) = ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                                 {"Name": "association.main", "Values": ["true"]}])["RouteTables"]
    (gateway,) = ec2.describe_internet_gateways(Filters=[{"Name": "attachment.vpc-id", "Values": [vpc]}])[
        "InternetGateways"]
    assert {"DestinationCidrBlock": "0.0.0.0/0", "GatewayId": gateway["InternetGatewayId"]}.items() <= next(
        route for route in main["Routes"] if route.get("DestinationCidrBlock") == "0.0.0.0/0").items()
    local_cloud.fleet.boot = lambda instance: None
    subnet = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]},
                                           {"Name": "availability-zone", "Values": ["us-east-1a"]}])["Subnets"][0]
    one = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1, MaxCount=1,
                            SubnetId=subnet["SubnetId"])["Instances"][0]
    efa = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="p4d.24xlarge", MinCount=1, MaxCount=1,
                            NetworkInterfaces=[{"NetworkCardIndex": card, "DeviceIndex": 0 if card == 0 else 1,
                                                "InterfaceType": "efa", "SubnetId": subnet["SubnetId"]}
                                               for card in range(4)])["Instances"][0]
    described = {instance["InstanceId"]: instance for reservation in ec2.describe_instances(
        InstanceIds=[one["InstanceId"], efa["InstanceId"]])["Reservations"] for instance in reservation["Instances"]}
    assert described[one["InstanceId"]].get("PublicIpAddress")
    assert not described[efa["InstanceId"]].get("PublicIpAddress")


def test_an_instance_of_a_launch_template_is_in_its_interfaces_groups_and_else_in_its_vpcs_default(local_cloud):
    """As EC2 has it: DescribeInstances names the groups the launch gave its primary interface (a
    fleet's launch template's); a launch that names none is in its VPC's default group."""
    ec2 = local_cloud.client("ec2")
    local_cloud.fleet.boot = lambda instance: None
    vpc = vpc_with_dns(ec2)
    subnet, _ = subnet_with_table(ec2, vpc, "10.9.2.0/24")
    group = ec2.create_security_group(GroupName="nodes", Description="nodes", VpcId=vpc)["GroupId"]
    template = ec2.create_launch_template(LaunchTemplateName=f"nodes-{vpc}", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "c5.large",
        "NetworkInterfaces": [{"DeviceIndex": 0, "SubnetId": subnet, "Groups": [group]}]})["LaunchTemplate"]
    fleet = ec2.create_fleet(Type="instant", TargetCapacitySpecification={
        "TotalTargetCapacity": 1, "DefaultTargetCapacityType": "on-demand"}, LaunchTemplateConfigs=[{
            "LaunchTemplateSpecification": {"LaunchTemplateId": template["LaunchTemplateId"], "Version": "$Latest"},
            "Overrides": [{"SubnetId": subnet}]}])
    (launched,) = fleet["Instances"][0]["InstanceIds"]
    bare = ec2.run_instances(ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1, MaxCount=1,
                             SubnetId=subnet)["Instances"][0]["InstanceId"]
    groups = {instance["InstanceId"]: [item["GroupId"] for item in instance["SecurityGroups"]]
              for reservation in ec2.describe_instances(InstanceIds=[launched, bare])["Reservations"]
              for instance in reservation["Instances"]}
    assert groups == {launched: [group], bare: [default_group(ec2, vpc)]}
