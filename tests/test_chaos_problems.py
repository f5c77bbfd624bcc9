"""The promises a chaos cell is judged by (localcloud.chaos.problems), over plain outcomes: each
broken promise is named, and a clean outcome has none."""

import pytest

from localcloud.chaos import CELLS, problems

TEMPLATE = {"trainer": {"training": {"steps": 40}}}
REFERENCE = {step: 5.0 - step / 10 for step in range(1, 41)}
LOST = {"attempt": 0, "failure_class": "INSTANCE_LOST", "message": "EC2 reports instance i-1 terminated"}
HUNG = {"attempt": 1, "failure_class": "HANG", "message": "States.HeartbeatTimeout: no heartbeat from training"}


def clean_outcome(**changes) -> dict:
    outcome = {
        "status": "SUCCEEDED", "error": None, "cause": None,
        "run": {"latest_checkpoint": 40},
        "losses": {0: {step: REFERENCE[step] for step in range(1, 26)},
                   1: {step: REFERENCE[step] for step in range(21, 41)}},
        "s3": {"markers": [(100.0, 10), (110.0, 20), (130.0, 30), (140.0, 40)],
               "launches": [(90.0, 0, None), (120.0, 1, 20)]},
        "injections": [{"fault": "kill", "target": "i-1", "phase": "training", "at": 115.0, "step": 25}],
        "nodes": {"i-1": {"failure": "INSTANCE_LOST"}, "i-0": {"failure": None}, "i-2": {"failure": None}},
        "leftovers": {"instances": [], "placement_groups": [], "launch_templates": []},
        "report": {"unaccounted_seconds": 0.0, "ledger": {"lost_by_cause": {"startup": 10.0}},
                   "failures": [LOST]},
    }
    return outcome | changes


def test_a_clean_outcome_breaks_no_promise():
    assert problems(CELLS["kill@training"], clean_outcome(), REFERENCE, TEMPLATE) == []


@pytest.mark.parametrize("changes, named", [
    ({"status": "FAILED"}, "run FAILED"),
    ({"losses": {0: {1: 9.9}}}, "losses differ"),
    ({"s3": {"markers": [(100.0, 10)], "launches": [(120.0, 1, 20)]}}, "not committed when it launched"),
    ({"s3": {"markers": [(100.0, 10), (110.0, 20)], "launches": [(120.0, 1, 10)]}}, "older than the committed 20"),
    ({"s3": {"markers": [(100.0, 10)], "launches": [(120.0, 1, None)]}}, "older than the committed 10"),
    ({"nodes": {"i-1": {"failure": "INSTANCE_LOST"}, "i-0": {"failure": "HANG"}}}, "no fault hit were blamed"),
    ({"leftovers": {"instances": ["i-2"], "placement_groups": [], "launch_templates": []}}, "instances left behind"),
    ({"report": {"unaccounted_seconds": 3.0, "ledger": {"lost_by_cause": {}}, "failures": [LOST]}},
     "every second"),
    ({"report": {"unaccounted_seconds": 0.0, "ledger": {"lost_by_cause": {}}, "failures": [LOST, HUNG]}},
     "failures booked: 2, faults of nodes: 1"),
])
def test_each_broken_promise_is_named(changes, named):
    found = problems(CELLS["kill@training"], clean_outcome(**changes), REFERENCE, TEMPLATE)
    assert any(named in problem for problem in found), found


def test_a_spot_notice_must_lose_nothing_trained_before_it():
    notice = [{"fault": "spot", "target": "i-1", "phase": "training", "at": 115.0, "step": 25}]
    spot = CELLS["spot@training"]
    lossless = clean_outcome(injections=notice, s3={"markers": [(100.0, 10), (117.0, 25)],
                                                    "launches": [(90.0, 0, None), (120.0, 1, 25)]})
    assert problems(spot, lossless, REFERENCE, TEMPLATE) == []
    lossy = clean_outcome(injections=notice)  # resumed from 20
    assert any("Spot notice came were lost" in problem for problem in problems(spot, lossy, REFERENCE, TEMPLATE))


def test_a_cell_whose_policy_must_end_the_run_fails_if_it_succeeds():
    found = problems(CELLS["budget-exhausted"], clean_outcome(), REFERENCE, TEMPLATE)
    assert any("restart budget spent" in problem for problem in found)


def test_a_starved_run_may_book_no_failure():
    starved = CELLS["starved"]
    untouched = clean_outcome(injections=[], nodes={"i-0": {"failure": None}, "i-1": {"failure": None}},
                              losses={0: {step: REFERENCE[step] for step in range(1, 41)}},
                              s3={"markers": [(100.0, 10)], "launches": [(90.0, 0, None)]})
    untouched["report"] = untouched["report"] | {"failures": []}
    assert problems(starved, untouched, REFERENCE, TEMPLATE) == []
    untouched["report"]["failures"] = [HUNG]
    assert any("failures booked: 1, faults of nodes: 0" in problem
               for problem in problems(starved, untouched, REFERENCE, TEMPLATE))
