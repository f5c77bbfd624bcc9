"""EC2 fleet adapter: the requests it builds, how it reads CreateFleet answers, and what the
local cloud (moto plus placement groups and EFA interfaces) holds after allocate and teardown."""

import base64
import contextlib
import copy
import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from botocore.awsrequest import AWSResponse

from localcloud.glue import ec2 as ec2_glue
from trainfleet.adapters import ec2_fleet as fleet
from trainfleet.core.catalogue import CATALOGUE, instance_facts
from trainfleet.core.lifecycle import BLOCK_TERMINATION_LEAD
from trainfleet.core.runspec import RunSpec
from trainfleet.core.settings import Settings

EXAMPLE = json.loads((Path(__file__).parents[1] / "events" / "example-run.json").read_text())
SETTINGS = Settings(run_table="runs", liveness_table="liveness", bucket="bucket", event_bus="agents", stack_name="trainfleet",
                    node_policy_arn="arn:aws:iam::123456789012:policy/trainfleet-node")
PROFILE = "arn:aws:iam::123456789012:instance-profile/trainfleet-node"
"""The run's node instance profile (Allocate makes it: trainfleet.adapters.node_roles)."""


def make_spec(instance_type="p4d.24xlarge", node_count=2, subnet_ids=("subnet-0123456789abcdef0",),
              security_group_ids=("sg-0123456789abcdef0",), run_name="r1", **capacity) -> RunSpec:
    doc = copy.deepcopy(EXAMPLE)
    ranks = node_count * instance_facts(instance_type).ranks_per_node
    doc.update(run_name=run_name, instance_type=instance_type, node_count=node_count, min_nodes=1)
    doc["trainer"]["parallel"].update(pp=2, dp=ranks // 2)
    doc["trainer"]["training"]["batch_size"] = 8 * ranks
    doc["trainer"]["parallel"]["microbatches"] = 8
    doc["capacity"] = {"subnet_ids": list(subnet_ids), "security_group_ids": list(security_group_ids), **capacity}
    return RunSpec.model_validate(doc)


# --- pure builders --------------------------------------------------------------------------

@pytest.mark.parametrize("instance_type, cards", [
    ("p4d.24xlarge", 4), ("p4de.24xlarge", 4), ("p5.48xlarge", 32), ("p5e.48xlarge", 32),
    ("p5en.48xlarge", 16), ("trn1.32xlarge", 8)])
def test_one_efa_interface_per_network_card(instance_type, cards):
    interfaces = fleet.efa_network_interfaces(CATALOGUE[instance_type], ["sg-1"])
    assert [(i["NetworkCardIndex"], i["DeviceIndex"], i["InterfaceType"]) for i in interfaces] == \
        [(0, 0, "efa")] + [(card, 1, "efa-only") for card in range(1, cards)]
    # EC2 refuses AssociatePublicIpAddress, even false, on a launch with several interfaces.
    assert all("AssociatePublicIpAddress" not in i and i["Groups"] == ["sg-1"] for i in interfaces)


def test_cpu_types_get_one_plain_interface():
    assert fleet.efa_network_interfaces(CATALOGUE["c5.large"], ["sg-1"]) == [
        {"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "interface", "Groups": ["sg-1"],
         "DeleteOnTermination": True, "AssociatePublicIpAddress": False}]


def test_launch_template_requires_imdsv2_and_tags_everything():
    spec = make_spec()
    data = fleet.launch_template_data(spec, SETTINGS, PROFILE)
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    # The agent ends its instance when the run is over: a shutdown from inside terminates it.
    assert data["InstanceInitiatedShutdownBehavior"] == "terminate"
    assert data["IamInstanceProfile"] == {"Arn": PROFILE}
    assert base64.b64decode(data["UserData"]).decode() == fleet.node_user_data("r1", SETTINGS)
    assert {tags["ResourceType"] for tags in data["TagSpecifications"]} == {"instance", "volume", "network-interface"}
    for tags in data["TagSpecifications"]:
        assert {"Key": fleet.TAG_RUN, "Value": "r1"} in tags["Tags"]
        assert {"Key": fleet.TAG_STACK, "Value": "trainfleet"} in tags["Tags"]
        assert {"Key": "team", "Value": "pretraining"} in tags["Tags"]
    assert "InstanceMarketOptions" not in data and "CapacityReservationSpecification" not in data


def test_capacity_block_and_reservation_go_into_the_template():
    block = make_spec(kind="capacity-block", reservation_id="cr-0123456789abcdef0")
    data = fleet.launch_template_data(block, SETTINGS, PROFILE)
    assert data["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert data["CapacityReservationSpecification"]["CapacityReservationTarget"] == \
        {"CapacityReservationId": "cr-0123456789abcdef0"}
    odcr = make_spec(kind="capacity-reservation", reservation_id="cr-0123456789abcdef0")
    data = fleet.launch_template_data(odcr, SETTINGS, PROFILE)
    assert "InstanceMarketOptions" not in data and "CapacityReservationSpecification" in data


def test_user_data_installs_and_starts_the_agent():
    script = fleet.node_user_data("r1", SETTINGS)
    assert script.startswith("#!/bin/bash\n")
    assert "TRAINFLEET_RUN_NAME=r1" in script and "TRAINFLEET_EVENT_BUS=agents" in script
    assert "TRAINFLEET_SHUTDOWN_COMMAND='shutdown -h now'" in script
    assert '-H "X-aws-ec2-metadata-token: $token"' in script  # IMDSv2 only, like the template
    assert f"export AWS_RETRY_MODE=standard AWS_MAX_ATTEMPTS={fleet.BOOT_REQUEST_ATTEMPTS}" in script
    assert "systemd-run --unit trainfleet-agent" in script and f"-m {fleet.AGENT_MODULE}" in script


def test_every_bootstrap_step_is_tried_again_with_jittered_backoff_and_named_when_it_fails():
    from trainfleet.core.events import BOOT_FAILED_AT, BOOT_STEPS

    script = fleet.node_user_data("r1", SETTINGS)
    steps = [line.split('"')[1] for line in script.splitlines() if line.startswith('step="')]
    assert steps == list(BOOT_STEPS)
    calls = [line for line in script.splitlines() if line.startswith("retried ")]
    assert len(calls) == len(BOOT_STEPS), "each step, and nothing else, is retried"
    assert f"retry_s=${{TRAINFLEET_BOOT_RETRY_S:-{fleet.BOOT_RETRY_S}}}" in script
    assert f'[ "$tries" -lt {fleet.BOOT_STEP_TRIES} ] || return "$status"' in script
    assert "sleep $(( wait / 2 + RANDOM % (wait / 2 + 1) ))" in script  # jitter: nodes that failed together part
    assert f'reason="{BOOT_FAILED_AT}$step (exit $status, $tries tries)"' in script


def test_a_node_copies_two_named_artifacts_from_the_prefix_its_instance_id_picks_at_a_capped_rate():
    """S3 serves at least 5,500 GET/HEAD a second per prefix: the artifacts are published under
    ARTIFACT_COPIES prefixes, each node asks one, in parts of ARTIFACT_PART_BYTES at most
    ARTIFACT_BANDWIDTH: 512 nodes stay far below it."""
    script = fleet.node_user_data("r1", SETTINGS)
    assert 'artifacts="s3://bucket/artifacts/$(printf \'%02d\' $(( 16#${instance_id: -2} % 16 )))/"' in script
    assert f'aws s3 cp "${{artifacts}}{fleet.NODE_PYTHON_ARTIFACT}"' in script
    assert f'aws s3 cp "${{artifacts}}{fleet.NODE_WHEELHOUSE_ARTIFACT}"' in script and "--recursive" not in script
    assert f"multipart_chunksize = {fleet.ARTIFACT_PART_BYTES}" in script and "max_bandwidth = 2GB/s" in script
    assert [fleet.artifact_copy(f"i-0123456789abcde{end}") for end in ("00", "0f", "10", "ff")] == [
        "artifacts/00/", "artifacts/15/", "artifacts/00/", "artifacts/15/"]
    gets_per_node_per_s = 2 * 10**9 / fleet.ARTIFACT_PART_BYTES
    assert 512 / fleet.ARTIFACT_COPIES * gets_per_node_per_s < 5500 / 10, "a tenth of a prefix's rate at most"


def test_the_agents_settings_are_read_back_from_the_user_data_and_only_from_a_nodes():
    settings = SETTINGS.model_copy(update={"stack_name": "stack with 'quotes' and $dollars"})
    read = fleet.user_data_settings(fleet.node_user_data("r1", settings))
    assert read is not None and read["TRAINFLEET_RUN_NAME"] == "r1" and read["TRAINFLEET_EVENT_BUS"] == "agents"
    assert read["TRAINFLEET_STACK"] == "stack with 'quotes' and $dollars"
    assert read["TRAINFLEET_SHUTDOWN_COMMAND"] == "shutdown -h now"
    assert fleet.user_data_settings("#!/bin/sh\nsleep 60\n") is None


def test_the_agents_unit_may_open_a_socket_to_every_rank_of_the_largest_world():
    """systemd's default of 1,024 open files is spent by a gloo group's sockets in a world of
    more than 1,024 ranks; torchrun and its ranks inherit the unit's limit."""
    script = fleet.node_user_data("r1", SETTINGS)
    start = script[script.index("systemd-run"):]
    assert f"--property=LimitNOFILE={fleet.AGENT_OPEN_FILES_LIMIT}" in start.split(f"-m {fleet.AGENT_MODULE}")[0]
    largest_world = 512 * 8
    assert fleet.AGENT_OPEN_FILES_LIMIT > 2 * largest_world


def test_user_data_installs_the_projects_python_and_torch_never_the_images():
    """The Deep Learning AMIs' python3 is 3.10 (Ubuntu 22.04) or 3.9 (AL2023), which pip refuses
    trainfleet on; the node runs the Python and the pinned torch the artifacts bring."""
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    script = fleet.node_user_data("r1", SETTINGS)
    assert f'tar -xzf "$home/artifacts/{fleet.NODE_PYTHON_ARTIFACT}"' in script
    assert f'tar -xf "$home/artifacts/{fleet.NODE_WHEELHOUSE_ARTIFACT}" -C "$home/wheels"' in script
    assert '"$home/python/bin/python3" -m venv "$home/venv"' in script and "--system-site-packages" not in script
    assert not any(line.lstrip().startswith(("python3", "pip")) for line in script.splitlines())
    assert "'trainfleet[trainer]'" in script and "torch==2.13.0" in extras["trainer"]


def test_user_data_is_a_valid_bash_script(tmp_path):
    script = tmp_path / "user-data.sh"
    script.write_text(fleet.node_user_data("r1", SETTINGS))
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=10)  # parse only, runs nothing


def test_fleet_request_per_capacity_kind():
    on_demand = fleet.create_fleet_request(make_spec(), "stk", "lt-1", "subnet-1", "pg", target=5, minimum=4, client_token="t")
    assert on_demand["Type"] == "instant" and on_demand["ClientToken"] == "t"
    assert {"Key": fleet.TAG_STACK, "Value": "stk"} in on_demand["TagSpecifications"][0]["Tags"]
    assert on_demand["LaunchTemplateConfigs"][0]["Overrides"] == [
        {"InstanceType": "p4d.24xlarge", "SubnetId": "subnet-1", "Placement": {"GroupName": "pg"}}]
    assert on_demand["TargetCapacitySpecification"] == {"TotalTargetCapacity": 5, "OnDemandTargetCapacity": 5,
                                                        "DefaultTargetCapacityType": "on-demand"}
    assert on_demand["OnDemandOptions"] == {"SingleInstanceType": True, "SingleAvailabilityZone": True,
                                            "MinTargetCapacity": 4}
    spot = fleet.create_fleet_request(make_spec(kind="spot"), "stk", "lt-1", "subnet-1", "pg", 5, 1, "t")
    assert spot["TargetCapacitySpecification"]["DefaultTargetCapacityType"] == "spot"
    assert spot["SpotOptions"]["MinTargetCapacity"] == 1 and "OnDemandOptions" not in spot
    odcr = fleet.create_fleet_request(make_spec(kind="capacity-reservation", reservation_id="cr-0123456789abcdef0"),
                                      "stk", "lt-1", "subnet-1", "pg", 5, 5, "t")
    assert odcr["OnDemandOptions"]["CapacityReservationOptions"] == {"UsageStrategy": "use-capacity-reservations-first"}
    block = fleet.create_fleet_request(make_spec(kind="capacity-block", reservation_id="cr-0123456789abcdef0"),
                                       "stk", "lt-1", "subnet-1", "pg", 5, 2, "t")
    # Capacity Blocks take neither OnDemand/Spot target capacities nor CapacityReservationOptions.
    assert block["TargetCapacitySpecification"] == {"TotalTargetCapacity": 5, "DefaultTargetCapacityType": "capacity-block"}
    assert "OnDemandOptions" not in block and "SpotOptions" not in block
    with pytest.raises(ValueError, match="minimum=6, target=5"):
        fleet.create_fleet_request(make_spec(), "stk", "lt-1", "subnet-1", "pg", 5, 6, "t")


# CreateFleet (instant) answers in the shape of the EC2 API reference (CreateFleetInstance,
# CreateFleetError); moto always fulfils, so shortfalls are fed to the interpreter directly.
OVERRIDES = {"LaunchTemplateSpecification": {"LaunchTemplateId": "lt-1", "Version": "1"},
             "Overrides": {"InstanceType": "p5.48xlarge", "SubnetId": "subnet-1"}}


def fleet_answer(instance_ids, *errors):
    instances = [{"LaunchTemplateAndOverrides": OVERRIDES, "Lifecycle": "on-demand", "InstanceIds": instance_ids,
                  "InstanceType": "p5.48xlarge"}] if instance_ids else []
    return {"FleetId": "fleet-1", "Instances": instances,
            "Errors": [{"LaunchTemplateAndOverrides": OVERRIDES, "Lifecycle": "on-demand", "ErrorCode": code,
                        "ErrorMessage": message} for code, message in errors]}


ICE = ("InsufficientInstanceCapacity",
       "We currently do not have sufficient p5.48xlarge capacity in the Availability Zone you requested (us-east-1a).")


def test_insufficient_capacity_moves_to_the_next_zone():
    outcome = fleet.interpret_fleet_response(fleet_answer([], ICE))
    assert outcome.instance_ids == [] and outcome.capacity_errors[0].startswith("InsufficientInstanceCapacity: ")
    assert fleet.zone_verdict(outcome, minimum=2) == "next_zone"


def test_partial_fulfilment_is_kept_when_it_meets_the_minimum():
    outcome = fleet.interpret_fleet_response(fleet_answer(["i-1", "i-2", "i-3"], ICE))
    assert (outcome.instance_ids, outcome.market) == (["i-1", "i-2", "i-3"], "on-demand")
    assert fleet.zone_verdict(outcome, minimum=3) == "accept"
    assert fleet.zone_verdict(outcome, minimum=4) == "next_zone"


UNSUPPORTED = ("Unsupported", "Your requested instance type (p5.48xlarge) is not supported in your requested "
               "Availability Zone (us-east-1a). Please retry your request by not specifying an Availability Zone "
               "or choosing us-east-1b, us-east-1c.")


def test_a_type_not_offered_in_a_zone_moves_to_the_next_zone():
    outcome = fleet.interpret_fleet_response(fleet_answer([], UNSUPPORTED))
    assert outcome.zone_errors == [f"{UNSUPPORTED[0]}: {UNSUPPORTED[1]}"] and not outcome.hard_errors
    assert fleet.zone_verdict(outcome, minimum=1) == "next_zone"


def test_errors_no_zone_can_cure_stop_the_allocation():
    outcome = fleet.interpret_fleet_response(
        fleet_answer([], ("VcpuLimitExceeded", "You have requested more vCPU capacity than your current vCPU limit")))
    assert outcome.hard_errors and not outcome.capacity_errors
    assert fleet.zone_verdict(outcome, minimum=1) == "fail"


# --- against the local cloud ----------------------------------------------------------------

@pytest.fixture
def cloud(local_cloud, monkeypatch):
    # EC2 semantics only: instances boot no process (the user data would run the agent).
    local_cloud.fleet.boot = lambda instance: None
    # EC2 refuses a launch whose instance profile does not exist, or that IAM made so recently
    # that EC2 does not see it yet (tests/test_localcloud_ec2.py); the profile made here is taken
    # as propagated. moto's IAM outlives a cloud: the first test of a worker makes it.
    monkeypatch.setattr(ec2_glue, "IAM_PROPAGATION_S", 0.0)
    iam = local_cloud.client("iam")
    profile = PROFILE.rsplit("/", 1)[1]
    with contextlib.suppress(iam.exceptions.EntityAlreadyExistsException):
        iam.create_instance_profile(InstanceProfileName=profile)
    return local_cloud


@pytest.fixture
def network(cloud):
    ec2 = cloud.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]
    subnets = [ec2.create_subnet(VpcId=vpc, CidrBlock=f"10.20.{n}.0/24", AvailabilityZone=zone)["Subnet"]["SubnetId"]
               for n, zone in enumerate(("us-east-1a", "us-east-1b"))]
    group = ec2.create_security_group(GroupName="efa", Description="EFA to itself", VpcId=vpc)["GroupId"]
    return subnets, group


