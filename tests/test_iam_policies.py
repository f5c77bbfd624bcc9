"""template.yaml's IAM policies, statement by statement, rendered as a deploy renders them and
evaluated as AWS does (localcloud/iam_policy.py) with the condition keys filled by the test.

The local cloud evaluates these policies on every request, but cannot derive every resource and
condition key from a request (docs/ARCHITECTURE.md, Local cloud, IAM); what it cannot derive is
covered here: EC2's per-resource checks, aws:ResourceTag on launch templates and placement
groups, ec2:CreateAction, iam:PassedToService, iam:AWSServiceName, ssm:GetParameters for
resolve:ssm image ids, SendTask* on the state machine, aws:SecureTransport=false."""

import json
import re
from pathlib import Path
from typing import Any

import pytest
from moto.iam.aws_managed_policies import aws_managed_policies_data

from localcloud.deploy import load_template, transform_sam
from localcloud.deploy_intrinsics import Resolver, evaluate_conditions, parameter_values
from localcloud.iam_policy import ALLOW, EXPLICIT_DENY, IMPLICIT_DENY, evaluate
from trainfleet.adapters.ec2_fleet import TAG_STACK
from trainfleet.core.node_access import NODE_READ_PREFIXES, NODE_WRITE_PREFIXES

REPO = Path(__file__).resolve().parent.parent
REGION, ACCOUNT, STACK = "us-east-1", "123456789012", "st"
EC2 = f"arn:aws:ec2:{REGION}:{ACCOUNT}"
BUCKET = f"{STACK}-checkpointbucket-x"
TABLE = f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{STACK}-RunTable-x"
STATE_MACHINE = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{STACK}-training-run"
AWS_MANAGED = json.loads(aws_managed_policies_data)

_ARNS = {
    "AWS::S3::Bucket": lambda name: f"arn:aws:s3:::{name}",
    "AWS::DynamoDB::Table": lambda name: f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{name}",
    "AWS::Events::EventBus": lambda name: f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/{name}",
    "AWS::IAM::Role": lambda name: f"arn:aws:iam::{ACCOUNT}:role/{name}",
    "AWS::IAM::InstanceProfile": lambda name: f"arn:aws:iam::{ACCOUNT}:instance-profile/{name}",
    "AWS::IAM::ManagedPolicy": lambda name: f"arn:aws:iam::{ACCOUNT}:policy/{name}",
    "AWS::Lambda::Function": lambda name: f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{name}",
    "AWS::SQS::Queue": lambda name: f"arn:aws:sqs:{REGION}:{ACCOUNT}:{name}",
    "AWS::Logs::LogGroup": lambda name: f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{name}:*",
}

_REF_IS_ARN = {"AWS::IAM::ManagedPolicy"}
"""Types whose Ref is their ARN (CloudFormation's return values)."""


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    return rendered_template()


def rendered_template() -> dict[str, Any]:
    """Resources of the deployed template, intrinsics resolved; physical names `st-Logical-x`."""
    template = load_template(REPO / "template.yaml")
    for resource in template["Resources"].values():
        for uri in ("CodeUri", "ContentUri", "DefinitionUri"):
            if uri in resource.get("Properties", {}):
                resource["Properties"][uri] = "s3://artifacts/package"
    parameters = {"AWS::Region": REGION, "AWS::AccountId": ACCOUNT, "AWS::StackName": STACK,
                  "AWS::Partition": "aws", "AWS::URLSuffix": "amazonaws.com",
                  **parameter_values(template["Parameters"], {})}
    transformed = transform_sam(template, parameters, REGION)
    resources = transformed["Resources"]
    resolver = Resolver(parameters)
    resolver.conditions = evaluate_conditions(transformed.get("Conditions", {}), resolver)
    for logical_id, resource in resources.items():
        name = BUCKET if logical_id == "CheckpointBucket" else f"{STACK}-{logical_id}-x"
        arn = _ARNS.get(resource["Type"], lambda name: name)(name)
        resolver.ref_of[logical_id] = arn if resource["Type"] in _REF_IS_ARN else name
        resolver.attributes_of[logical_id] = {"Arn": arn, "QueueName": name}
    return {logical_id: resolver.resolve(resource, logical_id) for logical_id, resource in resources.items()}


