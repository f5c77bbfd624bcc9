"""Deploy a SAM (or plain CloudFormation) template into the local cloud, as `sam deploy` would.

    from localcloud.deploy import DeployRequest, deploy
    stack = deploy(DeployRequest(template=Path("template.yaml"), endpoint=cloud.endpoint))
    stack.resources["TrainingRun"].physical_id     # the state machine's ARN
    stack.outputs["StateMachineArn"]

    trainfleet local deploy --template template.yaml --endpoint http://127.0.0.1:PORT --param Key=Value

The steps, in the order `sam deploy` and CloudFormation take them:

1. load the template (YAML with the short intrinsic tags, or JSON) and check the parameter
   values (overrides, Defaults, AllowedValues);
2. package: upload every local CodeUri / ContentUri / DefinitionUri to an artifact bucket in
   the local S3 and point the template at the S3 copy (what `sam package` does); a function's
   code is then a real deployment package that the local Lambda runtime unpacks;
3. transform with the real SAM translator, offline: managed policy names are looked up in the
   map bundled with the translator instead of calling IAM;
4. plan: Conditions; every resource type, property and AWS managed policy checked against what
   the local cloud can create, and every function's runtime and layers against what it can run
   (everything refused is listed before anything is created); resources ordered by their
   references and DependsOn;
5. create each resource through the local endpoint's AWS APIs (`localcloud.deploy_resources`),
   resolving Ref / Fn::GetAtt / Fn::Sub / ... against what was created before it;
6. resolve the Outputs and record the stack in the local CloudFormation, so that DescribeStacks
   answers with its name, status (CREATE_COMPLETE), description and outputs, which is what
   clients read of a stack (`trainfleet run`, scripts using the AWS CLI). The record is a stack
   of the deployed outputs alone: its resources are the deploy's, not CloudFormation's, so it
   lists none. A stack name recorded before is refused at the start (no updates).

There is no rollback: a failure stops the deploy and names the resource, the cause and what had
already been created (the local cloud is thrown away between runs anyway).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import io
import json
import subprocess
import uuid
import zipfile
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import boto3
import yaml
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from localcloud.deploy_intrinsics import (
    Resolver,
    TemplateError,
    check_rules,
    creation_order,
    evaluate_conditions,
    parameter_values,
    references,
)
from localcloud.deploy_resources import RESOURCE_TYPES, Context
from localcloud.lambda_runtimes import function_problems

__all__ = ["DeployRequest", "DeployedResource", "DeployedStack", "DeployError", "TemplateError",
           "UnsupportedResourcesError", "ResourceCreateError", "deploy", "format_stack", "load_template",
           "transform_sam"]

SAM_TRANSFORM = "AWS::Serverless-2016-10-31"
# Resource attributes that change nothing at create time, so they need no local counterpart.
_INERT_RESOURCE_KEYS = {"Type", "Properties", "Condition", "DependsOn", "Metadata", "DeletionPolicy",
                        "UpdateReplacePolicy"}


class DeployError(Exception):
    """A deploy that could not complete; the message says which resource or field and why."""


class UnsupportedResourcesError(DeployError):
    """Resource types or properties the local deploy cannot create; nothing was created."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("the local deploy cannot create these (nothing was created):\n  "
                         + "\n  ".join(problems))


class ResourceCreateError(DeployError):
    """Creating one resource failed; those created before it are left in place."""

    def __init__(self, logical_id: str, resource_type: str, cause: str, created: list[str]):
        self.logical_id = logical_id
        self.created = created
        super().__init__(f"creating {logical_id} ({resource_type}) failed: {cause}\n"
                         f"already created: {created or 'nothing'}")


