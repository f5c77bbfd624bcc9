"""EC2 in the local cloud: state-change events, the process fleet, placement groups, EFA."""

import base64
import json
import os
import signal
import sys
from pathlib import Path

import botocore.exceptions
import pytest

from trainfleet.adapters.liveness import instance_troubles

from localcloud.fleet import boot_user_data
from localcloud.glue import ec2 as ec2_glue
from localcloud.glue.ec2 import InterfaceError, interface_requests
from localcloud_helpers import (create_state_machine, deploy_function, event_sink, receive,
                                records, unique, wait_for_execution)

IMAGE = "ami-12c6146b"
# booted.json appears whole (written aside, then renamed): a reader that sees it reads all of it.
NODE_SCRIPT = ("import json, os, pathlib, time\n"
               "keys = ['LOCALCLOUD_INSTANCE_ID', 'LOCALCLOUD_PRIVATE_IP', 'AWS_ENDPOINT_URL']\n"
               "pathlib.Path('booted.part').write_text(json.dumps({k: os.environ[k] for k in keys}))\n"
               "os.replace('booted.part', 'booted.json')\n"
               "time.sleep(120)\n")


def efa_interfaces(cards: int) -> list[dict]:
    return [{"NetworkCardIndex": card, "DeviceIndex": 0 if card == 0 else 1, "InterfaceType": "efa"}
            for card in range(cards)]


def state_changes(cloud) -> str:
    return event_sink(cloud, {"source": ["aws.ec2"], "detail-type": ["EC2 Instance State-change Notification"]},
                      InputPath="$.detail")


def states_of(events: list[dict], instance_id: str) -> list[str]:
    return [event["state"] for event in events if event["instance-id"] == instance_id]


def boot_node_script(cloud):
    cloud.fleet.boot = lambda instance: [sys.executable, "-c", NODE_SCRIPT]


def launch(cloud, **request) -> str:
    request = {"ImageId": IMAGE, "InstanceType": "t3.micro", **request}
    return cloud.client("ec2").run_instances(MinCount=1, MaxCount=1, **request)["Instances"][0]["InstanceId"]


def describe(cloud, instance_id: str) -> dict:
    return cloud.client("ec2").describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


@pytest.mark.slow
def test_instance_boots_a_process_and_dies_with_it(local_cloud):
    boot_node_script(local_cloud)
    queue = state_changes(local_cloud)
    instance_id = launch(local_cloud)
    local_cloud.fleet.wait_for_state(instance_id, "running")
    instance = local_cloud.fleet.get(instance_id)
    booted = instance.workdir / "booted.json"
    local_cloud.wait_until(booted.exists, "the node process to boot")

    assert json.loads(booted.read_text()) == {"LOCALCLOUD_INSTANCE_ID": instance_id,
                                              "LOCALCLOUD_PRIVATE_IP": instance.private_ip,
                                              "AWS_ENDPOINT_URL": local_cloud.endpoint}
    assert describe(local_cloud, instance_id)["PrivateIpAddress"] == instance.private_ip

    local_cloud.fleet.kill(instance_id)
    local_cloud.fleet.wait_for_state(instance_id, "terminated")

    assert states_of(receive(local_cloud, queue, 4), instance_id) == \
        ["pending", "running", "shutting-down", "terminated"]
    described = describe(local_cloud, instance_id)
    assert described["State"]["Name"] == "terminated"
    assert described["StateReason"]["Code"] == "Client.InstanceInitiatedShutdown"


