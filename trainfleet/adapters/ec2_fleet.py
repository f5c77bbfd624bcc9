"""EC2 fleet adapter: launch template, cluster placement group, CreateFleet (instant), teardown.

Pure builders (tested on their output, no AWS):
    efa_network_interfaces(facts, security_group_ids)    one EFA interface per network card
    launch_template_data(spec, settings)                 EFA, IMDSv2, market, tags, user data
    node_user_data(run_name, settings)                   installs and starts the node agent
    create_fleet_request(spec, stack_name, launch_template_id, subnet_id, placement_group, target,
                         minimum, client_token)
    interpret_fleet_response(response) -> FleetOutcome   instances, capacity shortfall, zone and hard errors
    zone_verdict(outcome, minimum) -> "accept" | "next_zone" | "fail"
    placement_group_name(run_name, stack_name, availability_zone)

Calls (boto3 EC2 client passed in):
    ensure_launch_template(ec2, spec, settings) -> launch template id
    ensure_placement_group(ec2, name, run_name, stack_name)
    allocate(ec2, spec, stack_name, launch_template_id, subnet_ids, target, minimum, token_prefix)
        -> Allocation
    describe_reservation(ec2, reservation_id) -> Reservation
    run_instance_ids(ec2, run_name, stack_name) -> the run's instances that are not terminated
    terminate(ec2, instance_ids), teardown(ec2, run_name, stack_name) -> Teardown

Zones: a cluster placement group lives in one Availability Zone, so a run's fleet is in one
zone. allocate() tries the subnets in order (one group per zone); once a run has landed, its
replacements go to the same subnet only. A run on reserved capacity launches only in its
reservation's zone, into the reservation's own placement group or none (the instances of a
Capacity Block are placed together by EC2): a group the run made would never hold it.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from botocore.exceptions import ClientError

from trainfleet.core.catalogue import InstanceFacts
from trainfleet.core.events import BOOT_CHECK, BOOT_FAILED_AT, BOOT_STEPS, EVENT_SOURCE
from trainfleet.core.lifecycle.reservation import Reservation, reservation_problem
from trainfleet.core.node_access import node_log_group
from trainfleet.core.runspec import CapacityKind, RunSpec
from trainfleet.core.settings import Settings

__all__ = [
    "TAG_RUN", "TAG_STACK", "AGENT_MODULE", "CAPACITY_ERROR_CODES", "ZONE_ERROR_CODES", "FleetError",
    "FleetOutcome", "Allocation", "Teardown", "efa_network_interfaces", "launch_template_data", "node_user_data",
    "user_data_settings", "artifact_copy", "ARTIFACT_COPIES", "NODE_PYTHON_ARTIFACT", "NODE_WHEELHOUSE_ARTIFACT",
    "create_fleet_request", "interpret_fleet_response", "zone_verdict", "placement_group_name", "run_resource_name",
    "ensure_launch_template", "ensure_placement_group", "allocate", "describe_reservation", "run_instance_ids",
    "runs_with_resources",
    "terminate", "teardown", "instances_among",
]

TAG_RUN = "trainfleet:run"
"""Tag on every instance, launch template and placement group of a run: teardown finds them by it."""

TAG_STACK = "trainfleet:stack"
"""The deploying stack, beside the run tag: two stacks in one account never touch each other's runs."""

ALIVE_STATES = ("pending", "running", "stopping", "stopped")
"""Instance states TerminateInstances still has something to end in."""

AGENT_MODULE = "node.agent"
"""The node agent's entry point (python -m), started by the user data."""
AGENT_OPEN_FILES_LIMIT = 1_048_576
"""The agent's unit's limit on open files (soft and hard), which torchrun and its ranks inherit:
systemd gives a service 1,024 by default, and a rank holds a socket to every other rank of each
gloo group (4,095 in a world of 4,096 ranks) beside NCCL's, the data's and the uploads' files.
1,048,576 is the kernel's default fs.nr_open, the most a process may be allowed."""

# Errors that mean "not here, not now": another zone or a later retry may succeed.
CAPACITY_ERROR_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientCapacity",
    "InsufficientReservedInstanceCapacity", "ReservationCapacityExceeded", "UnfulfillableCapacity",
    "InsufficientFreeAddressesInSubnet", "SpotMaxPriceTooLow", "MaxSpotInstanceCountExceeded",
})

# Errors that mean "never here": the zone does not offer the instance type (EC2 names the zones
# that do). Another zone may succeed; a retry in this one never will.
ZONE_ERROR_CODES = frozenset({"Unsupported"})
MAX_FLEET_TARGET = 10_000
"""EC2's quota on the target capacity of one EC2 Fleet: a larger fleet takes several requests."""


class FleetError(RuntimeError):
    """EC2 refused the request for a reason retrying elsewhere cannot fix (bad parameter, quota)."""

    def __init__(self, message: str, codes: frozenset[str] = frozenset()):
        super().__init__(message)
        self.codes = codes
        """EC2's error codes of the refusal."""

    @property
    def profile_not_visible(self) -> bool:
        """EC2 does not know the launch's instance profile (yet): IAM makes a new one visible
        to EC2 within seconds, and a launch before that is refused as invalid."""
        return "InvalidParameterValue" in self.codes and PROFILE_REFUSED in str(self)