@dataclass(frozen=True)
class DeployRequest:
    """What to deploy, and where."""

    template: Path
    """The SAM or CloudFormation template (YAML or JSON); relative CodeUri/DefinitionUri paths are
    taken from its folder."""
    endpoint: str
    """The local cloud's endpoint URL, e.g. http://127.0.0.1:5000."""
    stack_name: str = "trainfleet"
    """AWS::StackName; also the first part of generated physical names."""
    region: str = "us-east-1"
    """AWS::Region of every resource."""
    parameters: Mapping[str, str] = field(default_factory=dict)
    """Parameter overrides (name -> value); the others take their Default."""
    artifact_bucket: str | None = None
    """Local S3 bucket for packaged code and definitions; by default one named after the account
    and region, created on first use."""
    enforce_iam: bool = True
    """Authorize every call from then on, as on AWS (`_enforce_iam`); off for a part of a template
    deployed beside code that is tested without its roles."""


@dataclass(frozen=True)
class DeployedResource:
    """One resource as created."""

    resource_type: str
    """Its CloudFormation type, e.g. AWS::Lambda::Function."""
    physical_id: str
    """What Ref returns for it (a name, an id or an ARN, depending on the type)."""
    arn: str | None
    """Its ARN, where the type has one."""


@dataclass(frozen=True)
class DeployedStack:
    """The result of a deploy."""

    stack_name: str
    """The stack's name."""
    region: str
    """The region it was deployed to."""
    account_id: str
    """The local cloud's account id."""
    resources: dict[str, DeployedResource]
    """Every created resource by logical id (SAM resources appear under the logical ids the
    translator gives the resources it generates; the main one keeps the SAM resource's id)."""
    skipped: dict[str, str]
    """Logical ids not created because their Condition is false, with the condition's name."""
    outputs: dict[str, Any]
    """The stack Outputs by name (those whose Condition holds)."""
    packaged: dict[str, str]
    """Each local CodeUri/ContentUri/DefinitionUri path and the s3:// URI it was uploaded to."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_template(path: Path) -> dict[str, Any]:
    """A template file as plain data; YAML short tags (!Ref, !Sub, !GetAtt a.b, ...) become their
    long forms."""
    try:
        text = path.read_text()
    except OSError as error:
        raise TemplateError(f"cannot read template {path}: {error.strerror}") from error
    try:
        document = yaml.load(text, Loader=_TemplateLoader)  # JSON is YAML too
    except yaml.YAMLError as error:
        raise TemplateError(f"template {path} is not valid YAML/JSON: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("Resources"), dict):
        raise TemplateError(f"template {path} has no Resources mapping")
    return document


class _TemplateLoader(yaml.SafeLoader):
    """SafeLoader plus CloudFormation's short intrinsic tags, without touching yaml.SafeLoader."""


def _add_intrinsic_tags() -> None:
    from samtranslator.yaml_helper import intrinsics_multi_constructor

    _TemplateLoader.add_multi_constructor("!", intrinsics_multi_constructor)


_add_intrinsic_tags()


def transform_sam(template: Mapping[str, Any], parameters: Mapping[str, Any], region: str) -> dict[str, Any]:
    """The CloudFormation template that the AWS::Serverless transform makes of `template`
    (a copy of it when it does not use the transform). Makes no AWS call."""
    transforms = template.get("Transform", [])
    if SAM_TRANSFORM not in ([transforms] if isinstance(transforms, str) else transforms):
        return copy.deepcopy(dict(template))
    from samtranslator.model.exceptions import InvalidDocumentException
    from samtranslator.parser.parser import Parser
    from samtranslator.translator.translator import Translator

    # With a session that carries the region, the translator needs no credentials; AWS managed
    # policy names resolve through the map bundled with it.
    translator = Translator(managed_policy_map=None, sam_parser=Parser(),
                            boto_session=boto3.session.Session(region_name=region))
    try:
        return translator.translate(copy.deepcopy(dict(template)), parameter_values=dict(parameters))
    except InvalidDocumentException as error:
        causes = "\n  ".join(cause.message for cause in error.causes)
        raise TemplateError(f"SAM transform refused the template:\n  {causes}") from error