def test_a_user_data_script_that_ends_leaves_its_instance_up_until_it_shuts_down(local_cloud):
    """As on EC2: cloud-init runs the script once and the host stays up whatever its status (a
    failed bootstrap must not read as a lost node); `shutdown` from inside ends the instance as
    an instance-initiated shutdown does."""
    # What stays behind (the agent, started in the background) ends the instance once told to.
    script = (b"#!/bin/sh\necho bootstrap step failed\n"
              b"(while [ ! -e shut-down ]; do sleep 0.05; done; shutdown -h now) &\nexit 3\n")
    local_cloud.fleet.boot = boot_user_data  # the fleet's own boot, which other tests here replace
    instance_id = launch(local_cloud, UserData=script.decode())  # boto3 encodes it
    instance = local_cloud.fleet.get(instance_id)
    console = instance.console_log
    local_cloud.wait_until(lambda: console.exists() and "exited with status 3" in console.read_text(),
                           "the user data to end")
    assert "bootstrap step failed" in console.read_text()
    assert describe(local_cloud, instance_id)["State"]["Name"] == "running"

    (instance.workdir / "shut-down").touch()
    local_cloud.fleet.wait_for_state(instance_id, "terminated")
    assert describe(local_cloud, instance_id)["StateReason"]["Code"] == "Client.InstanceInitiatedShutdown"


@pytest.mark.slow
def test_hang_freezes_every_process_of_the_instance(local_cloud):
    """Also one that left the instance's process group, as torchrun's ranks do: a frozen machine
    runs nothing."""
    script = ("import pathlib, subprocess, time\n"
              "child = subprocess.Popen(['sleep', '120'], start_new_session=True)\n"
              "pathlib.Path('child.pid').write_text(str(child.pid))\n"
              "time.sleep(120)\n")
    local_cloud.fleet.boot = lambda instance: [sys.executable, "-c", script]
    instance_id = launch(local_cloud)
    local_cloud.fleet.wait_for_state(instance_id, "running")
    child_pid = local_cloud.fleet.get(instance_id).workdir / "child.pid"
    local_cloud.wait_until(child_pid.exists, "the child to start")

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    child = int(child_pid.read_text())
    local_cloud.fleet.hang(instance_id)
    local_cloud.wait_until(lambda: state(child) == "T", "the child to stop")
    local_cloud.fleet.resume(instance_id)
    local_cloud.wait_until(lambda: state(child) != "T", "the child to go on")
    local_cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    local_cloud.fleet.wait_for_state(instance_id, "terminated")
    os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_terminate_hung_instance_and_stop_start(local_cloud):
    boot_node_script(local_cloud)
    queue = state_changes(local_cloud)
    ec2 = local_cloud.client("ec2")
    hung, stopped = launch(local_cloud), launch(local_cloud)
    for instance_id in (hung, stopped):
        local_cloud.fleet.wait_for_state(instance_id, "running")
        local_cloud.wait_until((local_cloud.fleet.get(instance_id).workdir / "booted.json").exists, "boot")

    process = local_cloud.fleet.get(hung).process
    local_cloud.fleet.hang(hung)
    local_cloud.wait_until(lambda: Path(f"/proc/{process.pid}/stat").read_text().split()[2] == "T", "the process to stop")
    assert describe(local_cloud, hung)["State"]["Name"] == "running"
    # A frozen instance fails its instance status check, as EC2 reports one that stops responding.
    statuses = {status["InstanceId"]: status for status in ec2.describe_instance_status(
        InstanceIds=[hung, stopped])["InstanceStatuses"]}
    assert statuses[hung]["InstanceStatus"]["Status"] == "impaired"
    assert statuses[hung]["InstanceStatus"]["Details"] == [{"Name": "reachability", "Status": "failed"}]
    assert statuses[stopped]["InstanceStatus"]["Status"] == "ok"
    assert instance_troubles(ec2, [hung, stopped]) == {hung: "impaired"}
    assert ec2.terminate_instances(InstanceIds=[hung])["TerminatingInstances"][0]["CurrentState"]["Name"] \
        == "shutting-down"
    local_cloud.fleet.wait_for_state(hung, "terminated")
    assert process.poll() is not None
    assert instance_troubles(ec2, [hung]) == {hung: "terminated"}  # what Recover sees of a lost worker

    first_process = local_cloud.fleet.get(stopped).process
    ec2.stop_instances(InstanceIds=[stopped])
    local_cloud.fleet.wait_for_state(stopped, "stopped")
    assert first_process.poll() is not None
    assert instance_troubles(ec2, [stopped]) == {stopped: "stopped"}
    ec2.start_instances(InstanceIds=[stopped])
    local_cloud.fleet.wait_for_state(stopped, "running")
    local_cloud.wait_until(lambda: local_cloud.fleet.get(stopped).process not in (None, first_process), "the process to start again")

    events = receive(local_cloud, queue, 10)
    assert states_of(events, hung) == ["pending", "running", "shutting-down", "terminated"]
    assert states_of(events, stopped) == ["pending", "running", "stopping", "stopped", "pending", "running"]