PROFILE_REFUSED = "Invalid IAM Instance Profile"
"""What EC2's InvalidParameterValue says of a launch's instance profile it does not know."""


def run_resource_name(run_name: str, stack_name: str) -> str:
    """The name of a run's launch template: the run's, and the stack's in a short digest (EC2
    finds these by name, and the same run name in two stacks must not share them)."""
    return f"trainfleet-{run_name}-{hashlib.sha256(stack_name.encode()).hexdigest()[:8]}"


def placement_group_name(run_name: str, stack_name: str, availability_zone: str) -> str:
    """One cluster placement group per run (of its stack) and zone."""
    return f"{run_resource_name(run_name, stack_name)}-{availability_zone}"


def efa_network_interfaces(facts: InstanceFacts, security_group_ids: list[str]) -> list[dict[str, Any]]:
    """NetworkInterfaces of the launch template: one EFA interface per network card.

    The primary interface (card 0, device 0) is EFA with ENA: it carries the node's one private IP.
    Every other card gets an EFA-only interface at device index 1 (AWS's layout for P5: full EFA
    bandwidth without an IP address per card). No interface gets a public IP: a lone interface
    says so (a default subnet would give it one); several must not name AssociatePublicIpAddress
    at all, which EC2 refuses at launch (InvalidParameterCombination) even set to false, and
    never gives an instance with several interfaces a public address anyway. Types without EFA
    get a single ENA interface.
    """
    common = {"Groups": list(security_group_ids), "DeleteOnTermination": True}
    if not facts.efa_supported:
        interfaces = [{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "interface", **common}]
    else:
        interfaces = [{"NetworkCardIndex": 0, "DeviceIndex": 0, "InterfaceType": "efa", **common}]
        interfaces += [{"NetworkCardIndex": card, "DeviceIndex": 1, "InterfaceType": "efa-only", **common}
                       for card in range(1, facts.efa_interface_count)]
    if len(interfaces) == 1:
        interfaces[0]["AssociatePublicIpAddress"] = False
    return interfaces


BOOT_REQUEST_ATTEMPTS = 10
"""Tries of each AWS request of the bootstrap (the CLI's standard retry mode: capped exponential
backoff with jitter, about a minute in all): a node must not be lost to S3 throttling for seconds."""
BOOT_STEP_TRIES = 5
"""Tries of each bootstrap step, whose requests have had their own retries: a node rides out a
network blip or minutes of S3 answering SlowDown before it is reported sick."""
BOOT_RETRY_S = 30
"""The wait after a step's first failed try, doubling after each (at most BOOT_RETRY_MAX_S), each
drawn from its upper half so that nodes that failed together try again apart: about 7 minutes at
most over the five tries. TRAINFLEET_BOOT_RETRY_S sets another (a local run's waits)."""
BOOT_RETRY_MAX_S = 240
NODE_PYTHON_ARTIFACT = "python.tar.gz"
"""The node's own Python (`make artifacts`): a relocatable CPython 3.11 whose top folder is `python/`."""
NODE_WHEELHOUSE_ARTIFACT = "wheelhouse.tar"
"""trainfleet, its `trainer` extra and torch with its CUDA runtime and NCCL, as wheels in one tar."""
ARTIFACT_COPIES = 16
"""`make artifacts` publishes the artifacts under artifacts/00/ .. artifacts/15/, and a node copies
them from the one its instance id picks: S3 serves at least 5,500 GET/HEAD a second per prefix,
answering 503 SlowDown beyond, so the nodes of a large launch share 16 prefixes' rates, not one."""
ARTIFACT_PART_BYTES = 256 * 2**20
ARTIFACT_BANDWIDTH = "2GB/s"
"""The AWS CLI's part size (multipart_chunksize) and bandwidth cap (max_bandwidth) for the copy:
a node then sends at most 2 GB/s / 256 MiB, about 8 ranged GETs a second (two archives, a HEAD
each besides), so 512 nodes over 16 prefixes ask at most about 260 a second of any one (4,100 of
one prefix, below its 5,500, were the artifacts in one); 2 GB/s copies a 4 GB wheelhouse in
seconds, against minutes of boot."""


def artifact_copy(instance_id: str) -> str:
    """The artifacts/NN/ prefix an instance copies from (the user data's arithmetic)."""
    return f"artifacts/{int(instance_id[-2:], 16) % ARTIFACT_COPIES:02d}/"


