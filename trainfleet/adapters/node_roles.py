"""Each run's node role and instance profile: made by Allocate, deleted with the run's other
resources (Teardown, the reaper).

    ensure_node_profile(iam, run_name, stack_name, policy_arn) -> the instance profile's ARN
    delete_node_profile(iam, run_name, stack_name)
    delete_stack_node_profiles(iam, stack_name) -> the names deleted: every run's, as the stack goes

The role is /trainfleet/STACK/tf-DIGEST-RUN, tagged trainfleet:run=RUN and trainfleet:stack,
with the stack's NodePolicy attached and nothing else. The policy names the run through the
role's tag (`${aws:PrincipalTag/trainfleet:run}`), so the nodes of one run can read and write
that run's objects and records alone; a run resumed from another (RunSpec.resume_from) is tagged
trainfleet:resume-from=THAT-RUN as well, which lets its nodes read that run's checkpoints. Both
calls are safe to repeat.
"""

import hashlib
import json
from typing import Any

from trainfleet.adapters.ec2_fleet import TAG_RUN, TAG_STACK

__all__ = ["node_role_path", "node_role_name", "ensure_node_profile", "delete_node_profile",
           "delete_stack_node_profiles", "NodeRoleTaken", "TAG_RESUME_FROM"]

TAG_RESUME_FROM = "trainfleet:resume-from"
"""The role's tag naming the run whose checkpoints its nodes may read (NodePolicy)."""

EC2_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


class NodeRoleTaken(RuntimeError):
    """A role of the run's name exists and belongs to another run."""


def node_role_path(stack_name: str) -> str:
    """The IAM path of the stack's node roles and instance profiles (the functions' policies
    reach those under it alone)."""
    return f"/trainfleet/{stack_name}/"


def node_role_name(run_name: str, stack_name: str) -> str:
    """The name of the run's role and instance profile. IAM names are unique in the account
    whatever the path: the stack's digest keeps two stacks' runs of one name apart, in at most
    3 + 8 + 1 + 48 of IAM's 64 characters."""
    return f"tf-{hashlib.sha256(stack_name.encode()).hexdigest()[:8]}-{run_name}"


def _tags(run_name: str, stack_name: str) -> list[dict[str, str]]:
    return [{"Key": TAG_RUN, "Value": run_name}, {"Key": TAG_STACK, "Value": stack_name}]


def ensure_node_profile(iam: Any, run_name: str, stack_name: str, policy_arn: str,
                        resume_from: str | None = None) -> str:
    """The run's instance profile, with its role, made if missing; its ARN. `resume_from`: the run
    whose checkpoints its nodes may read."""
    name, path, tags = node_role_name(run_name, stack_name), node_role_path(stack_name), _tags(run_name, stack_name)
    resumed = [{"Key": TAG_RESUME_FROM, "Value": resume_from}] if resume_from else []
    try:
        iam.create_role(RoleName=name, Path=path, AssumeRolePolicyDocument=json.dumps(EC2_TRUST),
                        Tags=tags + resumed, Description=f"the nodes of run {run_name} of stack {stack_name}")
    except iam.exceptions.EntityAlreadyExistsException:
        found = {tag["Key"]: tag["Value"] for tag in iam.get_role(RoleName=name)["Role"].get("Tags", [])}
        if (found.get(TAG_RUN), found.get(TAG_STACK)) != (run_name, stack_name):
            raise NodeRoleTaken(f"role {name} exists for run {found.get(TAG_RUN)!r} of stack "
                                f"{found.get(TAG_STACK)!r}, not run {run_name!r} of {stack_name!r}") from None
    iam.attach_role_policy(RoleName=name, PolicyArn=policy_arn)
    try:
        profile = iam.create_instance_profile(InstanceProfileName=name, Path=path, Tags=tags)["InstanceProfile"]
    except iam.exceptions.EntityAlreadyExistsException:
        profile = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]
    if not any(role["RoleName"] == name for role in profile.get("Roles", [])):
        iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
    return profile["Arn"]


def delete_node_profile(iam: Any, run_name: str, stack_name: str) -> None:
    """Delete the run's instance profile and role, whatever is left of them. Found by listing
    the stack's path: IAM refuses a Get of a name that does not exist (a run that never
    allocated) as if it were outside the path, where it answers NoSuchEntity to no one."""
    _delete(iam, node_role_path(stack_name), {node_role_name(run_name, stack_name)})


def delete_stack_node_profiles(iam: Any, stack_name: str) -> list[str]:
    """Delete every run's instance profile and role under the stack's path (runs whose teardown
    never finished, runs still going); the names deleted. The stack's NodePolicy cannot be
    deleted while a role has it attached (IAM's DeleteConflict), nor can the stack then."""
    path = node_role_path(stack_name)
    names = {role["RoleName"] for page in iam.get_paginator("list_roles").paginate(PathPrefix=path)
             for role in page["Roles"]}
    names |= {profile["InstanceProfileName"] for page in iam.get_paginator("list_instance_profiles").paginate(
        PathPrefix=path) for profile in page["InstanceProfiles"]}
    _delete(iam, path, names)
    return sorted(names)


def _delete(iam: Any, path: str, names: set[str]) -> None:
    """Delete the instance profiles and roles of `names` under `path` (a profile first: a role in
    one cannot be deleted)."""
    for profile in _listed(iam, "list_instance_profiles", "InstanceProfiles", path, "InstanceProfileName", names):
        for role in profile.get("Roles", []):
            iam.remove_role_from_instance_profile(InstanceProfileName=profile["InstanceProfileName"],
                                                  RoleName=role["RoleName"])
        iam.delete_instance_profile(InstanceProfileName=profile["InstanceProfileName"])
    for role in _listed(iam, "list_roles", "Roles", path, "RoleName", names):
        name = role["RoleName"]
        for policy in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]:
            iam.detach_role_policy(RoleName=name, PolicyArn=policy["PolicyArn"])
        iam.delete_role(RoleName=name)


def _listed(iam: Any, operation: str, key: str, path: str, name_key: str, names: set[str]) -> list[dict[str, Any]]:
    pages = iam.get_paginator(operation).paginate(PathPrefix=path)
    return [entity for page in pages for entity in page[key] if entity[name_key] in names]
