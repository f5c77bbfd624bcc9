"""Instance catalogue: the facts about each supported EC2 instance type that the control plane needs.

Offers:
    InstanceFacts            one type's facts (accelerators, EFA layout, bandwidth, price)
    CATALOGUE                every supported type, keyed by API name
    instance_facts(name)     look one up; an unknown name raises UnknownInstanceType naming it
    UnknownInstanceType      ValueError subclass, lists the supported names
    nccl_environment(facts, inherited, probe=False)
                             what NCCL's processes need in their environment: EFA on that type, and
                             error handling that leaves a failed world's ranks alive to repair it

Sources: the Amazon EC2 accelerated computing instance specifications and the EFA user guide
("Maximize network bandwidth on instances with multiple network cards"); the hardware figures
agree with EC2's DescribeInstanceTypes data (tests/test_catalogue.py checks them against the
copy moto ships). Prices are us-east-1 Linux on-demand per instance-hour. trn1 and c5 are
published list prices. The P-type prices are estimates (`price_is_estimate`): AWS cut P4d,
P4de, P5 and P5en on-demand prices by up to 45 % in June 2025, the current list could not be
checked here, and p5e is sold mainly as Capacity Blocks. Prices feed only the cost ledger and the
cost ceiling; check the pricing page before relying on a ceiling.
GPU memory is what CUDA reports as the device's total, which the memory plan holds layouts to: the
data sheets' 40 GB and 80 GB are 39.39 GiB on an A100 40 GB, 79.35 GiB on an A100 80 GB and 79.18
GiB on an H100 80 GB (the driver's and ECC's reservations come off). The H200's 139.8 GiB is an
estimate (nvidia-smi's 143,771 MiB, less the same share as on the H100), to confirm with
torch.cuda.mem_get_info.
The all-reduce bus-bandwidth floors are this project's acceptance thresholds for the preflight
all-reduce test (nccl-tests "busbw" between two nodes), set at roughly half the EFA line rate
in bytes: a healthy pair of nodes clears them, a node with a dead EFA card does not. They are
estimates to tune on real hardware.

GPU facts per accelerator (`_GPU_FACTS`), what preflight's device checks hold each node to: NVLink
links per GPU (A100 SXM4: 12 of NVLink 3, H100 and H200 SXM5: 18 of NVLink 4), the GPUs' host link
(PCIe gen4 x16 on P4, gen5 x16 on P5), the dense bf16 tensor-core peak of one GPU (NVIDIA's data
sheets: A100 312 TFLOPS, H100 and H200 SXM 989; the sheets' larger figures are with sparsity), and
the floor of an all-reduce across the node's 8 GPUs over NVLink (nccl-tests busbw): about half of
what NCCL reaches on a healthy node (about 230 GB/s on 8x A100, 370 GB/s on 8x H100 with ring
algorithms, the effective NVLink rate after protocol overhead), so a node with a link down or a GPU
clocked down fails it. These floors are estimates to tune on real hardware as well.

NCCL over EFA (`nccl_environment`): NCCL reaches EFA only through the aws-ofi-nccl plugin
(libnccl-net.so), which it dlopens at start; without it NCCL falls back to TCP sockets without an
error. The Deep Learning AMI installs the plugin in /opt/amazon/ofi-nccl/lib (the EFA installer's
copy; older images: /opt/aws-ofi-nccl/lib) and libfabric in /opt/amazon/efa/lib (lib64 on Amazon
Linux). Where an image adds them to the search path in a login shell's profile, a systemd service
and the processes it starts never see them; naming them here does not depend on how the image was
built. The variables are those of AWS's "Get started with EFA
and NCCL" test: FI_PROVIDER=efa, FI_EFA_USE_DEVICE_RDMA=1 where the EFA supports RDMA read (all
instances on Nitro v4 and later, which every P4 and P5 type is; libfabric then aborts rather than
run without it). NCCL's log: the preflight probe runs with NCCL_DEBUG=INFO, whose lines name the
network NCCL chose (preflight reads them); training ranks with NCCL_DEBUG=WARN, and
NCCL_DEBUG_SUBSYS=INIT,NET for whoever raises the level on a node: at INFO each rank logs its
rings, trees and channels for every communicator it joins, millions of lines in a world of 4,096
ranks. FI_EFA_FORK_SAFE=1 keeps libfabric from aborting a process that forks (data loader workers)
with an old kernel or rdma-core; on current ones libfabric ignores it. NCCL_PROTO=simple, which
older guides set, is left out: the plugin sets it itself on the platforms that need it, and it
would slow the platforms that do not.

NCCL's error handling (`NCCL_ERROR_HANDLING`, torch 2.13's ProcessGroupNCCL). Its watchdog thread
finds a collective that failed (a peer's process gone: NCCL reports it within seconds; a node gone:
after the network's retries) or outlived the group's timeout, sets the group's error
(Backend.get_error) and sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default: a minute)
for other ranks to dump their flight recorders. Then TORCH_NCCL_ASYNC_ERROR_HANDLING decides: 0
does nothing (a wait on the lost peer never ends unless the program aborts the group); 1 aborts the
group's communicators and rethrows from the watchdog thread, which ends the process (SIGABRT); 3,
ProcessGroupNCCL's default, rethrows without aborting; 2 aborts the communicators and leaves the
process. torchrun sets 1 for its workers unless the variable is set. Only 2 keeps a rank alive to
leave the failed world and form the next one (trainer/repair.py): the abort lets the collective's
kernels exit, the host's next synchronisation returns normally with whatever had been reduced, and
the next call on the group raises; the trainer checks the group's error after each such
synchronisation (trainer/world_failure.py). The dump timeout is 1 s, so the abort comes 4 s after
the error rather than a minute. TORCH_NCCL_DUMP_ON_TIMEOUT=0: with it on, the first error anywhere
has every rank's heartbeat monitor dump its flight recorder and end its process (SIGABRT)
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (8 minutes) later unless it left the failed world by then, which
a rank held by a peer that is stuck rather than gone may not have; nothing collects the dumps (a
file in /tmp of the instance). The variables are set on every type: only NCCL's process groups
read them, and the CPU types' local runs hold gloo to NCCL's rules in the same mode
(tests/nccl_rules.py).
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["InstanceFacts", "CATALOGUE", "instance_facts", "UnknownInstanceType", "nccl_environment",
           "NCCL_ERROR_HANDLING", "NCCL_WATCHDOG_PAUSE_S"]

CUDA_GPUS = ("A100", "H100", "H200")
"""Accelerators the trainer drives through CUDA, and so whose collectives NCCL carries."""
NCCL_EFA_LIBRARY_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib", "/opt/amazon/efa/lib",
                         "/opt/amazon/efa/lib64")
"""Where the Deep Learning AMI keeps the aws-ofi-nccl plugin and libfabric (see the module docstring);
a folder an image lacks costs the loader one failed lookup."""
NCCL_PROBE_LOG = {"NCCL_DEBUG": "INFO"}
"""The preflight probe's NCCL log: every INFO line of every subsystem (it reads the network's)."""
NCCL_TRAINING_LOG = {"NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
"""A training rank's NCCL log: warnings only (see the module docstring)."""
NCCL_WATCHDOG_PAUSE_S = 4.0
"""How long NCCL's watchdog waits between finding a collective failed and aborting its group's
communicators: 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (see the module docstring)."""
NCCL_ERROR_HANDLING = MappingProxyType({
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(int(NCCL_WATCHDOG_PAUSE_S / 4 * 1000)),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
})
"""NCCL's error handling in a world that may be repaired in place: a failed collective's group is
aborted and its ranks live on (see the module docstring)."""


