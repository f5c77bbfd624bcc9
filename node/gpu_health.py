"""GPU device checks of preflight: what `nvidia-smi` and the kernel log say, and two measurements.

    python -m node.gpu_health gemm             # {"0": 731.2, ...}: bf16 TFLOPS of each GPU
    python -m node.gpu_health allreduce 8      # {"busbw_gbytes_per_s": 362.5}: NVLink all-reduce

node.health runs the commands and the measurements in subprocesses (a hung GPU must not hang
preflight) and judges what they print with the pure functions here, each over the text of a real
command's output (recordings in tests/data/nvidia-smi and tests/data/kernel-log):

- check_ecc_errors (`nvidia-smi -q`): ECC on, no uncorrectable error since the driver loaded
  (the volatile counters) and no SRAM error count over NVIDIA's replacement threshold. Lifetime
  (aggregate) DRAM uncorrectable errors are shown, not judged: row remapping repairs them, and
  check_remapped_rows judges whether it did.
- check_remapped_rows: no remapping pending (rows marked after an uncorrectable error, active
  only after a GPU reset) and no remapping failure (NVIDIA's replacement criterion).
- check_clocks: no hardware slowdown, thermal slowdown or power brake active. Idle clocks, the
  applications-clocks setting, the software power cap and sync boost are normal states.
- check_pcie_link: each GPU's host link has the type's lanes, and its generation while busy; an
  idle GPU lowers its link generation to save power, so an idle one is held to the generation its
  link can reach.
- check_nvlink_links (`nvidia-smi nvlink -s`): every GPU has all the type's links up.
- check_kernel_xids (dmesg): no Xid whose immediate action in NVIDIA's Xid catalogue is a GPU
  reset or more (REPLACE_NODE_XIDS), each one named with its GPU; the others are listed.
- check_gemm: each GPU's bf16 GEMM reaches GEMM_FLOOR_FRACTION of the type's peak.
- check_nvlink_allreduce: an all-reduce across the node's GPUs reaches the type's busbw floor.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from trainfleet.core.catalogue import InstanceFacts
from trainfleet.core.events import HealthCheckResult

__all__ = ["GpuQuery", "parse_nvidia_smi_query", "parse_nvlink_status", "parse_kernel_xids", "XidEvent",
           "REPLACE_NODE_XIDS", "GEMM_FLOOR_FRACTION", "check_ecc_errors", "check_remapped_rows", "check_clocks",
           "check_pcie_link", "check_nvlink_links", "check_kernel_xids", "check_gemm", "check_nvlink_allreduce",
           "measure_gemm_tflops", "measure_allreduce_busbw"]

GEMM_FLOOR_FRACTION = 0.5
"""Share of the catalogue's bf16 peak each GPU's GEMM must reach. A healthy GPU's large square bf16
GEMM runs well above half its data-sheet peak; one below half is clocked down or faulty. An
estimate to tune on real hardware, like the bandwidth floors."""
GEMM_SIZE = 8192
"""Side of the square bf16 matrices: large enough that the tensor cores, not the launch, set the pace."""
GEMM_ITERATIONS = 50
ALLREDUCE_BYTES = 1 << 30
"""Bytes each rank all-reduces: nccl-tests' busbw is still climbing at 256 MB on NVLink 4."""
ALLREDUCE_ITERATIONS = 20

# Catalogue entries (NVIDIA's Xid catalogue for Ampere and later) whose immediate action is a GPU
# reset, a bare-metal restart, or a workflow that ends in one (48, 74): a node logging one must not
# train until it is reset, and a fresh EC2 node is replaced rather than repaired.
REPLACE_NODE_XIDS = {
    46: "GPU stopped processing",
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained memory error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    136: "NVLink training failed",
    140: "unrecovered ECC error",
    143: "GPU initialization error",
    155: "NVLink software-defined error",
    158: "GPU fatal timeout",
}
# Common Xids whose catalogue action is to restart the application or nothing: the node can train.
_INFORMATIONAL_XIDS = {
    13: "graphics engine exception", 31: "GPU memory page fault", 43: "GPU stopped processing (application)",
    45: "preemptive cleanup", 63: "row remapping recorded", 92: "high single-bit ECC rate",
    94: "contained memory error", 154: "GPU recovery action changed",
}
_SLOWDOWNS = ("HW Slowdown", "HW Thermal Slowdown", "HW Power Brake Slowdown", "SW Thermal Slowdown")
"""Clock event reasons that mean the GPU is held below its clocks by heat or a power fault."""


