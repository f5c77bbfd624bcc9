"""localcloud.scale at four nodes: the deployed state machine drives stand-in nodes forked from the
warm image through a kill, a Spot notice and an AWS Health retirement, and the figures bench/scale.py
prints are counted (the 512-node run is the same code, too long for the suite)."""

import json
import sys
from pathlib import Path

import pytest

from localcloud.waiting import run_captured

REPO = Path(__file__).resolve().parent.parent
LIMITS = {"states": 256 * 1024, "dynamodb": 400 * 1024, "events": 256 * 1024}
"""Step Functions' state payload, DynamoDB's item and EventBridge's event limits."""


@pytest.fixture(scope="module")
def figures() -> dict:
    # A process of its own: the local cloud imports the deployed copy of the handlers.
    done = run_captured([sys.executable, "-m", "localcloud.scale", "--nodes", "4", "--steady-s", "20"],
                        what="a four-node scale run", cwd=REPO)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_run_recovers_from_each_failure_by_replacing_one_node_and_completes(figures):
    assert figures["state"] == "SUCCEEDED" and figures["restarts"] == 3
    assert [recovery["failure"] for recovery in figures["recoveries"]] == ["kill", "spot", "health"]
    assert [recovery["attempt"] for recovery in figures["recoveries"]] == [1, 2, 3]
    assert figures["instances_launched"] == 4 + 3, "one replacement a failure, nothing more"
    for recovery in figures["recoveries"]:
        assert 0 < recovery["to_training_s"] <= recovery["seconds"]


@pytest.mark.slow
def test_every_phase_is_counted_and_no_payload_nears_its_limit(figures):
    assert set(figures["phases"]) >= {"allocate_to_ready", "steady_training", "recovery_kill", "teardown"}
    steady = figures["per_training_hour"]
    assert steady["lambda_invocations"] > 0 and steady["dynamodb_writes"] > 0
    assert steady["state_transitions"] == 0, "steady training moves no state"
    for kind, payload in figures["largest_payloads"].items():
        assert payload["size_bytes"] < LIMITS[kind] / 8, (kind, payload)


@pytest.mark.slow
def test_the_nodes_copied_their_artifacts_from_their_copies_within_s3s_prefix_rates(figures):
    s3 = figures["s3_prefixes"]
    assert s3["slowdowns"] == 0
    artifacts = s3["busiest_artifacts_read"]
    assert artifacts["prefix"] and 0 < artifacts["requests_in_a_second"] <= artifacts["limit"] == 5500