def deploy(request: DeployRequest) -> DeployedStack:
    """Deploy `request.template` into the local cloud and return what was created."""
    session = _session(request.region)

    @functools.cache
    def client(service: str) -> Any:
        # A local endpoint either answers or is broken: retrying only delays the error.
        return session.client(service, endpoint_url=request.endpoint, config=Config(retries={"max_attempts": 1}))

    try:
        account_id = client("sts").get_caller_identity()["Account"]
    except (BotoCoreError, ClientError) as error:
        raise DeployError(f"cannot reach the local cloud at {request.endpoint}: {error}") from error

    template = load_template(request.template)
    cloudformation = client("cloudformation")
    if _stack_exists(cloudformation, request.stack_name):
        raise DeployError(f"stack {request.stack_name} exists already: the local deploy creates stacks, it does not "
                          "update them (deploy under another --stack-name, or into a new local cloud)")
    parameters = {**_pseudo_parameters(request, account_id),
                  **parameter_values(template.get("Parameters", {}), request.parameters)}
    bucket = request.artifact_bucket or f"trainfleet-local-artifacts-{account_id}-{request.region}"
    packaged = _package(template, request.template.parent, client("s3"), bucket, request.region)
    template = transform_sam(template, parameters, request.region)
    resolver = Resolver(parameters, mappings=template.get("Mappings", {}),
                        availability_zones=lambda region: _availability_zones(session, request.endpoint, region))
    check_rules(template.get("Rules", {}), resolver)
    resolver.conditions = evaluate_conditions(template.get("Conditions", {}), resolver)

    resources = template["Resources"]
    skipped = {logical_id: resource["Condition"] for logical_id, resource in resources.items()
               if "Condition" in resource and not _condition(resolver, resource["Condition"], logical_id)}
    to_create = {logical_id: resource for logical_id, resource in resources.items() if logical_id not in skipped}
    _check_supported(to_create)
    _check_functions_runnable(to_create, resolver, client("lambda"))
    _check_aws_managed_policies(to_create, resolver, client("iam"))

    created: dict[str, DeployedResource] = {}
    for logical_id in creation_order(to_create):
        context = Context(client, request.region, account_id, request.stack_name, logical_id)
        created[logical_id] = _create(to_create[logical_id], context, resolver, list(created))

    outputs = {name: _output_value(resolver, name, output)
               for name, output in template.get("Outputs", {}).items()
               if "Condition" not in output or _condition(resolver, output["Condition"], f"Outputs.{name}")}
    _record_stack(cloudformation, request.stack_name, template, outputs)
    if request.enforce_iam:
        _enforce_iam(request.endpoint)
    return DeployedStack(request.stack_name, request.region, account_id, created, skipped, outputs, packaged)


def _stack_exists(cloudformation: Any, stack_name: str) -> bool:
    try:
        stacks = cloudformation.describe_stacks(StackName=stack_name)["Stacks"]
    except ClientError as error:
        if error.response["Error"]["Code"] == "ValidationError":  # CloudFormation's "does not exist"
            return False
        raise
    return any(stack["StackStatus"] != "DELETE_COMPLETE" for stack in stacks)