# --- nvidia-smi -q ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuQuery:
    """One GPU's section of `nvidia-smi -q`: nested sections, each a dict of values and sections."""

    bus_id: str
    """e.g. "00000000:19:00.0", the section's heading."""
    fields: dict

    def get(self, *path: str) -> str | dict | None:
        """The value at `path` (section names, then a field), or None where the driver shows none."""
        found = self.fields
        for name in path:
            if not isinstance(found, dict) or name not in found:
                return None
            found = found[name]
        return found

    def first(self, *paths: tuple[str, ...]) -> str | dict | None:
        """The value at the first of `paths` this driver shows (section names changed across drivers)."""
        return next((found for path in paths if (found := self.get(*path)) is not None), None)


_GPU_HEADING = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])\s*$")


def parse_nvidia_smi_query(output: str) -> list[GpuQuery]:
    """The GPUs of `nvidia-smi -q` output, in its order. Its layout is an indented tree: a line
    "Name : value" is a field, a line without a value opens a section of the lines indented below."""
    gpus: list[GpuQuery] = []
    stack: list[tuple[int, dict]] = []
    for line in output.splitlines():
        if heading := _GPU_HEADING.match(line):
            gpus.append(GpuQuery(bus_id=heading[1], fields={}))
            stack = [(0, gpus[-1].fields)]
            continue
        if not gpus or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:  # the next top-level line ends the GPU's sections (a footer, another command)
            stack = []
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if not stack:
            continue
        name, _, value = line.strip().partition(":")
        section = stack[-1][1]
        if value.strip():
            section[name.strip()] = value.strip()
        else:
            section[name.strip()] = {}
            stack.append((indent, section[name.strip()]))
    return gpus


def _count(value: object) -> int:
    """A counter's value; "N/A" (not tracked on this GPU) counts as none."""
    return int(value) if isinstance(value, str) and value.isdigit() else 0


def _uncorrectable(counters: object) -> int:
    """Uncorrectable errors of an ECC counter section. Drivers name them "DRAM Uncorrectable",
    "SRAM Uncorrectable Parity", "SRAM Uncorrectable SEC-DED" (535 on), "SRAM Uncorrectable"
    (before), or keep a "Double Bit" section with a "Total" (before Ampere's)."""
    if not isinstance(counters, dict):
        return 0
    if isinstance(counters.get("Double Bit"), dict):
        return _count(counters["Double Bit"].get("Total"))
    return sum(_count(value) for name, value in counters.items() if "Uncorrectable" in name)


def _check(name: str, failures: list[str], passed_detail: str, *, measured: float | None = None,
           expected: float | None = None) -> HealthCheckResult:
    return HealthCheckResult(name=name, passed=not failures, measured=measured, expected=expected,
                             detail="; ".join(failures) if failures else passed_detail)


def _no_gpus(name: str) -> HealthCheckResult:
    return HealthCheckResult(name=name, passed=False, detail="nvidia-smi -q lists no GPU")


def check_ecc_errors(query: str) -> HealthCheckResult:
    """Passed when every GPU has ECC on, no volatile uncorrectable error and no SRAM threshold exceeded."""
    gpus = parse_nvidia_smi_query(query)
    if not gpus:
        return _no_gpus("ecc_errors")
    failures, lifetime = [], []
    for gpu in gpus:
        if gpu.get("ECC Mode", "Current") == "Disabled":
            failures.append(f"GPU {gpu.bus_id}: ECC is disabled")
        if volatile := _uncorrectable(gpu.get("ECC Errors", "Volatile")):
            failures.append(f"GPU {gpu.bus_id}: {volatile} uncorrectable ECC errors since the driver loaded")
        if gpu.get("ECC Errors", "Aggregate", "SRAM Threshold Exceeded") == "Yes":
            failures.append(f"GPU {gpu.bus_id}: lifetime SRAM uncorrectable errors over NVIDIA's threshold")
        if aggregate := _uncorrectable(gpu.get("ECC Errors", "Aggregate")):
            lifetime.append(f"{gpu.bus_id} ({aggregate})")
    check = _check("ecc_errors", failures, f"{len(gpus)} GPUs with ECC on and no uncorrectable error since "
                                           "the driver loaded")
    if lifetime:
        history = f"; lifetime uncorrectable errors (repaired by row remapping): {', '.join(lifetime)}"
        check = check.model_copy(update={"detail": check.detail + history})
    return check