@pytest.mark.slow
def test_terminate_event_reaches_a_lambda_and_a_state_machine(local_cloud, tmp_path):
    """The end-to-end path the event handler relies on: TerminateInstances -> rule -> targets."""
    record_file = tmp_path / "handler.jsonl"
    function_arn = deploy_function(local_cloud, "echo", record_file)
    machine_arn = create_state_machine(local_cloud, {"StartAt": "Seen", "States": {
        "Seen": {"Type": "Pass", "Parameters": {"lost.$": "$.detail.instance-id"}, "End": True}}})
    events = local_cloud.client("events")
    rule = unique("terminated")
    events.put_rule(Name=rule, EventPattern=json.dumps({
        "source": ["aws.ec2"], "detail-type": ["EC2 Instance State-change Notification"],
        "detail": {"state": ["terminated"]}}))
    events.put_targets(Rule=rule, Targets=[{"Id": "fn", "Arn": function_arn},
                                           {"Id": "sm", "Arn": machine_arn}])
    instance_id = launch(local_cloud)
    local_cloud.fleet.wait_for_state(instance_id, "running")

    local_cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])

    local_cloud.wait_until(lambda: records(record_file), "the Lambda target")
    [delivered] = [entry["event"] for entry in records(record_file)
                   if entry["event"]["detail"]["instance-id"] == instance_id]
    assert delivered["source"] == "aws.ec2"
    assert delivered["resources"] == [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance_id}"]
    assert set(delivered) == {"version", "id", "detail-type", "source", "account", "time",
                              "region", "resources", "detail"}
    sfn = local_cloud.client("stepfunctions")
    local_cloud.wait_until(lambda: sfn.list_executions(stateMachineArn=machine_arn)["executions"], "the state machine target")
    outputs = [json.loads(wait_for_execution(local_cloud, execution["executionArn"])["output"])
               for execution in sfn.list_executions(stateMachineArn=machine_arn)["executions"]]
    assert {"lost": instance_id} in outputs


@pytest.mark.slow
def test_spot_interruption_rebalance_and_health_events(local_cloud):
    queue = event_sink(local_cloud, {"source": ["aws.ec2", "aws.health"],
                                     "detail-type": ["EC2 Spot Instance Interruption Warning",
                                                     "EC2 Instance Rebalance Recommendation",
                                                     "AWS Health Event"]})
    instance_id = launch(local_cloud)
    local_cloud.fleet.wait_for_state(instance_id, "running")

    local_cloud.inject_rebalance(instance_id)
    local_cloud.inject_health_event([instance_id])
    local_cloud.inject_spot_interruption(instance_id)

    assert local_cloud.fleet.get(instance_id).spot_action["action"] == "terminate"
    assert local_cloud.fleet.get(instance_id).rebalance_notice["noticeTime"].endswith("Z")
    by_type = {event["detail-type"]: event for event in receive(local_cloud, queue, 3)}
    assert by_type["EC2 Spot Instance Interruption Warning"]["detail"] == \
        {"instance-id": instance_id, "instance-action": "terminate"}
    assert by_type["EC2 Instance Rebalance Recommendation"]["detail"] == {"instance-id": instance_id}
    health = by_type["AWS Health Event"]
    assert health["source"] == "aws.health" and health["resources"] == [instance_id]
    assert health["detail"]["service"] == "EC2"
    assert health["detail"]["affectedEntities"] == [{"entityValue": instance_id}]
    local_cloud.fleet.wait_for_state(instance_id, "terminated")
    assert describe(local_cloud, instance_id)["StateReason"]["Code"] == "Server.SpotInstanceTermination"