def test_allocate_builds_an_efa_fleet_in_a_cluster_placement_group(cloud, network):
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="alloc", subnet_ids=subnets, security_group_ids=[group])
    template_id = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    assert fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE) == template_id  # a retry reuses it

    allocation = fleet.allocate(ec2, spec, SETTINGS.stack_name, template_id, subnets, target=3, minimum=2,
                                token_prefix="alloc-0")
    assert len(allocation.instance_ids) == 3 and allocation.shortfall == 0
    assert (allocation.subnet_id, allocation.availability_zone) == (subnets[0], "us-east-1a")
    assert allocation.placement_group == fleet.placement_group_name("alloc", SETTINGS.stack_name, "us-east-1a")
    groups = ec2.describe_placement_groups(GroupNames=[allocation.placement_group])["PlacementGroups"]
    assert groups[0]["Strategy"] == "cluster"
    assert {"Key": fleet.TAG_RUN, "Value": "alloc"} in groups[0]["Tags"]

    described = [instance for reservation in ec2.describe_instances(InstanceIds=allocation.instance_ids)["Reservations"]
                 for instance in reservation["Instances"]]
    for instance in described:
        assert instance["Placement"]["GroupName"] == allocation.placement_group
        assert instance["SubnetId"] == subnets[0] and "PublicIpAddress" not in instance
        assert {"Key": fleet.TAG_RUN, "Value": "alloc"} in instance["Tags"]
        assert {"Key": fleet.TAG_STACK, "Value": SETTINGS.stack_name} in instance["Tags"]
        layout = sorted((nic["Attachment"]["NetworkCardIndex"], nic["Attachment"]["DeviceIndex"], nic["InterfaceType"])
                        for nic in instance["NetworkInterfaces"])
        assert layout == [(0, 0, "efa"), (1, 1, "efa-only"), (2, 1, "efa-only"), (3, 1, "efa-only")]

    # What EC2 applies at launch is the template: IMDSv2 required, the agent's user data.
    version = ec2.describe_launch_template_versions(LaunchTemplateId=template_id)["LaunchTemplateVersions"][0]
    data = version["LaunchTemplateData"]
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    assert f"-m {fleet.AGENT_MODULE}" in base64.b64decode(data["UserData"]).decode()
    assert len(data["NetworkInterfaces"]) == 4


