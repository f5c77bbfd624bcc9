"""Preflight health checks: does this node have what its instance type promises?

    python -m trainer.health --instance-type p5.48xlarge     # one JSON list of check results

The node agent runs this as a subprocess before it reports NodeReady (so the agent itself never
imports torch) and sends the results with NodeReady or NodeUnhealthy. Each check compares what
the node shows with the catalogue (trainfleet.catalogue):

- accelerator_count: torch.cuda.device_count() equals the type's GPU count (the trainer runs one
  rank per GPU). CPU types have nothing to count and Trainium chips are not CUDA devices: skipped.
- efa_devices: `fi_info -p efa` lists one EFA device per network card, on types with EFA only.
  A missing fi_info on such a type fails: without libfabric the trainer cannot use the cards.
- gloo_allreduce: torch.distributed works on this node (a one-rank gloo all-reduce gives back
  its input). It proves the libraries load, not the network.
- allreduce_busbw: the cross-node bandwidth probe needs the other nodes, which preflight runs
  before; skipped, saying so.

A check that cannot run here is reported skipped with its reason, never as passed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from trainfleet.catalogue import InstanceFacts, UnknownInstanceType, instance_facts
from trainfleet.contracts import HealthCheckResult

__all__ = ["Probes", "ProbeError", "preflight", "system_probes", "parse_fi_info"]

FI_INFO_TIMEOUT_S = 30


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


def system_probes() -> Probes:
    """The probes of the machine this runs on."""
    return Probes(cuda_device_count=_cuda_device_count, efa_devices=_efa_devices,
                  gloo_allreduce_ok=_gloo_allreduce_ok)


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


def preflight(facts: InstanceFacts, probes: Probes) -> list[HealthCheckResult]:
    """Every preflight check for a node of type `facts`, in a fixed order."""
    return [
        check_accelerators(facts, probes),
        check_efa(facts, probes),
        check_gloo(probes),
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
