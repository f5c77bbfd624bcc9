"""A local instance's network made slow (LocalFleet.slow_network, instance_site/sitecustomize.py):
torch.distributed's transfers wait the delay in every process that starts with the instance's
environment, and torch itself sees one function where it checks which one an operation names."""

import json
import sys

from localcloud.fleet import INSTANCE_SITE
from localcloud.waiting import run_captured

PROBE = """
import json, time
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