def check_remapped_rows(query: str) -> HealthCheckResult:
    """Passed when no GPU has a row remapping pending or a remapping failure."""
    gpus = parse_nvidia_smi_query(query)
    if not gpus:
        return _no_gpus("remapped_rows")
    failures = []
    for gpu in gpus:
        uncorrectable = _count(gpu.get("Remapped Rows", "Uncorrectable Error"))
        if gpu.get("Remapped Rows", "Pending") == "Yes":
            failures.append(f"GPU {gpu.bus_id}: row remapping pending ({uncorrectable} rows remapped for "
                            "uncorrectable errors; a GPU reset activates it)")
        if gpu.get("Remapped Rows", "Remapping Failure Occurred") == "Yes":
            failures.append(f"GPU {gpu.bus_id}: row remapping failed (NVIDIA's criterion to replace the GPU)")
    return _check("remapped_rows", failures, f"{len(gpus)} GPUs with no row remapping pending or failed")


def _clock_reasons(gpu: GpuQuery) -> dict:
    """Clock event reasons: "Clocks Event Reasons" since driver 535, "Clocks Throttle Reasons" before;
    HW Thermal and HW Power Brake Slowdown are nested under HW Slowdown."""
    reasons = gpu.first(("Clocks Event Reasons",), ("Clocks Throttle Reasons",))
    if not isinstance(reasons, dict):
        return {}
    flat = {name: value for name, value in reasons.items() if isinstance(value, str)}
    for nested in (value for value in reasons.values() if isinstance(value, dict)):
        flat.update(nested)
    if isinstance(reasons.get("HW Slowdown"), dict):  # a driver that nests without its own value
        flat.setdefault("HW Slowdown", "Not Active")
    return flat


def check_clocks(query: str) -> HealthCheckResult:
    """Passed when no GPU has a hardware slowdown, a thermal slowdown or a power brake active."""
    gpus = parse_nvidia_smi_query(query)
    if not gpus:
        return _no_gpus("gpu_clocks")
    failures = []
    for gpu in gpus:
        reasons = _clock_reasons(gpu)
        if not reasons:
            failures.append(f"GPU {gpu.bus_id}: nvidia-smi shows no clock event reasons")
        elif active := [reason for reason in _SLOWDOWNS if reasons.get(reason) == "Active"]:
            failures.append(f"GPU {gpu.bus_id}: {', '.join(active)} active")
    return _check("gpu_clocks", failures, f"{len(gpus)} GPUs with no hardware, thermal or power-brake slowdown")


def check_pcie_link(facts: InstanceFacts, query: str) -> HealthCheckResult:
    """Passed when every GPU's host link has the type's lanes and, while busy, at least its
    generation; an idle GPU is held to the generation its link can reach ("Max")."""
    gpus = parse_nvidia_smi_query(query)
    if not gpus:
        return _no_gpus("gpu_pcie")
    expected = f"gen{facts.gpu_pcie_generation} x{facts.gpu_pcie_lanes}"
    failures = []
    for gpu in gpus:
        link = gpu.get("PCI", "GPU Link Info")
        if not isinstance(link, dict):
            failures.append(f"GPU {gpu.bus_id}: nvidia-smi shows no PCIe link")
            continue
        lanes = _count(str(link.get("Link Width", {}).get("Current", "")).rstrip("x"))
        generation = _count(link.get("PCIe Generation", {}).get("Current"))
        reachable = _count(link.get("PCIe Generation", {}).get("Max"))
        idle = _clock_reasons(gpu).get("Idle") == "Active"
        judged = reachable if idle and generation < facts.gpu_pcie_generation else generation
        if lanes != facts.gpu_pcie_lanes or judged < facts.gpu_pcie_generation:
            seen = f"gen{generation} x{lanes}" + (f" (idle; its link reaches gen{reachable})" if idle else "")
            failures.append(f"GPU {gpu.bus_id}: PCIe {seen}, {facts.name} has {expected}")
    return _check("gpu_pcie", failures, f"{len(gpus)} GPUs on PCIe {expected}")


# --- nvidia-smi nvlink -s --------------------------------------------------------------------

_NVLINK_GPU = re.compile(r"^GPU (\d+): (.+?)(?: \(UUID: [^)]*\))?\s*$")
_NVLINK_LINK = re.compile(r"^\s*Link (\d+): (.+?)\s*$")