class InstanceFacts(BaseModel):
    """What the lifecycle and the fleet adapter need to know about one instance type."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """EC2 API name, e.g. "p5.48xlarge"."""
    accelerator: Literal["A100", "H100", "H200", "Trainium", "none"]
    """Accelerator model; "none" for the small CPU types used by local runs."""
    accelerator_count: int = Field(ge=0)
    """Accelerators per instance (GPUs, or Trainium chips)."""
    accelerator_memory_gib: float = Field(ge=0)
    """Memory of one accelerator in GiB: on GPUs, what CUDA reports as the device's total
    (torch.cuda.mem_get_info), a little under the data sheet's figure (see the module docstring)."""
    ranks_per_node: int = Field(ge=1)
    """Trainer processes per instance: one per GPU, one per NeuronCore (2 per Trainium chip),
    one per physical core on CPU types."""
    host_memory_gib: float = Field(gt=0)
    """The instance's own memory (RAM) in GiB: the in-memory checkpoints live in its tmpfs
    (/dev/shm, half of it by default; memory_plan.host_memory_problem)."""
    vcpus: int = Field(ge=1)
    """vCPUs per instance."""
    network_cards: int = Field(ge=1)
    """Network cards; the launch template attaches one EFA interface to each."""
    efa_supported: bool
    """Whether the type takes EFA interfaces at all (the CPU types do not)."""
    efa_bandwidth_gbps: int = Field(ge=0)
    """Aggregate EFA network bandwidth in Gbit/s (0 when EFA is not supported)."""
    efa_rdma_read: bool = False
    """Whether the type's EFA supports RDMA read (Nitro v4 and later), so libfabric can move NCCL's
    buffers between GPU memory and the wire without a copy through the host (GPUDirect RDMA)."""
    busbw_floor_gbytes_per_s: float = Field(gt=0)
    """Minimum two-node all-reduce bus bandwidth (GB/s) a healthy pair must reach in preflight."""
    on_demand_usd_per_hour: float = Field(gt=0)
    """us-east-1 Linux on-demand price per instance-hour."""
    price_is_estimate: bool = False
    """True when the price is not a published on-demand list price (see module docstring)."""
    nvlink_links_per_gpu: int = Field(default=0, ge=0)
    """NVLink links each GPU has, all up on a healthy node; 0 where there is no NVLink."""
    gpu_pcie_generation: int = Field(default=0, ge=0)
    """PCIe generation of each GPU's host link; 0 on types without GPUs."""
    gpu_pcie_lanes: int = Field(default=0, ge=0)
    """PCIe lanes of each GPU's host link; 0 on types without GPUs."""
    bf16_dense_tflops: float = Field(default=0.0, ge=0)
    """Peak dense bf16 tensor-core rate of one GPU (TFLOPS, data sheet); 0 on types without GPUs."""
    nvlink_busbw_floor_gbytes_per_s: float = Field(default=0.0, ge=0)
    """Minimum bus bandwidth (GB/s) of an all-reduce across all the node's GPUs over NVLink."""

    @property
    def memory_per_rank_gib(self) -> float:
        """Accelerator memory of one trainer process: a whole GPU, half a Trainium chip (one
        NeuronCore); 0 on CPU types."""
        return self.accelerator_memory_gib * self.accelerator_count / self.ranks_per_node

    @property
    def efa_interface_count(self) -> int:
        """EFA interfaces to attach: one per network card, none on types without EFA."""
        return self.network_cards if self.efa_supported else 0

    @property
    def nccl_over_efa(self) -> bool:
        """Whether the trainer's collectives cross nodes through NCCL on EFA: CUDA GPUs with EFA.
        The CPU types train with gloo; Trainium's collectives are the Neuron runtime's, not NCCL's."""
        return self.efa_supported and self.accelerator in CUDA_GPUS