def test_a_fleet_above_ec2s_per_fleet_target_is_launched_in_several_requests(cloud, network, monkeypatch):
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="split", subnet_ids=subnets, security_group_ids=[group])
    template_id = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    requested_before = cloud.requests[("ec2", "CreateFleet")]
    monkeypatch.setattr(fleet, "MAX_FLEET_TARGET", 2)

    allocation = fleet.allocate(ec2, spec, SETTINGS.stack_name, template_id, subnets, target=5, minimum=4,
                                token_prefix="split-0")

    assert len(set(allocation.instance_ids)) == 5 and allocation.shortfall == 0
    assert cloud.requests[("ec2", "CreateFleet")] - requested_before == 3  # 2 + 2 + 1
    again = fleet.allocate(ec2, spec, SETTINGS.stack_name, template_id, subnets, target=5, minimum=4,
                           token_prefix="split-0")
    assert sorted(again.instance_ids) == sorted(allocation.instance_ids)  # a retry launches nothing new


def test_two_stacks_of_one_account_launch_runs_of_the_same_name(cloud, network):
    # EC2 keeps ClientTokens per account and region: a token of run name and attempt alone made
    # the second stack's request (its own launch template) IdempotentParameterMismatch.
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="twin", subnet_ids=subnets, security_group_ids=[group])
    launched = []
    for stack in ("stack-a", "stack-b"):
        settings = SETTINGS.model_copy(update={"stack_name": stack})
        template_id = fleet.ensure_launch_template(ec2, spec, settings, PROFILE)
        launched.append(fleet.allocate(ec2, spec, stack, template_id, subnets, target=2, minimum=2,
                                       token_prefix="twin/0/0").instance_ids)
    assert all(len(ids) == 2 for ids in launched) and not set(launched[0]) & set(launched[1])


