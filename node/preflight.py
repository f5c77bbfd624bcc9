"""Preflight as the agent runs it: `python -m node.health` in a subprocess (the agent never
imports torch), or, under the stand-in trainer, nothing probed."""

from __future__ import annotations

import json
import subprocess
import sys

from node.trainer_process import OUTPUT_TAIL_CHARS
from trainfleet.core.events import HealthCheckResult

HEALTH_TIMEOUT_S = 300
"""Longest preflight; beyond it the node is unhealthy."""


def standin_preflight() -> tuple[list[HealthCheckResult], str | None]:
    """With the stand-in trainer nothing on the node is probed: one check, skipped, says so."""
    return [HealthCheckResult(name="preflight", passed=False, skipped=True,
                              detail="stand-in trainer (TRAINFLEET_STANDIN_STEP_S): the node's devices and "
                                     "network are not probed")], None


def run_preflight(instance_type: str) -> tuple[list[HealthCheckResult], str | None]:
    """The checks and, when the node must not train, why."""
    command = [sys.executable, "-m", "node.health", "--instance-type", instance_type]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=HEALTH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [], f"preflight did not finish within {HEALTH_TIMEOUT_S} s"
    if done.returncode != 0:
        return [], f"preflight failed with exit code {done.returncode}: {done.stderr[-OUTPUT_TAIL_CHARS:]}"
    checks = [HealthCheckResult.model_validate(item) for item in json.loads(done.stdout)]
    failed = [check for check in checks if check.failed]
    return checks, "; ".join(f"{check.name}: {check.detail}" for check in failed) or None