def policies(rendered: dict[str, Any], role: str) -> list[dict]:
    """The role's inline policies and the AWS managed ones it attaches (their documents as IAM
    has them); a managed policy of the template's: its document."""
    properties = rendered[role]["Properties"]
    if rendered[role]["Type"] == "AWS::IAM::ManagedPolicy":
        return [properties["PolicyDocument"]]
    managed = [AWS_MANAGED[arn.rpartition("/")[2]]["Document"] for arn in properties.get("ManagedPolicyArns", [])
               if arn.startswith("arn:aws:iam::aws:policy/")]
    return [policy["PolicyDocument"] for policy in properties.get("Policies", [])] + managed


def decide(rendered, role, action, resource, **context) -> str:
    context = {key.replace("__", "/").replace("_", ":", 1): value for key, value in context.items()}
    return evaluate(policies(rendered, role), action, resource, context)


NODE, PEER = (f"arn:aws:ec2:{REGION}:{ACCOUNT}:instance/i-0{n}" for n in "ab")
"""ec2:SourceInstanceARN of a node's requests, and another node's."""


def s3(key: str) -> str:
    return f"arn:aws:s3:::{BUCKET}/{key}"


# --- NodePolicy: what the nodes of run "r" may do -----------------------------------------------

RUN = {"aws_PrincipalTag__trainfleet:run": "r"}
NODE_LOGS = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/trainfleet/{STACK}/nodes"
"""The stack's node log group (trainfleet.core.node_access.node_log_group)."""
"""The run's node role is tagged with the run (trainfleet.adapters.node_roles)."""
LIVENESS = f"arn:aws:dynamodb:{REGION}:{ACCOUNT}:table/{STACK}-LivenessTable-x"


def node(rendered, action: str, resource: str, **context) -> str:
    """The decision for a node of run r."""
    return decide(rendered, "NodePolicy", action, resource, **RUN, **context)


def node_s3_prefixes(rendered, actions: set[str]) -> set[str]:
    found = set()
    for document in policies(rendered, "NodePolicy"):
        for statement in document["Statement"]:
            listed = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            if actions & set(listed):
                for resource in statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]:
                    # Under runs/, the run's own folder (the role's tag names the run), and the
                    # checkpoints of the run it resumes (another tag).
                    found.add(re.sub(rf"^arn:aws:s3:::{BUCKET}/(.*)\*$", r"\1", resource)
                              .replace("${aws:PrincipalTag/trainfleet:run}/", "")
                              .replace("${aws:PrincipalTag/trainfleet:resume-from}/checkpoints/", ""))
    return found


def test_the_node_role_grants_exactly_the_prefixes_validate_checks_run_specs_against(rendered):
    assert node_s3_prefixes(rendered, {"s3:GetObject"}) == set(NODE_READ_PREFIXES)
    assert node_s3_prefixes(rendered, {"s3:PutObject"}) == set(NODE_WRITE_PREFIXES)
    for prefix in NODE_READ_PREFIXES:
        assert node(rendered, "s3:GetObject", s3(f"{prefix}r/x")) == ALLOW
        assert node(rendered, "s3:ListBucket", f"arn:aws:s3:::{BUCKET}", s3_prefix=f"{prefix}r/") == ALLOW
    for prefix in NODE_WRITE_PREFIXES:
        assert node(rendered, "s3:PutObject", s3(f"{prefix}r/x")) == ALLOW


