"""What the step-time model (step_time.py) needs to know of a GPU cluster, as plain data.

A cluster is its GPU model, GPUs a node and the node's network; the EC2 types come from the
catalogue (catalogue.py), and a published cluster is described the same way beside them, so the
model's predictions can be held against measurements made on it.

Offers:
    GPU, Cluster                      the data
    A100_40GB, A100_80GB, H100, H200  the SXM GPUs (figures and sources below)
    DGX_A100_SUPERPOD, DGX_H100_SUPERPOD   NVIDIA's reference clusters
    ec2_cluster(facts)                the cluster a fleet of one EC2 type makes; UnmodelledInstanceType
                                      for a type whose GPU is not described here

GPU figures. Peaks are the dense bf16 tensor-core rates of NVIDIA's data sheets (the larger ones
there are with sparsity), memory bandwidth and SM counts too (A100: 108 SMs, 1,555 GB/s with
40 GB of HBM2, 2,039 GB/s with 80 GB of HBM2e; H100 SXM5: 132 SMs, 3.35 TB/s of HBM3; H200:
4.8 TB/s of HBM3e). What the kernels reach of them is measured, not calibrated:
- matmul_efficiency: the maximum achievable matmul rate (bf16 GEMMs over many large shapes),
  S. Bekman, "Machine Learning Engineering", compute/accelerator, "Maximum Achievable Matmul
  FLOPS comparison table": A100 SXM 267.9 of 312 TFLOPS (85.9 %), H100 SXM 792.1 of 989 (80.1 %);
  the H200 is the same chip at the same clocks.
- attention_efficiency: FlashAttention-2, which torch's scaled_dot_product_attention runs first on
  these GPUs (its backend priority is flash, efficient, math, cudnn): 50-73 % of the A100's peak
  forward and backward (Dao, "FlashAttention-2", 2023, abstract and figure 4; 0.6 taken) and 35 %
  of the H100's (Shah et al., "FlashAttention-3", 2024, abstract).
- nvlink_busbw: what NCCL's ring all-gather and reduce-scatter reach among a node's 8 GPUs
  (nccl-tests bus bandwidth): about 230 GB/s on NVLink 3 (NCCL's own tuning model caps sm80 at
  235, src/graph/tuning.cc) and 370 GB/s on NVLink 4 (catalogue.py's NVLink floors are half of
  these).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfleet.core.catalogue import InstanceFacts

__all__ = ["GPU", "Cluster", "A100_40GB", "A100_80GB", "H100", "H200", "DGX_A100_SUPERPOD", "DGX_H100_SUPERPOD",
           "ec2_cluster", "UnmodelledInstanceType"]


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_tflops: float
    """Dense bf16 tensor-core peak (data sheet)."""
    matmul_efficiency: float
    """Of the peak, what bf16 GEMMs of large, well-divided shapes reach (measured)."""
    attention_efficiency: float
    """Of the peak, what FlashAttention-2's forward and backward reach (measured)."""
    hbm_gbytes_per_s: float
    """Memory bandwidth (data sheet)."""
    sms: int
    """Streaming multiprocessors: a GEMM runs in waves of one output tile per SM."""
    nvlink_busbw_gbytes_per_s: float
    """Bus bandwidth of NCCL's all-gather and reduce-scatter among a node's GPUs (measured)."""


@dataclass(frozen=True)
class Cluster:
    name: str
    gpu: GPU
    gpus_per_node: int
    network_gbits_per_s: float
    """A node's bandwidth to the other nodes, all its network cards together (line rate)."""

    @property
    def network_bytes_per_s(self) -> float:
        return self.network_gbits_per_s * 1e9 / 8


A100_40GB = GPU("A100 SXM4 40GB", 312.0, 0.859, 0.60, 1555.0, 108, 230.0)
A100_80GB = GPU("A100 SXM4 80GB", 312.0, 0.859, 0.60, 2039.0, 108, 230.0)
H100 = GPU("H100 SXM5 80GB", 989.0, 0.801, 0.35, 3350.0, 132, 370.0)
H200 = GPU("H200 SXM 141GB", 989.0, 0.801, 0.35, 4800.0, 132, 370.0)

DGX_A100_SUPERPOD = Cluster("DGX A100 SuperPOD", A100_80GB, 8, 8 * 200)
"""DGX A100 nodes with eight 200 Gb/s HDR InfiniBand adapters for the application's traffic (NVIDIA's
Selene: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC21, section 5)."""
DGX_H100_SUPERPOD = Cluster("DGX H100 SuperPOD", H100, 8, 8 * 400)
"""DGX H100 nodes with eight 400 Gb/s NDR InfiniBand adapters (NVIDIA DGX H100 data sheet)."""

_EC2_GPUS = {"p4d.24xlarge": A100_40GB, "p4de.24xlarge": A100_80GB, "p5.48xlarge": H100, "p5e.48xlarge": H200,
             "p5en.48xlarge": H200}
"""The GPU of each EC2 type the catalogue has with CUDA GPUs."""


class UnmodelledInstanceType(ValueError):
    """An instance type whose accelerator the step-time model does not describe."""

    def __init__(self, name: str):
        super().__init__(f"the step-time model describes no accelerator of {name}; it knows "
                         f"{', '.join(sorted(_EC2_GPUS))}")
        self.name = name


def ec2_cluster(facts: InstanceFacts) -> Cluster:
    """A fleet of `facts`' type: its GPU, GPUs a node and EFA bandwidth (the catalogue's)."""
    if facts.name not in _EC2_GPUS:
        raise UnmodelledInstanceType(facts.name)
    return Cluster(facts.name, _EC2_GPUS[facts.name], facts.accelerator_count, facts.efa_bandwidth_gbps)