def test_placement_groups_are_kept(local_cloud):
    ec2 = local_cloud.client("ec2")
    name = unique("pg")
    created = ec2.create_placement_group(GroupName=name, Strategy="cluster",
                                         TagSpecifications=[{"ResourceType": "placement-group",
                                                             "Tags": [{"Key": "run", "Value": "r1"}]}])
    [described] = ec2.describe_placement_groups(GroupNames=[name])["PlacementGroups"]
    assert described["Strategy"] == "cluster" and described["State"] == "available"
    assert described["Tags"] == [{"Key": "run", "Value": "r1"}]
    assert ec2.describe_placement_groups(GroupIds=[described["GroupId"]])["PlacementGroups"] == [described]
    assert created["PlacementGroup"]["GroupId"] == described["GroupId"]
    other = unique("pg")
    ec2.create_placement_group(GroupName=other, Strategy="spread",
                               TagSpecifications=[{"ResourceType": "placement-group",
                                                   "Tags": [{"Key": "run", "Value": "r2"}]}])

    def filtered(*filters: tuple[str, list[str]]) -> set[str]:
        found = ec2.describe_placement_groups(Filters=[{"Name": n, "Values": v} for n, v in filters])
        return {group["GroupName"] for group in found["PlacementGroups"]} & {name, other}
    assert filtered(("tag:run", ["r1"])) == {name}
    assert filtered(("tag:run", ["r1", "r2"])) == {name, other}
    assert filtered(("tag:run", ["r1"]), ("strategy", ["spread"])) == set()
    assert filtered(("strategy", ["spread"]), ("group-name", [other])) == {other}
    assert filtered(("tag-key", ["run"])) == {name, other}
    with pytest.raises(botocore.exceptions.ClientError, match="The filter 'colour' is invalid"):
        filtered(("colour", ["red"]))
    ec2.delete_placement_group(GroupName=other)

    with pytest.raises(botocore.exceptions.ClientError, match="InvalidPlacementGroup.Duplicate"):
        ec2.create_placement_group(GroupName=name, Strategy="cluster")
    with pytest.raises(botocore.exceptions.ClientError, match="Strategy"):
        ec2.create_placement_group(GroupName=unique("pg"), Strategy="huddle")

    instance_id = launch(local_cloud, Placement={"GroupName": name})
    assert describe(local_cloud, instance_id)["Placement"]["GroupName"] == name
    with pytest.raises(botocore.exceptions.ClientError, match="InvalidPlacementGroup.InUse"):
        ec2.delete_placement_group(GroupName=name)
    ec2.terminate_instances(InstanceIds=[instance_id])
    local_cloud.fleet.wait_for_state(instance_id, "terminated")
    ec2.delete_placement_group(GroupName=name)
    with pytest.raises(botocore.exceptions.ClientError, match="InvalidPlacementGroup.Unknown"):
        ec2.describe_placement_groups(GroupNames=[name])
    with pytest.raises(botocore.exceptions.ClientError, match="InvalidPlacementGroup.Unknown"):
        launch(local_cloud, Placement={"GroupName": name})