def test_the_local_cloud_refuses_a_fleet_above_ec2s_per_fleet_target(cloud, network):
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="huge", subnet_ids=subnets, security_group_ids=[group])
    template_id = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    request = fleet.create_fleet_request(spec, SETTINGS.stack_name, template_id, subnets[0], "group", 10_001, 1, "t")
    with pytest.raises(ec2.exceptions.ClientError, match="InvalidParameterValue.*10,000"):
        ec2.create_fleet(**request)


def test_the_same_run_name_in_two_stacks_shares_no_template_nor_placement_group(cloud, network):
    """EC2 finds launch templates and placement groups by name: named by the run alone, a run of
    another stack with the same name reused them, and its teardown deleted them."""
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="twin", subnet_ids=subnets, security_group_ids=[group])
    other = SETTINGS.model_copy(update={"stack_name": "another-stack"})
    assert fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE) != fleet.ensure_launch_template(ec2, spec, other, PROFILE)
    assert (fleet.placement_group_name("twin", SETTINGS.stack_name, "us-east-1a")
            != fleet.placement_group_name("twin", other.stack_name, "us-east-1a"))
    assert len(fleet.run_resource_name("x" * 48, "s" * 128)) <= 128  # EC2's limit for a launch template


def test_teardown_terminates_everything_of_the_run_and_nothing_else(cloud, network):
    ec2 = cloud.client("ec2")
    subnets, group = network
    mine = make_spec(run_name="doomed", subnet_ids=subnets, security_group_ids=[group])
    other = make_spec(run_name="bystander", subnet_ids=subnets, security_group_ids=[group])
    launched = {}
    for spec in (mine, other):
        template = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
        launched[spec.run_name] = fleet.allocate(ec2, spec, SETTINGS.stack_name, template, subnets, 2, 2,
                                                 f"{spec.run_name}-0").instance_ids
    assert fleet.run_instance_ids(ec2, "doomed", SETTINGS.stack_name) == sorted(launched["doomed"])
    assert fleet.teardown(ec2, "doomed", "another-stack").terminated == []  # not that stack's run

    first = fleet.teardown(ec2, "doomed", SETTINGS.stack_name)
    assert sorted(first.terminated) == sorted(launched["doomed"])
    assert fleet.run_instance_ids(ec2, "doomed", SETTINGS.stack_name) == []
    cloud.wait_until(lambda: _states(ec2, launched["doomed"]) == {"terminated"},
                     what="the run's instances to be terminated")
    second = fleet.teardown(ec2, "doomed", SETTINGS.stack_name)  # repeatable; the group goes once its instances are gone
    assert second.terminated == [] and second.placement_groups_in_use == []
    names = [g["GroupName"] for g in ec2.describe_placement_groups()["PlacementGroups"]]
    assert fleet.placement_group_name("doomed", SETTINGS.stack_name, "us-east-1a") not in names
    assert fleet.placement_group_name("bystander", SETTINGS.stack_name, "us-east-1a") in names
    assert not ec2.describe_launch_templates(
        Filters=[{"Name": "launch-template-name",
                  "Values": [fleet.run_resource_name("doomed", SETTINGS.stack_name)]}])["LaunchTemplates"]
    assert _states(ec2, launched["bystander"]) <= {"pending", "running"}