def parse_nvlink_status(output: str) -> dict[int, dict[int, float | None]]:
    """`nvidia-smi nvlink -s` output: GPU index -> link -> GB/s, None for a link shown "<inactive>"."""
    gpus: dict[int, dict[int, float | None]] = {}
    links: dict[int, float | None] | None = None
    for line in output.splitlines():
        if found := _NVLINK_GPU.match(line):
            links = gpus.setdefault(int(found[1]), {})
        elif links is not None and (found := _NVLINK_LINK.match(line)):
            rate = re.match(r"([\d.]+) GB/s", found[2])
            links[int(found[1])] = float(rate[1]) if rate else None
    return gpus


def check_nvlink_links(facts: InstanceFacts, status: str) -> HealthCheckResult:
    """Passed when every GPU listed has all the type's NVLink links up."""
    gpus = parse_nvlink_status(status)
    expected = facts.nvlink_links_per_gpu
    if not gpus:
        return HealthCheckResult(name="nvlink_links", passed=False, expected=expected,
                                 detail="nvidia-smi nvlink -s lists no GPU")
    failures = []
    for index, links in sorted(gpus.items()):
        up = [link for link, rate in links.items() if rate]
        if len(up) != expected:
            down = sorted(link for link, rate in links.items() if not rate)
            failures.append(f"GPU {index}: {len(up)} of {expected} NVLink links up"
                            + (f" (down: {', '.join(map(str, down))})" if down else ""))
    fewest = min(sum(1 for rate in links.values() if rate) for links in gpus.values())
    return _check("nvlink_links", failures, f"{len(gpus)} GPUs with all {expected} NVLink links up",
                  measured=fewest, expected=expected)


# --- the kernel log --------------------------------------------------------------------------

@dataclass(frozen=True)
class XidEvent:
    """An Xid the NVIDIA driver logged: the GPU's PCI address, the code, its first message."""

    gpu: str
    xid: int
    message: str


# "NVRM: Xid (PCI:0000:19:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit
# error ..." ("PCI:" is absent in older drivers, and there is no pid in some messages).
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9A-Fa-f:.]+)\): (\d+),?\s*(.*)$")


def parse_kernel_xids(log: str) -> list[XidEvent]:
    """Each distinct (GPU, Xid) in a kernel log, in the order first seen, with its first message."""
    events: dict[tuple[str, int], XidEvent] = {}
    for line in log.splitlines():
        if found := _XID.search(line):
            key = (found[1], int(found[2]))
            events.setdefault(key, XidEvent(gpu=found[1], xid=int(found[2]), message=found[3].strip()))
    return list(events.values())


def _named(xid: int) -> str:
    name = REPLACE_NODE_XIDS.get(xid) or _INFORMATIONAL_XIDS.get(xid)
    return f"Xid {xid} ({name})" if name else f"Xid {xid}"


def check_kernel_xids(log: str) -> HealthCheckResult:
    """Failed when the kernel log holds an Xid of REPLACE_NODE_XIDS, each named with its GPU."""
    events = parse_kernel_xids(log)
    fatal = [event for event in events if event.xid in REPLACE_NODE_XIDS]
    others = sorted({f"{_named(event.xid)} on {event.gpu}" for event in events if event.xid not in REPLACE_NODE_XIDS})
    noted = f"; also logged, not fatal: {', '.join(others)}" if others else ""
    if fatal:
        named = [f"{_named(event.xid)} on GPU {event.gpu}: {event.message[:160]}" for event in fatal]
        return HealthCheckResult(name="gpu_xid", passed=False, measured=len(fatal),
                                 detail="replace the node: " + "; ".join(named) + noted)
    return HealthCheckResult(name="gpu_xid", passed=True, measured=0,
                             detail=("no Xid in the kernel log" if not events else "no Xid that needs a reset")
                                    + noted)


# --- measurements ----------------------------------------------------------------------------