_GPU_FACTS = {
    "A100": dict(nvlink_links_per_gpu=12, gpu_pcie_generation=4, gpu_pcie_lanes=16, bf16_dense_tflops=312.0,
                 nvlink_busbw_floor_gbytes_per_s=115.0),
    "H100": dict(nvlink_links_per_gpu=18, gpu_pcie_generation=5, gpu_pcie_lanes=16, bf16_dense_tflops=989.0,
                 nvlink_busbw_floor_gbytes_per_s=185.0),
    "H200": dict(nvlink_links_per_gpu=18, gpu_pcie_generation=5, gpu_pcie_lanes=16, bf16_dense_tflops=989.0,
                 nvlink_busbw_floor_gbytes_per_s=185.0),
}
"""Per-GPU facts of each SXM accelerator (see the module docstring)."""


def _gpu(name: str, accelerator: str, count: int, memory_gib: float, host_gib: float, cards: int, efa_gbps: int,
         busbw_floor: float, price: float, *, estimate: bool = False, vcpus: int = 96) -> InstanceFacts:
    return InstanceFacts(name=name, accelerator=accelerator, accelerator_count=count,
                         accelerator_memory_gib=memory_gib, host_memory_gib=host_gib, ranks_per_node=count, vcpus=vcpus,
                         network_cards=cards, efa_supported=True, efa_bandwidth_gbps=efa_gbps,
                         efa_rdma_read=True, busbw_floor_gbytes_per_s=busbw_floor, on_demand_usd_per_hour=price,
                         price_is_estimate=estimate, **_GPU_FACTS[accelerator])