def test_terminate_skips_instances_ec2_no_longer_knows(cloud, network):
    """A node whose termination event was lost stays TERMINATING in the records; an hour later
    EC2 no longer knows its id and TerminateInstances naming it fails the whole call. Only the
    instances EC2 still reports alive are asked to end."""
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="forgotten", subnet_ids=subnets, security_group_ids=[group])
    template = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    gone, alive = fleet.allocate(ec2, spec, SETTINGS.stack_name, template, subnets, 2, 2, "forgotten-0").instance_ids
    ec2.terminate_instances(InstanceIds=[gone])
    cloud.wait_until(lambda: _states(ec2, [gone]) == {"terminated"}, what="the instance to be terminated")
    assert gone in cloud.forget_terminated_instances()
    with pytest.raises(ec2.exceptions.ClientError, match="InvalidInstanceID.NotFound"):
        ec2.terminate_instances(InstanceIds=[gone, alive])  # as EC2 answers: nothing is ended
    assert fleet.terminate(ec2, [gone, alive]) == [alive]
    assert _states(ec2, [alive]) <= {"shutting-down", "terminated"}


def answer_create_fleet(ec2, answers: dict[str, dict]) -> None:
    """Let EC2 answer CreateFleet in the given subnets with the given (documented) answer.

    moto always has capacity; real EC2 often does not. The answer replaces only the HTTP
    exchange of CreateFleet in those subnets, at the SDK's own hook; every other call, and
    CreateFleet in other subnets, goes to the local cloud.
    """
    def before_call(params, **kwargs):
        subnets = [value for key, value in params["body"].items() if key.endswith(".SubnetId")]
        for subnet in subnets:
            if subnet in answers:
                return AWSResponse(url="", status_code=200, headers={}, raw=None), answers[subnet]
        return None

    ec2.meta.events.register("before-call.ec2.CreateFleet", before_call)


