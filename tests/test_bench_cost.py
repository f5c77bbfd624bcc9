"""bench/cost.py's arithmetic: requests priced at the named list prices, and a fleet's cost from
a per-run part and a per-look part fitted through the measured runs, never below zero."""

import importlib.util
import sys
from collections import Counter
from pathlib import Path

import pytest

from trainfleet.core import pace

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("cost_bench", REPO / "bench" / "cost.py")
cost = sys.modules["cost_bench"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(cost)

HANG_S = 600


def test_each_request_is_priced_by_its_service_and_kind():
    rates = cost.Rates(requests=Counter({("dynamodb", "GetItem"): 1e6, ("dynamodb", "TransactWriteItems"): 1e6,
                                         ("s3", "PutObject"): 1000, ("s3", "GetObject"): 1000,
                                         ("s3", "ListObjectsV2"): 1000, ("events", "PutEvents"): 1e6,
                                         ("sqs", "SendMessage"): 1e6, ("sqs", "ReceiveMessage"): 1e6,
                                         ("states", "SendTaskHeartbeat"): 1e6}),
                       transitions=1000, invocations=1e6, gb_seconds=1.0, log_bytes=1e9, metrics=720)
    assert rates.usd_per_hour() == pytest.approx({
        "step_functions": 0.025, "lambda": 0.20 + 0.0000166667, "dynamodb": 0.125 + 2 * 0.625,
        "eventbridge": 1.00, "s3": 2 * 0.005 + 0.0004, "sqs": 2 * 0.40, "cloudwatch": 0.50 + 720 * 0.30 / 720})


def test_a_fleet_is_priced_at_its_look_rate_from_the_measured_sizes():
    per_run, per_look = {"s3": 0.01}, {"s3": 0.002}
    measured = [(nodes, cost.priced(per_run, per_look, nodes, HANG_S)) for nodes in (4, 8, 16)]
    fitted_run, fitted_look = cost.fit(measured, HANG_S)
    assert fitted_run == pytest.approx(per_run) and fitted_look == pytest.approx(per_look)
    # Above FULL_RATE_NODES the looks a second stop growing, and so does the cost.
    at = {nodes: cost.priced(per_run, per_look, nodes, HANG_S)["s3"] for nodes in (256, 512, 4096)}
    assert at[256] == pytest.approx(at[512]) == pytest.approx(at[4096])
    assert at[256] == pytest.approx(0.01 + 0.002 * pace.looks_per_second(256, HANG_S))


def test_noisy_runs_never_fit_a_negative_cost():
    """Two noisy sizes whose line falls with the fleet (the 8-node run cheaper than the 4-node
    one) or starts below zero gave negative costs at 512 nodes; neither part may be negative."""
    falling = [(4, {"s3": 0.010}), (8, {"s3": 0.006}), (4, {"s3": 0.012}), (8, {"s3": 0.007})]
    per_run, per_look = cost.fit(falling, HANG_S)
    assert per_look["s3"] == 0 and per_run["s3"] == pytest.approx(0.00875)
    rising_from_below = [(4, {"s3": 0.001}), (8, {"s3": 0.009}), (16, {"s3": 0.025})]
    per_run, per_look = cost.fit(rising_from_below, HANG_S)
    assert per_run["s3"] == 0 and per_look["s3"] > 0
    for nodes in (4, 64, 512):
        assert cost.priced(per_run, per_look, nodes, HANG_S)["s3"] >= 0
    # Least squares through the runs: repeats of a size pull the line to their mean.
    exact = [(nodes, {"s3": 0.01 + 0.002 * pace.looks_per_second(nodes, HANG_S) + noise})
             for nodes, noise in ((4, 0.001), (4, -0.001), (8, 0.001), (8, -0.001))]
    assert cost.fit(exact, HANG_S)[0]["s3"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="at least two sizes"):
        cost.fit([(4, {"s3": 0.01}), (4, {"s3": 0.02})], HANG_S)