def test_efa_interfaces_from_a_launch_template_via_run_instances_and_create_fleet(local_cloud):
    ec2 = local_cloud.client("ec2")
    group = unique("pg")
    ec2.create_placement_group(GroupName=group, Strategy="cluster")
    template = unique("lt")
    user_data = base64.b64encode(b"#!/bin/sh\nsleep 60\n").decode()
    ec2.create_launch_template(LaunchTemplateName=template, LaunchTemplateData={
        "ImageId": IMAGE, "InstanceType": "p4d.24xlarge", "UserData": user_data,
        "NetworkInterfaces": efa_interfaces(4), "Placement": {"GroupName": group}})

    single = ec2.run_instances(MinCount=1, MaxCount=1,
                               LaunchTemplate={"LaunchTemplateName": template})["Instances"][0]["InstanceId"]
    fleet = ec2.create_fleet(Type="instant", LaunchTemplateConfigs=[
        {"LaunchTemplateSpecification": {"LaunchTemplateName": template, "Version": "$Latest"}}],
        TargetCapacitySpecification={"TotalTargetCapacity": 2, "DefaultTargetCapacityType": "on-demand"})
    fleet_ids = [instance_id for entry in fleet["Instances"] for instance_id in entry["InstanceIds"]]

    assert len(fleet_ids) == 2
    for instance_id in [single, *fleet_ids]:
        described = describe(local_cloud, instance_id)
        assert described["InstanceType"] == "p4d.24xlarge"
        assert described["Placement"]["GroupName"] == group
        interfaces = sorted((nic["Attachment"]["NetworkCardIndex"], nic["Attachment"]["DeviceIndex"],
                             nic["InterfaceType"]) for nic in described["NetworkInterfaces"])
        assert interfaces == [(0, 0, "efa"), (1, 1, "efa"), (2, 1, "efa"), (3, 1, "efa")]
        assert local_cloud.fleet.get(instance_id).user_data == "#!/bin/sh\nsleep 60\n"


def test_instance_types_and_interfaces_are_checked(local_cloud):
    ec2 = local_cloud.client("ec2")
    with pytest.raises(botocore.exceptions.ClientError, match="InvalidInstanceType"):
        launch(local_cloud, InstanceType="p9.huge")
    with pytest.raises(botocore.exceptions.ClientError, match=r"InterfaceType: 'efa' is not supported by t3.micro"):
        ec2.run_instances(MinCount=1, MaxCount=1, ImageId=IMAGE, InstanceType="t3.micro",
                          NetworkInterfaces=[{"DeviceIndex": 0, "InterfaceType": "efa"}])


def test_interface_requests_name_the_faulty_entry():
    assert len(interface_requests("p5.48xlarge", efa_interfaces(32))) == 32
    with pytest.raises(ValueError, match=r"NetworkInterfaces\[4\].NetworkCardIndex: 4 is out of range"):
        interface_requests("p4d.24xlarge", efa_interfaces(5))
    with pytest.raises(ValueError, match="requested twice"):
        interface_requests("p4d.24xlarge", efa_interfaces(2) + efa_interfaces(2)[1:])
    with pytest.raises(ValueError, match="primary interface"):
        interface_requests("p4d.24xlarge", efa_interfaces(2)[1:])


def test_ec2s_rules_for_several_interfaces_are_kept():
    """What EC2 refuses of an EFA layout: a public address asked for (even refused) with several
    interfaces, more interfaces on a card than it takes, more EFA interfaces than the type has."""
    public = [dict(spec, AssociatePublicIpAddress=False) for spec in efa_interfaces(4)]
    with pytest.raises(InterfaceError, match="associatePublicIPAddress parameter cannot be specified") as refused:
        interface_requests("p4d.24xlarge", public)
    assert refused.value.code == "InvalidParameterCombination"
    assert len(interface_requests("p4d.24xlarge", public[:1])) == 1, "one interface may say it"
    plain = [{"NetworkCardIndex": 0, "DeviceIndex": device, "InterfaceType": "interface"} for device in range(4)]
    with pytest.raises(InterfaceError, match="network card 0 of c5.large takes at most 3"):
        interface_requests("c5.large", plain)
    two_on_card_0 = efa_interfaces(4) + [{"NetworkCardIndex": 0, "DeviceIndex": 2, "InterfaceType": "efa"}]
    with pytest.raises(InterfaceError, match="5 EFA interfaces requested; p4d.24xlarge supports at most 4"):
        interface_requests("p4d.24xlarge", two_on_card_0)


