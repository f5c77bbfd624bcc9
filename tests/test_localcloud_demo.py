"""The demo's closing summary, from an outcome as the local run gathers it."""

from localcloud.demo import narrate_outcome


def test_the_summary_shows_the_lost_time_by_cause_largest_first():
    report = {"failures": [{"failure_class": "INSTANCE_LOST", "resume_step": 20}],
              "nodes": {"replaced": ["i-1"]}, "state": "SUCCEEDED", "restarts": 1, "goodput": 0.6,
              "ledger": {"productive_seconds": 60.0, "lost_seconds": 40.0,
                         "lost_by_cause": {"startup": 10.0, "restart:INSTANCE_LOST": 25.0, "finishing": 5.0}}}
    outcome = {"launches": {}, "losses": {0: {1: 2.5}}, "instances": {"i-1": "terminated"}, "report": report,
               "run": {"latest_checkpoint": 20}, "error": None}
    said = []
    narrate_outcome(outcome, said.append)
    assert said[-4:] == [
        "goodput 60% of the run's time: 60.0 s productive, 40.0 s lost",
        "    25.0 s lost to restart:INSTANCE_LOST: backoff, replacement, rendezvous, checkpoint load until the "
        "first step after the failure (INSTANCE_LOST)",
        "    10.0 s lost to startup: allocation, boot, preflight, rendezvous until the first step",
        "     5.0 s lost to finishing: after the final checkpoint or last reported step: the trainer's exit, "
        "the completion event",
    ]
