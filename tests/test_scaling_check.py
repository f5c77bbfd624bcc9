"""The scaling check (trainer/scaling_check.py): the verdict over plain timings, the clocks, the
control plane's answer to a slow node it names, and a real two-rank pipeline under torchrun
whose first steps are judged."""

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from localcloud.waiting import run_captured

from test_lifecycle import SPARE, T0, WORKERS, make_run, make_spec, scaling_figures
from trainer import scaling_check
from trainer.scaling_check import ComputeClock, Pipeline, RankTiming, slow_ranks, verdict
from trainfleet.core import lifecycle as lc
from trainfleet.core.events import ScalingChecked
from trainfleet.core.records import FailureClass, RecoveryAction

TOKENS_PER_STEP = 1000
FACTOR = 1.25


NO_PIPELINE = Pipeline("1f1b", 1, 4, 1)
TWO_STAGES = Pipeline("1f1b", 2, 4, 1)  # a bubble of 1/4 of a stage's compute


def timing(rank: int, stages: tuple[int, ...], compute: float, step: float = 1.0, finish: float = 0.0) -> RankTiming:
    """A rank whose compute is a third forward and two thirds backward, as a transformer's is."""
    return RankTiming(rank, f"node-{rank}", stages, compute / 3, 2 * compute / 3, 0.0, finish, step)


def judge(timings: list[RankTiming], pipeline: Pipeline = NO_PIPELINE, floor: float = 0.7, steps: int = 5):
    return verdict(timings, pipeline, floor, FACTOR, TOKENS_PER_STEP, steps)


def test_the_bubble_is_the_schedules_from_the_slowest_stages_forward_backward_and_weight_times():
    stage = RankTiming(0, "node-0", (0,), 0.8, 1.2, 0.8, 0.0, 1.0)   # over 8 microbatches: F 0.1, B 0.15, W 0.1
    assert NO_PIPELINE.bubble(stage) == 0.0
    assert Pipeline("1f1b", 4, 8, 1).bubble(stage) == pytest.approx(3 * 0.35), "3 hops of a whole microbatch"
    assert Pipeline("interleaved-1f1b", 4, 4, 2).bubble(stage) == pytest.approx(3 * 0.35), "each chunk is half"
    # A zero-bubble schedule fills with the longer of forward and input gradient, the weight
    # gradients filling the rest: (pp - 1) max(F, B, F + B - W).
    assert Pipeline("interleaved-zero-bubble", 4, 4, 2).bubble(stage) == pytest.approx(3 * 0.15)


def test_the_slowest_stage_sets_the_expected_step():
    # pp=2 x dp=2: stage 1 (the head) computes more; the step is what its pace allows.
    timings = [timing(0, (0,), 0.4), timing(1, (0,), 0.41), timing(2, (1,), 0.6), timing(3, (1,), 0.62)]
    result = judge(timings, TWO_STAGES)
    assert result.slowest_stages == [1] and result.slowest_stage_seconds == 0.6
    assert result.expected_step_seconds == pytest.approx(0.75)
    assert result.efficiency == pytest.approx(0.75) and result.passed
    assert result.slowest_stage_nodes == ["node-2", "node-3"]
    assert result.slowest_rank == 3 and result.slowest_rank_seconds == 0.62
    assert result.tokens_per_second == pytest.approx(TOKENS_PER_STEP)
    assert result.expected_tokens_per_second == pytest.approx(TOKENS_PER_STEP / 0.75)


def test_a_stage_needs_what_its_fastest_rank_computes():
    # One data-parallel peer is slow: the others show what the stage needs; the world waits on
    # the slow one, and the step falls below what the compute predicts.
    timings = [timing(0, (0,), 0.5, step=1.6), timing(1, (0,), 1.5, step=1.6)]
    result = judge(timings)
    assert result.expected_step_seconds == 0.5 and not result.passed
    assert result.slowest_rank == 1 and result.slowest_rank_node == "node-1"


def test_the_end_of_the_step_is_expected_as_the_rank_that_waits_least_measures_it():
    # Rank 1 reached the step's all-reduce last: its 0.1 s is the reduction and optimizer alone;
    # rank 0 waited for it besides.
    timings = [timing(0, (0,), 0.4, step=1.0, finish=0.5), timing(1, (1,), 0.6, step=1.0, finish=0.1)]
    result = judge(timings, TWO_STAGES, floor=0.8)
    assert result.finish_seconds == 0.1
    assert result.expected_step_seconds == pytest.approx(0.6 * 1.25 + 0.1) and result.passed
    assert not judge([timing(0, (0,), 0.4, finish=0.0), timing(1, (1,), 0.6, finish=0.0)], TWO_STAGES, 0.8).passed


def test_a_rank_far_slower_than_its_peers_is_slow_and_a_rank_without_peers_never_is():
    timings = [timing(0, (0,), 1.0), timing(1, (0,), 1.02), timing(2, (0,), 1.6), timing(3, (0,), 0.98),
               timing(4, (1,), 9.0)]
    assert [t.rank for t in slow_ranks(timings, FACTOR)] == [2]
    assert slow_ranks([timing(0, (0,), 0.5), timing(1, (0,), 0.6)], FACTOR) == [], "within the factor"
    assert [t.rank for t in slow_ranks([timing(0, (0,), 0.5), timing(1, (0,), 1.5)], FACTOR)] == [1]


def test_a_throttled_gpu_below_the_floor_names_its_node_to_replace():
    # dp=4 on one stage: rank 2 computes 1.6x its peers' time; the whole world waits on it.
    timings = [timing(rank, (0,), 1.6 if rank == 2 else 1.0, step=1.7) for rank in range(4)]
    result = judge(timings)
    assert not result.passed and result.slow_nodes == ["node-2"]
    assert "slow: node-2" in result.describe()


