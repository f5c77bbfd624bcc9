"""How each CloudFormation resource type is created through the AWS APIs of the local cloud.

One function per type, registered with the properties it understands. `localcloud.deploy`
checks every resource of a template against this table before creating anything, so a type
or a property that the local deploy cannot honour is reported up front instead of dropped.
Each function receives properties with intrinsics already resolved, calls boto3, and returns
what Ref and Fn::GetAtt give for the new resource (as the CloudFormation resource reference
documents them).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import secrets
import string
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

__all__ = ["Created", "ResourceType", "RESOURCE_TYPES", "physical_name", "custom_resource_request"]


@dataclass(frozen=True)
class Created:
    """One created resource."""

    physical_id: str
    """What Ref returns for it (a name, an id or an ARN, depending on the type)."""
    arn: str | None
    """Its ARN, where the type has one."""
    attributes: dict[str, Any]
    """What Fn::GetAtt returns for it, by attribute name."""


@dataclass(frozen=True)
class Context:
    """What a create function needs besides the resource's own properties."""

    client: Callable[[str], Any]
    """boto3 client factory bound to the local endpoint and region."""
    region: str
    """The stack's region."""
    account_id: str
    """The local cloud's account id."""
    stack_name: str
    """The stack's name, used in generated physical names."""
    logical_id: str
    """The resource's logical id, used in generated physical names."""

    def name(self, max_length: int, lowercase: bool = False) -> str:
        """A generated physical name, as CloudFormation makes one when the template gives none."""
        return physical_name(self.stack_name, self.logical_id, max_length, lowercase)

    def arn(self, service: str, resource: str, region: bool = True, account: bool = True) -> str:
        return (f"arn:aws:{service}:{self.region if region else ''}:"
                f"{self.account_id if account else ''}:{resource}")


@dataclass(frozen=True)
class ResourceType:
    """How one resource type is created."""

    create: Callable[[Context, dict[str, Any]], Created]
    """Creates the resource from its resolved properties."""
    properties: frozenset[str]
    """Properties this function honours; any other is refused before anything is created."""
    required: frozenset[str]
    """Properties without which the resource cannot be created (checked before anything is)."""
    inert: frozenset[str] = frozenset()
    """Properties accepted although they change nothing in the local cloud (each type says why);
    they are not applied."""

    @property
    def accepted(self) -> frozenset[str]:
        return self.properties | self.inert


RESOURCE_TYPES: dict[str, ResourceType] = {}


