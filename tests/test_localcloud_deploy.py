"""Deploying SAM templates into the local cloud: template semantics (pure), then whole deploys
read back through boto3, then the project's own template.yaml."""

import io
import json
import re
import zipfile
from pathlib import Path

import pytest

from localcloud.deploy import (
    DeployError,
    DeployRequest,
    ResourceCreateError,
    UnsupportedResourcesError,
    deploy,
    load_template,
    transform_sam,
)
from localcloud.deploy_intrinsics import (
    Resolver,
    TemplateError,
    check_rules,
    creation_order,
    evaluate_conditions,
    parameter_values,
)
from localcloud.deploy_resources import (custom_resource_request, ip_permission, lifecycle_rule, physical_name,
                                        substitute_definition)
from localcloud_helpers import remove_rules

REPO = Path(__file__).resolve().parents[1]
TEST_TEMPLATE = REPO / "tests" / "data" / "deploy" / "template.yaml"


# --- template semantics ---------------------------------------------------------------------

def test_parameters_take_overrides_then_defaults_and_split_lists():
    declared = {"Stage": {"Type": "String", "Default": "dev", "AllowedValues": ["dev", "prod"]},
                "Zones": {"Type": "CommaDelimitedList", "Default": "a, b"},
                "Size": {"Type": "Number"}}
    assert parameter_values(declared, {"Size": "3", "Stage": "prod"}) == {
        "Stage": "prod", "Zones": ["a", "b"], "Size": "3"}


@pytest.mark.parametrize("overrides, message", [
    ({"Size": "1", "Colour": "red"}, "'Colour'"),
    ({}, "'Size' has no Default"),
    ({"Size": "1", "Stage": "qa"}, "'Stage'='qa' is not one of AllowedValues"),
    ({"Size": "1", "Subnets": "subnet-1,vpc-2"}, "'Subnets'='subnet-1,vpc-2' does not match AllowedPattern"),
])
def test_bad_parameters_are_named(overrides, message):
    declared = {"Stage": {"Default": "dev", "AllowedValues": ["dev", "prod"]}, "Size": {"Type": "Number"},
                "Subnets": {"Default": "", "AllowedPattern": "^(subnet-[0-9]+(,subnet-[0-9]+)*)?$"}}
    with pytest.raises(TemplateError, match=message):
        parameter_values(declared, overrides)


def test_rules_refuse_the_parameters_their_assertions_fail_on():
    rules = {"SubnetsNeedGroups": {
        "RuleCondition": {"Fn::Not": [{"Fn::Equals": [{"Ref": "Subnets"}, ""]}]},
        "Assertions": [{"Assert": {"Fn::Not": [{"Fn::Equals": [{"Ref": "Groups"}, ""]}]},
                        "AssertDescription": "Subnets needs Groups"}]}}
    check_rules(rules, Resolver({"Subnets": "", "Groups": ""}))  # the rule's condition is false
    check_rules(rules, Resolver({"Subnets": "subnet-1", "Groups": "sg-1"}))
    with pytest.raises(TemplateError, match="Rules.SubnetsNeedGroups: Subnets needs Groups"):
        check_rules(rules, Resolver({"Subnets": "subnet-1", "Groups": ""}))


def _resolver(**created_attributes):
    resolver = Resolver({"AWS::Region": "eu-west-1", "AWS::AccountId": "111122223333", "Stage": "prod",
                         "Zones": ["eu-west-1a", "eu-west-1b"]},
                        mappings={"Sizes": {"prod": {"Nodes": 8}}})
    for logical_id, attributes in created_attributes.items():
        resolver.ref_of[logical_id] = attributes["Ref"]
        resolver.attributes_of[logical_id] = attributes
    resolver.conditions = evaluate_conditions({
        "IsProd": {"Fn::Equals": [{"Ref": "Stage"}, "prod"]},
        "IsDev": {"Fn::Not": [{"Condition": "IsProd"}]},
        "ProdInIreland": {"Fn::And": [{"Condition": "IsProd"},
                                      {"Fn::Equals": ["eu-west-1", {"Ref": "AWS::Region"}]}]},
    }, resolver)
    return resolver


def test_conditions_refer_to_each_other():
    assert _resolver().conditions == {"IsProd": True, "IsDev": False, "ProdInIreland": True}