def node_user_data(run_name: str, settings: Settings) -> str:
    """Cloud-init script: the node's own Python and packages from the stack's artifacts, the
    agent's settings, the agent under systemd.

    The node's software is the project's, never the image's: `make artifacts` publishes to
    s3://BUCKET/artifacts/NN/ (ARTIFACT_COPIES of them) a relocatable CPython 3.11
    (NODE_PYTHON_ARTIFACT) and a wheelhouse with trainfleet, its `trainer` extra and torch 2.13.0
    (its CUDA runtime and NCCL) in one tar (NODE_WHEELHOUSE_ARTIFACT): two named objects, no
    listing. The image brings the NVIDIA driver, the EFA software with aws-ofi-nccl, curl and the
    AWS CLI; the Deep Learning AMIs' python3 (3.10 on Ubuntu 22.04, 3.9 on Amazon Linux 2023)
    cannot run trainfleet, and their torch is not the pinned one.

    Each step (trainfleet.core.events.BOOT_STEPS) is tried BOOT_STEP_TRIES times, with jittered
    backoff between tries. A step that fails every try is reported to the control plane as
    NodeUnhealthy with a failed BOOT_CHECK naming the step and the end of its output, and its
    output goes to the console: the node is replaced as a sick one, and the run gives up when
    several nodes fail at the same step (lifecycle.decide_recovery: software that fails on one
    node fails on all). TRAINFLEET_ROOT (unset on EC2) is the filesystem root the script writes
    under, AWS_EC2_METADATA_SERVICE_ENDPOINT the metadata service, as the SDKs read it, and
    TRAINFLEET_BOOT_RETRY_S the first wait: a local instance runs this same script in its own folder.
    """
    env = {
        "TRAINFLEET_RUN_NAME": run_name,
        "TRAINFLEET_RUN_TABLE": settings.run_table,
        "TRAINFLEET_LIVENESS_TABLE": settings.liveness_table,
        "TRAINFLEET_BUCKET": settings.bucket,
        "TRAINFLEET_EVENT_BUS": settings.event_bus,
        "TRAINFLEET_STACK": settings.stack_name,
        "TRAINFLEET_NODE_LOG_GROUP": node_log_group(settings.stack_name),
        # How the agent ends its instance once the run is over (shutdown behaviour: terminate).
        "TRAINFLEET_SHUTDOWN_COMMAND": "shutdown -h now",
    }
    env_lines = "\n".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
    metadata, settings_step, copying, unpacking, installing, starting = BOOT_STEPS
    return f"""#!/bin/bash
# trainfleet node bootstrap: the node's own Python and packages, the agent's settings, the agent.
set -eEuo pipefail
root=${{TRAINFLEET_ROOT:-}}
imds=${{AWS_EC2_METADATA_SERVICE_ENDPOINT:-http://169.254.169.254}}
retry_s=${{TRAINFLEET_BOOT_RETRY_S:-{BOOT_RETRY_S}}}
home=$root/opt/trainfleet
log=$root/var/log/trainfleet-bootstrap.log
run_name={shlex.quote(run_name)}
bus={shlex.quote(settings.event_bus)}
step=starting tries=0 region= instance_id= instance_arn=
mkdir -p "$home" "$(dirname "$log")"
exec 3>&1 >>"$log" 2>&1
export AWS_RETRY_MODE=standard AWS_MAX_ATTEMPTS={BOOT_REQUEST_ATTEMPTS}

json() {{  # standard input as a JSON string
  printf '"'
  tr '\\011' ' ' | tr -d '\\000-\\010\\013-\\037' | sed -e 's/\\\\/\\\\\\\\/g' -e 's/"/\\\\"/g' | awk 'BEGIN {{ ORS = "\\\\n" }} {{ print }}'
  printf '"'
}}

report_failure() {{  # the failed step and its output: to the console, and as NodeUnhealthy
  status=$?
  trap - ERR
  tail -c 4000 "$log" >&3
  reason="{BOOT_FAILED_AT}$step (exit $status, $tries tries)"
  echo "trainfleet: $reason" >&3
  if [ -n "$instance_arn" ]; then
    output=$(tail -c 1500 "$log" | json)
    detail="{{\\"run_name\\": \\"$run_name\\", \\"attempt\\": 0, \\"instance_id\\": \\"$instance_id\\", \\"reason\\": \\"$reason\\", \\"checks\\": [{{\\"name\\": \\"{BOOT_CHECK}\\", \\"passed\\": false, \\"detail\\": $output}}]}}"
    printf '[{{"Source": "{EVENT_SOURCE}/%s", "DetailType": "NodeUnhealthy", "EventBusName": "%s", "Resources": ["%s"], "Detail": %s}}]' \\
      "$instance_arn" "$bus" "$instance_id" "$(printf '%s' "$detail" | json)" > "$home/bootstrap-failure.json"
    aws events put-events --region "$region" --entries "file://$home/bootstrap-failure.json" >&3 2>&1 || true
  fi
  exit "$status"
}}
trap report_failure ERR

retried() {{  # the step's command until it succeeds, {BOOT_STEP_TRIES} tries, jittered waits doubling
  local wait=$retry_s status
  tries=1
  until "$@"; do
    status=$?
    [ "$tries" -lt {BOOT_STEP_TRIES} ] || return "$status"
    echo "trainfleet: $step failed (exit $status), try $tries of {BOOT_STEP_TRIES}" >&3
    sleep $(( wait / 2 + RANDOM % (wait / 2 + 1) ))
    tries=$((tries + 1))
    wait=$(( wait * 2 < {BOOT_RETRY_MAX_S} ? wait * 2 : {BOOT_RETRY_MAX_S} ))
  done
}}

read_metadata() {{  # in a function called as a condition bash stops on no error: every command is checked
  token=$(curl -sf -X PUT "$imds/latest/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300") &&
  region=$(curl -sf -H "X-aws-ec2-metadata-token: $token" "$imds/latest/meta-data/placement/region") &&
  instance_id=$(curl -sf -H "X-aws-ec2-metadata-token: $token" "$imds/latest/meta-data/instance-id") &&
  partition=$(curl -sf -H "X-aws-ec2-metadata-token: $token" "$imds/latest/meta-data/services/partition") &&
  account=$(curl -sf -H "X-aws-ec2-metadata-token: $token" "$imds/latest/dynamic/instance-identity/document" |
    sed -n 's/.*"accountId"[^"]*"\\([0-9]*\\)".*/\\1/p')
}}

write_settings() {{
  mkdir -p "$root/etc" &&
  cat > "$root/etc/trainfleet.env" <<'ENV' &&
{env_lines}
ENV
  echo "AWS_DEFAULT_REGION=$region" >> "$root/etc/trainfleet.env"
}}

copy_artifacts() {{  # the instance's copy of the artifacts, two named objects, in parts at a capped rate
  mkdir -p "$home/artifacts" &&
  printf '[default]\\ns3 =\\n  multipart_chunksize = {ARTIFACT_PART_BYTES}\\n  max_bandwidth = {ARTIFACT_BANDWIDTH}\\n' \\
    > "$home/aws-config" &&
  AWS_CONFIG_FILE=$home/aws-config aws s3 cp "${{artifacts}}{NODE_PYTHON_ARTIFACT}" "$home/artifacts/" &&
  AWS_CONFIG_FILE=$home/aws-config aws s3 cp "${{artifacts}}{NODE_WHEELHOUSE_ARTIFACT}" "$home/artifacts/"
}}

unpack_python() {{
  tar -xzf "$home/artifacts/{NODE_PYTHON_ARTIFACT}" -C "$home" &&
  mkdir -p "$home/wheels" && tar -xf "$home/artifacts/{NODE_WHEELHOUSE_ARTIFACT}" -C "$home/wheels"
}}

install() {{
  "$home/python/bin/python3" -m venv "$home/venv" &&
  "$home/venv/bin/pip" install --quiet --no-index --find-links "$home/wheels" 'trainfleet[trainer]'
}}

start_agent() {{
  systemd-run --unit trainfleet-agent --property=EnvironmentFile="$root/etc/trainfleet.env" \\
    --property=LimitNOFILE={AGENT_OPEN_FILES_LIMIT} --property=Restart=on-failure \\
    "$home/venv/bin/python" -m {AGENT_MODULE}
}}

step="{metadata}"
retried read_metadata
instance_arn="arn:$partition:ec2:$region:$account:instance/$instance_id"  # the sender its events name
export AWS_DEFAULT_REGION=$region
artifacts="s3://{settings.bucket}/artifacts/$(printf '%02d' $(( 16#${{instance_id: -2}} % {ARTIFACT_COPIES} )))/"

step="{settings_step}"
retried write_settings

step="{copying}"
retried copy_artifacts

step="{unpacking}"
retried unpack_python

step="{installing}"
retried install

step="{starting}"
retried start_agent
"""


