"""The one way tests, benches and torchrun choose a port for a server about to start
(trainer/local_ports.py): never from the kernel's ephemeral range, which hands a released port to
the next outgoing connection."""

import os
import socket
import sys
from pathlib import Path

import pytest

from localcloud.waiting import run_captured
from trainer import local_ports
from trainer.local_ports import free_port

REPO = Path(__file__).resolve().parents[1]


def test_a_port_is_drawn_below_the_ephemeral_range_and_nothing_listens_on_it():
    port = free_port()
    assert port in local_ports.DRAWN and port < local_ports._ephemeral_start()  # noqa: SLF001
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_a_port_in_use_is_passed_over_and_none_left_is_named(monkeypatch):
    monkeypatch.setattr(local_ports, "_ephemeral_start", lambda: 65_536)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            spare = probe.getsockname()[1]
        monkeypatch.setattr(local_ports, "DRAWN", [busy, spare])
        assert free_port() == spare
        monkeypatch.setattr(local_ports, "DRAWN", [busy])
        with pytest.raises(OSError, match="no free port on 127.0.0.1"):
            free_port()


def test_torchrun_as_the_node_runs_it_gives_its_workers_a_store_port_below_the_ephemeral_range(tmp_path):
    """With the rendezvous store not shared (as the agent starts torchrun), node rank 0's torchrun
    picks the workers' store port: drawn by free_port, not by torch's bind to port 0."""
    worker = tmp_path / "worker.py"
    worker.write_text("import os\nprint('port', os.environ['MASTER_PORT'], flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    done = run_captured([sys.executable, "-m", "node.torchrun", "--standalone", "--nproc-per-node=1", str(worker)],
                        what="torchrun with one worker", cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (port,) = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("port ")]
    assert port in local_ports.DRAWN, port