def test_intrinsics_resolve_like_cloudformation():
    resolver = _resolver(Table={"Ref": "runs", "Arn": "arn:aws:dynamodb:eu-west-1:111122223333:table/runs"})
    template = {
        "Sub": {"Fn::Sub": "${AWS::Region}/${Table}/${Table.Arn}/${!Literal}"},
        "SubVariables": {"Fn::Sub": ["${Name}-${AWS::AccountId}", {"Name": {"Ref": "Stage"}}]},
        "Join": {"Fn::Join": [",", [{"Ref": "Table"}, "x"]]},
        "Select": {"Fn::Select": [1, {"Ref": "Zones"}]},
        "Split": {"Fn::Split": ["/", "a/b"]},
        "Map": {"Fn::FindInMap": ["Sizes", {"Ref": "Stage"}, "Nodes"]},
        "If": {"Fn::If": ["IsDev", "dev-value", {"Ref": "AWS::NoValue"}]},
        "List": ["kept", {"Ref": "AWS::NoValue"}],
    }
    assert resolver.resolve(template, "test") == {
        "Sub": "eu-west-1/runs/arn:aws:dynamodb:eu-west-1:111122223333:table/runs/${Literal}",
        "SubVariables": "prod-111122223333",
        "Join": "runs,x",
        "Select": "eu-west-1b",
        "Split": ["a", "b"],
        "Map": 8,
        "List": ["kept"],
    }


@pytest.mark.parametrize("value, message", [
    ({"Ref": "Missing"}, r"Ref to 'Missing'"),
    ({"Fn::GetAtt": ["Table", "StreamArn"]}, r"Table has no attribute 'StreamArn'"),
    ({"Fn::If": ["Nope", 1, 2]}, r"undeclared condition 'Nope'"),
    ({"Fn::ImportValue": "other-stack-export"}, r"not supported"),
])
def test_unresolvable_intrinsics_name_the_place(value, message):
    resolver = _resolver(Table={"Ref": "runs", "Arn": "arn"})
    with pytest.raises(TemplateError, match=message):
        resolver.resolve({"Properties": {"Field": value}}, "Resources.X")


def test_creation_order_follows_references_and_depends_on():
    resources = {
        "Function": {"Properties": {"Role": {"Fn::GetAtt": ["Role", "Arn"]},
                                    "Env": {"Fn::Sub": "${Bucket}-${AWS::Region}"}}},
        "Role": {"DependsOn": "Bucket"},
        "Bucket": {},
        "Rule": {"Properties": {"Targets": [{"Arn": {"Ref": "Function"}}]}},
    }
    assert creation_order(resources) == ["Bucket", "Role", "Function", "Rule"]


def test_circular_references_are_refused():
    resources = {"A": {"Properties": {"X": {"Ref": "B"}}}, "B": {"Properties": {"X": {"Fn::GetAtt": "A.Arn"}}}}
    with pytest.raises(TemplateError, match=r"circular dependency between resources \['A', 'B'\]"):
        creation_order(resources)


def test_definition_substitutions_must_cover_every_placeholder():
    definition = '{"Resource": "${FunctionArn}", "Table": "${TableName}"}'
    assert substitute_definition(definition, {"FunctionArn": "arn:f", "TableName": "t"}) == (
        '{"Resource": "arn:f", "Table": "t"}')
    with pytest.raises(ValueError, match=r"\['TableName'\]"):
        substitute_definition(definition, {"FunctionArn": "arn:f"})


def test_cloudformation_shapes_become_api_shapes():
    assert lifecycle_rule({"Id": "old", "Status": "Enabled", "Prefix": "tmp/", "ExpirationInDays": "3"}) == {
        "ID": "old", "Status": "Enabled", "Filter": {"Prefix": "tmp/"}, "Expiration": {"Days": 3}}
    assert ip_permission({"IpProtocol": -1, "SourceSecurityGroupId": "sg-1"}) == {
        "IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": "sg-1"}]}
    with pytest.raises(ValueError, match=r"\['Transitions'\]"):
        lifecycle_rule({"Status": "Enabled", "Transitions": []})


def test_generated_names_fit_their_limits():
    name = physical_name("a-very-long-stack-name-" * 3, "AVeryLongLogicalIdIndeed" * 3, 63, lowercase=True)
    assert len(name) <= 63 and name == name.lower() and name.startswith("a-very-long")


def test_sam_transform_runs_offline():
    template = load_template(TEST_TEMPLATE)
    template["Resources"]["EchoFunction"]["Properties"]["CodeUri"] = "s3://artifacts/echo.zip"
    template["Resources"]["TrainingRun"]["Properties"]["DefinitionUri"] = "s3://artifacts/run.asl.json"
    resources = transform_sam(template, {"AWS::AccountId": "123456789012"}, "eu-west-1")["Resources"]
    role = resources["EchoFunctionRole"]["Properties"]
    # The AWS managed policy came from the translator's bundled map, not from an IAM call.
    assert role["ManagedPolicyArns"] == ["arn:aws:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"]
    assert resources["TrainingRun"]["Properties"]["DefinitionS3Location"] == {
        "Bucket": "artifacts", "Key": "run.asl.json"}