_SETTINGS_BLOCK = re.compile(r"""cat > "\$root/etc/trainfleet\.env" <<'ENV' &&\n(.*?)\nENV\n""", re.DOTALL)


def user_data_settings(user_data: str) -> dict[str, str] | None:
    """The agent's settings a node's user data writes (node_user_data's trainfleet.env), or None
    for user data that is not a trainfleet node's."""
    found = _SETTINGS_BLOCK.search(user_data)
    if found is None:
        return None
    settings = {}
    for line in found[1].splitlines():
        key, _, quoted = line.partition("=")
        (settings[key],) = shlex.split(quoted)
    return settings


def _owner_tags(run_name: str, stack_name: str) -> list[dict[str, str]]:
    return [{"Key": TAG_RUN, "Value": run_name}, {"Key": TAG_STACK, "Value": stack_name}]


def _tags(spec: RunSpec, stack_name: str) -> list[dict[str, str]]:
    extra = {**spec.tags, "Name": f"trainfleet-{spec.run_name}"}
    return _owner_tags(spec.run_name, stack_name) + [{"Key": key, "Value": value} for key, value in extra.items()]


def _owned(resource: dict[str, Any], run_name: str, stack_name: str) -> bool:
    tags = resource.get("Tags", [])
    return all(tag in tags for tag in _owner_tags(run_name, stack_name))


