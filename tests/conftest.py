"""Shared fixtures. AWS is always moto over real HTTP on 127.0.0.1, never hand-written stubs."""

import multiprocessing
import os
import resource
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nccl_rules import ENABLE_VARIABLE as NCCL_RULES_VARIABLE
from nccl_rules import SITE as NCCL_SITE
from trainfleet.core.catalogue import NCCL_ERROR_HANDLING

# No test may reach a real AWS endpoint or pick up a developer's credentials.
os.environ.update(
    AWS_ACCESS_KEY_ID="testing",
    AWS_SECRET_ACCESS_KEY="testing",
    AWS_SESSION_TOKEN="testing",
    AWS_DEFAULT_REGION="us-east-1",
    AWS_REGION="us-east-1",
)
# Real IAM knows AWS's managed policies (SAM roles attach them); moto only when asked, and it
# reads this when its IAM first starts, so it must be set before any test touches IAM.
os.environ.setdefault("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
# Every process the session starts that imports torch follows NCCL's rules of progress and of
# failure (nccl_rules.py): spawn_ranks' ranks, and torchrun's on local-cloud instances, whose
# environment (PYTHONPATH included) is the session's. Its ranks handle NCCL's errors as the node
# agent has every rank handle them (catalogue.NCCL_ERROR_HANDLING).
os.environ[NCCL_RULES_VARIABLE] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NCCL_SITE), os.environ.get("PYTHONPATH")]))
os.environ.update(NCCL_ERROR_HANDLING)


LONGEST_FIRST = (
    "chaos/test_chaos_fast.py", "test_trainer_equivalence.py", "test_spares_local_run.py",
    "test_localcloud_scale.py", "test_memory_plan_measured.py", "test_localcloud_stepfunctions.py",
    "test_standin_local_run.py", "checkpoint/test_checkpoint_trainer.py", "test_agent_local_run.py",
    "test_localcloud_faults.py", "test_scaling_check_local_run.py", "test_handlers_capacity_run.py",
    "test_handlers_local_run.py", "checkpoint/test_memory_checkpoint.py", "test_agent.py", "test_health.py",
)
"""The files of a minute or more, longest first, those that mostly wait (on a run's timers, a
retry's backoff) beside those that keep cores busy: four such files waiting together left half
of the two cores idle for two minutes."""


def pytest_collection_modifyitems(items):
    """The longest files first, then the others with slow tests, then the rest: the workers take
    whole files in collection order (--dist loadfile), and a file of minutes taken last leaves
    the other workers idle while it runs."""
    tests = Path(__file__).parent

    def order(item) -> tuple[int, bool]:
        path = item.path.relative_to(tests).as_posix()
        rank = LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)
        return rank, item.get_closest_marker("slow") is None

    items.sort(key=order)


TIMELINE_VARIABLE = "TRAINFLEET_TEST_TIMELINE"
"""Set to a file: each worker appends a line per test it ran (worker, file, start, end in seconds
since the epoch, CPU seconds of the worker and the children it reaped), to see how the files were
spread over the workers and what each cost (.ci/timeline.py)."""


def cpu_seconds() -> float:
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(usage.ru_utime + usage.ru_stime for usage in used)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started, cpu_before = time.time(), cpu_seconds()
    yield
    path = os.environ.get(TIMELINE_VARIABLE)
    if path:  # this hook runs where the test ran: a worker, or the one process without xdist
        with open(path, "a") as timeline:
            timeline.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {item.nodeid.split('::')[0]} "
                           f"{started:.1f} {time.time():.1f} {cpu_seconds() - cpu_before:.1f}\n")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


RANK_PRELOAD = ["trainer.train", "trainer.fleet_check"]
"""What the fork server imports once, so that no rank pays three seconds of importing torch."""


def spawn_ranks(function: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`function(rank, *args)` in `nprocs` processes, joined; an exception in one is raised here.
    The processes fork from a server that imported torch and the trainer before it ran anything
    (a fork of this process could inherit a busy thread pool)."""
    import torch.multiprocessing as torch_mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    torch_mp.start_processes(function, args=args, nprocs=nprocs, join=True, start_method="forkserver")


@pytest.fixture(scope="session")
def moto_endpoint():
    """A plain moto server (S3 and friends) over HTTP; separate processes reach it too."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    previous = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = url
    yield url
    server.stop()
    if previous is None:
        os.environ.pop("AWS_ENDPOINT_URL", None)
    else:
        os.environ["AWS_ENDPOINT_URL"] = previous


@pytest.fixture
def local_cloud(monkeypatch):
    """A started LocalCloud (localcloud package) with time scaled 50x down, and
    AWS_ENDPOINT_URL pointing at it for the test. moto's state is per process and outlives
    the cloud: give resources unique names."""
    from localcloud import LocalCloud

    with LocalCloud(time_scale=0.02) as cloud:
        for name, value in cloud.env().items():
            monkeypatch.setenv(name, value)
        yield cloud