@pytest.mark.parametrize("action, key, expected", [
    ("s3:GetObject", "artifacts/trainfleet-0.1-py3-none-any.whl", ALLOW),  # the user data's install
    ("s3:GetObject", "data/tokens/shard-0", ALLOW),
    ("s3:GetObject", "runs/r/launch-spec.json", ALLOW),
    ("s3:PutObject", "runs/r/checkpoints/step-000000100/__0_0.distcp", ALLOW),
    ("s3:DeleteObject", "runs/r/checkpoints/step-000000100/.metadata", ALLOW),
    ("s3:PutObject", "artifacts/evil.whl", IMPLICIT_DENY),  # a node cannot change what others install
    ("s3:PutObject", "data/tokens/shard-0", IMPLICIT_DENY),
    ("s3:GetObject", "other/secret", IMPLICIT_DENY),
    # Another run's objects: its checkpoints, its launch spec.
    ("s3:GetObject", "runs/other/launch-spec.json", IMPLICIT_DENY),
    ("s3:PutObject", "runs/other/checkpoints/step-000000100/__0_0.distcp", IMPLICIT_DENY),
    ("s3:DeleteObject", "runs/other/checkpoints/step-000000100/.metadata", IMPLICIT_DENY),
    ("s3:GetObject", "runs/rr/launch-spec.json", IMPLICIT_DENY),  # a run whose name starts like r's
])
def test_node_role_objects(rendered, action, key, expected):
    assert node(rendered, action, s3(key)) == expected


@pytest.mark.parametrize("context, expected", [
    ({"s3_prefix": "artifacts/"}, ALLOW), ({"s3_prefix": "runs/r/checkpoints/"}, ALLOW),
    ({"s3_prefix": "runs/other/checkpoints/"}, IMPLICIT_DENY), ({"s3_prefix": "runs/"}, IMPLICIT_DENY),
    ({"s3_prefix": "other/"}, IMPLICIT_DENY), ({}, IMPLICIT_DENY),  # no prefix lists the whole bucket
])
def test_node_role_lists_only_its_prefixes(rendered, context, expected):
    assert node(rendered, "s3:ListBucket", f"arn:aws:s3:::{BUCKET}", **context) == expected


RESUMED = {**RUN, "aws_PrincipalTag__trainfleet:resume-from": "old"}
"""A run resumed from run "old" (RunSpec.resume_from): its role's tag (trainfleet.adapters.node_roles)."""


@pytest.mark.parametrize("action, key, resumed, not_resumed", [
    ("s3:GetObject", "runs/old/checkpoints/step-000000100/commit.json", ALLOW, IMPLICIT_DENY),
    ("s3:GetObject", "runs/old/checkpoints/shards-3/step-000000100/__3_0.distcp", ALLOW, IMPLICIT_DENY),
    ("s3:PutObject", "runs/old/checkpoints/step-000000200/__0_0.distcp", IMPLICIT_DENY, IMPLICIT_DENY),
    ("s3:DeleteObject", "runs/old/checkpoints/step-000000100/commit.json", IMPLICIT_DENY, IMPLICIT_DENY),
    ("s3:GetObject", "runs/old/launch-spec.json", IMPLICIT_DENY, IMPLICIT_DENY),  # its task token
    ("s3:GetObject", "runs/other/checkpoints/step-000000100/commit.json", IMPLICIT_DENY, IMPLICIT_DENY),
    ("s3:PutObject", "runs/r/checkpoints/step-000000200/__0_0.distcp", ALLOW, ALLOW),  # its own, as ever
])
def test_a_resumed_runs_nodes_read_the_old_runs_checkpoints_and_never_write_or_prune_them(
        rendered, action, key, resumed, not_resumed):
    assert decide(rendered, "NodePolicy", action, s3(key), **RESUMED) == resumed
    assert node(rendered, action, s3(key)) == not_resumed