def launch_template_data(spec: RunSpec, settings: Settings, instance_profile_arn: str) -> dict[str, Any]:
    """LaunchTemplateData for the run: its nodes' instance profile, EFA interfaces, IMDSv2 only,
    capacity market, tags."""
    data: dict[str, Any] = {
        "ImageId": spec.image_id,
        "InstanceType": spec.instance_type,
        "IamInstanceProfile": {"Arn": instance_profile_arn},
        # The agent shuts its instance down when the run is over or the control plane stays
        # unreachable: that must end the instance (and its bill), not just stop it.
        "InstanceInitiatedShutdownBehavior": "terminate",
        "UserData": base64.b64encode(node_user_data(spec.run_name, settings).encode()).decode(),
        "NetworkInterfaces": efa_network_interfaces(spec.facts, spec.capacity.security_group_ids),
        # IMDSv2 only (session tokens); tags readable from IMDS so the agent learns its run.
        "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled",
                            "HttpPutResponseHopLimit": 1, "InstanceMetadataTags": "enabled"},
        "TagSpecifications": [{"ResourceType": kind, "Tags": _tags(spec, settings.stack_name)}
                              for kind in ("instance", "volume", "network-interface")],
    }
    capacity = spec.capacity
    if capacity.kind is CapacityKind.CAPACITY_BLOCK:
        data["InstanceMarketOptions"] = {"MarketType": "capacity-block"}
    if capacity.kind in (CapacityKind.CAPACITY_BLOCK, CapacityKind.CAPACITY_RESERVATION):
        data["CapacityReservationSpecification"] = {
            "CapacityReservationTarget": {"CapacityReservationId": capacity.reservation_id}}
    return data


def create_fleet_request(spec: RunSpec, stack_name: str, launch_template_id: str, subnet_id: str,
                         placement_group: str | None, target: int, minimum: int, client_token: str) -> dict[str, Any]:
    """CreateFleet arguments: Type=instant, one instance type, one subnet, the placement group.

    `minimum` is the fewest instances worth having: on-demand and Spot fleets are told
    MinTargetCapacity so that EC2 launches nothing rather than too few. Capacity Blocks take
    no such option: EC2 fills what the block holds and interpret_fleet_response reports the rest.
    """
    if not 1 <= minimum <= target:
        raise ValueError(f"need 1 <= minimum <= target, got minimum={minimum}, target={target}")
    kind = spec.capacity.kind
    override: dict[str, Any] = {"InstanceType": spec.instance_type, "SubnetId": subnet_id}
    if placement_group:
        override["Placement"] = {"GroupName": placement_group}
    request: dict[str, Any] = {
        "Type": "instant",
        "ClientToken": client_token,
        "LaunchTemplateConfigs": [{
            "LaunchTemplateSpecification": {"LaunchTemplateId": launch_template_id, "Version": "$Latest"},
            "Overrides": [override],
        }],
        "TagSpecifications": [{"ResourceType": "fleet", "Tags": _tags(spec, stack_name)}],
    }
    all_in_one_zone = {"SingleInstanceType": True, "SingleAvailabilityZone": True, "MinTargetCapacity": minimum}
    if kind is CapacityKind.CAPACITY_BLOCK:
        request["TargetCapacitySpecification"] = {"TotalTargetCapacity": target,
                                                  "DefaultTargetCapacityType": "capacity-block"}
    elif kind is CapacityKind.SPOT:
        request["TargetCapacitySpecification"] = {"TotalTargetCapacity": target, "SpotTargetCapacity": target,
                                                  "DefaultTargetCapacityType": "spot"}
        request["SpotOptions"] = {"AllocationStrategy": "capacity-optimized", **all_in_one_zone}
    else:
        request["TargetCapacitySpecification"] = {"TotalTargetCapacity": target, "OnDemandTargetCapacity": target,
                                                  "DefaultTargetCapacityType": "on-demand"}
        request["OnDemandOptions"] = dict(all_in_one_zone)
        if kind is CapacityKind.CAPACITY_RESERVATION:
            request["OnDemandOptions"]["CapacityReservationOptions"] = {
                "UsageStrategy": "use-capacity-reservations-first"}
    return request


@dataclass(frozen=True)
class FleetOutcome:
    """What an instant fleet did."""

    instance_ids: list[str]
    """Instances launched (pending)."""
    market: str | None
    """Lifecycle EC2 reports for them: on-demand, spot, capacity-block; None when none launched."""
    capacity_errors: list[str] = field(default_factory=list)
    """"Code: message" of every shortfall another zone or a retry may cure."""
    zone_errors: list[str] = field(default_factory=list)
    """"Code: message" of every refusal that only another zone may cure."""
    hard_errors: list[str] = field(default_factory=list)
    """"Code: message" of every error no zone and no retry can fix."""


