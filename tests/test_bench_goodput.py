"""bench/goodput.py drives the real lifecycle decisions on simulated time: its books balance, a month
without failures loses only the start-up and the checkpoint stalls, READY spares spare the boot,
and a fault that stays on its node ends in the crash-loop rule."""

import importlib.util
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from localcloud.waiting import run_captured

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("goodput_bench", REPO / "bench" / "goodput.py")
goodput = sys.modules["goodput_bench"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(goodput)

WEEK = goodput.Scenario(nodes=256, days=7.0)
GPU_CHECKS_ONLY = tuple(cause for cause in goodput.CAUSES if cause.seen is goodput.Seen.NODE_CHECK)


def test_without_failures_only_the_start_up_and_the_checkpoint_stalls_are_lost():
    timings = goodput.Timings()
    outcome = goodput.simulate(replace(WEEK, causes=()), timings)
    pace = goodput.Pace.of(WEEK, timings)
    startup = (pace.boot + pace.between_look + pace.rendezvous).total_seconds()
    assert sum(outcome.failures.values()) == 0
    assert outcome.run.ledger.productive_seconds == pytest.approx(outcome.horizon_s - startup)
    assert dict(outcome.lost_s) == pytest.approx({"startup": startup})
    saves = int(outcome.run.ledger.productive_seconds // pace.cadence.total_seconds())
    copies = int(outcome.run.ledger.productive_seconds // pace.step.total_seconds())  # one a step
    blocked = saves * pace.stall + copies * pace.copy_stall
    assert outcome.ettr == pytest.approx((outcome.horizon_s - startup - blocked) / outcome.horizon_s)


def test_in_memory_checkpoints_redo_a_step_where_s3_alone_redoes_the_interval():
    # At 2,048 nodes (a failure every few hours) the copies' staging, 10 ms of a 6 s step, pays for
    # itself; at 256 nodes (`bench/goodput.py --nodes 256`: a failure a day, 76 ms of staging a
    # step as modelled from CPU figures) a copy every step costs more than the work it saves.
    scenario = replace(WEEK, nodes=2048, days=3, causes=GPU_CHECKS_ONLY, spares=41, seed=1, interval_s=30 * 60)
    timings = goodput.Timings()
    from_memory = goodput.simulate(scenario, timings)
    s3_only = goodput.simulate(replace(scenario, memory_copies=False), timings)
    assert sum(from_memory.failures.values()) == sum(s3_only.failures.values()) > 0
    redone = lambda outcome: sum(seconds for cause, seconds in outcome.run.ledger.lost_by_cause.items()  # noqa: E731
                                 if cause.startswith("redone:")) / sum(outcome.failures.values())
    # At most the last report's age (PROGRESS_EVERY_S, its half on average) and the failure's
    # detection and decision: not a share of the 30 minutes since the last commit.
    pace = goodput.Pace.of(scenario, timings)
    assert redone(from_memory) <= goodput.PROGRESS_EVERY_S + (pace.detect + pace.control_plane).total_seconds()
    assert redone(s3_only) > 5 * 60
    assert from_memory.ettr > s3_only.ettr


@pytest.mark.parametrize("spares", [0, 6])
def test_the_ledger_accounts_for_every_simulated_second(spares):
    outcome = goodput.simulate(replace(WEEK, spares=spares, seed=3), goodput.Timings())
    assert sum(outcome.failures.values()) > 0
    assert goodput.unaccounted_seconds(outcome.run) == pytest.approx(0.0, abs=1e-6)
    assert sum(outcome.lost_s.values()) + outcome.run.ledger.productive_seconds == pytest.approx(outcome.horizon_s)


def test_ready_spares_replace_a_failed_node_without_waiting_for_a_boot():
    scenario = replace(WEEK, causes=GPU_CHECKS_ONLY, seed=1)
    without = goodput.simulate(scenario, goodput.Timings())
    with_spares = goodput.simulate(replace(scenario, spares=6), goodput.Timings())
    assert without.failures == with_spares.failures and sum(without.failures.values()) > 0
    assert without.boot_waits == sum(without.failures.values()) and with_spares.boot_waits == 0
    boot = goodput.Timings().boot_s + goodput.Timings().preflight_s
    assert max(with_spares.recoveries_s) < min(without.recoveries_s) - boot / 2
    assert with_spares.ettr > without.ettr


def test_a_world_repaired_in_place_trains_again_sooner_than_one_restarted():
    scenario = replace(WEEK, causes=GPU_CHECKS_ONLY, spares=6, seed=1)
    timings = goodput.Timings()
    repaired = goodput.simulate(scenario, timings)
    restarted = goodput.simulate(replace(scenario, repairs=False), timings)
    assert repaired.failures == restarted.failures and sum(repaired.failures.values()) > 0
    # Every failure here names one sick node, replaced by a READY spare: each is repaired.
    assert repaired.repairs == sum(repaired.failures.values()) and restarted.repairs == 0
    # Confirmed by Recover, the survivors and the spare wait for no look: not for the survivors'
    # trainers to stall, nor their next look; the launch spec is read within a second.
    pace = goodput.Pace.of(scenario, timings)
    confirm = (max(pace.stalled - pace.detect - pace.control_plane, goodput.timedelta()) + pace.between_look)
    saved = (timings.rendezvous_s - timings.trainer_start_s - timings.repair_s + confirm.total_seconds()
             + pace.between_look.total_seconds() - goodput.LAUNCH_SPEC_POLL_S)
    assert statistics.fmean(restarted.recoveries_s) - statistics.fmean(repaired.recoveries_s) == pytest.approx(saved)
    assert repaired.ettr > restarted.ettr
    parts = goodput.failure_to_training(scenario, timings)
    assert parts["the world repaired (store, communicators)"] == timings.repair_s
    assert sum(goodput.failure_to_training(replace(scenario, repairs=False), timings).values()) - sum(
        parts.values()) == pytest.approx(saved)


def test_a_gpu_fault_the_agent_cannot_name_ends_the_run_as_a_crash_loop():
    scenario = replace(WEEK, causes=goodput.gpu_faults_unnamed(GPU_CHECKS_ONLY), seed=1)
    outcome = goodput.simulate(scenario, goodput.Timings())
    assert outcome.gave_up_at_s is not None
    assert outcome.run.error is not None and "crash loop" in outcome.run.error
    assert any(cause.startswith("give_up:") for cause in outcome.run.ledger.lost_by_cause)


@pytest.mark.slow
def test_the_bench_prints_its_table_and_last_line():
    done = run_captured([sys.executable, "bench/goodput.py", "--nodes", "64", "--days", "2", "--seeds", "1"],
                        what="bench/goodput.py", cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("ETTR") for line in lines)
    assert lines[-1].startswith("ettr=") and 0.0 < float(lines[-1].removeprefix("ettr=")) <= 1.0
    assert lines[-2].startswith("ettr_s3_30min=") and 0.0 < float(lines[-2].removeprefix("ettr_s3_30min=")) <= 1.0
