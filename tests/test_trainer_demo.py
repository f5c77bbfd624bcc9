"""The demo end to end, shortened: torchrun, two pipeline ranks, a falling loss, a summary."""

import json

import pytest

from trainer import demo


@pytest.mark.slow
def test_demo_trains_with_two_pipeline_ranks(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    assert demo.main(["--", "--training.steps=12", "--optim.warmup_steps=2", "--model.n_layers=4",
                      "--model.d_model=48", "--model.seq_len=64", f"--data.shards={tmp_path}/shards",
                      "--data.corpus=stdlib", "--data.corpus_bytes=100000", f"--training.metrics_file={metrics}"]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    out = capsys.readouterr().out
    assert "12 steps: loss" in out and "tokens/s" in out


def test_summary_reports_the_start_and_end_of_the_curve():
    records = [{"loss": 5.0 - i * 0.1, "tokens_per_s": 100.0 + i} for i in range(20)]
    assert demo.summarise(records).startswith("20 steps: loss 4.950 -> 3.150 (mean of first and last 2)")