@pytest.mark.parametrize("run_name, answer", [("ice", ICE), ("offered", UNSUPPORTED)])
def test_a_zone_without_capacity_or_without_the_type_lands_the_fleet_in_the_next(cloud, network, run_name, answer):
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name=run_name, subnet_ids=subnets, security_group_ids=[group])
    template = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    answer_create_fleet(ec2, {subnets[0]: fleet_answer([], answer)})

    allocation = fleet.allocate(ec2, spec, SETTINGS.stack_name, template, subnets, 2, 2, f"{run_name}-0")
    assert (allocation.subnet_id, allocation.availability_zone) == (subnets[1], "us-east-1b")
    assert allocation.placement_group == fleet.placement_group_name(run_name, SETTINGS.stack_name, "us-east-1b")
    assert len(allocation.instance_ids) == 2
    assert allocation.errors == [f"us-east-1a: {answer[0]}: {answer[1]}"]
    described = ec2.describe_instances(InstanceIds=allocation.instance_ids)["Reservations"]
    assert {i["Placement"]["AvailabilityZone"] for r in described for i in r["Instances"]} == {"us-east-1b"}

    fleet.teardown(ec2, run_name, SETTINGS.stack_name)
    cloud.wait_until(lambda: _states(ec2, allocation.instance_ids) == {"terminated"},
                     what="the run's instances to be terminated")
    assert fleet.teardown(ec2, run_name, SETTINGS.stack_name).placement_groups_in_use == []


def test_no_zone_with_capacity_launches_nothing_and_says_why(cloud, network):
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="dry", subnet_ids=subnets, security_group_ids=[group])
    template = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    answer_create_fleet(ec2, {subnet: fleet_answer([], ICE) for subnet in subnets})
    allocation = fleet.allocate(ec2, spec, SETTINGS.stack_name, template, subnets, 3, 2, "dry-0")
    assert (allocation.instance_ids, allocation.shortfall, allocation.subnet_id) == ([], 3, None)
    assert [line.split(":")[0] for line in allocation.errors] == ["us-east-1a", "us-east-1b"]
    assert fleet.run_instance_ids(ec2, "dry", SETTINGS.stack_name) == []


