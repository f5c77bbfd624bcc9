"""A local instance's network as its trainer feels it (instance_site/sitecustomize.py): made slow
(LocalFleet.slow_network), torch.distributed's transfers wait the delay in every process that
starts with the instance's environment, and torch itself sees one function where it checks which
one an operation names; and its ports are its own, as a node's on EC2 are."""

import json
import subprocess
import sys
from datetime import timedelta

from torch.distributed import TCPStore

from localcloud.fleet import INSTANCE_SITE
from localcloud.waiting import run_captured
from trainer.local_ports import free_port

PROBE = """
import json, os, time
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
started = time.perf_counter()
dist.all_reduce(torch.ones(4))
seconds = time.perf_counter() - started
operation = dist.P2POp(dist.isend, torch.ones(1), 0)  # refused unless it is c10d's own isend
print(json.dumps({"seconds": seconds, "same": dist.isend is distributed_c10d.isend}), flush=True)
dist.destroy_process_group()  # as the trainer ends: a group left to interpreter exit may abort its threads
# What is probed is said; torch's own teardown at interpreter exit is not (once in a suite's run, a
# gloo thread still joinable there aborted the process: "terminate called without an active exception").
os._exit(0)
"""


def probe(delay_file) -> dict:
    done = run_captured([sys.executable, "-c", PROBE], what="the network probe",
                        env={"PYTHONPATH": str(INSTANCE_SITE), "LOCALCLOUD_NETWORK_DELAY_FILE": str(delay_file),
                             "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_delay_written_for_the_instance_slows_each_transfer(tmp_path):
    delay = tmp_path / "network-delay"
    delay.write_text("0.5")
    slowed = probe(delay)
    assert slowed["seconds"] >= 0.5 and slowed["same"]


def test_without_a_delay_nothing_waits(tmp_path):
    unslowed = probe(tmp_path / "absent")
    assert unslowed["seconds"] < 0.5 and unslowed["same"]


HOST = """
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
address, port = sys.argv[1], sys.argv[2]
_, store = create_backend(RendezvousParameters("c10d", f"{address}:{port}", "run", 1, 1, is_host="true",
                                               read_timeout="30"))
store.set("host", address)
print("hosting", flush=True)
sys.stdin.read()  # until the test is done
"""


def test_two_instances_host_their_rendezvous_on_the_same_port():
    """Two runs whose attempts drew the same port, their hosts on two instances: on EC2 each node
    has its own network stack and both rendezvous start; here too, each at its own address."""
    port = free_port()
    addresses = ["127.77.250.1", "127.77.250.2"]
    hosts = []
    try:
        for address in addresses:
            host = subprocess.Popen([sys.executable, "-c", HOST, address, str(port)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={"PYTHONPATH": str(INSTANCE_SITE), "LOCALCLOUD_PRIVATE_IP": address,
                                         "PATH": "/usr/bin:/bin"})
            hosts.append(host)
            assert host.stdout.readline() == "hosting\n", host.communicate()[1][-3000:]
        for address in addresses:
            peer = TCPStore(address, port, is_master=False, timeout=timedelta(seconds=30))
            assert peer.get("host") == address.encode()
    finally:
        for host in hosts:
            host.stdin.close()
            host.wait()