def test_a_fleet_whose_template_ec2_refuses_launches_nothing_and_says_why(local_cloud):
    """CreateFleet (instant) answers a launch EC2 refuses in its Errors, and launches nothing;
    RunInstances fails with the same code."""
    ec2 = local_cloud.client("ec2")
    public = [dict(spec, AssociatePublicIpAddress=False) for spec in efa_interfaces(4)]
    template = ec2.create_launch_template(LaunchTemplateName="public-efa", LaunchTemplateData={
        "ImageId": IMAGE, "InstanceType": "p4d.24xlarge", "NetworkInterfaces": public})["LaunchTemplate"]
    subnet = default_subnet(ec2, "us-east-1a")
    instances = lambda: len(local_cloud.fleet.instances())  # noqa: E731
    before = instances()
    launched, errors = on_demand_fleet(ec2, template["LaunchTemplateId"], "p4d.24xlarge", subnet, target=2, minimum=2)
    assert launched == [] and [error["ErrorCode"] for error in errors] == ["InvalidParameterCombination"]
    assert instances() == before
    with pytest.raises(botocore.exceptions.ClientError, match="InvalidParameterCombination"):
        ec2.run_instances(MinCount=1, MaxCount=1, ImageId=IMAGE, InstanceType="p4d.24xlarge",
                          NetworkInterfaces=public)


def default_subnet(ec2, zone: str) -> str:
    return ec2.describe_subnets(Filters=[{"Name": "availability-zone", "Values": [zone]},
                                         {"Name": "default-for-az", "Values": ["true"]}])["Subnets"][0]["SubnetId"]


def on_demand_fleet(ec2, template: str, instance_type: str, subnet: str, target: int, minimum: int,
                    **client_token) -> tuple[list[str], list[dict]]:
    """An instant on-demand CreateFleet in one subnet: (instance ids, Errors)."""
    answer = ec2.create_fleet(Type="instant", LaunchTemplateConfigs=[{
        "LaunchTemplateSpecification": {"LaunchTemplateId": template, "Version": "$Latest"},
        "Overrides": [{"InstanceType": instance_type, "SubnetId": subnet}]}],
        TargetCapacitySpecification={"TotalTargetCapacity": target, "OnDemandTargetCapacity": target,
                                     "DefaultTargetCapacityType": "on-demand"},
        OnDemandOptions={"SingleInstanceType": True, "SingleAvailabilityZone": True, "MinTargetCapacity": minimum},
        **client_token)
    return [i for entry in answer.get("Instances", []) for i in entry["InstanceIds"]], answer.get("Errors", [])


def spot_fleet(ec2, template: str, instance_type: str, subnet: str, target: int,
               **allocation_strategy) -> tuple[list[str], list[dict]]:
    """An instant Spot CreateFleet in one subnet, as Allocate asks for Spot capacity: (instance ids, Errors)."""
    answer = ec2.create_fleet(Type="instant", LaunchTemplateConfigs=[{
        "LaunchTemplateSpecification": {"LaunchTemplateId": template, "Version": "$Latest"},
        "Overrides": [{"InstanceType": instance_type, "SubnetId": subnet}]}],
        TargetCapacitySpecification={"TotalTargetCapacity": target, "SpotTargetCapacity": target,
                                     "DefaultTargetCapacityType": "spot"},
        SpotOptions={**allocation_strategy, "SingleInstanceType": True, "SingleAvailabilityZone": True})
    return [i for entry in answer.get("Instances", []) for i in entry["InstanceIds"]], answer.get("Errors", [])