def interpret_fleet_response(response: dict[str, Any]) -> FleetOutcome:
    """Read a CreateFleet (instant) response: its Instances and Errors lists."""
    instance_ids = [instance_id for group in response.get("Instances", [])
                    for instance_id in group.get("InstanceIds", [])]
    markets = {group.get("Lifecycle") for group in response.get("Instances", []) if group.get("InstanceIds")}
    capacity, zone, hard = [], [], []
    for error in response.get("Errors", []):
        code = error.get("ErrorCode")
        line = f"{code}: {error.get('ErrorMessage', '')}".strip()
        (capacity if code in CAPACITY_ERROR_CODES else zone if code in ZONE_ERROR_CODES else hard).append(line)
    return FleetOutcome(instance_ids=instance_ids, market=next(iter(markets), None) if markets else None,
                        capacity_errors=capacity, zone_errors=zone, hard_errors=hard)


def zone_verdict(outcome: FleetOutcome, minimum: int) -> Literal["accept", "next_zone", "fail"]:
    """Keep what a zone gave, move on to the next zone, or stop.

    Hard errors stop (a bad parameter or a quota is the same in every zone). At least `minimum`
    instances are kept, short of the target or not (partial fulfilment). Fewer than that, with a
    capacity error, a zone error (the type is not offered here) or none at all, mean this zone
    cannot hold the fleet now.
    """
    if outcome.hard_errors:
        return "fail"
    if len(outcome.instance_ids) >= minimum:
        return "accept"
    return "next_zone"


# --- calls --------------------------------------------------------------------------------

def ensure_launch_template(ec2: Any, spec: RunSpec, settings: Settings, instance_profile_arn: str) -> str:
    """Create the run's launch template (or reuse it: the name is the run's in this stack); its id."""
    name = run_resource_name(spec.run_name, settings.stack_name)
    existing = ec2.describe_launch_templates(Filters=[{"Name": "launch-template-name", "Values": [name]}])
    if existing["LaunchTemplates"]:
        return existing["LaunchTemplates"][0]["LaunchTemplateId"]
    created = ec2.create_launch_template(
        LaunchTemplateName=name, LaunchTemplateData=launch_template_data(spec, settings, instance_profile_arn),
        TagSpecifications=[{"ResourceType": "launch-template", "Tags": _tags(spec, settings.stack_name)}])
    return created["LaunchTemplate"]["LaunchTemplateId"]


def ensure_placement_group(ec2: Any, name: str, run_name: str, stack_name: str) -> None:
    """Create the cluster placement group unless it exists."""
    try:
        ec2.describe_placement_groups(GroupNames=[name])
        return
    except ec2.exceptions.ClientError as exc:
        if exc.response["Error"]["Code"] != "InvalidPlacementGroup.Unknown":
            raise
    ec2.create_placement_group(GroupName=name, Strategy="cluster", TagSpecifications=[
        {"ResourceType": "placement-group", "Tags": _owner_tags(run_name, stack_name)}])


@dataclass(frozen=True)
class Allocation:
    """Where a run's instances landed, and what could not be had."""

    instance_ids: list[str]
    subnet_id: str | None
    availability_zone: str | None
    placement_group: str | None
    market: str | None
    shortfall: int
    """Instances asked for and not launched."""
    errors: list[str]
    """Capacity errors met on the way, zone by zone."""
    stop_by: datetime | None = None
    """When a Capacity Block's terminations begin (Reservation.stop_by); None otherwise."""


def describe_reservation(ec2: Any, reservation_id: str) -> Reservation:
    """The run's Capacity Reservation; FleetError when EC2 does not know it."""
    try:
        found = ec2.describe_capacity_reservations(CapacityReservationIds=[reservation_id])["CapacityReservations"]
    except ec2.exceptions.ClientError as exc:
        code = exc.response["Error"]["Code"]
        raise FleetError(f"capacity.reservation_id {reservation_id}: {code}: {exc.response['Error'].get('Message')}",
                         frozenset({code})) from exc
    if not found:
        raise FleetError(f"capacity.reservation_id {reservation_id}: EC2 knows no such Capacity Reservation")
    item = found[0]
    group_arn = item.get("PlacementGroupArn")
    return Reservation(
        reservation_id=reservation_id, instance_type=item["InstanceType"], availability_zone=item["AvailabilityZone"],
        total=item["TotalInstanceCount"], available=item["AvailableInstanceCount"], state=item["State"],
        capacity_block=item.get("ReservationType") == "capacity-block", start_at=item.get("StartDate"),
        end_at=item.get("EndDate"), placement_group=group_arn.rsplit("/", 1)[-1] if group_arn else None)


def _launch_in_zone(ec2: Any, spec: RunSpec, stack_name: str, launch_template_id: str, subnet_id: str,
                    group: str | None, target: int, minimum: int, token: str) -> FleetOutcome:
    """One zone's instances, in as many instant fleets as MAX_FLEET_TARGET requires. Each asks
    for what is still missing of `minimum` as its MinTargetCapacity; one that comes short ends
    the zone's requests (it has no more)."""
    outcomes: list[FleetOutcome] = []
    launched = 0
    for index, start in enumerate(range(0, target, MAX_FLEET_TARGET)):
        size = min(MAX_FLEET_TARGET, target - start)
        request = create_fleet_request(spec, stack_name, launch_template_id, subnet_id, group, size,
                                       max(1, min(size, minimum - launched)), f"{token}-{index}" if index else token)
        outcomes.append(interpret_fleet_response(ec2.create_fleet(**request)))
        launched += len(outcomes[-1].instance_ids)
        if len(outcomes[-1].instance_ids) < size or outcomes[-1].hard_errors:
            break
    return FleetOutcome(instance_ids=[i for outcome in outcomes for i in outcome.instance_ids],
                        market=next((outcome.market for outcome in outcomes if outcome.market), None),
                        capacity_errors=[e for outcome in outcomes for e in outcome.capacity_errors],
                        zone_errors=[e for outcome in outcomes for e in outcome.zone_errors],
                        hard_errors=[e for outcome in outcomes for e in outcome.hard_errors])