def test_sam_transform_errors_name_the_resource():
    template = load_template(TEST_TEMPLATE)  # CodeUri is still a local path: not packaged
    with pytest.raises(TemplateError, match=r"\[EchoFunction\] is invalid. 'CodeUri'"):
        transform_sam(template, {}, "us-east-1")


# --- whole deploys --------------------------------------------------------------------------

STACKS = "deploy-test-"
"""Every stack this module deploys is named with this prefix."""


@pytest.fixture(scope="module")
def cloud():
    """A local cloud for this module's deploys. moto's state outlives it in this process, so
    the EventBridge rules deployed here are removed at the end: left in place they would keep
    routing other tests' EC2 events to this module's functions and state machines."""
    from localcloud import LocalCloud

    with LocalCloud() as running:
        yield running
        remove_rules(running.client("events"), STACKS)


def _read_back(cloud, resource):
    """Reads the resource through the AWS API its type belongs to (raises if it is absent)."""
    pid = resource.physical_id
    readers = {
        "AWS::IAM::Role": lambda: cloud.client("iam").get_role(RoleName=pid)["Role"],
        "AWS::IAM::Policy": lambda: pid,  # checked through its role below
        "AWS::IAM::InstanceProfile": lambda: cloud.client("iam").get_instance_profile(InstanceProfileName=pid),
        "AWS::IAM::ManagedPolicy": lambda: cloud.client("iam").get_policy(PolicyArn=pid)["Policy"],
        "AWS::Lambda::Function": lambda: cloud.client("lambda").get_function_configuration(FunctionName=pid),
        "AWS::Lambda::Permission": lambda: pid,  # checked through its function's policy below
        "AWS::Lambda::EventInvokeConfig": lambda: cloud.client("lambda").get_function_event_invoke_config(
            FunctionName=pid.rsplit(":", 1)[0]),
        "AWS::Lambda::EventSourceMapping": lambda: cloud.client("lambda").get_event_source_mapping(UUID=pid),
        "AWS::StepFunctions::StateMachine": lambda: cloud.client("stepfunctions").describe_state_machine(
            stateMachineArn=pid),
        "AWS::Events::Rule": lambda: cloud.client("events").list_targets_by_rule(
            Rule=pid.split("|")[-1], EventBusName=pid.split("|")[0] if "|" in pid else "default")["Targets"],
        "AWS::DynamoDB::Table": lambda: cloud.client("dynamodb").describe_table(TableName=pid)["Table"],
        "AWS::S3::Bucket": lambda: cloud.client("s3").get_bucket_encryption(Bucket=pid),
        "AWS::S3::BucketPolicy": lambda: json.loads(cloud.client("s3").get_bucket_policy(Bucket=pid)["Policy"]),
        "AWS::Logs::LogGroup": lambda: cloud.client("logs").describe_log_groups(
            logGroupNamePrefix=pid)["logGroups"][0],
        "AWS::CloudWatch::Alarm": lambda: cloud.client("cloudwatch").describe_alarms(
            AlarmNames=[pid])["MetricAlarms"][0],
        "AWS::CloudWatch::Dashboard": lambda: json.loads(cloud.client("cloudwatch").get_dashboard(
            DashboardName=pid)["DashboardBody"]),
        "AWS::EC2::LaunchTemplate": lambda: cloud.client("ec2").describe_launch_template_versions(
            LaunchTemplateId=pid)["LaunchTemplateVersions"][0]["LaunchTemplateData"],
        "AWS::EC2::PlacementGroup": lambda: cloud.client("ec2").describe_placement_groups(
            GroupNames=[pid])["PlacementGroups"][0],
        "AWS::EC2::SecurityGroup": lambda: cloud.client("ec2").describe_security_groups(
            GroupIds=[pid])["SecurityGroups"][0],
        "AWS::EC2::SecurityGroupIngress": lambda: cloud.client("ec2").describe_security_group_rules(
            SecurityGroupRuleIds=[pid])["SecurityGroupRules"][0],
        "AWS::Lambda::LayerVersion": lambda: cloud.client("lambda").get_layer_version(
            LayerName=pid.split(":")[6], VersionNumber=int(pid.split(":")[7])),
        "AWS::SQS::Queue": lambda: cloud.client("sqs").get_queue_attributes(
            QueueUrl=pid, AttributeNames=["All"])["Attributes"],
        "AWS::SQS::QueuePolicy": lambda: pid,  # checked through its queue in the template test
        "AWS::Events::EventBus": lambda: cloud.client("events").describe_event_bus(Name=pid),
        "AWS::SNS::Topic": lambda: cloud.client("sns").get_topic_attributes(TopicArn=pid)["Attributes"],
        "AWS::CloudFormation::CustomResource": lambda: pid,  # its function answered SUCCESS, or the deploy failed
        "AWS::EC2::VPC": lambda: cloud.client("ec2").describe_vpc_attribute(VpcId=pid, Attribute="enableDnsHostnames"),
        "AWS::EC2::Subnet": lambda: cloud.client("ec2").describe_subnets(SubnetIds=[pid])["Subnets"][0],
        "AWS::EC2::RouteTable": lambda: cloud.client("ec2").describe_route_tables(RouteTableIds=[pid])["RouteTables"][0],
        "AWS::EC2::SubnetRouteTableAssociation": lambda: cloud.client("ec2").describe_route_tables(Filters=[
            {"Name": "association.route-table-association-id", "Values": [pid]}])["RouteTables"][0],
        "AWS::EC2::VPCEndpoint": lambda: cloud.client("ec2").describe_vpc_endpoints(
            VpcEndpointIds=[pid])["VpcEndpoints"][0],
        "AWS::EC2::SecurityGroupEgress": lambda: cloud.client("ec2").describe_security_group_rules(
            SecurityGroupRuleIds=[pid])["SecurityGroupRules"][0],
    }
    return readers[resource.resource_type]()


