"""IAM glue: identity policies are evaluated as AWS evaluates them, with the request's resource and
condition keys, and a denial names the caller, the action and the resource.

- Replaces `IAMRequestBase.check_action_permitted`, moto's evaluator (see localcloud/iam_policy.py
  for how it differs from AWS), with `localcloud.iam_policy.evaluate` over the caller's policies,
  for each (resource, condition context) the request needs (`authorizations`). The denial is
  AWS's: `User: arn:aws:sts::ACCOUNT:assumed-role/ROLE/SESSION is not authorized to perform:
  ACTION on resource: RESOURCE because no identity-based policy allows the ACTION action`
  (AccessDenied; UnauthorizedOperation for EC2; AccessDeniedException for the JSON-protocol
  services: DynamoDB, EventBridge, Step Functions, CloudWatch Logs).
- DeletePolicy refuses a managed policy still attached (DeleteConflict), as IAM does.
- ListInstanceProfiles lists those under its PathPrefix alone, as IAM does (moto listed all).
- A pre-signed URL's request is its signer's (moto's authorization wanted an Authorization header).
- Replaces `FakeBucket.get_permission`, which checks the bucket policy with moto's evaluator
  (its TLS-only Deny then refused everything, because moto treats the Bool condition as met),
  with the same evaluation; aws:SecureTransport is "true" (see SECURE_TRANSPORT).
- Identities, made in-process, as the AWS services that hold them do, with no IAM check:
  `admin_identity` (the deployer's and the harness's fake credentials, and the fixed key moto's
  Step Functions interpreter signs its integrations with) and `role_credentials` (STS
  credentials of a role, for a Lambda function's execution role and an instance's profile).
- `enforce(True)` switches moto's authentication on (every request is signed by a known
  identity and authorized), `enforce(False)` off again.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, unquote, urlparse
from xml.etree import ElementTree

from moto.core.exceptions import JsonRESTError, _RESTError
from moto.iam.exceptions import DeleteConflictException, NotFoundException
from moto.iam.access_control import IAMPolicy, IAMRequestBase, S3IAMRequest
from moto.core.responses import ActionResult
from moto.iam.models import IAMBackend, filter_items_with_path_prefix
from moto.iam.responses import IamResponse
from moto.s3.exceptions import S3ClientError
from moto.s3.models import FakeBucket

from localcloud.account import ADMIN_ROLE, FAKE_CREDENTIALS
from localcloud.glue import active_cloud
from localcloud.iam_policy import ALLOW, EXPLICIT_DENY, IMPLICIT_DENY, evaluate

_moto_check_action_permitted = IAMRequestBase.check_action_permitted
_moto_check_signature = IAMRequestBase.check_signature
_moto_get_permission = FakeBucket.get_permission
_moto_delete_policy = IAMBackend.delete_policy
_moto_iam_request_init = IAMRequestBase.__init__

FAKE_KEY = FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"]
"""Access key id of the deployer's and the harness's credentials (account.FAKE_CREDENTIALS)."""
INTERPRETER_KEY = ("ak", "sk")
"""The key moto's Step Functions interpreter signs every integration call with (it ignores the
state machine's role)."""
ADMINISTRATOR_ACCESS = {"Version": "2012-10-17",
                        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}

SECURE_TRANSPORT = "true"
"""aws:SecureTransport of every request. The local endpoint is plain HTTP on loopback, standing
in for AWS's HTTPS endpoints, which every SDK uses by default: reporting "false" would make the
template's TLS-only bucket policy refuse everything locally, which no SDK client meets on AWS.
The Deny itself is checked per statement with "false" (tests/test_iam_policies.py)."""

UNEVALUATED_KEYS = ("iam:PassedToService", "iam:AWSServiceName", "ec2:CreateAction", "aws:SourceAccount")
"""Condition keys of calls AWS makes on the caller's behalf (PassRole and CreateTags inside
RunInstances/CreateFleet, the service-linked role, a service principal's delivery), which the
local cloud never makes as separate requests: their conditions are not evaluated locally."""

_lock = threading.Lock()
_role_sessions: dict[str, tuple[float, dict[str, str]]] = {}
_instance_sessions: dict[str, str] = {}
"""Access key id of an instance profile's session -> the instance's ARN (ec2:SourceInstanceARN)."""
ROLE_SESSION_SECONDS = 3600
RENEW_BEFORE_SECONDS = 600


