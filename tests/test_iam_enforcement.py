"""The local cloud enforces IAM: a role's credentials get what its policies allow and a denial
names the role, the action and the resource, as AWS's does."""

import json
import uuid
from datetime import datetime, timezone
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from localcloud.glue import iam as iam_glue

REPO = Path(__file__).resolve().parent.parent
TRUST_EC2 = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


@pytest.fixture
def enforced(local_cloud):
    iam_glue.enforce(True)
    yield local_cloud
    iam_glue.enforce(False)


def role_with(cloud, statements: list[dict]) -> str:
    name = f"role-{uuid.uuid4().hex[:8]}"
    iam = cloud.client("iam")
    arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(TRUST_EC2))["Role"]["Arn"]
    iam.put_role_policy(RoleName=name, PolicyName="p", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": statements}))
    return arn


def client_as(cloud, role_arn: str, service: str, session: str = "node", instance_arn: str | None = None):
    credentials = iam_glue.role_credentials(cloud.account_id, cloud.region, role_arn, session, instance_arn)
    return boto3.client(service, endpoint_url=cloud.endpoint, region_name=cloud.region,
                        aws_access_key_id=credentials["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
                        aws_session_token=credentials["AWS_SESSION_TOKEN"])


def test_a_role_gets_what_its_policy_allows_and_a_denial_names_role_action_and_resource(enforced):
    cloud = enforced
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    admin = cloud.client("s3")
    admin.create_bucket(Bucket=bucket)
    admin.put_object(Bucket=bucket, Key="runs/x", Body=b"1")
    admin.put_object(Bucket=bucket, Key="artifacts/w.whl", Body=b"2")
    role = role_with(cloud, [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/runs/*"}])
    s3 = client_as(cloud, role, "s3")
    assert s3.get_object(Bucket=bucket, Key="runs/x")["Body"].read() == b"1"
    with pytest.raises(ClientError) as denied:
        s3.get_object(Bucket=bucket, Key="artifacts/w.whl")
    error = denied.value.response["Error"]
    assert error["Code"] == "AccessDenied"
    role_name = role.rsplit("/", 1)[1]
    assert error["Message"] == (
        f"User: arn:aws:sts::{cloud.account_id}:assumed-role/{role_name}/node is not authorized to perform: "
        f"s3:GetObject on resource: arn:aws:s3:::{bucket}/artifacts/w.whl because no identity-based "
        f"policy allows the s3:GetObject action")


def test_a_session_of_a_deleted_role_is_denied(enforced):
    """A node's credentials outlive its run's role (Teardown deletes it while the instance shuts
    down): AWS denies their requests; moto failed them with IAM's NoSuchEntity."""
    cloud = enforced
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    cloud.client("s3").create_bucket(Bucket=bucket)
    role = role_with(cloud, [{"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"}])
    s3 = client_as(cloud, role, "s3", session="gone")
    assert s3.list_objects_v2(Bucket=bucket)["KeyCount"] == 0
    iam, name = cloud.client("iam"), role.rsplit("/", 1)[1]
    iam.delete_role_policy(RoleName=name, PolicyName="p")
    iam.delete_role(RoleName=name)
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.list_objects_v2(Bucket=bucket)


def test_deleting_several_objects_needs_delete_on_each_object_not_on_the_bucket(enforced):
    """DeleteObjects (what a trainer's checkpoint clean-up sends) is authorized per object key."""
    cloud = enforced
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    admin = cloud.client("s3")
    admin.create_bucket(Bucket=bucket)
    for key in ("runs/r/step-1/a", "runs/r/step-1/b", "artifacts/w.whl"):
        admin.put_object(Bucket=bucket, Key=key, Body=b"x")
    role = role_with(cloud, [{"Effect": "Allow", "Action": "s3:DeleteObject",
                              "Resource": f"arn:aws:s3:::{bucket}/runs/*"}])
    s3 = client_as(cloud, role, "s3")
    answer = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "runs/r/step-1/a"},
                                                                  {"Key": "runs/r/step-1/b"}]})
    assert sorted(deleted["Key"] for deleted in answer["Deleted"]) == ["runs/r/step-1/a", "runs/r/step-1/b"]
    with pytest.raises(ClientError, match=f"s3:DeleteObject on resource: arn:aws:s3:::{bucket}/artifacts/w.whl"):
        s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": "artifacts/w.whl"}]})
    assert [item["Key"] for item in admin.list_objects_v2(Bucket=bucket)["Contents"]] == ["artifacts/w.whl"]


def new_table(cloud) -> str:
    """A new on-demand table keyed by "pk"; its name."""
    table = f"t-{uuid.uuid4().hex[:8]}"
    cloud.client("dynamodb").create_table(
        TableName=table, BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[{"AttributeName": "pk", "AttributeType": "S"}],
        KeySchema=[{"AttributeName": "pk", "KeyType": "HASH"}])
    return table


def test_resources_and_condition_keys_are_derived_from_the_request(enforced):
    cloud = enforced
    table = new_table(cloud)
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    cloud.client("s3").create_bucket(Bucket=bucket)
    table_arn = f"arn:aws:dynamodb:{cloud.region}:{cloud.account_id}:table/{table}"
    role = role_with(cloud, [
        {"Effect": "Allow", "Action": "dynamodb:GetItem", "Resource": table_arn},
        {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
         "Condition": {"StringLike": {"s3:prefix": ["runs/*"]}}},
        {"Effect": "Allow", "Action": "events:PutEvents", "Resource": f"arn:aws:events:{cloud.region}:{cloud.account_id}:event-bus/default",
         "Condition": {"StringEquals": {"events:source": "trainfleet"}}},
    ])
    dynamodb, s3, events = (client_as(cloud, role, service) for service in ("dynamodb", "s3", "events"))
    dynamodb.get_item(TableName=table, Key={"pk": {"S": "x"}})
    with pytest.raises(ClientError, match="dynamodb:PutItem on resource: " + table_arn):
        dynamodb.put_item(TableName=table, Item={"pk": {"S": "x"}})
    s3.list_objects_v2(Bucket=bucket, Prefix="runs/r/")
    with pytest.raises(ClientError, match="AccessDenied"):
        s3.list_objects_v2(Bucket=bucket, Prefix="artifacts/")
    events.put_events(Entries=[{"Source": "trainfleet", "DetailType": "NodeReady", "Detail": "{}"}])
    with pytest.raises(ClientError, match="events:PutEvents on resource: .*event-bus/default"):
        events.put_events(Entries=[{"Source": "aws.ec2", "DetailType": "NodeReady", "Detail": "{}"}])


def test_a_transaction_is_authorized_per_item_action_on_its_table(enforced):
    """TransactWriteItems has no IAM action of its own: each item needs PutItem, UpdateItem,
    DeleteItem or ConditionCheckItem on its table."""
    cloud = enforced
    table = new_table(cloud)
    table_arn = f"arn:aws:dynamodb:{cloud.region}:{cloud.account_id}:table/{table}"
    role = role_with(cloud, [{"Effect": "Allow", "Action": ["dynamodb:PutItem", "dynamodb:UpdateItem"],
                              "Resource": table_arn}])
    dynamodb = client_as(cloud, role, "dynamodb")
    put = {"Put": {"TableName": table, "Item": {"pk": {"S": "node"}}}}
    add = {"Update": {"TableName": table, "Key": {"pk": {"S": "count"}}, "UpdateExpression": "ADD n :one",
                      "ExpressionAttributeValues": {":one": {"N": "1"}}}}
    dynamodb.transact_write_items(TransactItems=[put, add])
    check = {"ConditionCheck": {"TableName": table, "Key": {"pk": {"S": "node"}},
                                "ConditionExpression": "attribute_exists(pk)"}}
    with pytest.raises(ClientError, match="dynamodb:ConditionCheckItem on resource: " + table_arn):
        dynamodb.transact_write_items(TransactItems=[add, check])
    counted = cloud.client("dynamodb").get_item(TableName=table, Key={"pk": {"S": "count"}})["Item"]
    assert counted["n"] == {"N": "1"}, "the refused transaction wrote nothing"


def test_the_harness_keeps_an_administrator_and_unknown_keys_are_refused(enforced):
    cloud = enforced
    cloud.client("iam").list_roles()
    cloud.client("s3").list_buckets()
    stranger = boto3.client("s3", endpoint_url=cloud.endpoint, region_name=cloud.region,
                            aws_access_key_id="AKIAUNKNOWN000000000", aws_secret_access_key="x")
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        stranger.list_buckets()


TRUST_LAMBDA = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


def test_each_lambda_function_runs_with_its_execution_roles_credentials(enforced):
    from localcloud_helpers import HANDLERS_MODULE, handlers_zip, unique

    cloud = enforced
    bucket = f"b-{uuid.uuid4().hex[:8]}"
    cloud.client("s3").create_bucket(Bucket=bucket)
    for key in ("runs/x", "artifacts/w.whl"):
        cloud.client("s3").put_object(Bucket=bucket, Key=key, Body=key.encode())
    iam, functions = cloud.client("iam"), {}
    for prefix in ("runs", "artifacts"):
        role = iam.create_role(RoleName=unique(f"fn-{prefix}"), AssumeRolePolicyDocument=json.dumps(TRUST_LAMBDA))["Role"]
        iam.put_role_policy(RoleName=role["RoleName"], PolicyName="p", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": "s3:GetObject", "Resource": f"arn:aws:s3:::{bucket}/{prefix}/*"}]}))
        name = unique(f"read-{prefix}")
        cloud.client("lambda").create_function(
            FunctionName=name, Runtime="python3.11", Role=role["Arn"], Handler=f"{HANDLERS_MODULE}.read_objects",
            Code={"ZipFile": handlers_zip()}, Timeout=10)
        functions[prefix] = (name, role["RoleName"])
    event = json.dumps({"bucket": bucket, "keys": ["runs/x", "artifacts/w.whl"]})
    # Each function makes its own module-level client, from the one boto3 default session of the
    # process (first resolved by the harness); each still signs with its own role.
    outcomes = {prefix: json.loads(cloud.client("lambda").invoke(FunctionName=name, Payload=event)["Payload"].read())
                for prefix, (name, _) in functions.items()}
    runs_role, artifacts_role = functions["runs"][1], functions["artifacts"][1]
    assert outcomes["runs"]["runs/x"] == "runs/x"
    assert outcomes["runs"]["artifacts/w.whl"].startswith(f"User: arn:aws:sts::{cloud.account_id}:assumed-role/{runs_role}/")
    assert outcomes["artifacts"]["artifacts/w.whl"] == "artifacts/w.whl"
    assert f"assumed-role/{artifacts_role}/" in outcomes["artifacts"]["runs/x"]


def test_an_instance_profiles_requests_carry_the_instance_so_a_policy_can_name_it(enforced):
    """ec2:SourceInstanceARN, as a policy variable: each instance may put events under its own
    ARN only (the node role's rule); a session that is no instance's has no such key."""
    cloud = enforced
    bus = f"arn:aws:events:{cloud.region}:{cloud.account_id}:event-bus/default"
    role = role_with(cloud, [{"Effect": "Allow", "Action": "events:PutEvents", "Resource": bus,
                              "Condition": {"StringEquals": {"events:source": "trainfleet/${ec2:SourceInstanceARN}"}}}])
    mine, theirs = (f"arn:aws:ec2:{cloud.region}:{cloud.account_id}:instance/i-0{n}" for n in "ab")
    events = client_as(cloud, role, "events", session="i-0a", instance_arn=mine)
    events.put_events(Entries=[{"Source": f"trainfleet/{mine}", "DetailType": "NodeReady", "Detail": "{}"}])
    for source in (f"trainfleet/{theirs}", "trainfleet/${ec2:SourceInstanceARN}", "trainfleet"):
        with pytest.raises(ClientError, match="not authorized to perform: events:PutEvents"):
            events.put_events(Entries=[{"Source": source, "DetailType": "NodeReady", "Detail": "{}"}])
    not_an_instance = client_as(cloud, role, "events", session="operator")
    with pytest.raises(ClientError, match="not authorized to perform: events:PutEvents"):
        not_an_instance.put_events(Entries=[{"Source": f"trainfleet/{mine}", "DetailType": "NodeReady", "Detail": "{}"}])


def test_a_node_writes_its_own_liveness_record_and_no_peers(enforced):
    """NodePolicy's liveness statement, as template.yaml has it, on a table keyed as the template's:
    a node's record is keyed by its own instance's ARN, so a node of the run cannot overwrite a
    peer's (a forged record could get the peer blamed and terminated)."""
    from localcloud.deploy import load_template
    from localcloud_helpers import table_from_template
    from trainfleet.adapters.liveness import read_liveness, write_liveness
    from trainfleet.core.records import NodeLiveness

    cloud = enforced
    table = table_from_template(cloud.client("dynamodb"), "LivenessTable")
    table_arn = f"arn:aws:dynamodb:{cloud.region}:{cloud.account_id}:table/{table}"
    document = load_template(REPO / "template.yaml")["Resources"]["NodePolicy"]["Properties"]["PolicyDocument"]
    (statement,) = [dict(statement, Resource=table_arn) for statement in document["Statement"]
                    if statement["Resource"] == {"Fn::GetAtt": ["LivenessTable", "Arn"]}]
    role = role_with(cloud, [statement])
    cloud.client("iam").tag_role(RoleName=role.rsplit("/", 1)[1], Tags=[{"Key": "trainfleet:run", "Value": "r"}])
    mine, peer = (f"arn:aws:ec2:{cloud.region}:{cloud.account_id}:instance/i-0{n}" for n in "ab")
    node = client_as(cloud, role, "dynamodb", session="i-0a", instance_arn=mine)
    record = NodeLiveness(instance_id="i-0a", attempt=0, reported_at=datetime.now(timezone.utc))
    write_liveness(node, table, "r", mine, record)
    for run, instance in (("r", peer), ("other", mine)):
        with pytest.raises(ClientError, match="not authorized to perform: dynamodb:PutItem"):
            write_liveness(node, table, run, instance, record.model_copy(update={"instance_id": "i-0b"}))
    assert read_liveness(cloud.client("dynamodb"), table, "r", [mine, peer]) == [record]
    with pytest.raises(ClientError, match="not authorized to perform: dynamodb:BatchGetItem"):
        read_liveness(node, table, "r", [mine])  # reading is Recover's


def test_a_resumed_runs_nodes_read_the_old_runs_checkpoints_and_cannot_write_or_delete_them(enforced):
    """The template's NodePolicy on a run's node role (trainfleet.adapters.node_roles): tagged with
    the run it resumes, its nodes read that run's checkpoints and change nothing of them; a node
    of a run that resumes none reads nothing of it."""
    from test_iam_policies import BUCKET, STACK, rendered_template
    from trainfleet.adapters.node_roles import ensure_node_profile, node_role_name

    cloud = enforced
    admin, iam = cloud.client("s3"), cloud.client("iam")
    admin.create_bucket(Bucket=BUCKET)
    step = "runs/old-run/checkpoints/step-000000040"
    for key in (f"{step}/commit.json", "runs/old-run/checkpoints/shards-3/step-000000040/__3_0.distcp",
                "runs/old-run/launch-spec.json"):
        admin.put_object(Bucket=BUCKET, Key=key, Body=b"{}")
    document = rendered_template()["NodePolicy"]["Properties"]["PolicyDocument"]
    policy = iam.create_policy(PolicyName=f"nodes-{uuid.uuid4().hex[:6]}", PolicyDocument=json.dumps(document))
    run = f"new-{uuid.uuid4().hex[:6]}"
    ensure_node_profile(iam, run, STACK, policy["Policy"]["Arn"], resume_from="old-run")
    ensure_node_profile(iam, f"{run}-x", STACK, policy["Policy"]["Arn"])
    resumed, unrelated = (client_as(cloud, f"arn:aws:iam::{cloud.account_id}:role/trainfleet/{STACK}/"
                                           f"{node_role_name(name, STACK)}", "s3") for name in (run, f"{run}-x"))

    listed = resumed.list_objects_v2(Bucket=BUCKET, Prefix="runs/old-run/checkpoints/")["Contents"]
    assert len(listed) == 2
    assert resumed.get_object(Bucket=BUCKET, Key=f"{step}/commit.json")["Body"].read() == b"{}"
    for denied in (lambda: resumed.put_object(Bucket=BUCKET, Key=f"{step}/commit.json", Body=b"x"),
                   lambda: resumed.delete_object(Bucket=BUCKET, Key=f"{step}/commit.json"),
                   lambda: resumed.get_object(Bucket=BUCKET, Key="runs/old-run/launch-spec.json"),
                   lambda: unrelated.get_object(Bucket=BUCKET, Key=f"{step}/commit.json"),
                   lambda: unrelated.list_objects_v2(Bucket=BUCKET, Prefix="runs/old-run/checkpoints/")):
        with pytest.raises(ClientError, match="AccessDenied"):
            denied()
    resumed.put_object(Bucket=BUCKET, Key=f"runs/{run}/checkpoints/step-000000050/commit.json", Body=b"{}")


def test_a_teardown_that_meets_another_finds_what_it_deletes_gone_and_is_done(enforced):
    """The reaper's schedule and an execution's status event may reap one run at once. Under the
    stack's policies (deletion allowed on the resource's stack tag), EC2 answers the second
    deletion of a launch template or placement group UnauthorizedOperation: there is no tag left
    to read. The teardown that comes second is done all the same."""
    from test_iam_policies import STACK, policies, rendered_template

    from trainfleet.adapters.ec2_fleet import (TAG_RUN, TAG_STACK, Teardown, ensure_placement_group,
                                               placement_group_name, teardown)

    cloud = enforced
    reaper = role_with(cloud, [statement for policy in policies(rendered_template(), "ReaperFunctionRole")
                               for statement in policy["Statement"] if statement["Action"] != "sts:AssumeRole"])
    admin, run = cloud.client("ec2"), f"run-{uuid.uuid4().hex[:8]}"
    group = placement_group_name(run, STACK, "us-east-1a")
    ensure_placement_group(admin, group, run, STACK)
    admin.create_launch_template(LaunchTemplateName=f"{run}-nodes", LaunchTemplateData={"InstanceType": "p5.48xlarge"},
                                 TagSpecifications=[{"ResourceType": "launch-template", "Tags": [
                                     {"Key": TAG_RUN, "Value": run}, {"Key": TAG_STACK, "Value": STACK}]}])
    ec2 = client_as(cloud, reaper, "ec2", session="reaper")
    # The other teardown deletes each just before this one's request reaches EC2 (a handler of
    # before-call that returned something would answer the call in EC2's place).
    def other_teardown_first(delete):
        def before_call(**_) -> None:
            delete()
        return before_call

    ec2.meta.events.register("before-call.ec2.DeleteLaunchTemplate", other_teardown_first(
        lambda: admin.delete_launch_template(LaunchTemplateName=f"{run}-nodes")))
    ec2.meta.events.register("before-call.ec2.DeletePlacementGroup", other_teardown_first(
        lambda: admin.delete_placement_group(GroupName=group)), unique_id="other")

    assert teardown(ec2, run, STACK) == Teardown(terminated=[], placement_groups_in_use=[])
    ec2.meta.events.unregister("before-call.ec2.DeletePlacementGroup", unique_id="other")
    with pytest.raises(ClientError) as gone:
        ec2.delete_placement_group(GroupName=group)
    assert gone.value.response["Error"]["Code"] == "UnauthorizedOperation", "as AWS answers it"