@pytest.mark.parametrize("prefix, resumed, not_resumed", [
    ("runs/old/checkpoints/", ALLOW, IMPLICIT_DENY), ("runs/old/checkpoints/shards-3/", ALLOW, IMPLICIT_DENY),
    ("runs/old/", IMPLICIT_DENY, IMPLICIT_DENY), ("runs/r/checkpoints/", ALLOW, ALLOW),
])
def test_a_resumed_runs_nodes_list_the_old_runs_checkpoints_alone(rendered, prefix, resumed, not_resumed):
    bucket = f"arn:aws:s3:::{BUCKET}"
    assert decide(rendered, "NodePolicy", "s3:ListBucket", bucket, s3_prefix=prefix, **RESUMED) == resumed
    assert node(rendered, "s3:ListBucket", bucket, s3_prefix=prefix) == not_resumed


@pytest.mark.parametrize("action, resource, context, expected", [
    ("dynamodb:GetItem", TABLE, {"dynamodb_LeadingKeys": ["RUN#r"]}, ALLOW),
    ("dynamodb:Query", TABLE, {"dynamodb_LeadingKeys": ["RUN#r"]}, ALLOW),
    ("dynamodb:GetItem", TABLE, {"dynamodb_LeadingKeys": ["RUN#other"]}, IMPLICIT_DENY),  # another run's records
    ("dynamodb:Query", TABLE, {"dynamodb_LeadingKeys": ["RUN#other"]}, IMPLICIT_DENY),
    ("dynamodb:Query", f"{TABLE}/index/by-instance", {"dynamodb_LeadingKeys": ["i-0a"]}, IMPLICIT_DENY),
    ("dynamodb:Scan", TABLE, {}, IMPLICIT_DENY),
    ("dynamodb:PutItem", TABLE, {"dynamodb_LeadingKeys": ["RUN#r"]}, IMPLICIT_DENY),
    # Its own liveness record alone: not a peer's of its run, which could get the peer terminated.
    ("dynamodb:PutItem", LIVENESS, {"dynamodb_LeadingKeys": [f"r#{NODE}"], "ec2_SourceInstanceARN": NODE}, ALLOW),
    ("dynamodb:PutItem", LIVENESS, {"dynamodb_LeadingKeys": [f"r#{PEER}"], "ec2_SourceInstanceARN": NODE},
     IMPLICIT_DENY),
    ("dynamodb:PutItem", LIVENESS, {"dynamodb_LeadingKeys": [f"other#{NODE}"], "ec2_SourceInstanceARN": NODE},
     IMPLICIT_DENY),
    ("dynamodb:PutItem", LIVENESS, {"dynamodb_LeadingKeys": ["r"], "ec2_SourceInstanceARN": NODE}, IMPLICIT_DENY),
    ("dynamodb:PutItem", LIVENESS, {"dynamodb_LeadingKeys": [f"r#{NODE}"]}, IMPLICIT_DENY),  # no instance's session
    ("events:PutEvents", f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/{STACK}-AgentEventBus-x",
     {"events_source": f"trainfleet/{NODE}", "ec2_SourceInstanceARN": NODE}, ALLOW),
    ("events:PutEvents", f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/{STACK}-AgentEventBus-x",
     {"events_source": f"trainfleet/{NODE}", "ec2_SourceInstanceARN": PEER}, IMPLICIT_DENY),  # as another node
    ("events:PutEvents", f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/{STACK}-AgentEventBus-x",
     {"events_source": "trainfleet", "ec2_SourceInstanceARN": NODE}, IMPLICIT_DENY),  # as no node
    ("events:PutEvents", f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/{STACK}-AgentEventBus-x",
     {"events_source": "aws.ec2", "ec2_SourceInstanceARN": NODE}, IMPLICIT_DENY),  # a node cannot forge AWS's events
    ("events:PutEvents", f"arn:aws:events:{REGION}:{ACCOUNT}:event-bus/default",
     {"events_source": f"trainfleet/{NODE}", "ec2_SourceInstanceARN": NODE}, IMPLICIT_DENY),
    ("states:SendTaskHeartbeat", STATE_MACHINE, {}, ALLOW),
    ("states:SendTaskSuccess", STATE_MACHINE, {}, IMPLICIT_DENY),
    # The node's log: its own run's streams in the stack's node log group, no other.
    ("logs:CreateLogStream", f"{NODE_LOGS}:log-stream:r/i-0a", {}, ALLOW),
    ("logs:PutLogEvents", f"{NODE_LOGS}:log-stream:r/i-0a", {}, ALLOW),
    ("logs:PutLogEvents", f"{NODE_LOGS}:log-stream:other/i-0a", {}, IMPLICIT_DENY),  # another run's stream
    ("logs:PutLogEvents", f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/lambda/x:log-stream:r/i-0a", {},
     IMPLICIT_DENY),
    ("logs:DeleteLogStream", f"{NODE_LOGS}:log-stream:r/i-0a", {}, IMPLICIT_DENY),
    # The run's metrics come from the handler: a node could write another run's alarm metric.
    ("cloudwatch:PutMetricData", "*", {"cloudwatch_namespace": "Trainfleet"}, IMPLICIT_DENY),
    ("ssmmessages:OpenDataChannel", "*", {}, ALLOW),  # Session Manager's shell on a node
    ("ssm:UpdateInstanceInformation", "*", {}, ALLOW),
    ("ssm:GetParameter", f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/team/database-password", {}, IMPLICIT_DENY),
    ("ssm:GetParameters", f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/team/api-key", {}, IMPLICIT_DENY),
])
def test_node_role_control_plane_calls(rendered, action, resource, context, expected):
    assert node(rendered, action, resource, **context) == expected


# --- the functions' fleet statements (Allocate and Recover share them) ------------------------

@pytest.mark.parametrize("role", ["AllocateFunctionRole", "RecoverFunctionRole"])
@pytest.mark.parametrize("action, resource, context, expected", [
    ("ec2:CreateFleet", f"{EC2}:instance/*", {f"aws_RequestTag__{TAG_STACK}": STACK}, ALLOW),
    ("ec2:CreateFleet", f"{EC2}:instance/*", {f"aws_RequestTag__{TAG_STACK}": "other"}, IMPLICIT_DENY),
    ("ec2:RunInstances", f"{EC2}:volume/*", {}, IMPLICIT_DENY),  # untagged
    ("ec2:CreateFleet", f"{EC2}:launch-template/lt-1", {f"aws_ResourceTag__{TAG_STACK}": STACK}, ALLOW),
    ("ec2:CreateFleet", f"{EC2}:launch-template/lt-1", {f"aws_ResourceTag__{TAG_STACK}": "other"}, IMPLICIT_DENY),
    ("ec2:CreateFleet", f"{EC2}:subnet/subnet-1", {}, ALLOW),
    ("ec2:CreateFleet", f"{EC2}:placement-group/reserved-ultracluster", {}, ALLOW),  # a reservation's group
    ("ec2:CreateFleet", f"{EC2}:capacity-reservation/cr-1", {}, ALLOW),
    ("ec2:CreateFleet", f"arn:aws:ec2:{REGION}::image/ami-1", {}, ALLOW),
    ("ec2:CreateTags", f"{EC2}:instance/i-1", {"ec2_CreateAction": "CreateFleet"}, ALLOW),
    ("ec2:CreateTags", f"{EC2}:instance/i-1", {}, IMPLICIT_DENY),  # retagging existing instances
    ("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/trainfleet/{STACK}/tf-1-r",
     {"iam_PassedToService": "ec2.amazonaws.com"}, ALLOW),
    ("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/trainfleet/other/tf-1-r",  # another stack's run
     {"iam_PassedToService": "ec2.amazonaws.com"}, IMPLICIT_DENY),
    ("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/admin", {"iam_PassedToService": "ec2.amazonaws.com"}, IMPLICIT_DENY),
    ("ssm:GetParameters", f"arn:aws:ssm:{REGION}::parameter/aws/service/deeplearning/ami/x86_64/"
                          "base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id", {}, ALLOW),
    ("ssm:GetParameters", f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/trainfleet/{STACK}/ami", {}, ALLOW),
    # The account's other parameters (its secrets among them) and another stack's.
    ("ssm:GetParameters", f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/team/ami", {}, IMPLICIT_DENY),
    ("ssm:GetParameters", f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/trainfleet/other/ami", {}, IMPLICIT_DENY),
    ("iam:CreateServiceLinkedRole", "*", {"iam_AWSServiceName": "spot.amazonaws.com"}, ALLOW),
    ("iam:CreateServiceLinkedRole", "*", {"iam_AWSServiceName": "rds.amazonaws.com"}, IMPLICIT_DENY),
    ("ec2:DescribeInstances", "*", {}, ALLOW),
    ("ec2:TerminateInstances", f"{EC2}:instance/i-1", {f"aws_ResourceTag__{TAG_STACK}": STACK}, ALLOW),
    ("ec2:TerminateInstances", f"{EC2}:instance/i-1", {f"aws_ResourceTag__{TAG_STACK}": "other"}, IMPLICIT_DENY),
    ("ec2:TerminateInstances", f"{EC2}:instance/i-1", {}, IMPLICIT_DENY),
    ("ec2:DeletePlacementGroup", f"{EC2}:placement-group/pg", {f"aws_ResourceTag__{TAG_STACK}": STACK}, ALLOW),
    ("dynamodb:Query", f"{TABLE}/index/by-instance", {}, ALLOW),
])
def test_fleet_statements(rendered, role, action, resource, context, expected):
    assert decide(rendered, role, action, resource, **context) == expected


@pytest.mark.parametrize("role", ["AllocateFunctionRole", "RecoverFunctionRole", "AgentEventsFunctionRole"])
def test_functions_that_launch_read_only_public_and_the_stacks_own_image_parameters(rendered, role):
    parameter = f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter"
    assert decide(rendered, role, "ssm:GetParameters", f"{parameter}/trainfleet/{STACK}/ami") == ALLOW
    assert decide(rendered, role, "ssm:GetParameters", f"arn:aws:ssm:{REGION}::parameter/aws/service/x") == ALLOW
    for other in ("team/database-password", "trainfleet/other/ami", "aws/service/x"):
        assert decide(rendered, role, "ssm:GetParameters", f"{parameter}/{other}") == IMPLICIT_DENY
    assert decide(rendered, role, "ssm:GetParameter", f"{parameter}/trainfleet/{STACK}/ami") == IMPLICIT_DENY


NODE_ROLES = f"arn:aws:iam::{ACCOUNT}:role/trainfleet/{STACK}"
NODE_PROFILES = f"arn:aws:iam::{ACCOUNT}:instance-profile/trainfleet/{STACK}"
NODE_POLICY = f"arn:aws:iam::{ACCOUNT}:policy/{STACK}-NodePolicy-x"


@pytest.mark.parametrize("role, action, resource, context, expected", [
    ("AllocateFunctionRole", "iam:CreateRole", f"{NODE_ROLES}/tf-1-r", {}, ALLOW),
    ("AllocateFunctionRole", "iam:CreateRole", f"arn:aws:iam::{ACCOUNT}:role/admin", {}, IMPLICIT_DENY),
    ("AllocateFunctionRole", "iam:CreateRole", f"arn:aws:iam::{ACCOUNT}:role/trainfleet/other/tf-1-r", {}, IMPLICIT_DENY),
    ("AllocateFunctionRole", "iam:AttachRolePolicy", f"{NODE_ROLES}/tf-1-r", {"iam_PolicyARN": NODE_POLICY}, ALLOW),
    # The node role gets the node policy and nothing else: no administrator through Allocate.
    ("AllocateFunctionRole", "iam:AttachRolePolicy", f"{NODE_ROLES}/tf-1-r",
     {"iam_PolicyARN": "arn:aws:iam::aws:policy/AdministratorAccess"}, IMPLICIT_DENY),
    ("AllocateFunctionRole", "iam:PutRolePolicy", f"{NODE_ROLES}/tf-1-r", {}, IMPLICIT_DENY),
    ("AllocateFunctionRole", "iam:AddRoleToInstanceProfile", f"{NODE_PROFILES}/tf-1-r", {}, ALLOW),
    ("RecoverFunctionRole", "iam:CreateRole", f"{NODE_ROLES}/tf-1-r", {}, IMPLICIT_DENY),
    # Recover passes the node role to EC2 alone; Allocate also adds it to its profile, which
    # passes it to no service (the role trusts EC2 alone either way).
    ("RecoverFunctionRole", "iam:PassRole", f"{NODE_ROLES}/tf-1-r", {"iam_PassedToService": "lambda.amazonaws.com"},
     IMPLICIT_DENY),
    ("AllocateFunctionRole", "iam:PassRole", f"{NODE_ROLES}/tf-1-r", {}, ALLOW),
    ("TeardownFunctionRole", "iam:DeleteRole", f"{NODE_ROLES}/tf-1-r", {}, ALLOW),
    ("ReaperFunctionRole", "iam:DeleteInstanceProfile", f"{NODE_PROFILES}/tf-1-r", {}, ALLOW),
    ("TeardownFunctionRole", "iam:DeleteRole", f"arn:aws:iam::{ACCOUNT}:role/admin", {}, IMPLICIT_DENY),
    ("AllocateFunctionRole", "iam:DeleteRole", f"{NODE_ROLES}/tf-1-r", {}, IMPLICIT_DENY),
])
def test_run_node_roles_are_made_and_deleted_under_the_stacks_path_alone(rendered, role, action, resource, context,
                                                                         expected):
    assert decide(rendered, role, action, resource, **context) == expected


def test_validate_may_only_record_runs_and_look_at_the_network(rendered):
    assert decide(rendered, "ValidateFunctionRole", "dynamodb:PutItem", TABLE) == ALLOW
    for action in ("ec2:DescribeSubnets", "ec2:DescribeInstanceTypeOfferings", "ec2:DescribeVpcs",
                   "ec2:DescribeVpcAttribute", "ec2:DescribeRouteTables", "ec2:DescribeVpcEndpoints",
                   "ec2:DescribeNatGateways", "ec2:DescribeSecurityGroups"):
        assert decide(rendered, "ValidateFunctionRole", action, "*") == ALLOW
    assert decide(rendered, "ValidateFunctionRole", "ec2:RunInstances", f"{EC2}:instance/*") == IMPLICIT_DENY
    assert decide(rendered, "ValidateFunctionRole", "ssm:GetParameters", f"arn:aws:ssm:{REGION}::parameter/aws/x") == IMPLICIT_DENY


@pytest.mark.parametrize("role, action, key, expected", [
    ("LaunchFunctionRole", "s3:PutObject", "runs/r/launch-spec.json", ALLOW),
    ("LaunchFunctionRole", "s3:PutObject", "runs/r/checkpoints/x", IMPLICIT_DENY),
    ("LaunchFunctionRole", "s3:GetObject", "runs/r/checkpoints/step-000000100/.metadata", ALLOW),
    ("ReportFunctionRole", "s3:PutObject", "runs/r/report.json", ALLOW),
    ("ReportFunctionRole", "s3:PutObject", "runs/r/report.html", ALLOW),
    ("ReportFunctionRole", "s3:PutObject", "runs/r/report-loss.png", ALLOW),
    ("ReportFunctionRole", "s3:PutObject", "runs/r/checkpoints/step-000000100/.metadata", IMPLICIT_DENY),
    ("ReportFunctionRole", "s3:GetObject", "runs/r/report.json", IMPLICIT_DENY),
    ("ReaperFunctionRole", "s3:PutObject", "runs/r/report.html", ALLOW),
    ("EventsFunctionRole", "s3:GetObject", "runs/r/checkpoints/step-000000100/manifest.json", ALLOW),
])
def test_function_objects(rendered, role, action, key, expected):
    assert decide(rendered, role, action, s3(key)) == expected


@pytest.mark.parametrize("role, action, expected", [
    ("AwaitNodesFunctionRole", "states:SendTaskSuccess", ALLOW),
    ("EventsFunctionRole", "states:SendTaskFailure", ALLOW),
    ("LaunchFunctionRole", "states:SendTaskSuccess", IMPLICIT_DENY),
])
def test_task_callbacks_reach_only_this_stacks_state_machine(rendered, role, action, expected):
    assert decide(rendered, role, action, STATE_MACHINE) == expected
    assert decide(rendered, role, action, STATE_MACHINE.replace(f":{STACK}-", ":other-")) == IMPLICIT_DENY


@pytest.mark.parametrize("role, expected", [
    ("ReportFunctionRole", ALLOW), ("ReaperFunctionRole", ALLOW), ("EventsFunctionRole", IMPLICIT_DENY)])
def test_the_report_reads_the_history_of_this_stacks_executions_alone(rendered, role, expected):
    execution = STATE_MACHINE.replace(":stateMachine:", ":execution:") + ":r1"
    assert decide(rendered, role, "states:GetExecutionHistory", execution) == expected
    assert decide(rendered, role, "states:GetExecutionHistory",
                  execution.replace(f":{STACK}-", ":other-")) == IMPLICIT_DENY


def test_the_state_machine_invokes_only_the_stacks_functions(rendered):
    function = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{STACK}-ValidateFunction-x"
    assert decide(rendered, "TrainingRunStateMachineRole", "lambda:InvokeFunction", function) == ALLOW
    assert decide(rendered, "TrainingRunStateMachineRole", "lambda:InvokeFunction",
                  f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:other") == IMPLICIT_DENY


@pytest.mark.parametrize("secure, expected", [("false", EXPLICIT_DENY), ("true", IMPLICIT_DENY)])
def test_the_bucket_refuses_requests_without_tls(rendered, secure, expected):
    policy = rendered["CheckpointBucketPolicy"]["Properties"]["PolicyDocument"]
    assert evaluate([policy], "s3:GetObject", s3("runs/r/x"), {"aws:SecureTransport": secure}) == expected


# --- the evaluator's policy variables ----------------------------------------------------------

def test_policy_variables_are_the_requests_values_and_a_missing_one_matches_nothing():
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::b/home/${aws:userid}/*"},
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "arn:aws:s3:::b",
         "Condition": {"StringLike": {"s3:prefix": "home/${aws:userid}/*"}}}]}
    me = {"aws:userid": "AROAEXAMPLE:i-0a"}
    assert evaluate([policy], "s3:GetObject", "arn:aws:s3:::b/home/AROAEXAMPLE:i-0a/x", me) == ALLOW
    assert evaluate([policy], "s3:GetObject", "arn:aws:s3:::b/home/AROAEXAMPLE:i-0b/x", me) == IMPLICIT_DENY
    assert evaluate([policy], "s3:GetObject", "arn:aws:s3:::b/home/${aws:userid}/x", {}) == IMPLICIT_DENY
    assert evaluate([policy], "s3:ListBucket", "arn:aws:s3:::b", me | {"s3:prefix": "home/AROAEXAMPLE:i-0a/"}) == ALLOW
    assert evaluate([policy], "s3:ListBucket", "arn:aws:s3:::b", {"s3:prefix": "home/${aws:userid}/"}) == IMPLICIT_DENY
    # The 2008 language has no variables: the text is literal.
    literal = policy | {"Version": "2008-10-17"}
    assert evaluate([literal], "s3:GetObject", "arn:aws:s3:::b/home/AROAEXAMPLE:i-0a/x", me) == IMPLICIT_DENY
    assert evaluate([literal], "s3:GetObject", "arn:aws:s3:::b/home/${aws:userid}/x", me) == ALLOW