# --- identities -------------------------------------------------------------------------------

def _backends(account_id: str, region: str) -> tuple[Any, Any]:
    from moto.iam.models import iam_backends
    from moto.sts.models import sts_backends

    return iam_backends[account_id]["aws"], sts_backends[account_id]["aws"]


def admin_identity(account_id: str, region: str) -> None:
    """Make the fake credentials (FAKE_KEY, with a session token) an administrator's role
    session, and the interpreter's key an administrator user's key; idempotent."""
    iam, sts = _backends(account_id, region)
    if not any(role.name == ADMIN_ROLE for role in iam.roles.values()):
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                         "Principal": {"AWS": f"arn:aws:iam::{account_id}:root"}}]}
        iam.create_role(ADMIN_ROLE, json.dumps(trust), "/", None, "local cloud administrator", [], "43200")
        iam.put_role_policy(ADMIN_ROLE, "administrator", json.dumps(ADMINISTRATOR_ACCESS))
        iam.create_user(region, ADMIN_ROLE)
        iam.put_user_policy(ADMIN_ROLE, "administrator", json.dumps(ADMINISTRATOR_ACCESS))
        key = iam.create_access_key(ADMIN_ROLE)
        key.access_key_id, key.secret_access_key = INTERPRETER_KEY
    if sts.get_assumed_role_from_access_key(FAKE_KEY) is None:
        session = sts.assume_role(region, "harness", f"arn:aws:iam::{account_id}:role/{ADMIN_ROLE}",
                                  "", 43200, "")
        session.access_key_id = FAKE_KEY
        session.secret_access_key = FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
        session.session_token = FAKE_CREDENTIALS["AWS_SESSION_TOKEN"]


def role_credentials(account_id: str, region: str, role_arn: str, session_name: str,
                     source_instance_arn: str | None = None) -> dict[str, str]:
    """STS credentials of `role_arn`, as AWS_ACCESS_KEY_ID/..._SECRET_.../..._SESSION_TOKEN,
    plus AWS_CREDENTIAL_EXPIRATION; one session per role and session name, renewed before it
    expires (many requests share it: moto looks keys up in a list). `source_instance_arn`: the
    instance whose profile the session is (EC2 names it by the instance id), whose requests then
    carry ec2:SourceInstanceARN."""
    key = f"{account_id}/{role_arn}/{session_name}"
    with _lock:
        held = _role_sessions.get(key)
        if held is None or held[0] - time.time() < RENEW_BEFORE_SECONDS:
            _, sts = _backends(account_id, region)
            session = sts.assume_role(region, session_name[:64], role_arn, "", ROLE_SESSION_SECONDS, "")
            if source_instance_arn is not None:
                _instance_sessions[session.access_key_id] = source_instance_arn
            held = _role_sessions[key] = (time.time() + ROLE_SESSION_SECONDS, {
                "AWS_ACCESS_KEY_ID": session.access_key_id,
                "AWS_SECRET_ACCESS_KEY": session.secret_access_key,
                "AWS_SESSION_TOKEN": session.session_token,
                "AWS_CREDENTIAL_EXPIRATION": session.expiration.strftime("%Y-%m-%dT%H:%M:%SZ"),
            })
        return dict(held[1])


def instance_profile_named(account_id: str, name: str) -> Any:
    """IAM's instance profile of that name in the account; None if it has none."""
    iam, _ = _backends(account_id, "")
    return next((profile for profile in iam.instance_profiles.values() if profile.name == name), None)


def role_allows(account_id: str, role_arn: str, action: str, resource: str) -> bool:
    """Whether the role's own policies (inline and attached) allow `action` on `resource`: what
    a service checks of an execution role before it acts for it (Lambda's event source mapping
    polling a queue, for one)."""
    iam, _ = _backends(account_id, "")
    name = iam.get_role_by_arn(role_arn).name
    inline = [iam.get_role_policy(name, policy_name)[1] for policy_name in iam.list_role_policies(name)]
    attached, _ = iam.list_attached_role_policies(name)
    policies = [IAMPolicy(policy)._policy_json for policy in [*inline, *attached]]
    return evaluate(policies, action, resource, {}, UNEVALUATED_KEYS) == ALLOW