def test_a_uniformly_poor_world_names_no_node():
    timings = [timing(rank, (rank % 2,), 0.5, step=2.0) for rank in range(4)]
    result = judge(timings)
    assert not result.passed and result.slow_nodes == []


def test_a_world_that_passed_names_no_node_even_with_a_slow_rank():
    timings = [timing(0, (0,), 1.0, step=1.1), timing(1, (0,), 1.3, step=1.1), timing(2, (0,), 1.0, step=1.1)]
    result = judge(timings, floor=0.5)
    assert result.passed and result.slow_nodes == [] and result.slowest_rank == 1


def test_the_clock_times_each_kind_of_compute_and_the_end_of_the_step_apart(monkeypatch):
    now = [100.0]  # the host's clock, moved by hand: a loaded machine cannot stretch the figures

    def spend(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(scaling_check.time, "perf_counter", lambda: now[0])
    clock = ComputeClock(torch.device("cpu"))
    with clock.timed("forward"):
        spend(0.05)
    with clock.timed("backward"):
        spend(0.02)
    spend(0.03)  # gradient reduction, optimizer
    clock.end_step()
    compute, finish = clock.take()
    assert compute == pytest.approx({"forward": 0.05, "backward": 0.02, "weight": 0.0})
    assert finish == pytest.approx(0.03)
    assert clock.take() == ({"forward": 0.0, "backward": 0.0, "weight": 0.0}, 0.0), \
        "taken: the next step starts from nothing"


def slow_node_figures(slow: list[str]):
    return scaling_figures(False).model_copy(update={"slow_instance_ids": slow})


def test_a_scaling_check_naming_a_node_replaces_it_with_the_spare_and_checks_again():
    checked = ScalingChecked(run_name="r1", attempt=1, instance_id="i-1", figures=slow_node_figures(["i-3"]))
    failure = lc.classify_event(checked, attempt=1, observed_at=T0)
    assert (failure.failure_class, failure.instance_ids) == (FailureClass.POOR_SCALING, ["i-3"])
    assert "slow: i-3" in failure.message
    decision = lc.decide_recovery(make_run(), [*WORKERS, SPARE], failure, 0.0, now=T0)
    assert decision.action is not RecoveryAction.GIVE_UP
    assert decision.terminate_instance_ids == ["i-3"] and decision.promote_spare_ids == ["i-9"]
    failed = make_run(make_spec(scaling_check={"enabled": True}), scaling_check=slow_node_figures(["i-3"]))
    assert lc.build_launch_spec(failed, WORKERS, None).trainer_config["scaling_check"]["enabled"], \
        "the new world is checked again: no world of the run has passed"


def test_a_uniformly_poor_world_still_ends_the_run():
    checked = ScalingChecked(run_name="r1", attempt=1, instance_id="i-1", figures=slow_node_figures([]))
    failure = lc.classify_event(checked, attempt=1, observed_at=T0)
    decision = lc.decide_recovery(make_run(), [*WORKERS, SPARE], failure, 0.0, now=T0)
    assert decision.action is RecoveryAction.GIVE_UP and "does not scale" in decision.reason


def test_a_world_waiting_on_its_hand_offs_fails_and_names_its_slowest_stage():
    timings = [timing(0, (0, 3), 0.1, step=2.0), timing(1, (1, 2), 0.12, step=2.0)]
    result = judge(timings, Pipeline("interleaved-1f1b", 2, 4, 2), floor=0.5, steps=3)
    assert not result.passed and result.efficiency == pytest.approx(0.12 * 1.125 / 2.0)
    assert result.slowest_stages == [1, 2]
    assert "slowest stage 1, 2" in result.describe()


def test_the_measured_step_is_the_median_of_the_ranks():
    timings = [timing(0, (0,), 0.5, step=1.0), timing(1, (1,), 0.5, step=1.0), timing(2, (2,), 0.5, step=9.0)]
    assert judge(timings).step_seconds == 1.0


@pytest.mark.slow
def test_a_two_rank_pipeline_judges_its_first_steps_and_trains_on(tmp_path: Path):
    """pp=2 under torchrun: rank 0 writes the verdict after the warm-up and timed steps, and a
    world that passed trains to its last step."""
    result_file = tmp_path / "scaling-check.json"
    completed = run_captured(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "trainer.train",
         "--config", "trainer/configs/small.toml", "--model.n_layers=2", "--model.d_model=32", "--model.seq_len=32",
         "--parallel.microbatches=2", "--training.batch_size=4", "--training.steps=8", "--optim.warmup_steps=1",
         f"--training.metrics_file={tmp_path / 'metrics.jsonl'}", f"--data.shards={tmp_path / 'data'}",
         "--data.corpus=stdlib", "--data.corpus_bytes=50000", "--scaling_check.enabled=true", "--scaling_check.warmup_steps=2",
         "--scaling_check.steps=3", "--scaling_check.efficiency_floor=0.01",
         f"--scaling_check.result_file={result_file}"],
        what="a two-rank pipeline", cwd=Path(__file__).resolve().parent.parent)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    result = json.loads(result_file.read_text())
    assert result["passed"] and result["steps"] == 3 and 0 < result["efficiency"]
    assert result["step_seconds"] > 0 and result["expected_step_seconds"] > 0 and result["slow_nodes"] == []
    assert 0 < result["finish_seconds"] < result["step_seconds"], "the optimizer's end of the step was timed"
    assert sorted(result["slowest_stages"]) in ([0], [1])
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
