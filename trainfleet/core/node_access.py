"""What a run's nodes may touch: the prefixes of the stack's bucket (template.yaml's NodePolicy
grants exactly these, tests/test_iam_policies.py checks both agree) and their log streams.

    NODE_READ_PREFIXES, NODE_WRITE_PREFIXES   the bucket's prefixes the nodes read and write
    node_access_problems(spec, bucket)        the RunSpec's S3 URIs that fall outside them: a
                                              RunSpec naming one would fail on the nodes with
                                              AccessDenied after the fleet was paid for
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


def node_log_group(stack_name: str) -> str:
    """The CloudWatch Logs group of the stack's nodes (template.yaml's NodeLogGroup)."""
    return f"/trainfleet/{stack_name}/nodes"


def node_log_stream(run_name: str, instance_id: str) -> str:
    """A node's stream in node_log_group: under its run's name, the prefix its role may write."""
    return f"{run_name}/{instance_id}"