def test_a_type_no_zone_offers_stops_with_each_zones_answer(cloud, network):
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="nowhere", subnet_ids=subnets, security_group_ids=[group])
    template = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    answer_create_fleet(ec2, {subnet: fleet_answer([], UNSUPPORTED) for subnet in subnets})
    # Retrying later cannot make a zone offer a type: this is no capacity shortfall.
    with pytest.raises(fleet.FleetError, match="us-east-1a: Unsupported.*us-east-1b: Unsupported"):
        fleet.allocate(ec2, spec, SETTINGS.stack_name, template, subnets, 2, 2, "nowhere-0")


def test_an_error_no_zone_can_cure_stops_at_once(cloud, network):
    ec2 = cloud.client("ec2")
    subnets, group = network
    spec = make_spec(run_name="quota", subnet_ids=subnets, security_group_ids=[group])
    template = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    quota = fleet_answer([], ("VcpuLimitExceeded", "You have requested more vCPU capacity than your current vCPU limit"))
    answer_create_fleet(ec2, {subnets[0]: quota})
    with pytest.raises(fleet.FleetError, match="VcpuLimitExceeded"):
        fleet.allocate(ec2, spec, SETTINGS.stack_name, template, subnets, 2, 2, "quota-0")
    assert fleet.run_instance_ids(ec2, "quota", SETTINGS.stack_name) == []  # the next zone was not tried


def _states(ec2, instance_ids):
    return {instance["State"]["Name"] for reservation in ec2.describe_instances(InstanceIds=instance_ids)["Reservations"]
            for instance in reservation["Instances"]}


# --- reserved capacity ----------------------------------------------------------------------

def allocated(ec2, network, run_name: str, **capacity) -> fleet.Allocation:
    """A run on this capacity, allocated: 3 instances wanted, 2 at least."""
    subnets, group = network
    spec = make_spec(run_name=run_name, subnet_ids=subnets, security_group_ids=[group], **capacity)
    template_id = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
    return fleet.allocate(ec2, spec, SETTINGS.stack_name, template_id, subnets, target=3, minimum=2,
                          token_prefix=f"{run_name}-0")


def launched(ec2, instance_ids: list[str]) -> list[dict]:
    return [instance for reservation in ec2.describe_instances(InstanceIds=instance_ids)["Reservations"]
            for instance in reservation["Instances"]]


def test_a_run_on_a_capacity_block_launches_in_its_zone_and_in_no_group_of_its_own(cloud, network):
    """EC2 places a Capacity Block's instances together itself; a cluster group the run made
    could never hold them. The block's end is recorded: the run stops before EC2 ends it."""
    ec2 = cloud.client("ec2")
    block = cloud.create_capacity_block("p4d.24xlarge", "us-east-1b", 3, ends_in_s=2 * 86400)
    allocation = allocated(ec2, network, "block", kind="capacity-block", reservation_id=block)
    assert len(allocation.instance_ids) == 3 and allocation.market == "capacity-block"
    assert (allocation.subnet_id, allocation.placement_group) == (network[0][1], None)
    assert all(instance["Placement"].get("GroupName", "") == "" for instance in launched(ec2, allocation.instance_ids))
    reservation = fleet.describe_reservation(ec2, block)
    assert reservation.available == 0 and allocation.stop_by == reservation.end_at - BLOCK_TERMINATION_LEAD
    assert not ec2.describe_placement_groups(Filters=[{"Name": f"tag:{fleet.TAG_RUN}", "Values": ["block"]}])[
        "PlacementGroups"], "no group made for the run"


def test_an_odcr_made_in_a_cluster_group_is_used_in_that_group(cloud, network):
    ec2 = cloud.client("ec2")
    ec2.create_placement_group(GroupName="reserved-ultracluster", Strategy="cluster")
    arn = ec2.describe_placement_groups(GroupNames=["reserved-ultracluster"])["PlacementGroups"][0]["GroupArn"]
    odcr = ec2.create_capacity_reservation(
        InstanceType="p4d.24xlarge", InstancePlatform="Linux/UNIX", AvailabilityZone="us-east-1a", InstanceCount=4,
        InstanceMatchCriteria="targeted", PlacementGroupArn=arn)["CapacityReservation"]["CapacityReservationId"]
    allocation = allocated(ec2, network, "odcr", kind="capacity-reservation", reservation_id=odcr)
    assert len(allocation.instance_ids) == 3 and allocation.placement_group == "reserved-ultracluster"
    assert allocation.stop_by is None, "an ODCR does not end its instances"
    assert {instance["Placement"]["GroupName"] for instance in launched(ec2, allocation.instance_ids)} == {
        "reserved-ultracluster"}
    assert fleet.describe_reservation(ec2, odcr).available == 1