def check_gemm(facts: InstanceFacts, tflops: dict[int, float]) -> HealthCheckResult:
    """Passed when each of the type's GPUs reaches GEMM_FLOOR_FRACTION of its bf16 peak; the slow
    ones are named."""
    floor = GEMM_FLOOR_FRACTION * facts.bf16_dense_tflops
    rates = ", ".join(f"{index}: {rate:.0f}" for index, rate in sorted(tflops.items()))
    failures = [f"GPU {index} reaches {rate:.0f} TFLOPS" for index, rate in sorted(tflops.items()) if rate < floor]
    if len(tflops) != facts.accelerator_count:
        failures.append(f"{len(tflops)} GPUs measured, {facts.name} has {facts.accelerator_count}")
    stated = (f"bf16 GEMM {GEMM_SIZE}^3, floor {floor:.0f} TFLOPS ({GEMM_FLOOR_FRACTION:.0%} of the "
              f"{facts.accelerator}'s {facts.bf16_dense_tflops:.0f}); per GPU: {rates or 'none'}")
    return HealthCheckResult(name="gpu_gemm", passed=not failures, expected=floor,
                             measured=min(tflops.values()) if tflops else None,
                             detail="; ".join([*failures, stated]) if failures else stated)


def check_nvlink_allreduce(facts: InstanceFacts, busbw_gbytes_per_s: float) -> HealthCheckResult:
    """Passed when the all-reduce across the node's GPUs reaches the type's NVLink busbw floor."""
    floor = facts.nvlink_busbw_floor_gbytes_per_s
    return HealthCheckResult(name="nvlink_allreduce_busbw", passed=busbw_gbytes_per_s >= floor,
                             measured=busbw_gbytes_per_s, expected=floor,
                             detail=f"{facts.accelerator_count}-GPU NCCL all-reduce of {ALLREDUCE_BYTES >> 20} MiB: "
                                    f"busbw {busbw_gbytes_per_s:.1f} GB/s, floor {floor:.0f} GB/s")


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gemm_tflops(device, dtype, size: int, iterations: int) -> float:
    """The rate of `iterations` square matmuls of side `size` on `device`, in TFLOPS."""
    import torch

    left = torch.randn(size, size, device=device, dtype=dtype)
    right = torch.randn(size, size, device=device, dtype=dtype)
    product = torch.matmul(left, right)  # the first call picks the kernel; it is not timed
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        torch.matmul(left, right, out=product)
    _synchronize(device)
    return 2 * size ** 3 * iterations / (time.perf_counter() - start) / 1e12


def gemm_tflops_of_each_gpu() -> dict[int, float]:
    """bf16 GEMM TFLOPS of each CUDA device, one after the other."""
    import torch

    return {index: measure_gemm_tflops(torch.device("cuda", index), torch.bfloat16, GEMM_SIZE, GEMM_ITERATIONS)
            for index in range(torch.cuda.device_count())}


def _allreduce_rank(rank: int, world_size: int, backend: str, size_bytes: int, iterations: int,
                    folder: str) -> None:
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.FileStore(str(Path(folder) / "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            device_id=device if device.type == "cuda" else None)
    try:
        tensor = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(tensor)  # warm-up: connects the ranks and sets up NCCL's channels
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(tensor)
        _synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the collective's pace
        if rank == 0:
            # nccl-tests' bus bandwidth: what each link carries in a ring all-reduce, 2(n-1)/n of the data.
            algbw = size_bytes * iterations / elapsed.item()
            busbw = algbw * 2 * (world_size - 1) / world_size / 1e9
            (Path(folder) / "busbw").write_text(repr(busbw))
    finally:
        dist.destroy_process_group()


def measure_allreduce_busbw(world_size: int, backend: str, size_bytes: int, iterations: int) -> float:
    """Bus bandwidth (GB/s) of an all-reduce of `size_bytes` across `world_size` processes on this
    machine, one per GPU with NCCL, on CPU with gloo."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_allreduce_rank, args=(world_size, backend, size_bytes, iterations, folder), nprocs=world_size)
        return float((Path(folder) / "busbw").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    measurement = parser.add_subparsers(dest="measurement", required=True)
    measurement.add_parser("gemm", help="bf16 GEMM TFLOPS of each GPU")
    allreduce = measurement.add_parser("allreduce", help="NCCL all-reduce busbw across this node's GPUs")
    allreduce.add_argument("ranks", type=int)
    args = parser.parse_args(argv)
    if args.measurement == "gemm":
        print(json.dumps(gemm_tflops_of_each_gpu()))
    else:
        busbw = measure_allreduce_busbw(args.ranks, "nccl", ALLREDUCE_BYTES, ALLREDUCE_ITERATIONS)
        print(json.dumps({"busbw_gbytes_per_s": busbw}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
