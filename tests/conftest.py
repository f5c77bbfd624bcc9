"""Shared fixtures. AWS is always moto over real HTTP on 127.0.0.1, never hand-written stubs."""

import multiprocessing
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from nccl_rules import ENABLE_VARIABLE as NCCL_RULES_VARIABLE
from nccl_rules import SITE as NCCL_SITE
from trainer.local_ports import free_port  # noqa: F401 (the tests import it from here)
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


SHARED_LOCAL_RUNS = {"tests/test_agent_local_run.py": ("agent_local_run.py", "node-loss"),
                     "tests/test_spares_local_run.py": ("agent_local_run.py", "spares"),
                     "tests/test_scaling_check_local_run.py": ("agent_local_run.py", "poor-scaling")}
"""Test modules whose local runs one script runs side by side on one deployed stack (tests/
<script> SCENARIO ...): module -> (script, scenario). The runs do not meet, and a stack's set-up
(a local cloud, a deploy, a warm image with torch, the instances' boots) is paid once for them
all, their waits overlapping."""


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, the modules of one shared local run taken as one file: the worker that runs
    the script runs every module that reads it."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedRunScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return SHARED_LOCAL_RUNS[file][0] if file in SHARED_LOCAL_RUNS else file

    return SharedRunScheduling(config, log)


_local_runs: dict[str, dict[str, dict]] = {}
"""script -> scenario -> what the script printed for it, once a session (an xdist worker)."""


def _repo_path(module) -> str:
    return Path(module.__file__).relative_to(Path(__file__).parent.parent).as_posix()


@pytest.fixture(scope="module")
def local_run(request) -> dict:
    """The requesting module's scenario of a shared local run (SHARED_LOCAL_RUNS), as its script
    printed it. The first module to ask starts the script with the scenarios of every module of
    the session that reads it (run alone, a module runs only its own)."""
    from localcloud_helpers import run_scenario

    script, scenario = SHARED_LOCAL_RUNS[_repo_path(request.module)]
    if script not in _local_runs:
        collected = {_repo_path(item.module) for item in request.session.items}
        wanted = sorted(name for module, (of, name) in SHARED_LOCAL_RUNS.items() if of == script and module in collected)
        _local_runs[script] = run_scenario(script, *wanted)
    return _local_runs[script][scenario]


TIMELINE_VARIABLE = "TRAINFLEET_TEST_TIMELINE"
"""Set to a file: each worker appends a line per test it ran (worker, file, start, end in seconds
since the epoch, CPU seconds of the worker and every process below it), to see how the files were
spread over the workers and what each cost (.ci/timeline.py)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(TIMELINE_VARIABLE)
    if not path:
        yield
        return
    from localcloud.procfs import tree_cpu_seconds

    started, cpu_before = time.time(), tree_cpu_seconds(os.getpid())
    yield
    # This hook runs where the test ran: a worker, or the one process without xdist.
    with open(path, "a") as timeline:
        timeline.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {item.nodeid.split('::')[0]} "
                       f"{started:.1f} {time.time():.1f} {tree_cpu_seconds(os.getpid()) - cpu_before:.1f}\n")


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