def test_the_local_cloud_holds_a_launch_to_its_reservations_terms(cloud, network):
    """As EC2 documents: a reservation made in a cluster group serves only launches into that
    group (the per-run group trainfleet made before could never use it), only in its zone, a
    Capacity Block only with market type capacity-block, and no more instances than it has free."""
    ec2 = cloud.client("ec2")
    subnets, group = network
    ec2.create_placement_group(GroupName="reserved", Strategy="cluster")
    ec2.create_placement_group(GroupName="the-runs-own", Strategy="cluster")
    arn = ec2.describe_placement_groups(GroupNames=["reserved"])["PlacementGroups"][0]["GroupArn"]
    odcr = ec2.create_capacity_reservation(
        InstanceType="p4d.24xlarge", InstancePlatform="Linux/UNIX", AvailabilityZone="us-east-1a", InstanceCount=2,
        PlacementGroupArn=arn)["CapacityReservation"]["CapacityReservationId"]
    block = cloud.create_capacity_block("p4d.24xlarge", "us-east-1a", 1, ends_in_s=86400)

    def errors(spec, subnet, placement_group, target=1):
        template_id = fleet.ensure_launch_template(ec2, spec, SETTINGS, PROFILE)
        answer = ec2.create_fleet(**fleet.create_fleet_request(spec, SETTINGS.stack_name, template_id, subnet,
                                                               placement_group, target, 1, str(uuid.uuid4())))
        return len(fleet.interpret_fleet_response(answer).instance_ids), [
            (error["ErrorCode"], error["ErrorMessage"]) for error in answer.get("Errors", [])]

    def run(name, **capacity):
        return make_spec(run_name=name, subnet_ids=subnets, security_group_ids=[group], **capacity)

    on_odcr = run("terms-odcr", kind="capacity-reservation", reservation_id=odcr)
    assert errors(on_odcr, subnets[0], "the-runs-own") == (0, [(
        "InvalidParameterCombination", f"Capacity Reservation {odcr} is in placement group reserved: "
                                       "launch into it, not the-runs-own")])
    assert errors(on_odcr, subnets[1], "reserved")[1][0][0] == "InvalidParameterCombination"  # another zone
    assert errors(on_odcr, subnets[0], "reserved", target=3) == (2, [(
        "ReservationCapacityExceeded", f"The Capacity Reservation {odcr} has 2 instance(s) free")])
    block_as_odcr = run("terms-block-as-odcr", kind="capacity-reservation", reservation_id=block)
    assert "MarketType capacity-block" in errors(block_as_odcr, subnets[0], None)[1][0][1]
    unknown = run("terms-unknown", kind="capacity-block", reservation_id="cr-0123456789abcdef0")
    assert errors(unknown, subnets[0], None)[1][0][0] == "InvalidCapacityReservationId.NotFound"
    with pytest.raises(ec2.exceptions.ClientError, match="InvalidCapacityReservationId.NotFound"):
        ec2.describe_capacity_reservations(CapacityReservationIds=["cr-0123456789abcdef0"])


@pytest.mark.parametrize("reservation, capacity, problem", [
    ({"instance_type": "p5.48xlarge"}, {}, "holds p5.48xlarge, the run asks for p4d.24xlarge"),
    ({"zone": "us-east-1c"}, {}, "the reservation is in us-east-1c; no subnet of the run is"),
    ({"instances": 2}, {}, "holds 2 instances; the run asks for 3 (2 nodes and 1 spares)"),
    ({"ends_in_s": 35 * 60}, {}, "too soon to train"),
    ({}, {"kind": "capacity-reservation"}, "is a Capacity Block: capacity.kind must be capacity-block"),
    (None, {}, "InvalidCapacityReservationId.NotFound"),
])
def test_a_reservation_the_run_cannot_use_is_refused_before_anything_launches(cloud, network, reservation, capacity,
                                                                              problem):
    ec2 = cloud.client("ec2")
    terms = {"instance_type": "p4d.24xlarge", "zone": "us-east-1a", "instances": 3, "ends_in_s": 86400,
             **(reservation or {})}
    block = ("cr-0123456789abcdef0" if reservation is None else
             cloud.create_capacity_block(terms["instance_type"], terms["zone"], terms["instances"], terms["ends_in_s"]))
    before = cloud.requests[("ec2", "CreateFleet")]
    with pytest.raises(fleet.FleetError, match=re.escape(problem)):
        allocated(ec2, network, "refused", **{"kind": "capacity-block", "reservation_id": block, **capacity})
    assert cloud.requests[("ec2", "CreateFleet")] == before, "nothing launched, nothing to undo"