def _record_stack(cloudformation: Any, stack_name: str, template: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
    """DescribeStacks' view of the deployed stack (step 6)."""
    declared = template.get("Outputs", {})
    record = {"Resources": {},
              "Outputs": {name: {"Value": value if isinstance(value, str) else json.dumps(value),
                                 **({"Description": declared[name]["Description"]}
                                    if isinstance(declared[name].get("Description"), str) else {})}
                          for name, value in outputs.items()}}
    if isinstance(template.get("Description"), str):
        record["Description"] = template["Description"]
    cloudformation.create_stack(StackName=stack_name, TemplateBody=json.dumps(record))


def _enforce_iam(endpoint: str) -> None:
    """From now on every call is authorized against its caller's policies, as on AWS, where the
    stack went into this process's LocalCloud (whose glue evaluates them and whose harness keeps
    an administrator); a bare moto server is left as it is."""
    from localcloud.glue import active_cloud

    cloud = active_cloud()
    if cloud is not None and cloud.endpoint == endpoint.rstrip("/"):
        from localcloud.glue import iam

        iam.enforce(True)


def _session(region: str) -> boto3.session.Session:
    session = boto3.session.Session(region_name=region)
    if session.get_credentials() is None:
        # Until a deploy enforces IAM the local endpoint accepts any key; never fall through
        # to a real account's.
        session = boto3.session.Session(region_name=region, aws_access_key_id="local",
                                        aws_secret_access_key="local")
    return session


def _availability_zones(session: boto3.session.Session, endpoint: str, region: str) -> list[str]:
    ec2 = session.client("ec2", region_name=region, endpoint_url=endpoint)
    return sorted(zone["ZoneName"] for zone in ec2.describe_availability_zones()["AvailabilityZones"])


def _pseudo_parameters(request: DeployRequest, account_id: str) -> dict[str, Any]:
    stack_id = uuid.uuid5(uuid.NAMESPACE_URL, f"{request.endpoint}/{request.stack_name}")
    return {
        "AWS::Region": request.region,
        "AWS::AccountId": account_id,
        "AWS::StackName": request.stack_name,
        "AWS::StackId": f"arn:aws:cloudformation:{request.region}:{account_id}:stack/{request.stack_name}/{stack_id}",
        "AWS::Partition": "aws",
        "AWS::URLSuffix": "amazonaws.com",
        "AWS::NotificationARNs": [],
    }


def _condition(resolver: Resolver, name: str, where: str) -> bool:
    if name not in resolver.conditions:
        raise TemplateError(f"{where}: Condition {name!r} is not declared in Conditions")
    return resolver.conditions[name]


def _check_supported(resources: Mapping[str, Mapping[str, Any]]) -> None:
    problems = []
    for logical_id, resource in resources.items():
        resource_type = resource.get("Type")
        if resource_type not in RESOURCE_TYPES:
            problems.append(f"{logical_id}: resource type {resource_type!r} is not supported "
                            f"(supported: {', '.join(sorted(RESOURCE_TYPES))})")
            continue
        unknown_keys = sorted(set(resource) - _INERT_RESOURCE_KEYS)
        if unknown_keys:
            problems.append(f"{logical_id}: resource attribute(s) {unknown_keys} are not supported")
        given = set(resource.get("Properties", {}))
        unknown_properties = sorted(given - RESOURCE_TYPES[resource_type].accepted)
        if unknown_properties:
            problems.append(f"{logical_id} ({resource_type}): propert(y/ies) {unknown_properties} not supported")
        missing = sorted(RESOURCE_TYPES[resource_type].required - given)
        if missing:
            problems.append(f"{logical_id} ({resource_type}): required propert(y/ies) {missing} missing")
    if problems:
        raise UnsupportedResourcesError(problems)


def _check_functions_runnable(resources: Mapping[str, Mapping[str, Any]], resolver: Resolver, lam: Any) -> None:
    """Refuse, before anything is created, functions the local cloud could not run: a runtime
    without an interpreter here, another language, a container image, a layer that is neither
    of this stack, nor of the local cloud, nor a public one it maps (lambda_runtimes)."""
    problems = []
    for logical_id, resource in resources.items():
        if resource.get("Type") != "AWS::Lambda::Function":
            continue
        where = f"Resources.{logical_id}.Properties"
        properties = resource.get("Properties", {})
        layers = [resolver.resolve(layer, f"{where}.Layers") for layer in properties.get("Layers", [])
                  if not references(layer) & set(resources)]  # this stack's own layers will exist
        problems += [f"{logical_id}: {problem}" for problem in function_problems(
            resolver.resolve(properties.get("Runtime"), f"{where}.Runtime"),
            resolver.resolve(properties.get("PackageType"), f"{where}.PackageType"),
            layers, lambda arn: _layer_exists(lam, arn))]
    if problems:
        raise UnsupportedResourcesError(problems)


def _layer_exists(lam: Any, arn: str) -> bool:
    """Whether `arn` (arn:aws:lambda:REGION:ACCOUNT:layer:NAME:VERSION) is a layer version of the
    local cloud; asked by name and version, the one form moto answers."""
    _, is_layer, layer = arn.partition(":layer:")
    name, _, version = layer.partition(":")
    if not is_layer or not version.isdigit():
        return False
    try:
        lam.get_layer_version(LayerName=name, VersionNumber=int(version))
        return True
    except lam.exceptions.ResourceNotFoundException:
        return False


def _check_aws_managed_policies(resources: Mapping[str, Mapping[str, Any]], resolver: Resolver, iam: Any) -> None:
    """Refuse, before anything is created, roles that attach AWS managed policies the local IAM
    does not have (moto loads them only when asked to)."""
    unknown = []
    for logical_id, resource in resources.items():
        for index, policy in enumerate(resource.get("Properties", {}).get("ManagedPolicyArns", [])):
            if references(policy) & set(resources):
                continue  # a policy of this stack: it will exist once created
            arn = resolver.resolve(policy, f"Resources.{logical_id}.Properties.ManagedPolicyArns[{index}]")
            if not arn.startswith("arn:aws:iam::aws:policy/"):
                continue
            try:
                iam.get_policy(PolicyArn=arn)
            except iam.exceptions.NoSuchEntityException:
                unknown.append(f"{logical_id}: {arn}")
    if unknown:
        raise DeployError("the local IAM does not know these AWS managed policies (nothing was created); start "
                          "the local cloud with MOTO_IAM_LOAD_MANAGED_POLICIES=true:\n  " + "\n  ".join(unknown))


def _create(resource: Mapping[str, Any], context: Context, resolver: Resolver,
            created_so_far: list[str]) -> DeployedResource:
    logical_id, resource_type = context.logical_id, resource["Type"]
    properties = resolver.resolve(resource.get("Properties", {}), f"Resources.{logical_id}.Properties")
    try:
        result = RESOURCE_TYPES[resource_type].create(context, properties)
    except KeyError as missing:  # top-level required properties were checked: this is a nested one
        raise ResourceCreateError(logical_id, resource_type, f"missing required key {missing} in its properties",
                                  created_so_far) from missing
    except (ClientError, BotoCoreError, ResponseParserError, ValueError, RuntimeError) as error:
        raise ResourceCreateError(logical_id, resource_type, str(error), created_so_far) from error
    resolver.ref_of[logical_id] = result.physical_id
    resolver.attributes_of[logical_id] = result.attributes
    return DeployedResource(resource_type, result.physical_id, result.arn)


def _output_value(resolver: Resolver, name: str, output: Mapping[str, Any]) -> Any:
    if "Value" not in output:
        raise TemplateError(f"Outputs.{name} has no Value")
    return resolver.resolve(output["Value"], f"Outputs.{name}.Value")


# --- packaging ------------------------------------------------------------------------------

# (resource type, property) that name a local artifact, and how the S3 copy is written back.
_ARTIFACT_PROPERTIES = {
    ("AWS::Serverless::Function", "CodeUri"): lambda bucket, key: f"s3://{bucket}/{key}",
    ("AWS::Serverless::StateMachine", "DefinitionUri"): lambda bucket, key: f"s3://{bucket}/{key}",
    ("AWS::Serverless::LayerVersion", "ContentUri"): lambda bucket, key: f"s3://{bucket}/{key}",
    ("AWS::Lambda::Function", "Code"): lambda bucket, key: {"S3Bucket": bucket, "S3Key": key},
    ("AWS::StepFunctions::StateMachine", "DefinitionS3Location"): lambda bucket, key: {"Bucket": bucket, "Key": key},
}
_ZIPPED_PROPERTIES = {"CodeUri", "Code", "ContentUri"}


def _package(template: dict[str, Any], base: Path, s3: Any, bucket: str, region: str) -> dict[str, str]:
    """Upload local artifact paths to `bucket`, rewrite the template to point at them, and
    return where each went (local path -> s3:// URI)."""
    targets = [(resource.get("Type"), resource.get("Properties", {}))
               for resource in template["Resources"].values() if isinstance(resource, dict)]
    global_function = template.get("Globals", {}).get("Function")
    if global_function:
        targets.append(("AWS::Serverless::Function", global_function))
    uploaded: dict[Path, str] = {}  # local path -> key; functions often share one CodeUri
    for resource_type, properties in targets:
        for (artifact_type, name), to_reference in _ARTIFACT_PROPERTIES.items():
            local = properties.get(name) if artifact_type == resource_type else None
            if not isinstance(local, str) or local.startswith("s3://"):
                continue
            path = (base / local).resolve()
            if not path.exists():
                raise TemplateError(f"{resource_type} {name}={local!r}: no such file or folder under {base}")
            if path not in uploaded:
                if not uploaded:
                    _ensure_bucket(s3, bucket, region)
                zipped = name in _ZIPPED_PROPERTIES and path.is_dir()
                body = _zip_folder(path) if zipped else path.read_bytes()
                uploaded[path] = f"{hashlib.sha256(body).hexdigest()}{'.zip' if zipped else path.suffix}"
                s3.put_object(Bucket=bucket, Key=uploaded[path], Body=body)
            properties[name] = to_reference(bucket, uploaded[path])
    return {str(path): f"s3://{bucket}/{key}" for path, key in uploaded.items()}


def _zip_folder(folder: Path) -> bytes:
    """The folder's source files as a zip with fixed timestamps (same code, same key)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for relative in _source_files(folder):
            info = zipfile.ZipInfo(str(relative), date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, (folder / relative).read_bytes(), zipfile.ZIP_DEFLATED)
    return buffer.getvalue()


def _source_files(folder: Path) -> list[Path]:
    """Files under `folder` that belong in a package: inside a git work tree, those git does not
    ignore (so `CodeUri: .` never packs a virtualenv or run outputs); elsewhere every file but
    hidden ones and bytecode."""
    try:
        listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "."],
                                 cwd=folder, capture_output=True, timeout=30, check=True).stdout
        files = [Path(name) for name in listing.decode().split("\0") if name]
        return sorted(name for name in files if (folder / name).is_file())
    except (OSError, subprocess.SubprocessError):
        return sorted(path.relative_to(folder) for path in folder.rglob("*")
                      if path.is_file() and path.suffix != ".pyc"
                      and not any(part.startswith(".") or part == "__pycache__"
                                  for part in path.relative_to(folder).parts))


def _ensure_bucket(s3: Any, bucket: str, region: str) -> None:
    location = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    try:
        s3.create_bucket(Bucket=bucket, **location)
    except ClientError as error:
        if error.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":
            raise


OUTPUT_CHARS = 100
"""Most characters of an output's value in the summary (the JSON has it whole)."""


def format_stack(stack: DeployedStack, as_json: bool = False) -> str:
    """The deploy result for the command line: what was made, by type, and the stack's outputs,
    one a line; or (`as_json`) every resource, skipped condition and output, as indented JSON."""
    if as_json:
        return json.dumps(stack.as_dict(), indent=2, sort_keys=False, default=str)
    kinds = Counter(resource.resource_type.removeprefix("AWS::") for resource in stack.resources.values())
    made = ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
    lines = [f"deployed stack {stack.stack_name} in {stack.region}: {len(stack.resources)} resources ({made})"]
    if stack.skipped:
        lines.append(f"skipped (condition false): {', '.join(sorted(stack.skipped))}")
    width = max((len(name) for name in stack.outputs), default=0)
    lines += [f"  {name:<{width}}  {_short(str(value))}" for name, value in stack.outputs.items()]
    return "\n".join(lines)


def _short(value: str) -> str:
    return value if len(value) <= OUTPUT_CHARS else value[:OUTPUT_CHARS - 1] + "…"
