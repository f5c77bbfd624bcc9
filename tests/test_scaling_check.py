"""The scaling check (trainer/scaling_check.py): the verdict over plain timings, and a real
two-rank pipeline under torchrun whose first steps are judged."""

import json
import sys
from pathlib import Path

import pytest

from localcloud.waiting import run_captured

from trainer.scaling_check import RankTiming, bubble_factor, verdict

TOKENS_PER_STEP = 1000


def timing(rank: int, stages: tuple[int, ...], compute: float, step: float = 1.0) -> RankTiming:
    return RankTiming(rank, f"node-{rank}", stages, compute, step)


def test_the_bubble_of_gpipe_and_1f1b():
    assert bubble_factor(1, 8, 1) == 1.0
    assert bubble_factor(4, 8, 1) == pytest.approx(1 + 3 / 8)
    assert bubble_factor(4, 8, 2) == pytest.approx(1 + 3 / 16), "interleaving shrinks the bubble"


def test_the_slowest_stage_sets_the_expected_step():
    # pp=2 x dp=2: stage 1 (the head) computes more; the step is what its pace allows.
    timings = [timing(0, (0,), 0.4), timing(1, (0,), 0.41), timing(2, (1,), 0.6), timing(3, (1,), 0.62)]
    result = verdict(timings, bubble=1.25, floor=0.7, tokens_per_step=TOKENS_PER_STEP, steps=5)
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
    result = verdict(timings, bubble=1.0, floor=0.7, tokens_per_step=TOKENS_PER_STEP, steps=5)
    assert result.expected_step_seconds == 0.5 and not result.passed
    assert result.slowest_rank == 1 and result.slowest_rank_node == "node-1"


def test_a_world_waiting_on_its_hand_offs_fails_and_names_its_slowest_stage():
    timings = [timing(0, (0, 3), 0.1, step=2.0), timing(1, (1, 2), 0.12, step=2.0)]
    result = verdict(timings, bubble=bubble_factor(2, 4, 2), floor=0.5, tokens_per_step=TOKENS_PER_STEP, steps=3)
    assert not result.passed and result.efficiency == pytest.approx(0.12 * 1.125 / 2.0)
    assert result.slowest_stages == [1, 2]
    assert "slowest stage 1, 2" in result.describe()


def test_the_measured_step_is_the_median_of_the_ranks():
    timings = [timing(0, (0,), 0.5, step=1.0), timing(1, (1,), 0.5, step=1.0), timing(2, (2,), 0.5, step=9.0)]
    assert verdict(timings, 1.0, 0.7, TOKENS_PER_STEP, 5).step_seconds == 1.0


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
         "--data.corpus_bytes=50000", "--scaling_check.enabled=true", "--scaling_check.warmup_steps=2",
         "--scaling_check.steps=3", "--scaling_check.efficiency_floor=0.01",
         f"--scaling_check.result_file={result_file}"],
        what="a two-rank pipeline", cwd=Path(__file__).resolve().parent.parent)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-4000:]
    result = json.loads(result_file.read_text())
    assert result["passed"] and result["steps"] == 3 and 0 < result["efficiency"]
    assert result["step_seconds"] > 0 and result["expected_step_seconds"] > 0
    assert sorted(result["slowest_stages"]) in ([0], [1])
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
