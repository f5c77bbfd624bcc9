"""The stand-in trainer on a thread of the agent (trainer/standin.py start_thread): the part of
subprocess.Popen the agent uses, and the real trainer's signals."""

import json
import signal
import subprocess
import sys

import pytest
import yaml

from trainer.progress import PROGRESS_FILE_ENV, read_progress
from trainer.standin import EXIT_CONFIG, EXIT_KILLED, EXIT_SIGNALLED, start_thread


def launch(tmp_path, steps: int, step_s: float = 0.01, config: dict | None = None):
    config_file = tmp_path / "trainer.yaml"
    config_file.write_text(yaml.safe_dump(config or {
        "model": {"seq_len": 16}, "training": {"steps": steps, "batch_size": 2, "metrics_file": str(tmp_path / "m.jsonl")},
        "checkpoint": {"resume": "none"}}))
    command = [sys.executable, "-m", "trainer.standin", "--config", str(config_file), "--node-rank=0", "--nodes=4",
               f"--step-seconds={step_s}"]
    with (tmp_path / "torchrun.log").open("ab") as output:
        return start_thread(command, tmp_path, {PROGRESS_FILE_ENV: str(tmp_path / "progress")}, output)


def test_it_trains_every_step_and_exits_0(tmp_path):
    trainer = launch(tmp_path, steps=5)
    assert trainer.wait(10) == 0 and trainer.poll() == 0
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5]
    assert records[0]["tokens_per_s"] == pytest.approx(32 / 0.01)
    assert read_progress(tmp_path / "progress") == 5


def test_sigterm_stops_it_within_a_step_with_torchruns_status(tmp_path):
    trainer = launch(tmp_path, steps=10_000, step_s=0.05)
    assert trainer.poll() is None
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(2) == EXIT_SIGNALLED
    assert "got SIGTERM" in (tmp_path / "torchrun.log").read_text()


def test_a_kill_ends_it_at_once(tmp_path):
    trainer = launch(tmp_path, steps=10_000, step_s=5)
    with pytest.raises(subprocess.TimeoutExpired):
        trainer.wait(0.1)
    trainer.kill()
    assert trainer.wait(0) == EXIT_KILLED == -9


def test_a_config_it_cannot_run_is_a_config_error_in_its_output(tmp_path):
    trainer = launch(tmp_path, steps=1, config={"training": {}})
    assert trainer.wait(10) == EXIT_CONFIG
    assert "config error: KeyError" in (tmp_path / "torchrun.log").read_text()


def test_only_the_standin_command_runs_on_a_thread(tmp_path):
    with pytest.raises(ValueError, match="not a stand-in command"):
        start_thread([sys.executable, "-m", "torch.distributed.run"], tmp_path, {}, sys.stdout.buffer)