def test_capacity_cap_per_type_and_zone(local_cloud):
    ec2, zone, instance_type = local_cloud.client("ec2"), "us-east-1f", "c6i.large"
    subnet = default_subnet(ec2, zone)
    template = ec2.create_launch_template(LaunchTemplateName=unique("lt"), LaunchTemplateData={
        "ImageId": IMAGE, "InstanceType": instance_type})["LaunchTemplate"]["LaunchTemplateId"]

    def fleet(target: int, minimum: int) -> tuple[list[str], list[dict]]:
        return on_demand_fleet(ec2, template, instance_type, subnet, target, minimum)

    def run_one() -> str:
        return ec2.run_instances(ImageId=IMAGE, InstanceType=instance_type, SubnetId=subnet, MinCount=1,
                                 MaxCount=1)["Instances"][0]["InstanceId"]

    local_cloud.set_capacity(instance_type, zone, 2)
    launched, errors = fleet(target=3, minimum=2)  # partial fulfilment above the minimum
    assert len(launched) == 2
    assert [error["ErrorCode"] for error in errors] == ["InsufficientInstanceCapacity"]
    assert zone in errors[0]["ErrorMessage"]
    with pytest.raises(botocore.exceptions.ClientError, match="InsufficientInstanceCapacity"):
        run_one()

    local_cloud.set_capacity(instance_type, zone, 3)
    nothing, errors = fleet(target=2, minimum=2)  # one fits, the minimum does not: none launched
    assert nothing == [] and errors[0]["ErrorCode"] == "InsufficientInstanceCapacity"
    launched.append(run_one())

    ec2.terminate_instances(InstanceIds=[launched[0]])  # capacity comes back once it is terminated
    local_cloud.wait_until(lambda: describe(local_cloud, launched[0])["State"]["Name"] == "terminated", what="terminated")
    launched.append(run_one())
    local_cloud.set_capacity(instance_type, zone, None)
    more, errors = fleet(target=2, minimum=2)
    assert len(more) == 2 and errors == []
    ec2.terminate_instances(InstanceIds=launched + more)

    for bad, message in [(dict(instances=-1), "instances"), (dict(availability_zone="eu-west-1a"), "zone"),
                         (dict(instance_type="p9.huge"), "instance_type")]:
        arguments = dict(instance_type=instance_type, availability_zone=zone, instances=1) | bad
        with pytest.raises(ValueError, match=message):
            local_cloud.set_capacity(**arguments)