def physical_name(stack_name: str, logical_id: str, max_length: int, lowercase: bool = False) -> str:
    """`{stack}-{logical id}-{random}` cut to fit `max_length`, like CloudFormation's names."""
    alphabet = (string.ascii_lowercase if lowercase else string.ascii_uppercase) + string.digits
    suffix = "".join(secrets.choice(alphabet) for _ in range(12))
    room = max_length - len(suffix) - 2
    stack_part = stack_name[: room // 2]
    logical_part = logical_id[: room - len(stack_part)]
    name = f"{stack_part}-{logical_part}-{suffix}"
    return name.lower() if lowercase else name


def _resource(type_name: str, *properties: str, required: tuple[str, ...] = (), inert: tuple[str, ...] = ()) -> Callable:
    def register(create: Callable[[Context, dict[str, Any]], Created]) -> Callable:
        RESOURCE_TYPES[type_name] = ResourceType(create, frozenset(properties) | set(required), frozenset(required),
                                                 frozenset(inert))
        return create

    return register


def _as_json(document: Any) -> str:
    return document if isinstance(document, str) else json.dumps(document)


def _iam_policy_json(document: Any) -> str:
    """An IAM policy document as JSON. IAM takes a document without Version (as 2008-10-17);
    moto refuses it, and SAM's policy templates have none. They use no policy variables, the
    one thing that differs between the versions, so the current version is stamped on."""
    if isinstance(document, dict) and "Version" not in document:
        document = {"Version": "2012-10-17", **document}
    return _as_json(document)


def _tag_list(tags: list[dict[str, str]] | None) -> list[dict[str, str]]:
    return [{"Key": tag["Key"], "Value": tag["Value"]} for tag in tags or []]


def _tag_dict(tags: list[dict[str, str]] | dict[str, str] | None) -> dict[str, str]:
    # SAM writes some Tags as a map, CloudFormation types as a Key/Value list.
    if isinstance(tags, dict):
        return dict(tags)
    return {tag["Key"]: tag["Value"] for tag in tags or []}


def _pick(props: Mapping[str, Any], *names: str) -> dict[str, Any]:
    """The properties among `names` that the template sets (API and CloudFormation spell them alike)."""
    return {name: props[name] for name in names if name in props}


# --- IAM ------------------------------------------------------------------------------------

@_resource("AWS::IAM::Role", "RoleName", "AssumeRolePolicyDocument", "Description", "ManagedPolicyArns",
           "MaxSessionDuration", "Path", "PermissionsBoundary", "Policies", "Tags",
           required=("AssumeRolePolicyDocument",))
def _role(ctx: Context, props: dict[str, Any]) -> Created:
    iam = ctx.client("iam")
    name = props.get("RoleName") or ctx.name(64)
    role = iam.create_role(
        RoleName=name, AssumeRolePolicyDocument=_iam_policy_json(props["AssumeRolePolicyDocument"]),
        Tags=_tag_list(props.get("Tags")),
        **_pick(props, "Description", "MaxSessionDuration", "Path", "PermissionsBoundary"))["Role"]
    for policy_arn in props.get("ManagedPolicyArns", []):
        _attach_role_policy(iam, name, policy_arn)
    for policy in props.get("Policies", []):
        iam.put_role_policy(RoleName=name, PolicyName=policy["PolicyName"],
                            PolicyDocument=_iam_policy_json(policy["PolicyDocument"]))
    return Created(name, role["Arn"], {"Arn": role["Arn"], "RoleId": role["RoleId"]})


def _attach_role_policy(iam: Any, role_name: str, policy_arn: str) -> None:
    try:
        iam.attach_role_policy(RoleName=role_name, PolicyArn=policy_arn)
    except ClientError as error:
        if error.response["Error"]["Code"] == "NoSuchEntity" and policy_arn.startswith("arn:aws:iam::aws:policy/"):
            raise RuntimeError(
                f"AWS managed policy {policy_arn} is unknown to the local IAM: start the local cloud with "
                f"MOTO_IAM_LOAD_MANAGED_POLICIES=true so that it knows AWS's managed policies") from error
        raise


@_resource("AWS::IAM::Policy", "PolicyName", "PolicyDocument", "Roles", "Users", "Groups",
           required=("PolicyName", "PolicyDocument"))
def _inline_policy(ctx: Context, props: dict[str, Any]) -> Created:
    iam = ctx.client("iam")
    document = _iam_policy_json(props["PolicyDocument"])
    name = props["PolicyName"]
    for role in props.get("Roles", []):
        iam.put_role_policy(RoleName=role, PolicyName=name, PolicyDocument=document)
    for user in props.get("Users", []):
        iam.put_user_policy(UserName=user, PolicyName=name, PolicyDocument=document)
    for group in props.get("Groups", []):
        iam.put_group_policy(GroupName=group, PolicyName=name, PolicyDocument=document)
    return Created(name, None, {})


@_resource("AWS::IAM::ManagedPolicy", "ManagedPolicyName", "PolicyDocument", "Description", "Path",
           "Roles", "Users", "Groups", required=("PolicyDocument",))
def _managed_policy(ctx: Context, props: dict[str, Any]) -> Created:
    iam = ctx.client("iam")
    policy = iam.create_policy(PolicyName=props.get("ManagedPolicyName") or ctx.name(128),
                               PolicyDocument=_iam_policy_json(props["PolicyDocument"]),
                               **_pick(props, "Description", "Path"))["Policy"]
    arn = policy["Arn"]
    for role in props.get("Roles", []):
        iam.attach_role_policy(RoleName=role, PolicyArn=arn)
    for user in props.get("Users", []):
        iam.attach_user_policy(UserName=user, PolicyArn=arn)
    for group in props.get("Groups", []):
        iam.attach_group_policy(GroupName=group, PolicyArn=arn)
    return Created(arn, arn, {"PolicyArn": arn, "PolicyId": policy["PolicyId"]})


@_resource("AWS::IAM::InstanceProfile", "InstanceProfileName", "Path", "Roles", required=("Roles",))
def _instance_profile(ctx: Context, props: dict[str, Any]) -> Created:
    iam = ctx.client("iam")
    name = props.get("InstanceProfileName") or ctx.name(128)
    profile = iam.create_instance_profile(InstanceProfileName=name, **_pick(props, "Path"))["InstanceProfile"]
    for role in props["Roles"]:
        iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=role)
    return Created(name, profile["Arn"], {"Arn": profile["Arn"]})


# --- Lambda ---------------------------------------------------------------------------------

LAMBDA_INERT_PROPERTIES = ("RuntimeManagementConfig", "SnapStart", "RecursiveLoop")
"""AWS::Lambda::Function properties that change nothing in a local run, accepted and not applied:
RuntimeManagementConfig chooses when Lambda moves a function to a new runtime version (the
local interpreter is the one installed); SnapStart snapshots the initialised environment of
published versions (the local deploy publishes none); RecursiveLoop chooses whether Lambda stops
a function invoking itself in a loop through SQS, SNS or S3 (the local cloud detects no loops
either way). Of LoggingConfig, LogGroup is honoured and LogFormat and the log levels are not:
the local runtime writes text lines whatever they say."""


@_resource("AWS::Lambda::Function", "FunctionName", "Handler", "Runtime", "Role", "Code", "Timeout",
           "MemorySize", "Environment", "Description", "Tags", "Architectures", "TracingConfig", "Layers",
           "EphemeralStorage", "LoggingConfig", "PackageType", "DeadLetterConfig", "KmsKeyArn", "VpcConfig",
           "ReservedConcurrentExecutions", required=("Code", "Role"), inert=LAMBDA_INERT_PROPERTIES)
def _function(ctx: Context, props: dict[str, Any]) -> Created:
    lam = ctx.client("lambda")
    code = dict(props["Code"])
    if "ZipFile" in code:  # inline source: CloudFormation packages it as index.<ext>
        code["ZipFile"] = _inline_zip(code["ZipFile"], props.get("Runtime", ""))
    function = lam.create_function(
        FunctionName=props.get("FunctionName") or ctx.name(64), Code=code, Tags=_tag_dict(props.get("Tags")),
        **_pick(props, "Handler", "Runtime", "Role", "Timeout", "MemorySize", "Environment", "Description",
                "Architectures", "TracingConfig", "Layers", "EphemeralStorage", "LoggingConfig", "PackageType",
                "DeadLetterConfig", "KmsKeyArn", "VpcConfig"))
    name = function["FunctionName"]
    if "ReservedConcurrentExecutions" in props:
        lam.put_function_concurrency(FunctionName=name,
                                     ReservedConcurrentExecutions=int(props["ReservedConcurrentExecutions"]))
    return Created(name, function["FunctionArn"], {"Arn": function["FunctionArn"]})


