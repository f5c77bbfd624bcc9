"""Typed settings of the control plane, read once from the environment (template.yaml sets them).

    SETTINGS = Settings.from_environ()     # at module level in a handler: fails at cold start

A missing or empty variable raises MissingSetting naming it, instead of a default that would
send writes to the wrong table.
"""

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

__all__ = ["Settings", "MissingSetting"]


class MissingSetting(RuntimeError):
    """A required environment variable is not set."""


class Settings(BaseModel):
    """Where the control plane's resources are."""

    model_config = ConfigDict(frozen=True)

    run_table: str
    """DynamoDB table of run and node records (TRAINFLEET_RUN_TABLE)."""
    liveness_table: str
    """DynamoDB table of the nodes' liveness records (TRAINFLEET_LIVENESS_TABLE)."""
    bucket: str
    """S3 bucket of checkpoints, run reports and agent artifacts (TRAINFLEET_BUCKET)."""
    event_bus: str
    """EventBridge bus the node agents send to (TRAINFLEET_EVENT_BUS)."""
    node_policy_arn: str
    """The policy of every run's node role (TRAINFLEET_NODE_POLICY_ARN; the role's trainfleet:run
    tag names the run it grants)."""
    stack_name: str
    """The stack, prefix of resource names (TRAINFLEET_STACK)."""
    node_subnet_ids: tuple[str, ...] = ()
    """The subnets nodes launch into when a RunSpec names none, in order of preference
    (TRAINFLEET_NODE_SUBNETS, comma-separated): the stack's own, or those it was deployed with."""
    node_security_group_ids: tuple[str, ...] = ()
    """Their security groups (TRAINFLEET_NODE_SECURITY_GROUPS, comma-separated)."""
    metrics_namespace: str = "Trainfleet"
    """CloudWatch namespace of the run metrics (POWERTOOLS_METRICS_NAMESPACE)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        values = {}
        for field, variable in _REQUIRED.items():
            value = environ.get(variable, "").strip()
            if not value:
                raise MissingSetting(f"environment variable {variable} ({field}) is not set")
            values[field] = tuple(value.split(",")) if field in _LISTS else value
        namespace = environ.get("POWERTOOLS_METRICS_NAMESPACE", "").strip()
        if namespace:
            values["metrics_namespace"] = namespace
        return cls(**values)


_REQUIRED = {
    "run_table": "TRAINFLEET_RUN_TABLE",
    "liveness_table": "TRAINFLEET_LIVENESS_TABLE",
    "bucket": "TRAINFLEET_BUCKET",
    "event_bus": "TRAINFLEET_EVENT_BUS",
    "node_policy_arn": "TRAINFLEET_NODE_POLICY_ARN",
    "stack_name": "TRAINFLEET_STACK",
    "node_subnet_ids": "TRAINFLEET_NODE_SUBNETS",
    "node_security_group_ids": "TRAINFLEET_NODE_SECURITY_GROUPS",
}
_LISTS = {"node_subnet_ids", "node_security_group_ids"}