def enforce(on: bool) -> None:
    """Switch moto's authentication and authorization of every request on or off."""
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0 if on else float("inf")
    ActionAuthenticatorMixin.request_count = 0


# --- what a request needs ---------------------------------------------------------------------

def _json_body(request: IAMRequestBase) -> dict[str, Any]:
    try:
        body = json.loads(request._body or b"{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


def _query(request: IAMRequestBase) -> dict[str, list[str]]:
    """Form or query parameters of a query-protocol request (EC2, IAM, STS, SQS)."""
    data = request._data if isinstance(request._data, dict) else {}
    return {key: value if isinstance(value, list) else [value] for key, value in data.items()}


def _delete_keys(request: IAMRequestBase) -> list[str]:
    """The object keys of an S3 DeleteObjects request body (<Delete><Object><Key>...)."""
    body = request._body or b""
    try:
        root = ElementTree.fromstring(body if isinstance(body, bytes) else body.encode())
    except ElementTree.ParseError:
        return []
    return [element.text or "" for element in root.iter() if element.tag.rsplit("}", 1)[-1] == "Key"]


def _request_tags(query: dict[str, list[str]]) -> dict[str, str]:
    """aws:RequestTag/KEY of an EC2 request: the tags of its TagSpecification.N.Tag.M (and of a
    CreateTags' Tag.M)."""
    tags = {}
    for name, values in query.items():
        if name.endswith(".Key") and ".Tag." in f".{name}":
            value = query.get(name[:-len("Key")] + "Value", [""])[0]
            tags[f"aws:RequestTag/{values[0]}"] = value
    return tags


def _ec2_resource_tags(request: IAMRequestBase, query: dict[str, list[str]]) -> Iterator[dict[str, str]]:
    """aws:ResourceTag/KEY of each existing resource an EC2 request names by id or name
    (instances, launch templates, placement groups), from EC2's own records."""
    from moto.ec2.models import ec2_backends

    from localcloud.glue.ec2_state import placement_groups

    backend = ec2_backends[request.account_id][request._region]
    resource_ids: list[str] = []
    for name, values in query.items():
        if name.startswith("InstanceId") or name == "LaunchTemplateId":
            resource_ids += values
        elif name == "LaunchTemplateName":
            resource_ids += [template.id for template in backend.describe_launch_templates(values, [], [])]
        elif name == "GroupName" and request._action == "ec2:DeletePlacementGroup":
            group = placement_groups(backend).get(values[0])
            if group is not None:
                yield {f"aws:ResourceTag/{key}": value for key, value in group.tags.items()}
    for resource_id in resource_ids:
        tags = backend.describe_tags(filters={"resource-id": [resource_id]})
        yield {f"aws:ResourceTag/{tag['key']}": tag["value"] for tag in tags}


def _leading_keys(request: IAMRequestBase, body: dict[str, Any], table: str, index: str | None) -> list[str]:
    """dynamodb:LeadingKeys: the partition key values a single-item request (Key, Item) or a
    Query (its KeyConditionExpression's `key = :value`) names; none for the rest (Scan)."""
    from moto.dynamodb.exceptions import ResourceNotFoundException
    from moto.dynamodb.models import dynamodb_backends

    try:
        found = dynamodb_backends[request.account_id][request._region].get_table(table)
    except ResourceNotFoundException:  # DynamoDB answers it itself
        return []
    hash_key = found.hash_key_attr
    if index is not None:
        hash_key = next((element["AttributeName"] for each in found.global_indexes + found.indexes
                         if each.name == index for element in each.schema if element["KeyType"] == "HASH"), hash_key)
    item = body.get("Key") or body.get("Item") or {}
    if hash_key in item:
        return [str(next(iter(item[hash_key].values())))]
    names = body.get("ExpressionAttributeNames", {})
    values = body.get("ExpressionAttributeValues", {})
    return [str(next(iter(values[value].values())))
            for name, value in re.findall(r"([#\w]+)\s*=\s*(:\w+)", body.get("KeyConditionExpression", ""))
            if names.get(name, name) == hash_key and value in values]


def _iam_resources(request: IAMRequestBase, query: dict[str, list[str]],
                   resource: str) -> Iterator[tuple[str, str | None]]:
    """(action, resource) an IAM request needs, as AWS authorizes it. moto names the role of any
    request with a RoleName (when it exists), and nothing else: a role to be created is its ARN
    to be (path and name), an instance profile request is on the profile, and adding a role to
    a profile also needs iam:PassRole on the role."""
    account, action = request.account_id, request._action
    if "InstanceProfileName" in query:
        name = query["InstanceProfileName"][0]
        existing = instance_profile_named(account, name)
        path = existing.path if existing is not None else query.get("Path", ["/"])[0]
        yield action, f"arn:aws:iam::{account}:instance-profile{path}{name}"
        if action == "iam:AddRoleToInstanceProfile":
            yield "iam:PassRole", None if resource == "*" else resource
    elif action == "iam:CreateRole":
        yield action, f"arn:aws:iam::{account}:role{query.get('Path', ['/'])[0]}{query['RoleName'][0]}"
    else:
        yield action, None if resource == "*" else resource


def _table_arn(table: str, region: str, account: str) -> str:
    return table if table.startswith("arn:") else f"arn:aws:dynamodb:{region}:{account}:table/{table}"


def authorizations(request: IAMRequestBase,
                   resource: str) -> Iterator[tuple[str, str | None, dict[str, Any], tuple[str, ...]]]:
    """(action, resource, condition context, keys not evaluated) for each authorization the
    request needs. `resource` is moto's (an ARN for S3, SQS, IAM and STS, else "*"); None where
    the local cloud does not derive the resource (only actions and conditions are evaluated)."""
    service, action = request._action.split(":", 1)
    region, account = request._region, request.account_id
    context: dict[str, Any] = {"aws:SecureTransport": SECURE_TRANSPORT}
    unevaluated = UNEVALUATED_KEYS
    if service == "s3":
        query = parse_qs(urlparse(request._path).query, keep_blank_values=True)
        if action == "ListBucket" and query.get("prefix"):
            context["s3:prefix"] = query["prefix"][0]
        if action == "DeleteObject" and "delete" in query:
            # DeleteObjects (POST ?delete) needs s3:DeleteObject on each object it names, not on
            # the bucket moto names. AWS answers a denied key in the response's Errors; here any
            # denied key refuses the whole request.
            for key in _delete_keys(request):
                yield (request._action, f"{resource}/{key}", context, unevaluated)
            return
        yield (request._action, resource, context, unevaluated)
    elif service == "iam":
        query = _query(request)
        if "PolicyArn" in query:  # Attach/DetachRolePolicy: the policy is the condition key iam:PolicyARN
            context = context | {"iam:PolicyARN": query["PolicyArn"][0]}
        for action_needed, needed in _iam_resources(request, query, resource):
            yield (action_needed, needed, context, unevaluated)
    elif service in ("sqs", "sts") and resource != "*":
        yield (request._action, resource, context, unevaluated)
    elif (service, action) == ("dynamodb", "TransactWriteItems"):
        # DynamoDB authorizes each item's action on its table: PutItem, UpdateItem, DeleteItem,
        # ConditionCheckItem (Using IAM with DynamoDB transactions); there is no action of its own.
        for entry in _json_body(request).get("TransactItems", []):
            for operation, detail in entry.items():
                item_action = "ConditionCheckItem" if operation == "ConditionCheck" else f"{operation}Item"
                yield (f"dynamodb:{item_action}", _table_arn(detail["TableName"], region, account), context,
                       unevaluated)
    elif (service, action) in (("dynamodb", "BatchGetItem"), ("dynamodb", "BatchWriteItem")):
        # Authorized on each table the request names, with the partition keys it names there.
        for table, requested in _json_body(request).get("RequestItems", {}).items():
            entries = requested["Keys"] if action == "BatchGetItem" else [
                entry.get("PutRequest", {}).get("Item") or entry.get("DeleteRequest", {}).get("Key") for entry in requested]
            leading = sorted({value for key in entries for value in _leading_keys(request, {"Key": key}, table, None)})
            yield (request._action, _table_arn(table, region, account),
                   context | ({"dynamodb:LeadingKeys": leading} if leading else {}), unevaluated)
    elif service == "dynamodb":
        body = _json_body(request)
        table = body.get("TableName")
        if table is None:
            yield (request._action, None, context, unevaluated)
            return
        arn = _table_arn(table, region, account)
        index = body.get("IndexName")
        leading = _leading_keys(request, body, table, index)
        if leading:
            context = context | {"dynamodb:LeadingKeys": leading}
        yield (request._action, f"{arn}/index/{index}" if index else arn, context, unevaluated)
    elif (service, action) == ("events", "PutEvents"):
        for entry in _json_body(request).get("Entries", []):
            bus = entry.get("EventBusName") or "default"
            arn = bus if bus.startswith("arn:") else f"arn:aws:events:{region}:{account}:event-bus/{bus}"
            yield (request._action, arn, context | {"events:source": entry.get("Source", ""),
                                   "events:detail-type": entry.get("DetailType", "")}, unevaluated)
    elif service == "lambda" and action == "InvokeFunction":
        name = unquote(request._path.split("/functions/", 1)[-1].split("/", 1)[0])
        arn = name if name.startswith("arn:") else f"arn:aws:lambda:{region}:{account}:function:{name}"
        yield (request._action, arn, context, unevaluated)
    elif (service, action) in (("logs", "CreateLogStream"), ("logs", "PutLogEvents"), ("logs", "GetLogEvents")):
        # A log stream's ARN; a policy's log-group:NAME:* covers the group's streams.
        body = _json_body(request)
        yield (request._action, f"arn:aws:logs:{region}:{account}:log-group:{body.get('logGroupName')}:log-stream:"
                                f"{body.get('logStreamName')}", context, unevaluated)
    elif (service, action) == ("states", "StartExecution"):
        yield (request._action, _json_body(request).get("stateMachineArn"), context, unevaluated)
    elif (service, action) == ("cloudwatch", "PutMetricData"):
        namespace = _query(request).get("Namespace", [_json_body(request).get("Namespace")])[0]
        if namespace is None:
            unevaluated += ("cloudwatch:namespace",)
        else:
            context["cloudwatch:namespace"] = namespace
        yield (request._action, None, context, unevaluated)
    elif service == "ec2":
        query = _query(request)
        context |= _request_tags(query)
        # Only calls on existing resources have their tags (a Create names what is to be).
        existing = not action.startswith(("Create", "Run", "Describe", "Import", "Allocate"))
        targets = list(_ec2_resource_tags(request, query)) if existing else []
        for tags in targets or [{}]:
            yield (request._action, None, context | tags, unevaluated)
    else:
        yield (request._action, None, context, unevaluated)


# --- the decision -----------------------------------------------------------------------------

class AccessDenied(_RESTError):
    code = 403


class UnauthorizedOperation(_RESTError):
    code = 403


class JsonAccessDenied(JsonRESTError):
    code = 400


JSON_PROTOCOL = frozenset({"dynamodb", "events", "states", "logs"})
"""Services of AWS's JSON protocol, whose denial is AccessDeniedException (HTTP 400), where the
query and REST services answer AccessDenied (403)."""


def denial_message(principal: str, action: str, resource: str | None, decision: str) -> str:
    """AWS's AccessDenied message for an identity-policy denial."""
    shown = f" on resource: {resource}" if resource else ""
    why = ("with an explicit deny in an identity-based policy" if decision == EXPLICIT_DENY
           else f"because no identity-based policy allows the {action} action")
    return f"User: {principal} is not authorized to perform: {action}{shown} {why}"


def _policies(request: IAMRequestBase) -> list[dict[str, Any]]:
    """The caller's identity-based policies. A session of a role deleted since (a run's node role
    once Teardown removed it) has none: AWS denies its requests, where moto failed them with
    IAM's NoSuchEntity from inside the request."""
    try:
        held = request._access_key.collect_policies()
    except NotFoundException:
        return []
    return [IAMPolicy(policy)._policy_json for policy in held]


def _principal_context(request: IAMRequestBase) -> dict[str, str]:
    """What a request's keys say of its caller: aws:PrincipalTag/KEY of a role session (the
    role's tags), and ec2:SourceInstanceARN of an instance profile's session."""
    key = request._access_key
    context = {}
    role_name = getattr(key, "_owner_role_name", None)
    if role_name is not None:
        iam, _ = _backends(request.account_id, "")
        role = next((role for role in iam.roles.values() if role.name == role_name), None)
        context = {f"aws:PrincipalTag/{tag['Key']}": tag["Value"] for tag in (role.tags if role else [])}
    instance = _instance_sessions.get(getattr(key, "_access_key_id", ""))
    if instance is not None:
        context["ec2:SourceInstanceARN"] = instance
    return context


def _check_action_permitted(self: IAMRequestBase, resource: str) -> None:
    if active_cloud() is None:
        return _moto_check_action_permitted(self, resource)
    if self._action == "sts:GetCallerIdentity":  # AWS allows it whatever the policies say
        return None
    policies = _policies(self)
    principal = _principal_context(self)
    for action, needed, context, unevaluated in authorizations(self, resource):
        decision = evaluate(policies, action, needed, principal | context, unevaluated)
        if decision == ALLOW:
            continue
        message = denial_message(self._access_key.arn, action, needed, decision)
        if isinstance(self, S3IAMRequest):
            raise S3ClientError("AccessDenied", message)
        if self._service == "ec2":
            raise UnauthorizedOperation("UnauthorizedOperation", message)
        if self._service in JSON_PROTOCOL:
            raise JsonAccessDenied("AccessDeniedException", message)
        raise AccessDenied("AccessDenied", message)
    return None


def _get_permission(self: FakeBucket, action: str, resource: str) -> Any:
    from moto.iam.access_control import PermissionResult

    if active_cloud() is None or self.policy is None:
        return _moto_get_permission(self, action, resource)
    decision = evaluate([json.loads(self.policy)], action, resource,
                        {"aws:SecureTransport": SECURE_TRANSPORT}, UNEVALUATED_KEYS)
    return {ALLOW: PermissionResult.PERMITTED, EXPLICIT_DENY: PermissionResult.DENIED,
            IMPLICIT_DENY: PermissionResult.NEUTRAL}[decision]


def _check_signature(self: IAMRequestBase) -> None:
    # moto recomputes SigV4 from the request as it received it, which differs from what the
    # client signed for some encoded paths (Lambda's GetFunctionConfiguration, for one), so a
    # correctly signed request failed with SignatureDoesNotMatch. The caller is still identified
    # by its access key (an unknown one is refused); its signature is not verified locally.
    if active_cloud() is None:
        _moto_check_signature(self)


def _delete_policy(self: IAMBackend, policy_arn: str) -> None:
    # IAM refuses to delete a managed policy attached to a user, group or role (DeleteConflict);
    # moto deleted it, and a stack whose deletion failed on it on AWS deleted cleanly here.
    policy = self.get_policy(policy_arn)
    if policy.attachment_count:
        raise DeleteConflictException("Cannot delete a policy attached to entities.")
    _moto_delete_policy(self, policy_arn)


def _list_instance_profiles(self: IamResponse) -> ActionResult:
    # moto ignored PathPrefix and listed every profile of the account: a stack's cleanup of its
    # own path reached other stacks' profiles, which its role may not touch.
    prefix = self._get_param("PathPrefix") or "/"
    return ActionResult({"InstanceProfiles": filter_items_with_path_prefix(prefix, self.backend.get_instance_profiles())})


def _presigned_init(self: IAMRequestBase, *, headers: Any, path: str, **request: Any) -> None:
    # A pre-signed URL (CloudFormation's ResponseURL to a custom resource, a shared download)
    # carries its signer's credentials in the query, where moto's authorization looked only for
    # an Authorization header and failed the request (500). The caller is its signer, as on AWS.
    query = parse_qs(urlparse(path).query)
    if "Authorization" not in headers and ("X-Amz-Credential" in query or "AWSAccessKeyId" in query):
        cloud = active_cloud()
        credential = (query["X-Amz-Credential"][0] if "X-Amz-Credential" in query else
                      f"{query['AWSAccessKeyId'][0]}/00000000/{cloud.region if cloud else 'us-east-1'}/s3/aws4_request")
        headers = {**dict(headers), "Authorization": f"AWS4-HMAC-SHA256 Credential={credential}, "
                                                     f"SignedHeaders=host, Signature=presigned"}
        token = query.get("X-Amz-Security-Token") or query.get("x-amz-security-token")
        if token:
            headers["X-Amz-Security-Token"] = token[0]
    _moto_iam_request_init(self, headers=headers, path=path, **request)


def apply() -> None:
    IAMRequestBase.__init__ = _presigned_init
    IAMBackend.delete_policy = _delete_policy
    IamResponse.list_instance_profiles = _list_instance_profiles
    IAMRequestBase.check_signature = _check_signature
    IAMRequestBase.check_action_permitted = _check_action_permitted
    FakeBucket.get_permission = _get_permission
