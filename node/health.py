"""Preflight health checks: does this node have what its instance type promises?

    python -m node.health --instance-type p5.48xlarge     # one JSON list of check results

The node agent runs this as a subprocess before it reports NodeReady (so the agent itself never
imports torch) and sends the results with NodeReady or NodeUnhealthy. Each check compares what
the node shows with the catalogue (trainfleet.core.catalogue):

- accelerator_count: torch.cuda.device_count() equals the type's GPU count (the trainer runs one
  rank per GPU). CPU types have nothing to count and Trainium chips are not CUDA devices: skipped.
- efa_devices: `fi_info -p efa` lists one EFA device per network card, on types with EFA only.
  A missing fi_info on such a type fails: without libfabric the trainer cannot use the cards.
- gloo_allreduce: torch.distributed works on this node (a one-rank gloo all-reduce gives back
  its input). It proves the libraries load, not the network.
- torch_version: torch is at least the oldest version the trainer supports and CI tests
  (TORCH_MINIMUM); the Deep Learning AMI brings its own build.
- nccl_version: on CUDA types, the NCCL torch carries is at least NCCL_MINIMUM. CPU types train
  with gloo, Trainium with the Neuron runtime: skipped.
- nccl_network: on CUDA types with EFA, NCCL selects the aws-ofi-nccl plugin with libfabric's efa
  provider. A one-rank NCCL all-reduce runs in a subprocess, in the environment the agent gives
  torchrun on this type (catalogue.nccl_environment, with NCCL_DEBUG=INFO), and its log is read
  (node/nccl_log.py): NCCL that falls back to TCP sockets (its "Using network Socket") still
  trains, an order of magnitude slower in every cross-node collective, and nothing else would
  notice. A one-rank
  communicator crosses no network, but NCCL loads its network plugin and picks the network at
  every communicator's start, so the choice it logs is the one the training world makes.
- allreduce_busbw: the cross-node bandwidth probe needs the other nodes, which preflight runs
  before; skipped, saying so.
- The GPU device checks (CUDA types; node.gpu_health judges, this module looks):
  ecc_errors, remapped_rows, gpu_clocks and gpu_pcie over one `nvidia-smi -q`; nvlink_links over
  `nvidia-smi nvlink -s`; gpu_xid over the kernel log (dmesg, or journalctl -k when dmesg is
  refused); gpu_gemm, a bf16 GEMM on each GPU against the catalogue's peak; nvlink_allreduce_busbw,
  an NCCL all-reduce with one process per GPU against the type's NVLink floor. A GPU type whose
  nvidia-smi is missing or fails fails these checks, as a missing fi_info fails efa_devices: the
  driver is what they look at. A kernel log this process may not read skips gpu_xid: that is the
  looker's limit, not the node's. The measurements run in subprocesses with time limits (a hung GPU
  must not hang preflight), the all-reduce in the type's NCCL environment (catalogue.nccl_environment).

A check that cannot run here is reported skipped with its reason, never as passed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from node import gpu_health
from node.nccl_log import check_nccl_network_log
from trainfleet.core.catalogue import InstanceFacts, UnknownInstanceType, instance_facts, nccl_environment
from trainfleet.core.events import HealthCheckResult

__all__ = ["Probes", "ProbeError", "preflight", "system_probes", "parse_fi_info", "TORCH_MINIMUM", "NCCL_MINIMUM",
           "GPU_DEVICE_CHECKS"]

FI_INFO_TIMEOUT_S = 30
NCCL_PROBE_TIMEOUT_S = 120
"""Longest the one-rank NCCL all-reduce may take (CUDA and NCCL start-up are most of it)."""
NVIDIA_SMI_TIMEOUT_S = 60
KERNEL_LOG_TIMEOUT_S = 30
GEMM_PROBE_TIMEOUT_S = 90
"""Longest the GEMMs of all GPUs, one after the other, may take (a few seconds each when healthy)."""
NVLINK_ALLREDUCE_TIMEOUT_S = 120
"""Longest the all-reduce across the node's GPUs may take, eight processes' start-up included."""
TORCH_MINIMUM = "2.11.0"
"""The oldest torch the trainer supports: CI runs its equivalence tests on it (the Makefile's
TORCH_OLDEST; a test keeps the two equal) beside the pin of pyproject.toml's trainer extra. The
APIs it uses reach back to 2.9 (DCP's DefaultStager and StagingOptions, ScheduleDualPipeV), but on
2.9 torch's pipelining mismatches a collective at the first GPipe step. The node's image brings its
own CUDA build of torch, so nothing else holds the node to it."""
NCCL_MINIMUM = (2, 17, 1)
"""The oldest NCCL the aws-ofi-nccl plugin releases (1.13 to 1.21) keep compatibility with."""


class ProbeError(RuntimeError):
    """A probe could not look (a tool missing or failing); the message says what happened."""


@dataclass(frozen=True)
class Probes:
    """How the checks look at the node; tests pass their own."""

    cuda_device_count: Callable[[], int]
    """CUDA devices torch sees."""
    efa_devices: Callable[[], list[str]]
    """EFA device (domain) names libfabric lists; raises ProbeError when it cannot ask."""
    gloo_allreduce_ok: Callable[[], bool]
    """Whether a one-rank gloo all-reduce returns its input."""
    torch_version: Callable[[], str]
    """torch.__version__, e.g. "2.13.0+cu128"."""
    nccl_version: Callable[[], tuple[int, int, int] | None]
    """The NCCL torch carries (torch.cuda.nccl.version()); None when torch is built without it."""
    nccl_network_log: Callable[[InstanceFacts], str]
    """The NCCL_DEBUG=INFO output of a one-rank NCCL all-reduce run in the environment the agent
    gives torchrun on a node of this type; raises ProbeError when it could not run."""
    nvidia_smi_query: Callable[[], str]
    """`nvidia-smi -q` output; raises ProbeError when nvidia-smi is missing or fails."""
    nvlink_status: Callable[[], str]
    """`nvidia-smi nvlink -s` output; raises ProbeError when nvidia-smi is missing or fails."""
    kernel_log: Callable[[], str]
    """The kernel log since boot; raises ProbeError when this process may not read it."""
    gemm_tflops: Callable[[], dict[int, float]]
    """bf16 GEMM TFLOPS of each GPU by index; raises ProbeError when the measurement failed."""
    nvlink_allreduce_busbw: Callable[[InstanceFacts], float]
    """busbw (GB/s) of an NCCL all-reduce with one process per GPU of this node, in the environment
    the agent gives torchrun on this type; raises ProbeError when it failed."""


def parse_fi_info(output: str) -> list[str]:
    """EFA devices in `fi_info -p efa` output: the distinct RDM domains (one per EFA card)."""
    domains = []
    for line in output.splitlines():
        key, _, value = line.strip().partition(":")
        name = value.strip()
        if key == "domain" and name.endswith("-rdm") and name not in domains:
            domains.append(name)
    return domains


def _efa_devices() -> list[str]:
    if shutil.which("fi_info") is None:
        raise ProbeError("fi_info is not installed (the EFA software is missing)")
    done = subprocess.run(["fi_info", "-p", "efa", "-t", "FI_EP_RDM"], capture_output=True, text=True,
                          timeout=FI_INFO_TIMEOUT_S)
    # fi_info exits non-zero with "No data available" when the provider finds no device.
    return parse_fi_info(done.stdout) if done.returncode == 0 else []


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _gloo_allreduce_ok() -> bool:
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        tensor = torch.arange(4, dtype=torch.float32)
        dist.all_reduce(tensor)
        return torch.equal(tensor, torch.arange(4, dtype=torch.float32))
    finally:
        dist.destroy_process_group()


def _torch_version() -> str:
    import torch

    return torch.__version__


def _nccl_version() -> tuple[int, int, int] | None:
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available():
        return None
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major, minor, patch


def nccl_allreduce_on_one_gpu() -> None:
    """A one-rank NCCL all-reduce on GPU 0: what the NCCL probe's subprocess runs."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        tensor = torch.ones(1, device=device)
        dist.all_reduce(tensor)
        torch.cuda.synchronize(device)
    finally:
        dist.destroy_process_group()


def _torchrun_environment(facts: InstanceFacts) -> dict[str, str]:
    """The environment of a probe that runs NCCL on this type: the one the agent gives torchrun, with
    NCCL logging at INFO (the NCCL probe reads the lines; the all-reduce's last line is its result).
    It must be there when the probe's process starts: the loader reads LD_LIBRARY_PATH once, and
    libfabric its FI_ variables when NCCL first loads it."""
    environment = {**os.environ, **nccl_environment(facts, os.environ, probe=True)}
    for sends_the_log_elsewhere in ("NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"):
        environment.pop(sends_the_log_elsewhere, None)  # the lines the NCCL probe reads must reach its output
    return environment


def _run_probe(what: str, command: list[str], timeout_s: int,
               environment: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`command`'s completed run; ProbeError, naming `what`, when it cannot start, times out or fails."""
    try:
        done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProbeError(f"{what} did not finish within {timeout_s} s") from None
    except OSError as exc:
        raise ProbeError(f"{what} could not start: {exc}") from None
    if done.returncode != 0:
        raise ProbeError(f"{what} exited with {done.returncode}: {(done.stdout + done.stderr)[-1000:]}")
    return done


def _nccl_network_log(facts: InstanceFacts) -> str:
    command = [sys.executable, "-c", "from node.health import nccl_allreduce_on_one_gpu as run; run()"]
    done = _run_probe("the NCCL probe", command, NCCL_PROBE_TIMEOUT_S, _torchrun_environment(facts))
    return done.stdout + done.stderr  # NCCL logs to stdout, Python's errors go to stderr


def _nvidia_smi(*arguments: str) -> str:
    if shutil.which("nvidia-smi") is None:
        raise ProbeError("nvidia-smi is not installed (the NVIDIA driver is missing)")
    return _run_probe(f"nvidia-smi {' '.join(arguments)}", ["nvidia-smi", *arguments], NVIDIA_SMI_TIMEOUT_S).stdout


def _kernel_log() -> str:
    refusals = []
    # dmesg reads the ring buffer (root, or kernel.dmesg_restrict=0); journald keeps the boot's kernel
    # lines for members of systemd-journal as well.
    for command in (["dmesg"], ["journalctl", "-k", "-b", "--no-pager"]):
        try:
            return _run_probe(command[0], command, KERNEL_LOG_TIMEOUT_S).stdout
        except ProbeError as exc:
            refusals.append(str(exc).strip())
    raise ProbeError("; ".join(refusals))


def _last_json_line(output: str) -> dict:
    """The JSON a measurement prints last (NCCL's INFO lines may come before it)."""
    lines = [line for line in output.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise ProbeError(f"the measurement printed no result: {output[-500:]}") from None


def _gemm_tflops() -> dict[int, float]:
    done = _run_probe("the GEMM probe", [sys.executable, "-m", "node.gpu_health", "gemm"], GEMM_PROBE_TIMEOUT_S)
    return {int(index): rate for index, rate in _last_json_line(done.stdout).items()}


def _nvlink_allreduce_busbw(facts: InstanceFacts) -> float:
    command = [sys.executable, "-m", "node.gpu_health", "allreduce", str(facts.accelerator_count)]
    done = _run_probe("the NVLink all-reduce", command, NVLINK_ALLREDUCE_TIMEOUT_S, _torchrun_environment(facts))
    return float(_last_json_line(done.stdout)["busbw_gbytes_per_s"])


def system_probes() -> Probes:
    """The probes of the machine this runs on."""
    return Probes(cuda_device_count=_cuda_device_count, efa_devices=_efa_devices,
                  gloo_allreduce_ok=_gloo_allreduce_ok, torch_version=_torch_version, nccl_version=_nccl_version,
                  nccl_network_log=_nccl_network_log, nvidia_smi_query=lambda: _nvidia_smi("-q"),
                  nvlink_status=lambda: _nvidia_smi("nvlink", "-s"), kernel_log=_kernel_log,
                  gemm_tflops=_gemm_tflops, nvlink_allreduce_busbw=_nvlink_allreduce_busbw)


def _skipped(name: str, why: str) -> HealthCheckResult:
    return HealthCheckResult(name=name, passed=False, skipped=True, detail=why)


def check_accelerators(facts: InstanceFacts, probes: Probes) -> HealthCheckResult:
    if facts.accelerator == "none":
        return _skipped("accelerator_count", f"{facts.name} has no accelerators to count")
    if facts.accelerator == "Trainium":
        return _skipped("accelerator_count", "Trainium chips are not CUDA devices; this check counts GPUs")
    seen = probes.cuda_device_count()
    return HealthCheckResult(name="accelerator_count", passed=seen == facts.accelerator_count,
                             measured=seen, expected=facts.accelerator_count,
                             detail=f"torch sees {seen} CUDA devices, {facts.name} has {facts.accelerator_count}")


def check_efa(facts: InstanceFacts, probes: Probes) -> HealthCheckResult:
    if not facts.efa_supported:
        return _skipped("efa_devices", f"{facts.name} has no EFA")
    try:
        devices = probes.efa_devices()
    except (ProbeError, OSError, subprocess.TimeoutExpired) as exc:
        return HealthCheckResult(name="efa_devices", passed=False, expected=facts.network_cards,
                                 detail=f"could not list EFA devices: {exc}")
    return HealthCheckResult(name="efa_devices", passed=len(devices) == facts.network_cards,
                             measured=len(devices), expected=facts.network_cards,
                             detail=f"fi_info lists {len(devices)} EFA devices, {facts.name} has "
                                    f"{facts.network_cards} network cards: {', '.join(devices) or 'none'}")


def check_gloo(probes: Probes) -> HealthCheckResult:
    try:
        ok = probes.gloo_allreduce_ok()
    except (RuntimeError, OSError) as exc:
        return HealthCheckResult(name="gloo_allreduce", passed=False, detail=f"gloo all-reduce failed: {exc}")
    return HealthCheckResult(name="gloo_allreduce", passed=ok,
                             detail="one-rank gloo all-reduce " + ("returned its input" if ok else "corrupted its input"))


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version: "2.13.0+cu128" and "2.13.0a0+git1234" -> (2, 13, 0)."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(number) for number in numbers[0].split(".")) if numbers else ()


def check_torch(probes: Probes) -> HealthCheckResult:
    installed = probes.torch_version()
    # A pre-release of the next version counts as that version (nightly and source builds).
    passed = _release(installed) >= _release(TORCH_MINIMUM)
    return HealthCheckResult(name="torch_version", passed=passed,
                             detail=f"torch {installed} is installed; the trainer needs torch {TORCH_MINIMUM} or later")


def _no_nccl_here(facts: InstanceFacts) -> str | None:
    """Why NCCL has nothing to do on this type, or None where the trainer's collectives are NCCL's."""
    if facts.accelerator == "none":
        return f"{facts.name} trains with gloo on CPU; NCCL is not used"
    if facts.accelerator == "Trainium":
        return "Trainium's collectives are the Neuron runtime's; NCCL is not used"
    return None


def check_nccl_version(facts: InstanceFacts, probes: Probes) -> HealthCheckResult:
    if why := _no_nccl_here(facts):
        return _skipped("nccl_version", why)
    installed = probes.nccl_version()
    needed = ".".join(map(str, NCCL_MINIMUM))
    if installed is None:
        return HealthCheckResult(name="nccl_version", passed=False,
                                 detail=f"torch is built without NCCL; {facts.name} needs NCCL {needed} or later")
    return HealthCheckResult(name="nccl_version", passed=installed >= NCCL_MINIMUM,
                             detail=f"NCCL {'.'.join(map(str, installed))} is installed (torch's); "
                                    f"the trainer needs NCCL {needed} or later")


def check_nccl_network(facts: InstanceFacts, probes: Probes) -> HealthCheckResult:
    if why := _no_nccl_here(facts):
        return _skipped("nccl_network", why)
    if not facts.nccl_over_efa:
        return _skipped("nccl_network", f"{facts.name} has no EFA for NCCL to use")
    try:
        log = probes.nccl_network_log(facts)
    except (ProbeError, OSError) as exc:
        return HealthCheckResult(name="nccl_network", passed=False, detail=f"could not run NCCL: {exc}")
    return check_nccl_network_log(log)


_NVIDIA_SMI_QUERY_CHECKS = ("ecc_errors", "remapped_rows", "gpu_clocks", "gpu_pcie")
GPU_DEVICE_CHECKS = (*_NVIDIA_SMI_QUERY_CHECKS, "nvlink_links", "gpu_xid", "gpu_gemm", "nvlink_allreduce_busbw")
"""The device checks of CUDA types, in preflight's order."""


def _no_cuda_gpus_here(facts: InstanceFacts) -> str | None:
    """Why the GPU device checks have nothing to look at on this type, or None on CUDA types."""
    if facts.accelerator == "none":
        return f"{facts.name} has no GPUs"
    if facts.accelerator == "Trainium":
        return "Trainium chips are not NVIDIA GPUs; these checks read nvidia-smi and the NVIDIA driver's log"
    return None


def _looked(name: str, look: Callable[[], object], judge: Callable[[object], HealthCheckResult],
            cannot_look: Callable[[str, str], HealthCheckResult]) -> HealthCheckResult:
    """`judge` over what `look` returns, or `cannot_look(name, why)` when the probe could not look."""
    try:
        seen = look()
    except (ProbeError, OSError) as exc:
        return cannot_look(name, str(exc))
    return judge(seen)


def _failed_to_look(name: str, why: str) -> HealthCheckResult:
    return HealthCheckResult(name=name, passed=False, detail=f"could not look: {why}")


def check_gpu_devices(facts: InstanceFacts, probes: Probes) -> list[HealthCheckResult]:
    """The GPU device checks (GPU_DEVICE_CHECKS), skipped together on types without CUDA GPUs."""
    if why := _no_cuda_gpus_here(facts):
        return [_skipped(name, why) for name in GPU_DEVICE_CHECKS]
    try:
        query = probes.nvidia_smi_query()
    except (ProbeError, OSError) as exc:
        query_checks = [_failed_to_look(name, str(exc)) for name in _NVIDIA_SMI_QUERY_CHECKS]
    else:
        query_checks = [gpu_health.check_ecc_errors(query), gpu_health.check_remapped_rows(query),
                        gpu_health.check_clocks(query), gpu_health.check_pcie_link(facts, query)]
    return [
        *query_checks,
        _looked("nvlink_links", probes.nvlink_status, lambda status: gpu_health.check_nvlink_links(facts, status),
                _failed_to_look),
        _looked("gpu_xid", probes.kernel_log, gpu_health.check_kernel_xids,
                lambda name, why: _skipped(name, f"the kernel log cannot be read here: {why}")),
        _looked("gpu_gemm", probes.gemm_tflops, lambda rates: gpu_health.check_gemm(facts, rates), _failed_to_look),
        _looked("nvlink_allreduce_busbw", lambda: probes.nvlink_allreduce_busbw(facts),
                lambda busbw: gpu_health.check_nvlink_allreduce(facts, busbw), _failed_to_look),
    ]


def preflight(facts: InstanceFacts, probes: Probes) -> list[HealthCheckResult]:
    """Every preflight check for a node of type `facts`, in a fixed order."""
    return [
        check_accelerators(facts, probes),
        check_efa(facts, probes),
        check_gloo(probes),
        check_torch(probes),
        check_nccl_version(facts, probes),
        check_nccl_network(facts, probes),
        *check_gpu_devices(facts, probes),
        _skipped("allreduce_busbw", "the cross-node bandwidth probe needs the other nodes; "
                                    "preflight runs before the world is formed"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instance-type", required=True, help="EC2 instance type of this node")
    args = parser.parse_args(argv)
    try:
        facts = instance_facts(args.instance_type)
    except UnknownInstanceType as exc:
        parser.error(str(exc))
    checks = preflight(facts, system_probes())
    print(json.dumps([check.model_dump(mode="json") for check in checks]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
