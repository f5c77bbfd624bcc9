"""One RunSpec on three networks, through the deployed state machine on the local cloud, whose
instances reach AWS only where their subnet's network leads (localcloud/glue/routes.py); the
nodes run the real agent and the stand-in trainer (node/standin.py).

1. refused: the RunSpec names a subnet of the stack's VPC whose route table has neither the
   gateway endpoints nor a default route: Validate refuses it, naming the subnet and S3 and
   DynamoDB (the VPC's interface endpoints serve every subnet of it); nothing launches.
2. silent: the RunSpec is on the stack's network, which is broken while its instances are still
   pending (the subnets moved to that bare route table, the VPC's DNS hostnames turned off, so no
   endpoint leads anywhere): no node ever reports, and the run gives up after its one boot timeout,
   saying what no node did (lifecycle SETUP_FAILED); its instances are torn down.
3. trains: the network put back as the stack made it, the same RunSpec trains to its last step.

The last line of stdout is one JSON document of the three outcomes.

    python tests/network_local_run.py
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localcloud.cloud import exit_after_local_cloud  # noqa: E402
from localcloud.demo import DEMO_RUN_SPEC, Narrator  # noqa: E402
from localcloud.stack import local_stack  # noqa: E402
from localcloud.waiting import until  # noqa: E402
from trainfleet.adapters.run_store import RunNotFound  # noqa: E402

STEP_S, BOOT_NOMINAL_S, TIME_SCALE = 0.2, 1500.0, 0.02
"""Instances stay pending 30 real seconds (1,500 nominal, scaled), time for the harness to break
the network under a run Validate has accepted."""
SILENT_BOOT_TIMEOUT_S = 60
"""The least boot timeout a RunSpec may give (RecoveryPolicy)."""


def launched(stack, run_name: str) -> bool:
    try:
        return bool(stack.store.nodes(run_name))
    except RunNotFound:
        return False


def outcome(stack, run) -> dict:
    """The execution's end, the run record's error and its instances' last states."""
    execution = stack.client("stepfunctions").describe_execution(executionArn=run.arn)
    try:
        record = stack.store.run(run.run_name)
        recorded = {"state": record.state.value, "error": record.error, "last_step": record.last_step,
                    "failures": [failure.failure_class.value for failure in record.failures]}
    except RunNotFound:
        recorded = None
    return {"status": execution["status"], "error": execution.get("error"), "cause": execution.get("cause"),
            "record": recorded, "instances": sorted(instance.state for instance in stack.instances(run)),
            "unreachable": {service: count for (service, answer), count in stack.cloud.failed_requests.items()
                            if answer == "unreachable"}}


def main() -> dict:
    template = json.loads(DEMO_RUN_SPEC.read_text())
    with local_stack(Narrator(), standin_step_s=STEP_S, time_scale=TIME_SCALE, boot_seconds=BOOT_NOMINAL_S) as stack:
        ec2 = stack.client("ec2")
        subnets = stack.outputs["NodeSubnetIds"].split(",")
        vpc = ec2.describe_subnets(SubnetIds=subnets[:1])["Subnets"][0]["VpcId"]
        bare_table = ec2.create_route_table(VpcId=vpc)["RouteTable"]["RouteTableId"]
        bare = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.192.0/24", AvailabilityZone="us-east-1a")["Subnet"]
        ec2.associate_route_table(SubnetId=bare["SubnetId"], RouteTableId=bare_table)
        results = {}

        # 1. Refused at Validate.
        refused = stack.start_run(template | {"run_name": "no-route", "capacity": {
            "kind": "on-demand", "subnet_ids": [bare["SubnetId"]],
            "security_group_ids": [stack.outputs["NodeSecurityGroupIds"]]}})
        stack.watch(refused).until(stack.ended(refused), "the refused run's end")
        results["refused"] = outcome(stack, refused) | {"subnet": bare["SubnetId"]}

        # 2. Accepted, then its network broken while its instances are pending: silent nodes.
        # No node of it ever reports: the least boot timeout a RunSpec may give, below the local
        # floor that keeps a healthy boot on a starved machine from being taken for a silent one.
        silent = stack.start_run(template | {"run_name": "silent", "recovery": template["recovery"] | {
            "boot_timeout_seconds": SILENT_BOOT_TIMEOUT_S}}, silent_nodes=True)
        stack.watch(silent).until(lambda: launched(stack, silent.run_name), "the silent run's instances")
        associations = {association["SubnetId"]: association["RouteTableAssociationId"]
                        for table in ec2.describe_route_tables(Filters=[{"Name": "vpc-id", "Values": [vpc]}])[
                            "RouteTables"] for association in table.get("Associations", [])
                        if association.get("SubnetId") in subnets}
        node_table = ec2.describe_route_tables(Filters=[
            {"Name": "association.subnet-id", "Values": subnets[:1]}])["RouteTables"][0]["RouteTableId"]
        moved = {subnet: ec2.replace_route_table_association(AssociationId=association, RouteTableId=bare_table)[
            "NewAssociationId"] for subnet, association in associations.items()}
        ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": False})
        results["silent_broken_before_boot"] = all(instance.state == "pending" for instance in stack.instances(silent))
        stack.watch(silent).until(stack.ended(silent), "the silent run's end")
        until(lambda: all(instance.state == "terminated" for instance in stack.instances(silent)),
              stack.cloud.activity, what="the silent run's instances torn down")
        results["silent"] = outcome(stack, silent)

        # 3. The network as the stack made it: the same RunSpec trains.
        ec2.modify_vpc_attribute(VpcId=vpc, EnableDnsHostnames={"Value": True})
        for association in moved.values():
            ec2.replace_route_table_association(AssociationId=association, RouteTableId=node_table)
        trains = stack.start_run(template | {"run_name": "trains"})
        stack.watch(trains).until(stack.ended(trains), "the training run's end")
        results["trains"] = outcome(stack, trains) | {"steps": template["trainer"]["training"]["steps"]}
    return results


if __name__ == "__main__":
    print(json.dumps(main(), default=str))
    exit_after_local_cloud(0)