def _cpu(name: str, vcpus: int, price: float) -> InstanceFacts:
    # The CPU types stand in for GPU nodes in local runs: gloo over loopback, one rank per core.
    # C5: 2 GiB of memory per vCPU.
    return InstanceFacts(name=name, accelerator="none", accelerator_count=0, accelerator_memory_gib=0,
                         host_memory_gib=2 * vcpus,
                         ranks_per_node=max(1, vcpus // 2), vcpus=vcpus, network_cards=1,
                         efa_supported=False, efa_bandwidth_gbps=0, busbw_floor_gbytes_per_s=0.01,
                         on_demand_usd_per_hour=price)


CATALOGUE: MappingProxyType[str, InstanceFacts] = MappingProxyType({
    facts.name: facts for facts in (
        # Every P type here runs on Nitro v4 or later: EFA with RDMA read (_gpu sets it).
        # 8x A100 40 GB, 1152 GiB of host memory, 4 network cards, 400 Gbps EFA.
        _gpu("p4d.24xlarge", "A100", 8, 39.39, 1152, 4, 400, 25.0, 21.96, estimate=True),
        # 8x A100 80 GB, same host and network as p4d.
        _gpu("p4de.24xlarge", "A100", 8, 79.35, 1152, 4, 400, 25.0, 27.45, estimate=True),
        # 8x H100 80 GB, 2048 GiB of host memory, 32 network cards, 3200 Gbps EFA (v2).
        _gpu("p5.48xlarge", "H100", 8, 79.18, 2048, 32, 3200, 200.0, 55.04, estimate=True, vcpus=192),
        # 8x H200 141 GB, 2048 GiB of host memory, 32 network cards, 3200 Gbps EFA (v2).
        _gpu("p5e.48xlarge", "H200", 8, 139.8, 2048, 32, 3200, 200.0, 60.00, estimate=True, vcpus=192),
        # 8x H200 141 GB, 2048 GiB of host memory, 16 network cards, 3200 Gbps EFA (v3).
        _gpu("p5en.48xlarge", "H200", 8, 139.8, 2048, 16, 3200, 200.0, 63.30, estimate=True, vcpus=192),
        # 16 Trainium chips (32 NeuronCores) with 32 GB each, 512 GiB of host memory, 8 network
        # cards, 800 Gbps EFA.
        InstanceFacts(name="trn1.32xlarge", accelerator="Trainium", accelerator_count=16,
                      accelerator_memory_gib=32, host_memory_gib=512, ranks_per_node=32, vcpus=128, network_cards=8,
                      efa_supported=True, efa_bandwidth_gbps=800, efa_rdma_read=True, busbw_floor_gbytes_per_s=50.0,
                      on_demand_usd_per_hour=21.50),
        _cpu("c5.large", 2, 0.085),
        _cpu("c5.xlarge", 4, 0.17),
        _cpu("c5.2xlarge", 8, 0.34),
    )
})


class UnknownInstanceType(ValueError):
    """An instance type the catalogue has no facts for."""

    def __init__(self, name: str):
        super().__init__(f"instance type {name!r} is not in the catalogue; "
                         f"supported: {', '.join(sorted(CATALOGUE))}")
        self.name = name


def instance_facts(name: str) -> InstanceFacts:
    """The facts for `name`, or UnknownInstanceType."""
    try:
        return CATALOGUE[name]
    except KeyError:
        raise UnknownInstanceType(name) from None


def nccl_environment(facts: InstanceFacts, inherited: Mapping[str, str], *, probe: bool = False) -> dict[str, str]:
    """The variables to set, over the `inherited` environment, in torchrun's ranks on a node of
    type `facts`, or with `probe` in the preflight probe: NCCL's error handling on every type, and
    where NCCL reaches other nodes over EFA what it needs for that, its log at INFO in the probe
    (see the module docstring). The node's own LD_LIBRARY_PATH is kept after the plugin's folders,
    without empty entries (an empty one means the working directory)."""
    if not facts.nccl_over_efa:
        return dict(NCCL_ERROR_HANDLING)
    kept = [folder for folder in inherited.get("LD_LIBRARY_PATH", "").split(":")
            if folder and folder not in NCCL_EFA_LIBRARY_DIRS]
    environment = {**NCCL_ERROR_HANDLING, "FI_PROVIDER": "efa", "FI_EFA_FORK_SAFE": "1",
                   "LD_LIBRARY_PATH": ":".join([*NCCL_EFA_LIBRARY_DIRS, *kept]),
                   **(NCCL_PROBE_LOG if probe else NCCL_TRAINING_LOG)}
    if facts.efa_rdma_read:
        environment["FI_EFA_USE_DEVICE_RDMA"] = "1"
    return environment