@pytest.mark.slow
def test_every_resource_type_deploys_and_reads_back(cloud):
    stack = deploy(DeployRequest(TEST_TEMPLATE, cloud.endpoint, stack_name=f"{STACKS}dev"))
    read = {logical_id: _read_back(cloud, resource) for logical_id, resource in stack.resources.items()}
    deployed_types = {resource.resource_type for resource in stack.resources.values()}
    assert deployed_types >= {
        "AWS::Lambda::Function", "AWS::StepFunctions::StateMachine", "AWS::Events::Rule", "AWS::DynamoDB::Table",
        "AWS::S3::Bucket", "AWS::S3::BucketPolicy", "AWS::IAM::Role", "AWS::IAM::Policy", "AWS::Logs::LogGroup",
        "AWS::CloudWatch::Alarm", "AWS::CloudWatch::Dashboard", "AWS::Lambda::Permission",
        "AWS::EC2::LaunchTemplate", "AWS::EC2::PlacementGroup", "AWS::EC2::SecurityGroup"}
    assert stack.skipped == {"ProdOnlyAlarm": "IsProd"}
    table = stack.resources["RunTable"].physical_id
    function = stack.resources["EchoFunction"]

    # Function: the packaged handler really runs, with the environment the template gave it.
    assert read["EchoFunction"]["Environment"]["Variables"] == {"RUN_TABLE": table, "STAGE": "dev"}
    assert (read["EchoFunction"]["Timeout"], read["EchoFunction"]["MemorySize"]) == (30, 256)  # Globals
    reply = cloud.client("lambda").invoke(FunctionName=function.physical_id, Payload=b'{"n": 1}')
    assert json.loads(reply["Payload"].read()) == {"table": table, "event": {"n": 1}}
    policy = json.loads(cloud.client("lambda").get_policy(FunctionName=function.physical_id)["Policy"])
    assert {statement["Sid"] for statement in policy["Statement"]} == {
        stack.resources["StateChangeRulePermission"].physical_id,
        stack.resources["EchoFunctionNodeEventsPermission"].physical_id}

    # State machine: DefinitionUri uploaded, DefinitionSubstitutions applied.
    assert sorted(stack.packaged) == [str(TEST_TEMPLATE.parent / "functions"),
                                      str(TEST_TEMPLATE.parent / "statemachine" / "run.asl.json")]
    definition = json.loads(read["TrainingRun"]["definition"])
    assert definition["States"]["Echo"]["Resource"] == function.arn
    assert definition["States"]["Record"]["Parameters"]["TableName"] == table

    # Rules: both InputPath and InputTransformer targets, and the SAM-generated rule.
    targets = {target["Id"]: target for target in read["StateChangeRule"]}
    assert targets["start-run"]["InputPath"] == "$.detail"
    assert targets["start-run"]["RoleArn"] == stack.resources["EventsStartRunRole"].arn
    assert targets["echo"]["InputTransformer"]["InputPathsMap"] == {
        "instance": "$.detail.instance-id", "state": "$.detail.state"}
    assert read["EchoFunctionNodeEvents"][0]["Arn"] == function.arn

    # Storage.
    assert read["RunTable"]["KeySchema"] == [{"AttributeName": "run_id", "KeyType": "HASH"}]
    ttl = cloud.client("dynamodb").describe_time_to_live(TableName=table)["TimeToLiveDescription"]
    assert ttl == {"AttributeName": "expires_at", "TimeToLiveStatus": "ENABLED"}
    bucket = stack.resources["CheckpointBucket"].physical_id
    s3 = cloud.client("s3")
    assert read["CheckpointBucket"]["ServerSideEncryptionConfiguration"]["Rules"][0][
        "ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    assert s3.get_public_access_block(Bucket=bucket)["PublicAccessBlockConfiguration"]["BlockPublicPolicy"]
    assert s3.get_bucket_versioning(Bucket=bucket)["Status"] == "Enabled"
    assert {"Key": "zones", "Value": "us-east-1a us-east-1b"} in s3.get_bucket_tagging(Bucket=bucket)["TagSet"]
    assert s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"][0]["Expiration"] == {"Days": 7}
    assert read["CheckpointBucketPolicy"]["Statement"][0]["Resource"] == [
        f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]

    # IAM: SAM policy templates on the generated role, the inline policy on its role.
    iam = cloud.client("iam")
    assert iam.list_role_policies(RoleName=stack.resources["EchoFunctionRole"].physical_id)["PolicyNames"] == [
        "EchoFunctionRolePolicy0"]
    start_run = iam.get_role_policy(RoleName=stack.resources["EventsStartRunRole"].physical_id,
                                    PolicyName="start-run")["PolicyDocument"]
    assert start_run["Statement"][0]["Resource"] == stack.resources["TrainingRun"].arn
    assert [p["PolicyName"] for p in iam.list_attached_role_policies(
        RoleName=stack.resources["NodeRole"].physical_id)["AttachedPolicies"]] == ["CloudWatchAgentServerPolicy"]

    # Observability.
    assert read["EchoFunctionLogs"]["logGroupName"] == f"/aws/lambda/{function.physical_id}"
    assert read["EchoFunctionLogs"]["retentionInDays"] == 7
    assert read["StateMachineLogs"]["logGroupName"] == f"/aws/vendedlogs/states/{STACKS}dev/run"
    assert read["FailedRunsAlarm"]["Threshold"] == 1.0  # from Mappings, for the dev stage
    assert read["FailedRunsAlarm"]["Dimensions"] == [{"Name": "StateMachineArn", "Value": stack.outputs[
        "StateMachineArn"]}]
    assert read["RunDashboard"]["widgets"][0]["properties"]["metrics"][0][3] == stack.outputs["StateMachineArn"]

    # EC2: the launch template refers to the instance profile, placement group and group made here.
    group_id = stack.resources["NodeSecurityGroup"].physical_id
    launch = read["NodeLaunchTemplate"]
    assert launch["Placement"]["GroupName"] == stack.resources["NodePlacementGroup"].physical_id
    assert launch["MetadataOptions"]["HttpTokens"] == "required"
    assert launch["Placement"]["AvailabilityZone"] == "us-east-1b"  # Fn::GetAZs, asked of EC2
    assert launch["IamInstanceProfile"]["Arn"] == stack.resources["NodeInstanceProfile"].arn
    assert launch["NetworkInterfaces"][0]["Groups"] == [group_id]
    assert read["NodePlacementGroup"]["Strategy"] == "cluster"
    assert read["NodeSecurityGroupSelfIngress"]["ReferencedGroupInfo"]["GroupId"] == group_id

    assert stack.outputs == {
        "StateMachineArn": stack.resources["TrainingRun"].arn, "CheckpointBucketName": bucket,
        "RunTableName": table, "DevNote": f"{STACKS}dev in us-east-1 ({cloud.account_id})"}


@pytest.mark.slow
def test_conditions_follow_parameter_overrides(cloud):
    stack = deploy(DeployRequest(TEST_TEMPLATE, cloud.endpoint, stack_name=f"{STACKS}prod",
                                 parameters={"Stage": "prod", "RetentionDays": "14"}))
    assert stack.skipped == {}
    alarm = _read_back(cloud, stack.resources["ProdOnlyAlarm"])
    assert stack.outputs["ProdAlarm"] == alarm["AlarmName"]
    assert "DevNote" not in stack.outputs
    assert _read_back(cloud, stack.resources["EchoFunctionLogs"])["retentionInDays"] == 14


def test_unsupported_types_and_properties_are_all_listed_before_anything_is_created(cloud, tmp_path):
    template = tmp_path / "template.yaml"
    template.write_text("""
Resources:
  Bucket:
    Type: AWS::S3::Bucket
    Properties: {BucketName: never-created-bucket}
  Queue:
    Type: AWS::Batch::JobQueue
    Properties: {Priority: 1}
  Table:
    Type: AWS::DynamoDB::Table
    Properties: {KinesisStreamSpecification: {StreamArn: x}}
  Alarm:
    Type: AWS::CloudWatch::Alarm
    Properties: {EvaluationPeriods: 1}
""")
    with pytest.raises(UnsupportedResourcesError) as raised:
        deploy(DeployRequest(template, cloud.endpoint))
    assert raised.value.problems[0].startswith("Queue: resource type 'AWS::Batch::JobQueue' is not supported")
    assert raised.value.problems[1:] == [
        "Table (AWS::DynamoDB::Table): propert(y/ies) ['KinesisStreamSpecification'] not supported",
        "Table (AWS::DynamoDB::Table): required propert(y/ies) ['KeySchema'] missing",
        "Alarm (AWS::CloudWatch::Alarm): required propert(y/ies) ['ComparisonOperator'] missing"]
    buckets = [b["Name"] for b in cloud.client("s3").list_buckets()["Buckets"]]
    assert "never-created-bucket" not in buckets


def test_unknown_aws_managed_policies_are_refused_before_anything_is_created(cloud, tmp_path):
    template = tmp_path / "template.yaml"
    template.write_text("""
Resources:
  Logs:
    Type: AWS::Logs::LogGroup
    Properties: {LogGroupName: never-created-logs}
  Role:
    Type: AWS::IAM::Role
    Properties:
      AssumeRolePolicyDocument: {Version: "2012-10-17", Statement: []}
      ManagedPolicyArns:
        - !Sub "arn:${AWS::Partition}:iam::aws:policy/service-role/AWSLambdaBasicExecutionRole"
        - arn:aws:iam::aws:policy/NoSuchPolicyAnywhere
""")
    with pytest.raises(DeployError, match=r"(?s)nothing was created.*Role: arn:aws:iam::aws:policy/NoSuchPolicyAnywhere$"):
        deploy(DeployRequest(template, cloud.endpoint, stack_name=f"{STACKS}unknown-policy"))
    assert cloud.client("logs").describe_log_groups(logGroupNamePrefix="never-created-logs")["logGroups"] == []


FUNCTION = """
  {name}:
    Type: AWS::Serverless::Function
    Properties:
      InlineCode: "def handler(event, context):\\n    return event\\n"
      Handler: index.handler
      Runtime: {runtime}
"""


def test_lambda_properties_that_change_nothing_locally_are_accepted_and_the_rest_refused(cloud, tmp_path):
    template = tmp_path / "template.yaml"
    template.write_text("Transform: AWS::Serverless-2016-10-31\nResources:" + FUNCTION.format(
        name="Echo", runtime="python3.11") + """      RuntimeManagementConfig: {UpdateRuntimeOn: Auto}
      SnapStart: {ApplyOn: None}
      RecursiveLoop: Terminate
      LoggingConfig: {LogFormat: JSON, ApplicationLogLevel: INFO}
""")
    stack = deploy(DeployRequest(template, cloud.endpoint, stack_name=f"{STACKS}inert"))
    reply = cloud.client("lambda").invoke(FunctionName=stack.resources["Echo"].physical_id, Payload=b'{"n": 1}')
    assert json.loads(reply["Payload"].read()) == {"n": 1}

    template.write_text(template.read_text() + "      FileSystemConfigs: [{Arn: arn:aws:efs:x, LocalMountPath: /mnt/x}]\n")
    with pytest.raises(UnsupportedResourcesError, match=r"Echo \(AWS::Lambda::Function\): propert\(y/ies\) "
                                                        r"\['FileSystemConfigs'\] not supported"):
        deploy(DeployRequest(template, cloud.endpoint, stack_name=f"{STACKS}efs"))


def test_functions_that_cannot_run_here_are_all_refused_before_anything_is_created(cloud, tmp_path):
    template = tmp_path / "template.yaml"
    template.write_text("Transform: AWS::Serverless-2016-10-31\nResources:\n"
                        "  Logs:\n    Type: AWS::Logs::LogGroup\n    Properties: {LogGroupName: never-created-function-logs}"
                        + FUNCTION.format(name="Node", runtime="nodejs20.x")
                        + FUNCTION.format(name="Future", runtime="python3.99")
                        + FUNCTION.format(name="Layered", runtime="python3.11")
                        + "      Layers: [!Sub 'arn:aws:lambda:${AWS::Region}:999999999999:layer:elsewhere:1']\n")
    with pytest.raises(UnsupportedResourcesError) as refused:
        deploy(DeployRequest(template, cloud.endpoint, stack_name=f"{STACKS}unrunnable"))
    assert refused.value.problems == [
        "Node: runtime nodejs20.x is not Python: the local cloud runs Python functions only",
        "Future: runtime python3.99: no python3.99 interpreter is installed here (looked for `python3.99` on PATH); "
        "install one, or use python3.11",
        "Layered: layer arn:aws:lambda:us-east-1:999999999999:layer:elsewhere:1 is unknown here: not a layer version "
        "of the local cloud, nor a public layer it maps (AWS Lambda Powertools for Python)"]
    assert cloud.client("logs").describe_log_groups(logGroupNamePrefix="never-created-function-logs")["logGroups"] == []


def test_a_failed_create_names_the_resource_and_what_came_before(cloud, tmp_path):
    template = tmp_path / "template.yaml"
    template.write_text("""
Resources:
  Logs:
    Type: AWS::Logs::LogGroup
  Table:
    Type: AWS::DynamoDB::Table
    DependsOn: Logs
    Properties:
      BillingMode: PAY_PER_REQUEST
      AttributeDefinitions: [{AttributeName: id, AttributeType: S}]
      KeySchema: [{AttributeName: run, KeyType: HASH}]
""")
    with pytest.raises(ResourceCreateError, match=r"creating Table \(AWS::DynamoDB::Table\) failed: .*run") as raised:
        deploy(DeployRequest(template, cloud.endpoint, stack_name=f"{STACKS}bad-table"))
    assert raised.value.created == ["Logs"]


# --- the project's own template -------------------------------------------------------------

PROJECT_TEMPLATE = REPO / "template.yaml"


@pytest.mark.slow
def test_project_template_deploys_and_every_resource_is_accounted_for(cloud):
    stack = deploy(DeployRequest(PROJECT_TEMPLATE, cloud.endpoint, stack_name=f"{STACKS}project"))
    declared = load_template(PROJECT_TEMPLATE)["Resources"]
    accounted = set(stack.resources) | set(stack.skipped)
    # Each declared resource is there under its own logical id; SAM appends a 10-digit hash to
    # a layer's, so that a new version gets a new resource.
    unaccounted = [logical_id for logical_id in declared if logical_id not in accounted
                   and not any(re.fullmatch(rf"{logical_id}[0-9a-f]{{10}}", name) for name in accounted)]
    assert unaccounted == []
    for logical_id, resource in stack.resources.items():
        assert _read_back(cloud, resource) is not None, logical_id
    for name, value in stack.outputs.items():
        assert value and "${" not in str(value), name
    # DescribeStacks answers with the deployed outputs, as on AWS; a second deploy of it is refused.
    (described,) = cloud.client("cloudformation").describe_stacks(StackName=stack.stack_name)["Stacks"]
    assert described["StackStatus"] == "CREATE_COMPLETE"
    assert {output["OutputKey"]: output["OutputValue"] for output in described["Outputs"]} == {
        name: str(value) for name, value in stack.outputs.items()}
    with pytest.raises(DeployError, match=f"stack {stack.stack_name} exists already"):
        deploy(DeployRequest(PROJECT_TEMPLATE, cloud.endpoint, stack_name=stack.stack_name))
    # The nodes' network: a private subnet a zone, endpoints for what nodes call, DNS for their names.
    ec2 = cloud.client("ec2")
    subnets = stack.outputs["NodeSubnetIds"].split(",")
    assert [subnet["AvailabilityZone"] for subnet in ec2.describe_subnets(SubnetIds=subnets)["Subnets"]] == [
        "us-east-1a", "us-east-1b", "us-east-1c"]
    endpoints = {endpoint["ServiceName"].rsplit(".", 1)[1]: endpoint for endpoint in ec2.describe_vpc_endpoints(
        Filters=[{"Name": "vpc-id", "Values": [stack.resources["NodeVpc"].physical_id]}])["VpcEndpoints"]}
    assert {service: (endpoint["VpcEndpointType"], endpoint["PrivateDnsEnabled"])
            for service, endpoint in endpoints.items()} == {
        "s3": ("Gateway", False), "dynamodb": ("Gateway", False), "events": ("Interface", True),
        "states": ("Interface", True), "logs": ("Interface", True), "ssm": ("Interface", True),
        "ssmmessages": ("Interface", True)}
    assert stack.outputs["NodeSecurityGroupIds"] == stack.resources["NodeSecurityGroup"].physical_id
    machine = cloud.client("stepfunctions").describe_state_machine(stateMachineArn=stack.outputs["StateMachineArn"])
    assert "${" not in machine["definition"]
    # An event the handler fails on every try is kept with those EventBridge could not deliver.
    on_failure = cloud.client("lambda").get_function_event_invoke_config(
        FunctionName=stack.outputs["EventsFunctionName"])["DestinationConfig"]["OnFailure"]["Destination"]
    assert on_failure == stack.resources["UndeliveredEvents"].arn
    # So is an agent event whose record failed five times.
    queue = cloud.client("sqs").get_queue_attributes(QueueUrl=stack.resources["AgentEventQueue"].physical_id,
                                                     AttributeNames=["RedrivePolicy"])["Attributes"]
    assert json.loads(queue["RedrivePolicy"])["deadLetterTargetArn"] == stack.resources["UndeliveredEvents"].arn

    # `CodeUri: .` packed the repository's sources, not its virtualenv, and the handlers import.
    bucket, key = stack.packaged[str(REPO)].removeprefix("s3://").split("/", 1)
    package = cloud.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()
    names = zipfile.ZipFile(io.BytesIO(package)).namelist()
    assert "functions/validate.py" in names and "template.yaml" in names
    assert not [name for name in names if name.startswith((".venv/", ".git/")) or "__pycache__" in name]
    reply = cloud.client("lambda").invoke(FunctionName=stack.resources["ValidateFunction"].physical_id, Payload=b"{}")
    error = json.loads(reply["Payload"].read())
    assert not error.get("errorType", "").startswith("Runtime."), error


@pytest.mark.slow
def test_the_stack_deletes_every_runs_node_role_before_its_node_policy(cloud):
    """Runs leave node roles (a teardown that never finished, a run still going) with NodePolicy
    attached, and IAM refuses to delete an attached policy: the stack's deletion failed on it.
    The NodeRoles custom resource depends on NodePolicy, so CloudFormation deletes it first, and
    its Delete request deletes the roles."""
    from trainfleet.adapters.node_roles import ensure_node_profile, node_role_path

    stack = deploy(DeployRequest(PROJECT_TEMPLATE, cloud.endpoint, stack_name=f"{STACKS}roles"))
    iam, policy = cloud.client("iam"), stack.outputs["NodePolicyArn"]
    for run in ("left-behind", "still-going"):
        ensure_node_profile(iam, run, stack.stack_name, policy)
    # Another stack's profile, outside the path, which the cleanup's role may not touch.
    iam.create_instance_profile(InstanceProfileName=f"{STACKS}elsewhere", Path="/elsewhere/")
    with pytest.raises(iam.exceptions.DeleteConflictException, match="attached to entities"):
        iam.delete_policy(PolicyArn=policy)
    assert load_template(PROJECT_TEMPLATE)["Resources"]["NodeRoles"]["DependsOn"] == "NodePolicy"
    cleanup = stack.resources["NodeRoles"]
    answer = custom_resource_request(cloud.client, stack.resources["StackCleanupFunction"].arn, "Delete",
                                     f"arn:aws:cloudformation:{cloud.region}:{cloud.account_id}:stack/{stack.stack_name}/x",
                                     "NodeRoles", {}, physical_id=cleanup.physical_id)
    assert answer["Status"] == "SUCCESS", answer
    path = node_role_path(stack.stack_name)
    assert iam.list_roles(PathPrefix=path)["Roles"] == iam.list_instance_profiles(PathPrefix=path)["InstanceProfiles"] == []
    assert [profile["InstanceProfileName"] for profile in iam.list_instance_profiles(
        PathPrefix="/elsewhere/")["InstanceProfiles"]] == [f"{STACKS}elsewhere"]
    iam.delete_policy(PolicyArn=policy)  # what CloudFormation deletes next


# --- the command ----------------------------------------------------------------------------

@pytest.mark.slow
def test_local_deploy_command_prints_a_summary_and_the_outputs_or_every_resource_as_json(cloud, capsys):
    from trainfleet.cli import main

    code = main(["local", "deploy", "--template", str(TEST_TEMPLATE), "--endpoint", cloud.endpoint,
                 "--stack", f"{STACKS}cli", "--param", "Stage=prod", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == 0
    assert printed["stack_name"] == f"{STACKS}cli"
    assert printed["resources"]["TrainingRun"]["resource_type"] == "AWS::StepFunctions::StateMachine"
    assert printed["outputs"]["StateMachineArn"] == printed["resources"]["TrainingRun"]["arn"]
    assert printed["skipped"] == {}

    assert main(["local", "deploy", "--template", str(TEST_TEMPLATE), "--endpoint", cloud.endpoint,
                 "--stack", f"{STACKS}cli-summary", "--param", "Stage=prod"]) == 0
    summary = capsys.readouterr().out.splitlines()
    assert summary[0].startswith(f"deployed stack {STACKS}cli-summary in us-east-1: {len(printed['resources'])} "
                                 "resources (") and "StepFunctions::StateMachine" in summary[0]
    assert len(summary) == 1 + len(printed["outputs"]) and all(len(line) < 200 for line in summary[1:])
    assert summary[1:] and all(line.split()[0] in printed["outputs"] for line in summary[1:])


def test_local_deploy_command_names_a_bad_parameter(cloud, capsys):
    from trainfleet.cli import main

    code = main(["local", "deploy", "--template", str(TEST_TEMPLATE), "--endpoint", cloud.endpoint,
                 "--param", "Stage=staging"])
    assert code == 1
    assert "'Stage'='staging' is not one of AllowedValues ['dev', 'prod']" in capsys.readouterr().err