def test_create_fleet_client_token_answers_a_repeat_with_the_first_answer(local_cloud):
    ec2, zone, instance_type = local_cloud.client("ec2"), "us-east-1e", "c6i.xlarge"
    subnet = default_subnet(ec2, zone)
    template = ec2.create_launch_template(LaunchTemplateName=unique("lt"), LaunchTemplateData={
        "ImageId": IMAGE, "InstanceType": instance_type})["LaunchTemplate"]["LaunchTemplateId"]
    token = unique("token")

    local_cloud.set_capacity(instance_type, zone, 0)
    nothing, errors = on_demand_fleet(ec2, template, instance_type, subnet, 2, 2, ClientToken=token)
    assert nothing == [] and errors[0]["ErrorCode"] == "InsufficientInstanceCapacity"
    local_cloud.set_capacity(instance_type, zone, None)
    # Capacity came back, but a repeated request is answered, not carried out again.
    assert on_demand_fleet(ec2, template, instance_type, subnet, 2, 2, ClientToken=token) == (nothing, errors)

    other_token = unique("token")
    launched, errors = on_demand_fleet(ec2, template, instance_type, subnet, 2, 2, ClientToken=other_token)
    assert len(launched) == 2 and errors == []
    assert on_demand_fleet(ec2, template, instance_type, subnet, 2, 2, ClientToken=other_token) == (launched, [])
    alive = ec2.describe_instances(Filters=[{"Name": "subnet-id", "Values": [subnet]},
                                            {"Name": "instance-type", "Values": [instance_type]},
                                            {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    assert sorted(i["InstanceId"] for r in alive["Reservations"] for i in r["Instances"]) == sorted(launched)
    with pytest.raises(botocore.exceptions.ClientError, match="IdempotentParameterMismatch"):
        on_demand_fleet(ec2, template, instance_type, subnet, 3, 2, ClientToken=other_token)
    ec2.terminate_instances(InstanceIds=launched)


def test_fleet_instances_get_the_launch_templates_instance_profile(local_cloud, monkeypatch):
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 0.0)  # not the point here: see below
    ec2, iam, zone, instance_type = local_cloud.client("ec2"), local_cloud.client("iam"), "us-east-1d", "c5.large"
    profile = iam.create_instance_profile(InstanceProfileName=unique("nodes"))["InstanceProfile"]
    template = ec2.create_launch_template(LaunchTemplateName=unique("lt"), LaunchTemplateData={
        "ImageId": IMAGE, "InstanceType": instance_type,
        "IamInstanceProfile": {"Arn": profile["Arn"]}})["LaunchTemplate"]["LaunchTemplateId"]
    launched, errors = on_demand_fleet(ec2, template, instance_type, default_subnet(ec2, zone), 1, 1)
    assert errors == []
    assert describe(local_cloud, launched[0])["IamInstanceProfile"]["Arn"] == profile["Arn"]
    ec2.terminate_instances(InstanceIds=launched)


def test_a_launch_naming_a_profile_iam_has_not_shown_ec2_yet_or_at_all_is_refused(local_cloud, monkeypatch):
    """IAM is eventually consistent: a new instance profile reaches EC2 seconds later, and EC2
    refuses a launch naming one it does not know (InvalidParameterValue), a fleet in its Errors."""
    ec2, iam, zone, instance_type = local_cloud.client("ec2"), local_cloud.client("iam"), "us-east-1d", "c5.large"
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 3600.0)
    young = iam.create_instance_profile(InstanceProfileName=unique("nodes"))["InstanceProfile"]["Arn"]
    unknown = young.replace("instance-profile/", "instance-profile/never-")
    for profile in (young, unknown):
        with pytest.raises(botocore.exceptions.ClientError,
                           match=rf"Value \({profile}\) for parameter iamInstanceProfile.arn is invalid"):
            ec2.run_instances(ImageId=IMAGE, InstanceType=instance_type, MinCount=1, MaxCount=1,
                              IamInstanceProfile={"Arn": profile})
        template = ec2.create_launch_template(LaunchTemplateName=unique("lt"), LaunchTemplateData={
            "ImageId": IMAGE, "InstanceType": instance_type, "IamInstanceProfile": {"Arn": profile}})[
            "LaunchTemplate"]["LaunchTemplateId"]
        launched, errors = on_demand_fleet(ec2, template, instance_type, default_subnet(ec2, zone), 1, 1)
        assert launched == [] and [error["ErrorCode"] for error in errors] == ["InvalidParameterValue"]
        for strategy in ({"AllocationStrategy": "capacity-optimized"}, {}):  # optional, as on EC2
            launched, errors = spot_fleet(ec2, template, instance_type, default_subnet(ec2, zone), 2, **strategy)
            assert launched == [] and [(error["Lifecycle"], error["ErrorCode"]) for error in errors] == [
                ("spot", "InvalidParameterValue")]
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 0.0)  # propagated
    launched = ec2.run_instances(ImageId=IMAGE, InstanceType=instance_type, MinCount=1, MaxCount=1,
                                 IamInstanceProfile={"Arn": young})["Instances"]
    ec2.terminate_instances(InstanceIds=[instance["InstanceId"] for instance in launched])
