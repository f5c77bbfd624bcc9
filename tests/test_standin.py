"""The stand-in trainer on a thread of the agent (node/standin.py start_thread): the part of
subprocess.Popen the agent uses, and the real trainer's signals."""

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml

from node.standin import EXIT_CONFIG, EXIT_KILLED, EXIT_RENDEZVOUS, EXIT_SIGNALLED, start_thread
from trainer.local_ports import free_port
from trainer.progress import PROGRESS_FILE_ENV, read_progress


def launch(tmp_path, steps: int, step_s: float = 0.01, config: dict | None = None, node_rank: int = 0,
           nodes: int = 1, port: int | None = None, join_timeout_s: float = 10):
    folder = tmp_path / f"node-{node_rank}"
    folder.mkdir(exist_ok=True)
    config_file = folder / "trainer.yaml"
    config_file.write_text(yaml.safe_dump(config or {
        "model": {"seq_len": 16}, "training": {"steps": steps, "batch_size": 2, "metrics_file": str(folder / "m.jsonl")},
        "checkpoint": {"resume": "none"}}))
    command = [sys.executable, "-m", "node.standin", "--config", str(config_file), f"--node-rank={node_rank}",
               f"--nodes={nodes}", f"--step-seconds={step_s}", f"--rendezvous=127.0.0.1:{port or free_port()}",
               f"--join-timeout-s={join_timeout_s}"]
    with (folder / "torchrun.log").open("ab") as output:
        return start_thread(command, folder, {PROGRESS_FILE_ENV: str(folder / "progress")}, output)


def test_it_trains_every_step_and_exits_0(tmp_path):
    trainer = launch(tmp_path, steps=5)
    assert trainer.wait(10) == 0 and trainer.poll() == 0
    records = [json.loads(line) for line in (tmp_path / "node-0" / "m.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4, 5]
    assert records[0]["tokens_per_s"] == pytest.approx(32 / 0.01)
    assert read_progress(tmp_path / "node-0" / "progress") == 5


def test_sigterm_stops_it_within_a_step_with_torchruns_status(tmp_path):
    trainer = launch(tmp_path, steps=10_000, step_s=0.05)
    assert trainer.poll() is None
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(2) == EXIT_SIGNALLED
    assert "got SIGTERM" in (tmp_path / "node-0" / "torchrun.log").read_text()


def test_a_kill_ends_it_at_once(tmp_path):
    trainer = launch(tmp_path, steps=10_000, step_s=5)
    with pytest.raises(subprocess.TimeoutExpired):
        trainer.wait(0.1)
    trainer.kill()
    assert trainer.wait(0) == EXIT_KILLED == -9


def test_a_config_it_cannot_run_is_a_config_error_in_its_output(tmp_path):
    trainer = launch(tmp_path, steps=1, config={"training": {}})
    assert trainer.wait(10) == EXIT_CONFIG
    assert "config error: KeyError" in (tmp_path / "node-0" / "torchrun.log").read_text()


def test_only_the_standin_command_runs_on_a_thread(tmp_path):
    with pytest.raises(ValueError, match="not a stand-in command"):
        start_thread([sys.executable, "-m", "torch.distributed.run"], tmp_path, {}, sys.stdout.buffer)


def test_no_node_steps_before_the_whole_world_has_joined(tmp_path):
    port = free_port()
    first = [launch(tmp_path, steps=3, node_rank=rank, nodes=3, port=port) for rank in (0, 2)]
    time.sleep(1)
    assert all(trainer.poll() is None for trainer in first)
    assert read_progress(tmp_path / "node-0" / "progress") is None  # waiting for node rank 1

    last = launch(tmp_path, steps=3, node_rank=1, nodes=3, port=port)

    assert [trainer.wait(10) for trainer in (*first, last)] == [0, 0, 0]
    assert all(read_progress(tmp_path / f"node-{rank}" / "progress") == 3 for rank in range(3))


def test_a_world_that_does_not_gather_ends_each_waiting_node_as_torchrun_does(tmp_path):
    port = free_port()
    trainers = [launch(tmp_path, steps=3, node_rank=rank, nodes=3, port=port, join_timeout_s=1) for rank in (0, 1)]
    assert [trainer.wait(10) for trainer in trainers] == [EXIT_RENDEZVOUS, EXIT_RENDEZVOUS]
    said = (tmp_path / "node-0" / "torchrun.log").read_text()
    assert "rendezvous failed" in said and "2 of 3 nodes joined; missing node ranks [2]" in said


def test_sigterm_at_the_rendezvous_stops_it(tmp_path):
    trainer = launch(tmp_path, steps=3, nodes=2)
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(2) == EXIT_SIGNALLED
