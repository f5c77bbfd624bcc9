"""bench/gpu.py runs unattended on a GPU machine it has never seen: its tiny CPU mode goes through
every check it makes there, its figures are the documented ones, and whatever goes wrong its last
line says `gpu_check=failed: <why>`."""

import importlib.metadata
import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from localcloud.waiting import run_captured
from trainer.config import load_config
from trainer.train import NonFiniteLossError
from trainfleet.core import memory_plan

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_bench", REPO / "bench" / "gpu.py")
gpu = sys.modules["gpu_bench"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(gpu)

GIB = 2**30


def run_bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_captured([sys.executable, "bench/gpu.py", "--tiny", "--device", "cpu", *args], what="bench/gpu.py",
                        cwd=REPO, env=env)


def last_line_fields(stdout: str) -> dict[str, str]:
    verdict, *pairs = shlex.split(stdout.splitlines()[-1])
    assert verdict == "gpu_check=ok"
    return dict(pair.split("=", 1) for pair in pairs)


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_on_a_tiny_model():
    done = run_bench("--warmup", "1", "--steps", "2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    fields = last_line_fields(done.stdout)
    assert fields["device"] == "cpu" and fields["mfu"] == "n/a" and fields["staging"] == "bit-exact"
    assert float(fields["tokens_per_s"]) > 0
    losses = [float(x) for x in re.search(r"^losses: ([\d. ]+)", done.stdout, re.M).group(1).split()]
    assert len(losses) == 3 and losses[0] == float(fields["loss_first"]) and losses[-1] == float(fields["loss_last"])
    changed = re.search(r"the step changed (\d+) of them", done.stdout)
    assert changed and int(changed.group(1)) > 0


def test_the_peak_is_matched_on_the_exact_device_name():
    assert gpu.device_facts("NVIDIA H100 80GB HBM3") == ("H100", 989.0)  # SXM5
    assert gpu.device_facts("NVIDIA H100 PCIe") == ("H100", 756.0)
    assert gpu.device_facts("NVIDIA H100 NVL") == ("H100", 835.0)
    assert gpu.device_facts("NVIDIA H200") == ("H200", 989.0)
    for a100 in ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"):
        assert gpu.device_facts(a100) == ("A100", 312.0)
    for unknown in ("NVIDIA H100", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA GeForce RTX 4090", "cpu"):
        assert gpu.device_facts(unknown) == ("", None)


def test_model_flops_count_the_matmuls_not_the_embedding_lookups():
    cfg = load_config(gpu.MODEL_1B)
    m = cfg.model
    shape = memory_plan.ModelShape(m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len, m.mlp_ratio)
    lookups = m.vocab_size * m.d_model + m.seq_len * m.d_model
    attention = 12 * m.n_layers * m.seq_len * m.d_model
    assert gpu.flops_per_token(cfg) == 6 * (memory_plan.parameter_count(shape) - lookups) + attention
    # Counting the lookups as matmuls was 7 % high for this model.
    assert 6 * memory_plan.parameter_count(shape) + attention > 1.07 * gpu.flops_per_token(cfg)


def test_a_tied_head_is_a_matmul_and_counts():
    cfg = load_config([*gpu.MODEL_TINY, "--model.tie_embeddings=true"])
    m = cfg.model
    shape = memory_plan.ModelShape(m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len, m.mlp_ratio,
                                   tie_embeddings=True)
    assert gpu.flops_per_token(cfg) == (6 * (memory_plan.parameter_count(shape) - m.seq_len * m.d_model)
                                        + 12 * m.n_layers * m.seq_len * m.d_model)


def cuda_memory(peak_allocated_gib: float, fragmentation_gib: float, outside_gib: float) -> "gpu.CudaMemory":
    total = 139.8 * GIB
    peak_reserved = int((peak_allocated_gib + fragmentation_gib) * GIB)
    return gpu.CudaMemory(peak_allocated=int(peak_allocated_gib * GIB), peak_reserved=peak_reserved,
                          allocated=int(12 * GIB), reserved=peak_reserved,
                          free=int(total - peak_reserved - outside_gib * GIB), total=int(total))


def test_memory_compares_the_tensors_with_the_plans_and_shows_the_allowance_beside_what_cuda_reports():
    workload = gpu.planned_workload(load_config(gpu.MODEL_1B), "H200")
    plan = memory_plan.fullest_rank(workload)
    tensors_gib = plan.tensors / GIB
    lines, ratio, flagged = gpu.memory_report(cuda_memory(1.10 * tensors_gib, 1.5, 0.6), workload)
    assert ratio == pytest.approx(1.10, abs=1e-3) and not flagged
    text = "\n".join(lines)
    assert "0.60 GiB measured" in text and "1.50 GiB measured" in text  # outside the allocator, fragmentation
    nccl = memory_plan.NCCL_COMMUNICATOR_BYTES["H200"] / GIB
    assert f"NCCL {nccl:.2f} for 1 communicator on H200" in text
    assert f"{(plan.allowance - memory_plan.CUDA_CONTEXT_BYTES - nccl * GIB) / GIB:.2f} GiB allowed" in text

    _, ratio, flagged = gpu.memory_report(cuda_memory(1.20 * tensors_gib, 1.5, 0.6), workload)
    assert ratio == pytest.approx(1.20, abs=1e-3) and flagged
    _, _, flagged = gpu.memory_report(cuda_memory(0.80 * tensors_gib, 1.5, 0.6), workload)
    assert flagged


def test_the_plan_is_for_the_devices_accelerator():
    cfg = load_config(gpu.MODEL_1B)
    h200, unknown = (memory_plan.fullest_rank(gpu.planned_workload(cfg, a)) for a in ("H200", ""))
    assert h200.tensors == unknown.tensors
    assert h200.allowance - unknown.allowance == memory_plan.NCCL_COMMUNICATOR_BYTES["H200"]


def test_each_failure_says_what_went_wrong():
    memory = gpu.CudaMemory(peak_allocated=70 * GIB, peak_reserved=75 * GIB, allocated=int(60.5 * GIB),
                            reserved=int(74.25 * GIB), free=int(0.5 * GIB), total=int(79.18 * GIB))
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")
    assert gpu.failure_reason(oom, "timed step 3 of 10", memory) == (
        "CUDA out of memory while timed step 3 of 10: 60.50 GiB allocated, 74.25 GiB reserved by PyTorch "
        "(peak 70.00 GiB allocated), 0.50 GiB free of 79.18 GiB; tried to allocate 2.00 gib")
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error\nmore")
    assert gpu.failure_reason(nccl, "starting the process group", None) == (
        "DistBackendError (NCCL or the process group) while starting the process group: "
        "NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error")
    nan = NonFiniteLossError("step 4: loss is nan, gradient norm is nan")
    assert gpu.failure_reason(nan, "warm-up step 4 of 3", None) == (
        "non-finite loss while warm-up step 4 of 3: step 4: loss is nan, gradient norm is nan")
    missing = ModuleNotFoundError("No module named 'yaml'", name="yaml")
    assert gpu.failure_reason(missing, "building the model", None).startswith("cannot import yaml: ")
    assert gpu.failure_reason(gpu.CheckFailed("differs at model.x"), "x", None) == "differs at model.x"


def test_the_staged_copy_is_compared_bit_for_bit():
    expected = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor(2.0)}
    assert gpu.first_difference({"a": torch.tensor([0.0, 1.0]), "b": torch.tensor(2.0)}, expected) is None
    assert gpu.first_difference({"a": torch.tensor([-0.0, 1.0]), "b": torch.tensor(2.0)}, expected) == "a"
    assert gpu.first_difference({"a": torch.tensor([0.0, 1.0])}, expected) == "b"
    assert gpu.first_difference({"a": torch.tensor([0.0, 1.0], dtype=torch.float64), "b": torch.tensor(2.0)},
                                expected) == "a"


@pytest.mark.slow
def test_a_time_limit_ends_the_check_with_its_line():
    done = run_bench("--steps", "1000000", "--time-limit", "1")
    assert done.returncode != 0
    assert re.fullmatch(r"gpu_check=failed: time limit of 1 s reached while \S.*",
                        done.stdout.splitlines()[-1]), done.stdout[-1000:]
    assert "Thread" in done.stderr  # where every thread was


@pytest.mark.slow
def test_a_package_the_machine_lacks_is_named(tmp_path):
    fake = tmp_path / "s3torchconnector"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 's3torchconnectorclient'\", "
                                      "name='s3torchconnectorclient')\n")
    done = run_bench(env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1].startswith("gpu_check=failed: cannot import s3torchconnectorclient: ")
    assert "Traceback" in done.stderr


def _loaded_distributions(imports: str) -> set[str]:
    """Distributions whose modules a fresh interpreter has loaded after running `imports`."""
    probe = f"import sys; {imports}; print(' '.join({{m.split('.')[0] for m in sys.modules}}))"
    modules = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    owners = importlib.metadata.packages_distributions()
    return {dist for module in modules for dist in owners.get(module, [])}


def _requirements_of(dist: str, seen: set[str]) -> set[str]:
    """`dist` and what it requires, transitively, among the installed distributions (no extras)."""
    name = re.split(r"[ ;<>=!~\[(]", dist)[0].lower().replace("_", "-")
    if name in seen:
        return seen
    seen.add(name)
    try:
        requirements = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return seen
    for requirement in requirements:
        if "extra ==" not in requirement:
            _requirements_of(requirement, seen)
    return seen


@pytest.mark.slow
def test_the_gpu_run_carries_every_package_the_check_imports_beyond_torch():
    carried = set(re.search(r'^CARRIED="([^"]+)"', (REPO / "bench" / "gpu_run.sh").read_text(), re.M).group(1).split())
    script = str(REPO / "bench" / "gpu.py")
    loaded = _loaded_distributions("import importlib.util as u; s = u.spec_from_file_location('probe', "
                                   f"{script!r}); s.loader.exec_module(u.module_from_spec(s))")
    needed = {name.lower().replace("_", "-") for name in loaded - _loaded_distributions("pass")}
    assert {"pydantic", "s3torchconnector", "boto3"} <= needed  # the probe sees the trainer's imports
    beyond_torch = needed - _requirements_of("torch", set()) - {"trainfleet"}
    assert beyond_torch <= carried, beyond_torch - carried


FAKE_PYTHON = """#!/bin/sh
# An interpreter without pip whose bench/gpu.py run dies as $FAKE_DEATH says.
echo "$@" >> "$FAKE_CALLS"
case "$1 $2" in
  "-m pip") exit 1 ;;
  "-m zipfile") exit 0 ;;
esac
case "$FAKE_DEATH" in
  sleep) exec sleep 30 ;;
  ok) echo "gpu_check=ok"; exit 0 ;;
  *) kill -"$FAKE_DEATH" $$ ;;
esac
"""


def gpu_run_with(tmp_path, death: str, time_limit: int = 480) -> tuple[subprocess.CompletedProcess, str]:
    """bench/gpu_run.sh run over a fake interpreter whose check dies as `death` says (a signal's
    name, `sleep` past the time limit, or `ok`); its output and the interpreter's calls."""
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    carry = tmp_path / "carry"
    carry.mkdir()
    (carry / "fake-1.0-py3-none-any.whl").write_bytes(b"")
    calls = tmp_path / "calls"
    env = {**__import__("os").environ, "PYTHON": str(python), "CARRY_DIR": str(carry),
           "SITE_DIR": str(tmp_path / "site"), "TIME_LIMIT": str(time_limit), "FAKE_DEATH": death,
           "FAKE_CALLS": str(calls)}
    done = run_captured(["bench/gpu_run.sh", "run"], what="bench/gpu_run.sh run", cwd=REPO, env=env)
    return done, calls.read_text()


@pytest.mark.parametrize("signal_name, number", [("ABRT", 6), ("SEGV", 11), ("TERM", 15)])
def test_a_check_killed_by_a_signal_says_which(tmp_path, signal_name, number):
    done, calls = gpu_run_with(tmp_path, signal_name)
    assert done.returncode == 128 + number
    assert done.stdout.splitlines()[-1] == f"gpu_check=failed: killed by signal {number}", done.stdout
    assert "-X faulthandler bench/gpu.py --time-limit 480" in calls  # stacks printed from the first line on


def test_a_kill_before_the_time_limit_is_not_called_a_timeout(tmp_path):
    done, _ = gpu_run_with(tmp_path, "KILL")  # as the host's OOM killer ends a process
    assert done.returncode == 137
    assert done.stdout.splitlines()[-1] == ("gpu_check=failed: killed by signal 9 (SIGKILL before the time limit: the "
                                            "host's OOM killer, or another process)")


def test_a_check_past_its_time_limit_is_killed_by_the_timeout(tmp_path):
    done, _ = gpu_run_with(tmp_path, "sleep", time_limit=-59)  # the timeout, 60 s past it: 1 s
    assert done.returncode == 124
    assert done.stdout.splitlines()[-1] == "gpu_check=failed: killed by timeout after 1 s; its own time limit did not end it"


def test_a_check_that_ends_itself_keeps_its_own_last_line(tmp_path):
    done, _ = gpu_run_with(tmp_path, "ok")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "gpu_check=ok"