def custom_resource_request(client: Callable[[str], Any], service_token: str, request_type: str, stack_id: str,
                            logical_id: str, properties: Mapping[str, Any], physical_id: str | None = None,
                            responses_bucket: str | None = None) -> dict[str, Any]:
    """What CloudFormation does with a custom resource: invoke its function with the request,
    which answers by a PUT to the pre-signed ResponseURL; the answer (Status, Reason, ...). A
    function that answers nothing fails the request (CloudFormation waits an hour, then fails)."""
    s3, lam = client("s3"), client("lambda")
    bucket = responses_bucket or f"cfn-responses-{hashlib.sha256(stack_id.encode()).hexdigest()[:16]}"
    try:
        s3.create_bucket(Bucket=bucket)
    except (s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
        pass
    request_id = secrets.token_hex(16)
    key = f"{logical_id}/{request_id}"
    event = {"RequestType": request_type, "ServiceToken": service_token, "StackId": stack_id, "RequestId": request_id,
             "LogicalResourceId": logical_id, "ResourceType": "AWS::CloudFormation::CustomResource",
             "ResourceProperties": dict(properties), "ResponseURL": s3.generate_presigned_url(
                 "put_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=7200)}
    if physical_id is not None:
        event["PhysicalResourceId"] = physical_id
    invoked = lam.invoke(FunctionName=service_token, Payload=json.dumps(event).encode())
    try:
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        raise RuntimeError(f"the custom resource's function answered no {request_type} request: "
                           f"{invoked['Payload'].read().decode(errors='replace')[:500]}") from None


@_resource("AWS::CloudFormation::CustomResource", "ServiceToken", required=("ServiceToken",))
def _custom_resource(ctx: Context, props: dict[str, Any]) -> Created:
    stack_id = ctx.arn("cloudformation", f"stack/{ctx.stack_name}")
    answer = custom_resource_request(ctx.client, props["ServiceToken"], "Create", stack_id, ctx.logical_id, props)
    if answer.get("Status") != "SUCCESS":
        raise RuntimeError(f"its function answered {answer.get('Status')}: {answer.get('Reason')}")
    return Created(answer.get("PhysicalResourceId") or ctx.name(64), None, dict(answer.get("Data") or {}))


def _inline_zip(source: str, runtime: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("index.py" if runtime.startswith("python") else "index.js", source)
    return buffer.getvalue()


@_resource("AWS::Lambda::LayerVersion", "LayerName", "Content", "Description", "CompatibleRuntimes",
           "CompatibleArchitectures", "LicenseInfo", required=("Content",))
def _layer_version(ctx: Context, props: dict[str, Any]) -> Created:
    layer = ctx.client("lambda").publish_layer_version(
        LayerName=props.get("LayerName") or ctx.name(64), Content=props["Content"],
        **_pick(props, "Description", "CompatibleRuntimes", "CompatibleArchitectures", "LicenseInfo"))
    arn = layer["LayerVersionArn"]
    return Created(arn, arn, {"LayerVersionArn": arn})


@_resource("AWS::Lambda::EventInvokeConfig", "FunctionName", "Qualifier", "MaximumRetryAttempts",
           "MaximumEventAgeInSeconds", "DestinationConfig", required=("FunctionName", "Qualifier"))
def _event_invoke_config(ctx: Context, props: dict[str, Any]) -> Created:
    ctx.client("lambda").put_function_event_invoke_config(
        FunctionName=props["FunctionName"], Qualifier=props["Qualifier"],
        **{name: int(props[name]) for name in ("MaximumRetryAttempts", "MaximumEventAgeInSeconds") if name in props},
        **_pick(props, "DestinationConfig"))
    return Created(f"{props['FunctionName']}:{props['Qualifier']}", None, {})


@_resource("AWS::Lambda::EventSourceMapping", "EventSourceArn", "FunctionName", "BatchSize", "Enabled",
           "MaximumBatchingWindowInSeconds", "FunctionResponseTypes", "ScalingConfig",
           required=("EventSourceArn", "FunctionName"))
def _event_source_mapping(ctx: Context, props: dict[str, Any]) -> Created:
    mapping = ctx.client("lambda").create_event_source_mapping(
        **{name: int(props[name]) for name in ("BatchSize", "MaximumBatchingWindowInSeconds") if name in props},
        **_pick(props, "EventSourceArn", "FunctionName", "Enabled", "FunctionResponseTypes", "ScalingConfig"))
    arn = mapping["EventSourceMappingArn"]
    return Created(mapping["UUID"], arn, {"EventSourceMappingArn": arn})


@_resource("AWS::Lambda::Permission", "FunctionName", "Action", "Principal", "SourceArn", "SourceAccount",
           "EventSourceToken", "PrincipalOrgID", "FunctionUrlAuthType",
           required=("Action", "FunctionName", "Principal"))
def _permission(ctx: Context, props: dict[str, Any]) -> Created:
    statement_id = ctx.name(100)
    ctx.client("lambda").add_permission(StatementId=statement_id, **props)
    return Created(statement_id, None, {})


# --- Step Functions -------------------------------------------------------------------------

@_resource("AWS::StepFunctions::StateMachine", "StateMachineName", "StateMachineType", "RoleArn", "Definition",
           "DefinitionString", "DefinitionS3Location", "DefinitionSubstitutions", "LoggingConfiguration",
           "TracingConfiguration", "Tags", required=("RoleArn",))
def _state_machine(ctx: Context, props: dict[str, Any]) -> Created:
    definition = substitute_definition(_state_machine_definition(ctx, props),
                                       props.get("DefinitionSubstitutions", {}))
    machine = ctx.client("stepfunctions").create_state_machine(
        name=props.get("StateMachineName") or ctx.name(80), definition=definition, roleArn=props["RoleArn"],
        type=props.get("StateMachineType", "STANDARD"),
        tags=[{"key": tag["Key"], "value": tag["Value"]} for tag in props.get("Tags", [])],
        **{_camel(key): _camel_keys(props[key]) for key in ("LoggingConfiguration", "TracingConfiguration")
           if key in props})
    arn = machine["stateMachineArn"]
    return Created(arn, arn, {"Arn": arn, "Name": arn.rsplit(":", 1)[1]})


def _camel(name: str) -> str:
    return name[:1].lower() + name[1:]


def _camel_keys(value: Any) -> Any:
    """Step Functions' API spells CloudFormation's PascalCase keys in camelCase."""
    if isinstance(value, dict):
        return {_camel(key): _camel_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_camel_keys(item) for item in value]
    return value


def _state_machine_definition(ctx: Context, props: dict[str, Any]) -> str:
    given = [key for key in ("Definition", "DefinitionString", "DefinitionS3Location") if key in props]
    if len(given) != 1:
        raise ValueError(f"exactly one of Definition, DefinitionString, DefinitionS3Location is needed, got {given}")
    if "Definition" in props:
        return json.dumps(props["Definition"])
    if "DefinitionString" in props:
        return props["DefinitionString"]
    location = props["DefinitionS3Location"]
    extra = {"VersionId": location["Version"]} if "Version" in location else {}
    body = ctx.client("s3").get_object(Bucket=location["Bucket"], Key=location["Key"], **extra)["Body"]
    return body.read().decode()


def substitute_definition(definition: str, substitutions: Mapping[str, Any]) -> str:
    """Replace `${Name}` for each DefinitionSubstitutions key, as CloudFormation does.
    CloudFormation leaves a `${Name}` without a substitution in place, and the state machine
    then fails only when it reaches that state; here it is refused at deploy time instead."""
    for key, value in substitutions.items():
        text = json.dumps(value) if isinstance(value, bool) else str(value)
        definition = definition.replace("${" + key + "}", text)
    leftover = sorted(set(_placeholders(definition)))
    if leftover:
        raise ValueError(f"definition has placeholders without DefinitionSubstitutions: {leftover}")
    return definition


def _placeholders(definition: str) -> list[str]:
    # JSONata expressions use {% %} and intrinsics use States.Format('{}'), never "${...}".
    return re.findall(r"\$\{([A-Za-z0-9_.:-]+)\}", definition)


# --- EventBridge ----------------------------------------------------------------------------

@_resource("AWS::Events::EventBus", "Name", "Tags", required=("Name",))
def _event_bus(ctx: Context, props: dict[str, Any]) -> Created:
    bus = ctx.client("events").create_event_bus(Name=props["Name"], Tags=_tag_list(props.get("Tags")))
    return Created(props["Name"], bus["EventBusArn"], {"Arn": bus["EventBusArn"], "Name": props["Name"]})


@_resource("AWS::Events::Rule", "Name", "Description", "EventBusName", "EventPattern", "ScheduleExpression",
           "State", "RoleArn", "Targets")
def _rule(ctx: Context, props: dict[str, Any]) -> Created:
    events = ctx.client("events")
    name = props.get("Name") or ctx.name(64)
    bus = _pick(props, "EventBusName")
    if "EventPattern" in props:
        bus["EventPattern"] = _as_json(props["EventPattern"])
    rule = events.put_rule(Name=name, State=props.get("State", "ENABLED"), **bus,
                           **_pick(props, "Description", "ScheduleExpression", "RoleArn"))
    if props.get("Targets"):
        result = events.put_targets(Rule=name, Targets=props["Targets"], **_pick(props, "EventBusName"))
        if result["FailedEntryCount"]:
            raise ValueError(f"targets refused: {result['FailedEntries']}")
    # CloudFormation's Ref of a rule on another bus than the default is "bus|rule".
    on_bus = props.get("EventBusName", "default")
    physical_id = name if on_bus == "default" else f"{on_bus}|{name}"
    return Created(physical_id, rule["RuleArn"], {"Arn": rule["RuleArn"]})


# --- Storage --------------------------------------------------------------------------------

@_resource("AWS::DynamoDB::Table", "TableName", "KeySchema", "AttributeDefinitions", "BillingMode",
           "ProvisionedThroughput", "GlobalSecondaryIndexes", "LocalSecondaryIndexes", "StreamSpecification",
           "SSESpecification", "TimeToLiveSpecification", "PointInTimeRecoverySpecification", "Tags",
           "TableClass", "DeletionProtectionEnabled", required=("KeySchema",))
def _table(ctx: Context, props: dict[str, Any]) -> Created:
    dynamodb = ctx.client("dynamodb")
    request = _pick(props, "KeySchema", "AttributeDefinitions", "BillingMode", "ProvisionedThroughput",
                    "GlobalSecondaryIndexes", "LocalSecondaryIndexes", "TableClass", "DeletionProtectionEnabled")
    if "StreamSpecification" in props:
        request["StreamSpecification"] = {"StreamEnabled": True, **props["StreamSpecification"]}
    if "SSESpecification" in props:
        sse = props["SSESpecification"]
        request["SSESpecification"] = {"Enabled": sse.get("SSEEnabled", False), **_pick(sse, "SSEType", "KMSMasterKeyId")}
    name = props.get("TableName") or ctx.name(255)
    table = dynamodb.create_table(TableName=name, Tags=_tag_list(props.get("Tags")), **request)["TableDescription"]
    if "TimeToLiveSpecification" in props:
        dynamodb.update_time_to_live(TableName=name, TimeToLiveSpecification=props["TimeToLiveSpecification"])
    if "PointInTimeRecoverySpecification" in props:
        dynamodb.update_continuous_backups(
            TableName=name, PointInTimeRecoverySpecification=props["PointInTimeRecoverySpecification"])
    attributes = {"Arn": table["TableArn"]}
    if "LatestStreamArn" in table:
        attributes["StreamArn"] = table["LatestStreamArn"]
    return Created(name, table["TableArn"], attributes)


@_resource("AWS::S3::Bucket", "BucketName", "BucketEncryption", "PublicAccessBlockConfiguration",
           "VersioningConfiguration", "LifecycleConfiguration", "OwnershipControls", "NotificationConfiguration",
           "Tags")
def _bucket(ctx: Context, props: dict[str, Any]) -> Created:
    s3 = ctx.client("s3")
    name = props.get("BucketName") or ctx.name(63, lowercase=True)
    location = {} if ctx.region == "us-east-1" else {
        "CreateBucketConfiguration": {"LocationConstraint": ctx.region}}
    s3.create_bucket(Bucket=name, **location)
    if "PublicAccessBlockConfiguration" in props:
        s3.put_public_access_block(Bucket=name, PublicAccessBlockConfiguration=props["PublicAccessBlockConfiguration"])
    if "BucketEncryption" in props:
        s3.put_bucket_encryption(Bucket=name, ServerSideEncryptionConfiguration={
            "Rules": [encryption_rule(rule) for rule in props["BucketEncryption"]["ServerSideEncryptionConfiguration"]]})
    if "VersioningConfiguration" in props:
        s3.put_bucket_versioning(Bucket=name, VersioningConfiguration=props["VersioningConfiguration"])
    if "LifecycleConfiguration" in props:
        s3.put_bucket_lifecycle_configuration(Bucket=name, LifecycleConfiguration={
            "Rules": [lifecycle_rule(rule) for rule in props["LifecycleConfiguration"]["Rules"]]})
    if "OwnershipControls" in props:
        s3.put_bucket_ownership_controls(Bucket=name, OwnershipControls=props["OwnershipControls"])
    if "NotificationConfiguration" in props:
        s3.put_bucket_notification_configuration(Bucket=name, NotificationConfiguration=bucket_notifications(
            props["NotificationConfiguration"]))
    if "Tags" in props:
        s3.put_bucket_tagging(Bucket=name, Tagging={"TagSet": _tag_list(props["Tags"])})
    arn = ctx.arn("s3", name, region=False, account=False)
    return Created(name, arn, {"Arn": arn, "DomainName": f"{name}.s3.amazonaws.com",
                               "RegionalDomainName": f"{name}.s3.{ctx.region}.amazonaws.com"})


def encryption_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A CloudFormation bucket encryption rule in the PutBucketEncryption shape."""
    converted = _pick(rule, "BucketKeyEnabled")
    if "ServerSideEncryptionByDefault" in rule:
        converted["ApplyServerSideEncryptionByDefault"] = dict(rule["ServerSideEncryptionByDefault"])
    return converted


_LIFECYCLE_RULE_KEYS = {"Id", "Status", "Prefix", "ExpirationInDays", "NoncurrentVersionExpirationInDays",
                        "NoncurrentVersionExpiration", "AbortIncompleteMultipartUpload"}


def lifecycle_rule(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A CloudFormation lifecycle rule in the PutBucketLifecycleConfiguration shape."""
    unknown = sorted(set(rule) - _LIFECYCLE_RULE_KEYS)
    if unknown:
        raise ValueError(f"LifecycleConfiguration rule keys {unknown} are not supported locally "
                         f"(supported: {sorted(_LIFECYCLE_RULE_KEYS)})")
    converted: dict[str, Any] = {"Status": rule["Status"], "Filter": {"Prefix": rule.get("Prefix", "")},
                                 **_pick(rule, "AbortIncompleteMultipartUpload")}
    if "Id" in rule:
        converted["ID"] = rule["Id"]
    if "ExpirationInDays" in rule:
        converted["Expiration"] = {"Days": int(rule["ExpirationInDays"])}
    if "NoncurrentVersionExpirationInDays" in rule:
        converted["NoncurrentVersionExpiration"] = {"NoncurrentDays": int(rule["NoncurrentVersionExpirationInDays"])}
    if "NoncurrentVersionExpiration" in rule:
        converted["NoncurrentVersionExpiration"] = dict(rule["NoncurrentVersionExpiration"])
    return converted


def bucket_notifications(notification: Mapping[str, Any]) -> dict[str, Any]:
    """CloudFormation's NotificationConfiguration in the API shape (EventBridge delivery only)."""
    unknown = sorted(set(notification) - {"EventBridgeConfiguration"})
    if unknown:
        raise ValueError(f"NotificationConfiguration {unknown} not supported locally (only EventBridgeConfiguration)")
    enabled = notification.get("EventBridgeConfiguration", {}).get("EventBridgeEnabled", False)
    return {"EventBridgeConfiguration": {}} if enabled else {}


@_resource("AWS::S3::BucketPolicy", "Bucket", "PolicyDocument", required=("Bucket", "PolicyDocument"))
def _bucket_policy(ctx: Context, props: dict[str, Any]) -> Created:
    ctx.client("s3").put_bucket_policy(Bucket=props["Bucket"], Policy=_as_json(props["PolicyDocument"]))
    return Created(props["Bucket"], None, {})


@_resource("AWS::SQS::Queue", "QueueName", "DelaySeconds", "MessageRetentionPeriod", "VisibilityTimeout",
           "RedrivePolicy", "FifoQueue", "KmsMasterKeyId", "SqsManagedSseEnabled", "Tags")
def _queue(ctx: Context, props: dict[str, Any]) -> Created:
    sqs = ctx.client("sqs")
    fifo = str(props.get("FifoQueue", "")).lower() == "true"
    name = props.get("QueueName") or ctx.name(75 if fifo else 80) + (".fifo" if fifo else "")
    attributes = {key: _queue_attribute(value) for key, value in props.items() if key not in ("QueueName", "Tags")}
    url = sqs.create_queue(QueueName=name, Attributes=attributes, tags=_tag_dict(props.get("Tags")))["QueueUrl"]
    arn = ctx.arn("sqs", name)
    return Created(url, arn, {"Arn": arn, "QueueName": name, "QueueUrl": url})


def _queue_attribute(value: Any) -> str:
    # SQS takes every attribute as a string: booleans lower-case, documents as JSON.
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else json.dumps(value)


@_resource("AWS::SQS::QueuePolicy", "Queues", "PolicyDocument", required=("Queues", "PolicyDocument"))
def _queue_policy(ctx: Context, props: dict[str, Any]) -> Created:
    sqs = ctx.client("sqs")
    for queue_url in props["Queues"]:
        sqs.set_queue_attributes(QueueUrl=queue_url, Attributes={"Policy": _as_json(props["PolicyDocument"])})
    return Created(ctx.name(255), None, {})


@_resource("AWS::SNS::Topic", "TopicName", "DisplayName", "KmsMasterKeyId", "Tags")
def _topic(ctx: Context, props: dict[str, Any]) -> Created:
    attributes = _pick(props, "DisplayName", "KmsMasterKeyId")
    name = props.get("TopicName") or ctx.name(256)
    arn = ctx.client("sns").create_topic(Name=name, Attributes=attributes, Tags=_tag_list(props.get("Tags")))["TopicArn"]
    return Created(arn, arn, {"TopicArn": arn, "TopicName": name})


# --- Observability --------------------------------------------------------------------------

@_resource("AWS::Logs::LogGroup", "LogGroupName", "RetentionInDays", "KmsKeyId", "Tags", "LogGroupClass")
def _log_group(ctx: Context, props: dict[str, Any]) -> Created:
    logs = ctx.client("logs")
    name = props.get("LogGroupName") or ctx.name(512)
    logs.create_log_group(logGroupName=name, tags=_tag_dict(props.get("Tags")),
                          **{api: props[cfn] for cfn, api in (("KmsKeyId", "kmsKeyId"),
                                                               ("LogGroupClass", "logGroupClass")) if cfn in props})
    if "RetentionInDays" in props:
        logs.put_retention_policy(logGroupName=name, retentionInDays=int(props["RetentionInDays"]))
    arn = ctx.arn("logs", f"log-group:{name}:*")
    return Created(name, arn, {"Arn": arn})


_ALARM_PROPERTIES = ("AlarmDescription", "ActionsEnabled", "OKActions", "AlarmActions", "InsufficientDataActions",
                     "MetricName", "Namespace", "Statistic", "ExtendedStatistic", "Dimensions", "Period", "Unit",
                     "EvaluationPeriods", "DatapointsToAlarm", "Threshold", "ComparisonOperator", "TreatMissingData",
                     "EvaluateLowSampleCountPercentile", "Metrics", "ThresholdMetricId")


@_resource("AWS::CloudWatch::Alarm", "AlarmName", "Tags", *_ALARM_PROPERTIES,
           required=("ComparisonOperator", "EvaluationPeriods"))
def _alarm(ctx: Context, props: dict[str, Any]) -> Created:
    name = props.get("AlarmName") or ctx.name(255)
    request = _pick(props, *_ALARM_PROPERTIES)
    for number in ("Period", "EvaluationPeriods", "DatapointsToAlarm"):
        if number in request:
            request[number] = int(request[number])
    if "Threshold" in request:
        request["Threshold"] = float(request["Threshold"])
    ctx.client("cloudwatch").put_metric_alarm(AlarmName=name, Tags=_tag_list(props.get("Tags")), **request)
    arn = ctx.arn("cloudwatch", f"alarm:{name}")
    return Created(name, arn, {"Arn": arn})


@_resource("AWS::CloudWatch::Dashboard", "DashboardName", "DashboardBody", required=("DashboardBody",))
def _dashboard(ctx: Context, props: dict[str, Any]) -> Created:
    name = props.get("DashboardName") or ctx.name(255)
    result = ctx.client("cloudwatch").put_dashboard(DashboardName=name, DashboardBody=_as_json(props["DashboardBody"]))
    if result.get("DashboardValidationMessages"):
        raise ValueError(f"DashboardBody refused: {result['DashboardValidationMessages']}")
    return Created(name, ctx.arn("cloudwatch", f"dashboard/{name}", region=False), {})


# --- EC2 ------------------------------------------------------------------------------------

@_resource("AWS::EC2::LaunchTemplate", "LaunchTemplateName", "LaunchTemplateData", "TagSpecifications",
           "VersionDescription", required=("LaunchTemplateData",))
def _launch_template(ctx: Context, props: dict[str, Any]) -> Created:
    template = ctx.client("ec2").create_launch_template(
        LaunchTemplateName=props.get("LaunchTemplateName") or ctx.name(128),
        LaunchTemplateData=props["LaunchTemplateData"],
        **_pick(props, "TagSpecifications", "VersionDescription"))["LaunchTemplate"]
    template_id = template["LaunchTemplateId"]
    return Created(template_id, ctx.arn("ec2", f"launch-template/{template_id}"), {
        "LaunchTemplateId": template_id,
        "LatestVersionNumber": str(template["LatestVersionNumber"]),
        "DefaultVersionNumber": str(template["DefaultVersionNumber"]),
    })


@_resource("AWS::EC2::PlacementGroup", "Strategy", "PartitionCount", "SpreadLevel", "Tags")
def _placement_group(ctx: Context, props: dict[str, Any]) -> Created:
    name = ctx.name(255)
    tags = [{"ResourceType": "placement-group", "Tags": _tag_list(props["Tags"])}] if props.get("Tags") else []
    request = _pick(props, "Strategy", "PartitionCount", "SpreadLevel")
    ctx.client("ec2").create_placement_group(GroupName=name, TagSpecifications=tags, **request)
    return Created(name, ctx.arn("ec2", f"placement-group/{name}"), {"GroupName": name})


@_resource("AWS::EC2::VPC", "CidrBlock", "EnableDnsSupport", "EnableDnsHostnames", "InstanceTenancy", "Tags",
           required=("CidrBlock",))
def _vpc(ctx: Context, props: dict[str, Any]) -> Created:
    ec2 = ctx.client("ec2")
    tags = [{"ResourceType": "vpc", "Tags": _tag_list(props["Tags"])}] if props.get("Tags") else []
    vpc = ec2.create_vpc(CidrBlock=props["CidrBlock"], TagSpecifications=tags,
                         **_pick(props, "InstanceTenancy"))["Vpc"]
    vpc_id = vpc["VpcId"]
    # EC2 sets one attribute a call, and DNS hostnames only where DNS support is on: support first.
    for attribute, default in (("EnableDnsSupport", True), ("EnableDnsHostnames", False)):
        if _true(props.get(attribute, default)) != default:
            ec2.modify_vpc_attribute(VpcId=vpc_id, **{attribute: {"Value": _true(props[attribute])}})
    group = ec2.describe_security_groups(Filters=[{"Name": "vpc-id", "Values": [vpc_id]},
                                                  {"Name": "group-name", "Values": ["default"]}])["SecurityGroups"]
    return Created(vpc_id, ctx.arn("ec2", f"vpc/{vpc_id}"), {
        "VpcId": vpc_id, "CidrBlock": vpc["CidrBlock"], "DefaultSecurityGroup": group[0]["GroupId"] if group else ""})


def _true(value: Any) -> bool:
    """A CloudFormation boolean: true or "true"."""
    return str(value).lower() == "true"


@_resource("AWS::EC2::Subnet", "VpcId", "CidrBlock", "AvailabilityZone", "MapPublicIpOnLaunch", "Tags",
           required=("VpcId", "CidrBlock"))
def _subnet(ctx: Context, props: dict[str, Any]) -> Created:
    ec2 = ctx.client("ec2")
    tags = [{"ResourceType": "subnet", "Tags": _tag_list(props["Tags"])}] if props.get("Tags") else []
    subnet = ec2.create_subnet(VpcId=props["VpcId"], CidrBlock=props["CidrBlock"], TagSpecifications=tags,
                               **_pick(props, "AvailabilityZone"))["Subnet"]
    subnet_id = subnet["SubnetId"]
    if _true(props.get("MapPublicIpOnLaunch", False)):
        ec2.modify_subnet_attribute(SubnetId=subnet_id, MapPublicIpOnLaunch={"Value": True})
    return Created(subnet_id, ctx.arn("ec2", f"subnet/{subnet_id}"), {
        "SubnetId": subnet_id, "VpcId": subnet["VpcId"], "AvailabilityZone": subnet["AvailabilityZone"],
        "CidrBlock": subnet["CidrBlock"]})


@_resource("AWS::EC2::RouteTable", "VpcId", "Tags", required=("VpcId",))
def _route_table(ctx: Context, props: dict[str, Any]) -> Created:
    tags = [{"ResourceType": "route-table", "Tags": _tag_list(props["Tags"])}] if props.get("Tags") else []
    table_id = ctx.client("ec2").create_route_table(VpcId=props["VpcId"],
                                                    TagSpecifications=tags)["RouteTable"]["RouteTableId"]
    return Created(table_id, ctx.arn("ec2", f"route-table/{table_id}"), {"RouteTableId": table_id})


@_resource("AWS::EC2::SubnetRouteTableAssociation", "SubnetId", "RouteTableId",
           required=("SubnetId", "RouteTableId"))
def _subnet_route_table_association(ctx: Context, props: dict[str, Any]) -> Created:
    association = ctx.client("ec2").associate_route_table(SubnetId=props["SubnetId"],
                                                          RouteTableId=props["RouteTableId"])["AssociationId"]
    return Created(association, None, {"Id": association})


@_resource("AWS::EC2::VPCEndpoint", "VpcId", "ServiceName", "VpcEndpointType", "RouteTableIds", "SubnetIds",
           "SecurityGroupIds", "PrivateDnsEnabled", "PolicyDocument", "Tags", required=("VpcId", "ServiceName"))
def _vpc_endpoint(ctx: Context, props: dict[str, Any]) -> Created:
    request = _pick(props, "VpcId", "ServiceName", "RouteTableIds", "SubnetIds", "SecurityGroupIds")
    if "PolicyDocument" in props:
        request["PolicyDocument"] = _as_json(props["PolicyDocument"])
    if props.get("Tags"):
        request["TagSpecifications"] = [{"ResourceType": "vpc-endpoint", "Tags": _tag_list(props["Tags"])}]
    kind = props.get("VpcEndpointType", "Gateway")
    if kind == "Interface":  # CloudFormation's default, not the API's: private DNS off
        request["PrivateDnsEnabled"] = _true(props.get("PrivateDnsEnabled", False))
    endpoint = ctx.client("ec2").create_vpc_endpoint(VpcEndpointType=kind, **request)["VpcEndpoint"]
    endpoint_id = endpoint["VpcEndpointId"]
    return Created(endpoint_id, ctx.arn("ec2", f"vpc-endpoint/{endpoint_id}"), {
        "Id": endpoint_id, "NetworkInterfaceIds": endpoint.get("NetworkInterfaceIds", []),
        "DnsEntries": [f"{entry.get('HostedZoneId', '')}:{entry.get('DnsName', '')}"
                       for entry in endpoint.get("DnsEntries", [])]})


@_resource("AWS::EC2::SecurityGroup", "GroupName", "GroupDescription", "VpcId", "SecurityGroupIngress",
           "SecurityGroupEgress", "Tags", required=("GroupDescription",))
def _security_group(ctx: Context, props: dict[str, Any]) -> Created:
    ec2 = ctx.client("ec2")
    tags = [{"ResourceType": "security-group", "Tags": _tag_list(props["Tags"])}] if props.get("Tags") else []
    group = ec2.create_security_group(GroupName=props.get("GroupName") or ctx.name(255),
                                      Description=props["GroupDescription"], TagSpecifications=tags,
                                      **_pick(props, "VpcId"))
    group_id = group["GroupId"]
    if props.get("SecurityGroupIngress"):
        ec2.authorize_security_group_ingress(
            GroupId=group_id, IpPermissions=[ip_permission(rule) for rule in props["SecurityGroupIngress"]])
    if "SecurityGroupEgress" in props:
        # Given egress rules replace the default allow-all rule, as in CloudFormation.
        ec2.revoke_security_group_egress(GroupId=group_id, IpPermissions=[_ALLOW_ALL_EGRESS])
        if props["SecurityGroupEgress"]:
            ec2.authorize_security_group_egress(
                GroupId=group_id, IpPermissions=[ip_permission(rule) for rule in props["SecurityGroupEgress"]])
    vpc_id = ec2.describe_security_groups(GroupIds=[group_id])["SecurityGroups"][0].get("VpcId", "")
    return Created(group_id, ctx.arn("ec2", f"security-group/{group_id}"), {"GroupId": group_id, "VpcId": vpc_id})


_ALLOW_ALL_EGRESS = {"IpProtocol": "-1", "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}
_RULE_PEER_KEYS = {"CidrIp", "CidrIpv6", "SourceSecurityGroupId", "DestinationSecurityGroupId",
                   "SourcePrefixListId", "DestinationPrefixListId"}
_RULE_KEYS = {"IpProtocol", "FromPort", "ToPort", "Description"} | _RULE_PEER_KEYS


def ip_permission(rule: Mapping[str, Any]) -> dict[str, Any]:
    """A CloudFormation ingress/egress rule as an EC2 IpPermission."""
    unknown = sorted(set(rule) - _RULE_KEYS)
    if unknown:
        raise ValueError(f"security group rule keys {unknown} are not supported locally")
    described = _pick(rule, "Description")
    permission: dict[str, Any] = {"IpProtocol": str(rule["IpProtocol"])}
    for port in ("FromPort", "ToPort"):
        if port in rule:
            permission[port] = int(rule[port])
    if "CidrIp" in rule:
        permission["IpRanges"] = [{"CidrIp": rule["CidrIp"], **described}]
    if "CidrIpv6" in rule:
        permission["Ipv6Ranges"] = [{"CidrIpv6": rule["CidrIpv6"], **described}]
    for key in ("SourceSecurityGroupId", "DestinationSecurityGroupId"):
        if key in rule:
            permission["UserIdGroupPairs"] = [{"GroupId": rule[key], **described}]
    for key in ("SourcePrefixListId", "DestinationPrefixListId"):
        if key in rule:
            permission["PrefixListIds"] = [{"PrefixListId": rule[key], **described}]
    return permission


def _security_group_rule(direction: str) -> Callable[[Context, dict[str, Any]], Created]:
    def create(ctx: Context, props: dict[str, Any]) -> Created:
        ec2 = ctx.client("ec2")
        authorize = (ec2.authorize_security_group_ingress if direction == "ingress"
                     else ec2.authorize_security_group_egress)
        rule_props = {key: value for key, value in props.items() if key != "GroupId"}
        result = authorize(GroupId=props["GroupId"], IpPermissions=[ip_permission(rule_props)])
        rule_id = result["SecurityGroupRules"][0]["SecurityGroupRuleId"]
        return Created(rule_id, None, {"Id": rule_id})

    return create


_resource("AWS::EC2::SecurityGroupIngress", "GroupId", *_RULE_KEYS,
          required=("GroupId", "IpProtocol"))(_security_group_rule("ingress"))
_resource("AWS::EC2::SecurityGroupEgress", "GroupId", *_RULE_KEYS,
          required=("GroupId", "IpProtocol"))(_security_group_rule("egress"))
