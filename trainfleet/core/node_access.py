"""What a run's nodes may touch: the prefixes of the stack's bucket (template.yaml's NodePolicy
grants exactly these, tests/test_iam_policies.py checks both agree) and their log streams.

    NODE_READ_PREFIXES, NODE_WRITE_PREFIXES   the bucket's prefixes the nodes read and write
    node_access_problems(spec, bucket)        the RunSpec's S3 URIs that fall outside them: a
                                              RunSpec naming one would fail on the nodes with
                                              AccessDenied after the fleet was paid for
    image_parameter_problem(spec, stack_name)  an image id read from an SSM parameter the
                                              functions may not read (IMAGE_PARAMETER_PREFIXES)
    node_log_group, node_log_stream           where a node's log goes in CloudWatch Logs
"""

from __future__ import annotations

from trainfleet.core.runspec import RunSpec

NODE_READ_PREFIXES = ("runs/", "data/", "models/", "artifacts/")
"""Readable by the nodes: their run's folder under runs/ (launch spec, checkpoints), token
shards, models imported for runs to start from (`trainfleet checkpoint import`), and the
wheelhouse the user data installs."""
NODE_WRITE_PREFIXES = ("runs/",)
"""Writable (and deletable) by the nodes: their run's folder under runs/ (checkpoints and what
else a run writes)."""


def node_access_problems(spec: RunSpec, bucket: str) -> list[str]:
    """`field: problem` for each S3 URI of the RunSpec the nodes could not use in `bucket`."""

    def outside(uri: str, prefixes: tuple[str, ...]) -> bool:
        return not any(uri.startswith(f"s3://{bucket}/{prefix}") for prefix in prefixes)

    def allowed(prefixes: tuple[str, ...]) -> str:
        return ", ".join(f"s3://{bucket}/{prefix}" for prefix in prefixes)

    problems = []
    own = f"s3://{bucket}/runs/{spec.run_name}/"
    if outside(spec.checkpoint.s3_uri + "/", NODE_WRITE_PREFIXES):
        problems.append(f"checkpoint.s3_uri: the nodes write checkpoints only under "
                        f"{allowed(NODE_WRITE_PREFIXES)} (this stack's bucket, NodePolicy) "
                        f"(got {spec.checkpoint.s3_uri!r})")
    elif not (spec.checkpoint.s3_uri + "/").startswith(own):
        # A RunSpec copied under a new name must not resume, prune or retain another run's steps.
        problems.append(f"checkpoint.s3_uri: a run's checkpoints are its own, under {own} "
                        f"(got {spec.checkpoint.s3_uri!r})")
    sections = spec.trainer.model_dump()
    for section, name in (("data", "shards"), ("training", "init_from")):
        uri = str(sections.get(section, {}).get(name, ""))
        if uri.startswith("s3://") and outside(uri.rstrip("/") + "/", NODE_READ_PREFIXES):
            problems.append(f"trainer.{section}.{name}: the nodes read only under "
                            f"{allowed(NODE_READ_PREFIXES)} (this stack's bucket, NodePolicy) (got {uri!r})")
        elif uri.startswith(f"s3://{bucket}/runs/") and not (uri.rstrip("/") + "/").startswith(own):
            problems.append(f"trainer.{section}.{name}: under runs/ a run's nodes read their own run's folder alone, "
                            f"{own} (got {uri!r})")
    return problems


IMAGE_PARAMETER_PREFIXES = ("/aws/service/", "/trainfleet/{stack}/")
"""The SSM parameters an image id may be resolved from (`resolve:ssm:PARAMETER`): AWS's public
ones (the Deep Learning AMIs) and the stack's own. EC2 resolves the parameter with the launching
function's permissions, which template.yaml grants on these alone: not every parameter of the
account, where secrets live too."""


def image_parameter_problem(spec: RunSpec, stack_name: str) -> str | None:
    """`image_id: problem` when the RunSpec's image is an SSM parameter outside
    IMAGE_PARAMETER_PREFIXES: EC2 would refuse the launch after Allocate made the run's roles."""
    if not spec.image_id.startswith("resolve:ssm:"):
        return None
    parameter = "/" + spec.image_id.removeprefix("resolve:ssm:").lstrip("/").rsplit(":", 1)[0]
    allowed = [prefix.format(stack=stack_name) for prefix in IMAGE_PARAMETER_PREFIXES]
    if any(parameter.startswith(prefix) for prefix in allowed):
        return None
    return (f"image_id: the functions resolve image parameters only under {' or '.join(allowed)} "
            f"(got {spec.image_id!r}): put the image id in a parameter under {allowed[1]}")


def node_log_group(stack_name: str) -> str:
    """The CloudWatch Logs group of the stack's nodes (template.yaml's NodeLogGroup)."""
    return f"/trainfleet/{stack_name}/nodes"


def node_log_stream(run_name: str, instance_id: str) -> str:
    """A node's stream in node_log_group: under its run's name, the prefix its role may write."""
    return f"{run_name}/{instance_id}"