def allocate(ec2: Any, spec: RunSpec, stack_name: str, launch_template_id: str, subnet_ids: list[str],
             target: int, minimum: int, token_prefix: str) -> Allocation:
    """Launch `target` instances (at least `minimum`) in the first subnet that has them.

    Zone by zone: a zone that cannot give `minimum` launches nothing (MinTargetCapacity), or, for
    Capacity Blocks, what it gave is terminated; then the next subnet is tried. The result may hold
    fewer than `target` (partial fulfilment) or none (shortfall == target); the caller decides.
    Raises FleetError on errors no zone can cure, and when no subnet's zone offers the instance
    type (no retry will change that). `token_prefix` makes the call idempotent per stack and
    subnet (EC2 answers a repeated ClientToken with the first answer): the same prefix for a
    retry of a launch, so it never launches a second fleet, a new one for a retry after a
    shortfall, which would otherwise only be told the shortfall again.
    """
    zones = {subnet["SubnetId"]: subnet["AvailabilityZone"]
             for subnet in ec2.describe_subnets(SubnetIds=subnet_ids)["Subnets"]}
    reservation = None
    if spec.capacity.reservation_id:
        reservation = describe_reservation(ec2, spec.capacity.reservation_id)
        problem = reservation_problem(spec, reservation, datetime.now(timezone.utc))
        subnet_ids = [subnet_id for subnet_id in subnet_ids if zones[subnet_id] == reservation.availability_zone]
        if problem is None and not subnet_ids:
            problem = (f"the reservation is in {reservation.availability_zone}; no subnet of the run is: "
                       f"{', '.join(f'{subnet} ({zone})' for subnet, zone in zones.items())}")
        if problem:
            raise FleetError(f"capacity.reservation_id: {problem}")
    errors: list[str] = []
    offered_somewhere = False
    for subnet_id in subnet_ids:
        zone = zones[subnet_id]
        if reservation is not None:
            group = reservation.placement_group
        else:
            group = placement_group_name(spec.run_name, stack_name, zone)
            ensure_placement_group(ec2, group, spec.run_name, stack_name)
        # ClientToken takes at most 64 characters; a digest keeps it unique and short. EC2 keeps
        # tokens per account and region: the stack's name keeps two stacks' runs of one name apart.
        token = hashlib.sha256(f"{stack_name}/{token_prefix}/{subnet_id}".encode()).hexdigest()[:40]
        outcome = _launch_in_zone(ec2, spec, stack_name, launch_template_id, subnet_id, group, target, minimum,
                                  token)
        errors += [f"{zone}: {line}" for line in outcome.capacity_errors + outcome.zone_errors]
        verdict = zone_verdict(outcome, minimum)
        if verdict == "accept":
            return Allocation(instance_ids=outcome.instance_ids, subnet_id=subnet_id, availability_zone=zone,
                              placement_group=group, market=outcome.market,
                              shortfall=target - len(outcome.instance_ids), errors=errors,
                              stop_by=reservation.stop_by if reservation else None)
        terminate(ec2, outcome.instance_ids)  # too few to be of use here
        if verdict == "fail":
            raise FleetError(f"CreateFleet in {subnet_id}: {'; '.join(outcome.hard_errors)}",
                             frozenset(line.partition(":")[0] for line in outcome.hard_errors))
        if outcome.instance_ids:
            errors.append(f"{zone}: only {len(outcome.instance_ids)} of the {minimum} needed")
        type_refused = bool(outcome.zone_errors) and not outcome.capacity_errors and not outcome.instance_ids
        offered_somewhere = offered_somewhere or not type_refused
    if not offered_somewhere:
        raise FleetError(f"no subnet's zone offers {spec.instance_type}: {'; '.join(errors)}")
    return Allocation(instance_ids=[], subnet_id=None, availability_zone=None, placement_group=None,
                      market=None, shortfall=target, errors=errors)


def run_instance_ids(ec2: Any, run_name: str, stack_name: str) -> list[str]:
    """The run's instances that are not terminated yet (found by tag, so none is forgotten)."""
    paginator = ec2.get_paginator("describe_instances")
    pages = paginator.paginate(Filters=[
        {"Name": f"tag:{TAG_RUN}", "Values": [run_name]},
        {"Name": f"tag:{TAG_STACK}", "Values": [stack_name]},
        {"Name": "instance-state-name", "Values": list(ALIVE_STATES)}])
    return sorted(instance["InstanceId"] for page in pages for reservation in page["Reservations"]
                  for instance in reservation["Instances"] if _owned(instance, run_name, stack_name))


def runs_with_resources(ec2: Any, stack_name: str) -> set[str]:
    """Names of this stack's runs that still hold an instance (not shutting down or gone) or a
    placement group: what the reaper looks at. Its cost follows what exists now, not the
    number of runs there ever were."""
    paginator = ec2.get_paginator("describe_instances")
    pages = paginator.paginate(Filters=[
        {"Name": f"tag:{TAG_STACK}", "Values": [stack_name]},
        {"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}])
    tagged = [instance.get("Tags", []) for page in pages for reservation in page["Reservations"]
              for instance in reservation["Instances"]]
    tagged += [group.get("Tags", []) for group in ec2.describe_placement_groups()["PlacementGroups"]]
    return {tags[TAG_RUN] for tags in ({tag["Key"]: tag["Value"] for tag in tag_list} for tag_list in tagged)
            if tags.get(TAG_STACK) == stack_name and TAG_RUN in tags}


def instances_among(ec2: Any, instance_ids: list[str], *filters: dict[str, Any]) -> list[str]:
    """Those of the instances DescribeInstances finds with `filters`, looked up by an instance-id
    filter, which fails no call for an id EC2 does not know (200 values a filter)."""
    found = []
    for start in range(0, len(instance_ids), 200):
        pages = ec2.get_paginator("describe_instances").paginate(Filters=[
            {"Name": "instance-id", "Values": instance_ids[start:start + 200]}, *filters])
        found += [instance["InstanceId"] for page in pages for reservation in page["Reservations"]
                  for instance in reservation["Instances"]]
    return found


def terminate(ec2: Any, instance_ids: list[str]) -> list[str]:
    """Terminate those of the instances EC2 still reports alive; the ids it was asked to end.

    EC2 forgets an instance about an hour after it terminated, and TerminateInstances naming one
    it no longer knows fails the whole call (InvalidInstanceID.NotFound): a node recorded as
    TERMINATING whose event was lost would fail every later Recover. So the ids are looked up
    first with a filter, which names no unknown id, and only those alive are terminated (up to
    1000 ids a call)."""
    alive = instances_among(ec2, instance_ids, {"Name": "instance-state-name", "Values": list(ALIVE_STATES)})
    for start in range(0, len(alive), 1000):
        ec2.terminate_instances(InstanceIds=alive[start:start + 1000])
    return alive


@dataclass(frozen=True)
class Teardown:
    terminated: list[str]
    """Instances terminated by this call."""
    placement_groups_in_use: list[str]
    """Groups not deleted yet: their instances are still shutting down (p4d and p5 take
    minutes); a later teardown of the run (the reaper's) deletes them."""


# Two teardowns of one run may meet (the reaper's schedule and an execution's status event reap
# it at once): a resource the other deleted first is done. EC2 answers its deletion with a
# NotFound code or, under the stack's policies (a deletion allowed on the resource's stack tag),
# UnauthorizedOperation, there being no tag left to read; either error stands only while the
# resource is still there.

def _delete_launch_template(ec2: Any, template: dict[str, Any]) -> None:
    try:
        ec2.delete_launch_template(LaunchTemplateId=template["LaunchTemplateId"])
    except ClientError:
        if ec2.describe_launch_templates(Filters=[
                {"Name": "launch-template-name", "Values": [template["LaunchTemplateName"]]}])["LaunchTemplates"]:
            raise


def _delete_placement_group(ec2: Any, name: str) -> bool:
    """Delete the group; False while its instances still hold it."""
    try:
        ec2.delete_placement_group(GroupName=name)
    except ClientError as exc:
        if exc.response["Error"]["Code"] == "InvalidPlacementGroup.InUse":
            return False
        if ec2.describe_placement_groups(Filters=[{"Name": "group-name", "Values": [name]}])["PlacementGroups"]:
            raise
    return True


def teardown(ec2: Any, run_name: str, stack_name: str) -> Teardown:
    """Terminate every instance of the run, delete its launch template and placement groups.

    Safe to repeat: the reaper repeats it until no placement group is left in use.
    Resources are matched on both tags client-side as well, so a filter an endpoint ignores
    can never widen the deletion to another run.
    """
    instance_ids = run_instance_ids(ec2, run_name, stack_name)
    terminate(ec2, instance_ids)
    templates = ec2.describe_launch_templates(
        Filters=[{"Name": f"tag:{TAG_RUN}", "Values": [run_name]}])["LaunchTemplates"]
    for template in templates:
        if _owned(template, run_name, stack_name):
            _delete_launch_template(ec2, template)
    groups = [group["GroupName"] for group in ec2.describe_placement_groups()["PlacementGroups"]
              if _owned(group, run_name, stack_name)]
    in_use = [group for group in groups if not _delete_placement_group(ec2, group)]
    return Teardown(terminated=instance_ids, placement_groups_in_use=in_use)
