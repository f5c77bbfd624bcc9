"""How long one training step of a layout takes on a cluster: the planner's clock.

Pure functions over plain numbers (no torch), beside the memory plan: `trainfleet plan` ranks the
layouts that fit in memory by the tokens a second predicted here. What is modelled is how the
trainer spends a step (trainer/pipeline_parallel.py, parallelize.py, train.py) on one rank of the
slowest pipeline stage, each term on the critical path:

- compute: every matmul of a microbatch as the GEMMs the tensor-parallel rank runs (forward,
  input gradient, weight gradient), each at the GPU's achievable rate for its shape: the larger
  of its arithmetic at `matmul_efficiency` of the peak, over the share of SMs its output tiles
  keep busy in their last wave, and its operands' traffic through memory (a roofline).
  FlashAttention-2 (causal: half of the score matrix) at `attention_efficiency`, its backward 2.5
  times its forward (five matmuls to two). Norms, activations, residual adds, layout copies,
  bias gradients, the embedding and the loss move their tensors through memory once per read and
  write (`_elementwise_bytes`). The parameters of the architecture (Architecture) give the shapes.
- recompute: under full activation checkpointing a block's forward again before its backward;
  under selective, what the trainer's policy recomputes (parallelize.py): the elementwise work,
  tensor parallel's all-gathers and the attention output projection (a row-parallel matmul,
  whose partial output is not kept).
- tensor parallel: sequence parallel's all-gather before and reduce-scatter after each half of a
  block, on NVLink, and their mirror in the backward; the trainer issues them in line with the
  compute, so none overlaps it.
- FSDP: all-gathers of bf16 parameters and reduce-scatters of fp32 gradients (the trainer's
  mixed-precision policy) over dp_shard, and HSDP's all-reduce over the replicas, as NCCL's rings
  run them (`_ring_seconds`). Each FSDP unit's collective overlaps the compute of its neighbours
  (prefetch), so a pass costs the larger of its compute (slowed while collectives run beside it:
  `CONTENTION`) and its communication, plus the first unit's gather and the last unit's
  reduction, which nothing hides; gathering copies out of the
  flat buffer on the compute stream. Without a pipeline every microbatch gathers its units
  (twice when they reshard after forward) and reduce-scatters its gradients. Under a pipeline a
  stage gathers once a step, and reduces only after its last backward (torch's REDUCE_GRAD), so
  the first stage's reduction, last to finish, is exposed whole; its first gather is exposed
  along the fill (every stage's, in turn, under gpipe and 1f1b; only the first stage's where the
  schedule's runtime unshards ahead).
- pipeline: the schedule's fill and drain (trainer/schedules.py's bubble_seconds, from the
  slowest stage's forward, backward and weight-gradient times) and the hand-off of each
  microbatch's activations and gradients to the next stage over the network, received before the
  compute that needs them.
- optimizer: fused AdamW over the rank's fp32 shard, the gradient norm and its clipping, all
  memory-bound, and the step's one small all-reduce of the loss and the norm.

What it rests on: the GPUs' measured rates (hardware.py), NCCL's own latency model (`NCCL_*`,
NVIDIA/nccl src/graph/tuning.cc: ring steps with the Simple protocol, trees for small
all-reduces), two efficiencies estimated (`NETWORK_EFFICIENCY`, `MEMORY_EFFICIENCY`), and two
calibrated to published training runs (`SUSTAINED`, `CONTENTION`), one number each for every GPU,
model and layout: tests/test_step_time_validation.py holds the predictions within 20 % of the 80
published runs it holds (and says why it holds none of the others it cites).

Offers:
    Matmul, Architecture            a model as the step time sees it
    gpt_architecture, llama_architecture, architecture(shape)   the families (the one place)
    Cost, StepTime                  the result, by term
    predict(workload, cluster)      the step of trainer/model.py's GPT in a layout
    step_time(arch, layout, cluster, reduce_bytes)   any architecture
    model_flops_per_token(arch)     the convention MFU is counted in
    layouts                         every layout the trainer runs on a fleet
    Ranked, fastest_layouts         the layouts that fit, fastest first
    format_step_time                the terms as a table
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from trainer.schedules import SCHEDULES, bubble_seconds, split_layers, stage_ids
from trainfleet.core import memory_plan as mp
from trainfleet.core.hardware import Cluster, GPU
from trainfleet.core.memory_plan import BF16, FP32, Layout, ModelShape, Workload

NETWORK_EFFICIENCY = 0.8
"""Of a node's line rate to other nodes, what NCCL's rings carry of a large message: less than the
line, for the protocol's headers and flow control, and the job's collectives sharing the fabric.
An estimate, not fitted."""

MEMORY_EFFICIENCY = 0.8
"""Of the HBM bandwidth of the data sheet, what a memory-bound kernel (elementwise, a copy, the
fused AdamW) moves: most of it, not all. An estimate, not fitted."""

SUSTAINED = 0.86
"""Calibrated. Of the kernels' isolated rates (the GEMMs' and FlashAttention's measured in hardware.py,
memory-bound kernels' above), what they sustain inside a training step: clocks held lower under a
step's sustained power, the gaps an eager step leaves between kernels, the tail of each kernel's
last wave. Fitted with CONTENTION to the published runs of tests/test_step_time_validation.py
(least squares of the log error; how each source fares left out of the fit: BENCHMARKS.md)."""

CONTENTION = 0.65
"""Calibrated. While NCCL's collectives run beside compute (FSDP prefetching its next unit,
reducing the last), their kernels take SMs and memory bandwidth from it: compute slows by this
fraction of the time they overlap, so prefetch hides only part of the traffic. Fitted with
SUSTAINED (above)."""

MATMUL_TILES = ((128, 256), (256, 128))
"""Output tiles of cuBLAS's large bf16 GEMM kernels on A100 and H100 (NVIDIA's "Matrix
Multiplication Background User's Guide": tile and wave quantization); one tile per SM a wave."""

ATTENTION_BACKWARD_RATIO = 2.5
"""FlashAttention-2's backward runs five matmuls of the forward's size to its two."""

NCCL_RING_BASE_US, NCCL_NVLINK_HOP_US, NCCL_NET_HOP_US = 8.4, 3.4, 9.6
"""NCCL's own latency model of a ring with the Simple protocol (NVIDIA/nccl src/graph/tuning.cc,
baseLat and hwLat, as of the releases with Tree, Ring and CollNet): a base, plus each step of the
ring over NVLink or the network."""
NCCL_TREE_LL_BASE_US, NCCL_TREE_LL_NVLINK_US, NCCL_TREE_LL_NET_US = 4.4, 0.52, 5.0
"""And of a tree with the LL protocol, which NCCL picks for a small all-reduce."""

ADAMW_BYTES_PER_PARAMETER = 40
"""Memory traffic per fp32 shard element at the step's end: fused AdamW reads the parameter, its
gradient and both moments and writes the parameter and the moments (28 bytes); the gradient norm
reads the gradient (4) and clipping reads and writes it (8)."""

FSDP_GATHER_COPY_BYTES = 2 * BF16
"""Per gathered bf16 parameter, the copy out of the all-gather's flat buffer (read and write)."""
FSDP_REDUCE_COPY_BYTES = BF16 + FP32
"""Per gradient element, the copy into the reduce-scatter's fp32 buffer (read bf16, write fp32)."""


# --------------------------------------------------------------------------------------------
# Architectures: what the step time needs of a model


@dataclass(frozen=True)
class Matmul:
    """One weight matrix of a block: `rows` inputs, `cols` outputs, split by tensor parallel."""

    name: str
    rows: int
    cols: int
    split: str
    """column (outputs split, input gathered) or row (inputs split, output partial)."""


@dataclass(frozen=True)
class Architecture:
    """A model as the step time sees it. Built by gpt_architecture or llama_architecture."""

    n_layers: int
    d_model: int
    seq_len: int
    vocab_size: int
    matmuls: tuple[Matmul, ...]
    """One block's weight matrices in forward order."""
    mlp_hidden: int
    """Width of the MLP's hidden activation."""
    gated_mlp: bool
    """SwiGLU (an activation of one projection times another) rather than GELU of one."""
    biases: bool
    block_params: int
    embedding_params: int
    head_params: int
    """Final norm and head (a tied head has no matrix of its own, and still multiplies)."""
    vocab_params: int
    """Of the embedding's (and an untied head's) parameters, the vocabulary rows tp splits."""
    n_heads: int
    tie_embeddings: bool = False
    attention: str = "flash"
    """flash: FlashAttention-2, as the trainer runs it; softmax: the score matrix materialized by a
    batched GEMM, softmax and dropout over it, then a GEMM with the values (Megatron-LM's fused
    softmax kernels, which the published runs of 2021-2022 used)."""

    @functools.cached_property
    def matrix_params(self) -> int:
        return sum(mm.rows * mm.cols for mm in self.matmuls)

    def block_params_on_rank(self, tp: int) -> int:
        """Matrices and column-parallel biases split; norms and row-parallel biases whole."""
        split = self.matrix_params + (sum(mm.cols for mm in self.matmuls if mm.split == "column") if self.biases else 0)
        return split // tp + self.block_params - split

    def embedding_params_on_rank(self, tp: int) -> int:
        return self.vocab_params // tp + self.embedding_params - self.vocab_params

    def head_params_on_rank(self, tp: int) -> int:
        head_matrix = 0 if self.tie_embeddings else self.vocab_params
        return head_matrix // tp + self.head_params - head_matrix

    def layers_per_stage(self, n_stages: int, given: tuple[int, ...] = ()) -> list[int]:
        """Balanced on parameter counts, as trainer/pipeline_parallel.py splits them."""
        if given:
            return list(given)
        return split_layers(self.block_params, self.n_layers, self.embedding_params, self.head_params, n_stages)


def gpt_architecture(shape: ModelShape, biases: bool = True, learned_positions: bool = True,
                     attention: str = "flash") -> Architecture:
    """trainer/model.py's GPT: q, k, v and fc column-parallel, both projections row-parallel,
    LayerNorm and GELU. The parameter counts are the memory plan's, so both halves of the planner
    split a model alike. `biases`, `learned_positions` and `attention` describe GPT-style models of
    published runs (MPT has no biases; Megatron-LM's materialized the attention scores), which this
    trainer never builds."""
    d, hidden = shape.d_model, shape.mlp_ratio * shape.d_model
    matmuls = (Matmul("q", d, d, "column"), Matmul("k", d, d, "column"), Matmul("v", d, d, "column"),
               Matmul("attention output", d, d, "row"), Matmul("fc", d, hidden, "column"),
               Matmul("mlp output", hidden, d, "row"))
    # Without biases, the two LayerNorms keep only their weights.
    block = mp._block_params(shape, 1) if biases else sum(mm.rows * mm.cols for mm in matmuls) + 2 * d
    embedding = mp._embedding_params(shape, 1) - (0 if learned_positions else shape.seq_len * d)
    return Architecture(shape.n_layers, d, shape.seq_len, shape.vocab_size, matmuls, hidden, False, biases, block,
                        embedding, mp._head_params(shape, 1), shape.vocab_size * d, shape.n_heads, shape.tie_embeddings,
                        attention)


def llama_architecture(n_layers: int, d_model: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, vocab_size: int,
                       seq_len: int) -> Architecture:
    """The Llama family: q and the grouped k, v column-parallel, o row-parallel, SwiGLU's gate and up
    column-parallel and down row-parallel; RMSNorm, no biases, rotary positions, an untied head."""
    head_dim = d_model // n_heads
    kv = n_kv_heads * head_dim
    matmuls = (Matmul("q", d_model, d_model, "column"), Matmul("k", d_model, kv, "column"),
               Matmul("v", d_model, kv, "column"), Matmul("attention output", d_model, d_model, "row"),
               Matmul("gate", d_model, ffn_hidden, "column"), Matmul("up", d_model, ffn_hidden, "column"),
               Matmul("mlp output", ffn_hidden, d_model, "row"))
    block = sum(mm.rows * mm.cols for mm in matmuls) + 2 * d_model
    return Architecture(n_layers, d_model, seq_len, vocab_size, matmuls, ffn_hidden, True, False, block,
                        vocab_size * d_model, d_model + vocab_size * d_model, vocab_size * d_model, n_heads)


@functools.lru_cache(maxsize=64)
def architecture(shape: ModelShape) -> Architecture:
    """The architecture of a trainer config's model section: the one place a family's shapes
    come from (the trainer builds trainer/model.py's GPT)."""
    return gpt_architecture(shape)


def model_flops_per_token(arch: Architecture) -> float:
    """The FLOPs MFU counts per token, PaLM's convention (Chowdhery et al. 2022, appendix B): 6 per
    weight of every matmul (the head's included, the embedding lookup not) and 12 L d s for
    attention, as if unmasked. Recomputation is not counted (that would be hardware FLOPs)."""
    weights = arch.n_layers * arch.matrix_params + arch.vocab_params  # the head multiplies, tied or not
    return 6 * weights + 12 * arch.n_layers * arch.d_model * arch.seq_len


# --------------------------------------------------------------------------------------------
# Kernels and collectives


def _gemm_seconds(gpu: GPU, m: int, n: int, k: int) -> float:
    """An (m x k) @ (k x n) bf16 GEMM: its arithmetic at the achievable rate over the SMs its last
    wave of output tiles keeps busy (the best of cuBLAS's tile shapes), or its operands' memory
    traffic, whichever is longer."""
    busy = max(m * n / (math.ceil(math.ceil(m / tm) * math.ceil(n / tn) / gpu.sms) * gpu.sms * tm * tn)
               for tm, tn in MATMUL_TILES)
    arithmetic = 2 * m * n * k / (gpu.bf16_tflops * 1e12 * gpu.matmul_efficiency * busy * SUSTAINED)
    return max(arithmetic, _memory_seconds(gpu, BF16 * (m * k + k * n + m * n)))


def _memory_seconds(gpu: GPU, nbytes: float) -> float:
    return nbytes / (gpu.hbm_gbytes_per_s * 1e9 * MEMORY_EFFICIENCY * SUSTAINED)


@dataclass(frozen=True)
class _Group:
    """A process group as NCCL meets it: `ranks` ranks, `stride` ranks apart in the world (the mesh
    is pp, dp_replicate, dp_shard, tp from outermost, and nodes hold consecutive ranks)."""

    ranks: int
    stride: int

    def per_node(self, gpus_per_node: int) -> int:
        return max(1, min(self.ranks, gpus_per_node // self.stride))

    def nodes(self, gpus_per_node: int) -> int:
        return math.ceil(self.ranks / self.per_node(gpus_per_node))


@functools.lru_cache(maxsize=4096)
def _ring_seconds(cluster: Cluster, nbytes: float, group: _Group, all_reduce: bool = False) -> float:
    """An all-gather or reduce-scatter of `nbytes` (the whole buffer, gathered) on NCCL's ring, or
    an all-reduce (two passes). Each rank moves (n - 1)/n of the buffer a pass over NVLink; a ring
    spanning nodes leaves each node once, and every group of its kind on the node (the other
    positions of the mesh's inner dimensions) runs at once on the same network cards. Latency is
    NCCL's ring model."""
    n = group.ranks
    if n == 1:
        return 0.0
    gpn = cluster.gpus_per_node
    per_node, nodes = group.per_node(gpn), group.nodes(gpn)
    passes = 2 if all_reduce else 1
    bandwidth = cluster.gpu.nvlink_busbw_gbytes_per_s * 1e9
    if nodes > 1:
        bandwidth = min(bandwidth, cluster.network_bytes_per_s * NETWORK_EFFICIENCY * per_node / gpn)
    steps, network_steps = passes * (n - 1), passes * (nodes - 1)
    latency = (NCCL_RING_BASE_US + (steps - network_steps) * NCCL_NVLINK_HOP_US
               + network_steps * NCCL_NET_HOP_US) * 1e-6
    return latency + passes * (n - 1) / n * nbytes / bandwidth


def _small_all_reduce_seconds(cluster: Cluster, world: int) -> float:
    """A few scalars all-reduced over the world: NCCL's tree with the LL protocol (latency only)."""
    if world == 1:
        return 0.0
    gpn = min(world, cluster.gpus_per_node)
    nodes = math.ceil(world / gpn)
    return (NCCL_TREE_LL_BASE_US + 2 * ((gpn - 1) * NCCL_TREE_LL_NVLINK_US
                                        + math.log2(nodes) * NCCL_TREE_LL_NET_US)) * 1e-6


def _handoff_seconds(cluster: Cluster, nbytes: float, crosses_nodes: bool) -> float:
    """One pipeline send, each GPU of a node sending its own share at once on the node's cards."""
    if not crosses_nodes:
        return (NCCL_RING_BASE_US + NCCL_NVLINK_HOP_US) * 1e-6 + nbytes / (cluster.gpu.nvlink_busbw_gbytes_per_s * 1e9)
    share = cluster.network_bytes_per_s * NETWORK_EFFICIENCY / cluster.gpus_per_node
    return (NCCL_RING_BASE_US + NCCL_NET_HOP_US) * 1e-6 + nbytes / share


# --------------------------------------------------------------------------------------------
# The cost of a microbatch on a stage


@dataclass(frozen=True)
class Cost:
    """Seconds of a piece of work, by what they are spent on."""

    compute: float = 0.0
    recompute: float = 0.0
    tensor_parallel: float = 0.0
    handoff: float = 0.0

    @property
    def seconds(self) -> float:
        return self.compute + self.recompute + self.tensor_parallel + self.handoff

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.compute + other.compute, self.recompute + other.recompute,
                    self.tensor_parallel + other.tensor_parallel, self.handoff + other.handoff)

    def __mul__(self, k: float) -> Cost:
        return Cost(self.compute * k, self.recompute * k, self.tensor_parallel * k, self.handoff * k)

    __rmul__ = __mul__


def _attention_seconds(arch: Architecture, gpu: GPU, tp: int, tokens: int) -> tuple[float, float]:
    """A block's attention over its tp share of the heads, forward and backward."""
    if arch.attention == "flash":
        causal_flops = 2 * tokens * arch.seq_len * arch.d_model / tp   # half of 4 tokens s d: the masked half skipped
        forward = causal_flops / (gpu.bf16_tflops * 1e12 * gpu.attention_efficiency * SUSTAINED)
        return forward, ATTENTION_BACKWARD_RATIO * forward
    # The whole score matrix, as batched GEMMs (one tall GEMM of the heads' rows), and 9 bytes an
    # element of softmax and dropout forward (read and write each, a one-byte mask), 11 backward.
    head_dim = arch.d_model // arch.n_heads
    rows = tokens * arch.n_heads // tp                                   # (sequence, head) pairs
    scores = rows * arch.seq_len
    forward = (_gemm_seconds(gpu, rows, arch.seq_len, head_dim) + _gemm_seconds(gpu, rows, head_dim, arch.seq_len)
               + _memory_seconds(gpu, 9 * scores))
    backward = (2 * _gemm_seconds(gpu, rows, arch.seq_len, head_dim) + 2 * _gemm_seconds(gpu, rows, head_dim,
                                                                                       arch.seq_len)
                + _memory_seconds(gpu, 11 * scores))
    return forward, backward


def _elementwise_bytes(arch: Architecture, tokens: int, tp: int) -> tuple[float, float]:
    """Memory traffic of a block's elementwise work, forward and backward, counted as eager
    PyTorch runs it: each kernel reads its inputs and writes its outputs once. In units of the
    residual stream under sequence parallel (u = tokens d / tp) and of the MLP's hidden activation
    (h = tokens hidden / tp):
    forward  two norms 2u each, two residual adds 3u each, attention's output to (tokens, heads x
             dim) 2u: 12u; GELU 2h, or SwiGLU's activation 2h and product 3h
    backward two norms 3u each, two gradient sums 3u each, the layout copy 2u: 14u; each bias's
             gradient reads its output's gradient (5u + h); GELU's 3h, SwiGLU's 8h
    """
    u = tokens * arch.d_model / tp
    h = tokens * arch.mlp_hidden / tp
    forward = 12 * u + (5 if arch.gated_mlp else 2) * h
    backward = 14 * u + (8 if arch.gated_mlp else 3) * h + (5 * u + h if arch.biases else 0)
    return BF16 * forward, BF16 * backward


@functools.lru_cache(maxsize=1024)
def _block_costs(arch: Architecture, cluster: Cluster, tp: int, tokens: int, mode: str) -> tuple[Cost, Cost, Cost]:
    """One block, one microbatch of `tokens` on one tensor-parallel rank: (forward, backward of the
    inputs' gradients with recomputation, backward of the weights' gradients)."""
    gpu = cluster.gpu
    forward = backward = weight = 0.0
    row_parallel_forward = 0.0
    for mm in arch.matmuls:
        rows, cols = (mm.rows, mm.cols // tp) if mm.split == "column" else (mm.rows // tp, mm.cols)
        forward += _gemm_seconds(gpu, tokens, cols, rows)
        backward += _gemm_seconds(gpu, tokens, rows, cols)
        weight += _gemm_seconds(gpu, rows, cols, tokens)
        if mm.split == "row" and mm.name == "attention output":
            row_parallel_forward = _gemm_seconds(gpu, tokens, cols, rows)
    attention_forward, attention_backward = _attention_seconds(arch, gpu, tp, tokens)
    elementwise_forward, elementwise_backward = (_memory_seconds(gpu, b) for b in _elementwise_bytes(arch, tokens, tp))
    forward += attention_forward + elementwise_forward
    backward += attention_backward + elementwise_backward
    # Sequence parallel: a gather before each half of the block and a reduce-scatter after it,
    # their mirror images in the backward.
    exchange = _ring_seconds(cluster, BF16 * tokens * arch.d_model, _Group(tp, 1)) if tp > 1 else 0.0
    tensor_parallel = 4 * exchange
    if mode == "none":
        recompute = Cost()
    elif mode == "full":
        recompute = Cost(recompute=forward + tensor_parallel)
    elif mode == "selective":
        recompute = Cost(recompute=elementwise_forward + (row_parallel_forward + 2 * exchange if tp > 1 else 0.0))
    else:
        raise ValueError(f"activation_checkpoint {mode!r} must be one of {', '.join(mp.ACTIVATION_CHECKPOINT_MODES)}")
    return (Cost(compute=forward, tensor_parallel=tensor_parallel),
            Cost(compute=backward, tensor_parallel=tensor_parallel) + recompute, Cost(compute=weight))


def _embedding_costs(arch: Architecture, cluster: Cluster, tp: int, tokens: int) -> tuple[Cost, Cost]:
    """The first stage's embedding lookups and their sum (forward); the table's gradient, dense
    over the rank's vocabulary rows (backward). Under tensor parallel the row-split tables' partial
    output is reduce-scattered over the sequence, and gathered back in the backward."""
    gpu = cluster.gpu
    u = tokens * arch.d_model / tp
    forward = _memory_seconds(gpu, BF16 * 5 * u)
    backward = _memory_seconds(gpu, BF16 * (arch.vocab_params / tp + 2 * u))
    exchange = _ring_seconds(cluster, BF16 * tokens * arch.d_model, _Group(tp, 1)) if tp > 1 else 0.0
    return Cost(forward, tensor_parallel=exchange), Cost(backward, tensor_parallel=exchange)


def _head_costs(arch: Architecture, cluster: Cluster, tp: int, tokens: int) -> tuple[Cost, Cost, Cost]:
    """The last stage's final norm, vocabulary-split head and loss (fp32 log-softmax over the rank's
    logits, loss_parallel's all-reduces of a few numbers per position)."""
    gpu = cluster.gpu
    vocab = arch.vocab_size // tp
    u = tokens * arch.d_model / tp
    logits = tokens * vocab
    forward = (_gemm_seconds(gpu, tokens, vocab, arch.d_model) + _memory_seconds(gpu, BF16 * 2 * u)
               + _memory_seconds(gpu, 14 * logits))
    backward = (_gemm_seconds(gpu, tokens, arch.d_model, vocab) + _memory_seconds(gpu, BF16 * 3 * u)
                + _memory_seconds(gpu, 18 * logits))
    weight = _gemm_seconds(gpu, arch.d_model, vocab, tokens)
    exchange = _ring_seconds(cluster, BF16 * tokens * arch.d_model, _Group(tp, 1)) if tp > 1 else 0.0
    small = 3 * _small_all_reduce_seconds(cluster, tp) if tp > 1 else 0.0
    return (Cost(forward, tensor_parallel=exchange + small), Cost(backward, tensor_parallel=exchange + small),
            Cost(weight))


# --------------------------------------------------------------------------------------------
# The step


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds, by term, on the slowest rank."""

    terms: dict[str, float]
    tokens: int
    """Tokens a step (the global batch)."""
    world: int
    model_flops: float
    """FLOPs a step in the MFU convention (model_flops_per_token)."""
    peak_flops: float
    """One GPU's dense bf16 peak."""

    @property
    def seconds(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_second / self.world

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.seconds * self.world * self.peak_flops)


TERMS = ("compute", "recompute", "tensor parallel", "pipeline bubble", "pipeline hand-offs", "FSDP gathers",
         "FSDP reductions", "HSDP all-reduce", "optimizer")
"""The terms of a step, in the order the plan prints them."""


@dataclass(frozen=True)
class _Stage:
    """One stage (a chunk of a pipeline rank): a microbatch's forward, input-gradient and
    weight-gradient cost, and its parameters on a rank by FSDP unit."""

    forward: Cost
    backward: Cost
    weight: Cost
    units: tuple[int, ...]
    """Parameters of each FSDP unit on one tensor-parallel rank, in forward order."""
    kept_units: tuple[bool, ...]
    """Whether a unit stays gathered from its forward to its backward."""

    @functools.cached_property
    def work(self) -> Cost:
        return self.forward + self.backward + self.weight


def _stages(arch: Architecture, layout: Layout, cluster: Cluster) -> list[_Stage]:
    n_stages = layout.n_stages
    crosses_nodes = layout.world_size // layout.pp >= cluster.gpus_per_node
    tokens = layout.microbatch_size * arch.seq_len
    return [_stage(arch, cluster, layout.tp, tokens, layout.activation_checkpoint, layout.reshard_after_forward,
                   layout.pp > 1, crosses_nodes, n, s == 0, s == n_stages - 1)
            for s, n in enumerate(arch.layers_per_stage(n_stages, layout.layers_per_stage))]


@functools.lru_cache(maxsize=4096)
def _stage(arch: Architecture, cluster: Cluster, tp: int, tokens: int, mode: str, reshard_after_forward: str,
           piped: bool, crosses_nodes: bool, n_layers: int, first: bool, last: bool) -> _Stage:
    """A stage of `n_layers` blocks, with the embeddings if `first` and the head if `last`
    (stages alike are alike: remembered)."""
    block_f, block_b, block_w = _block_costs(arch, cluster, tp, tokens, mode)
    forward, backward, weight = n_layers * block_f, n_layers * block_b, n_layers * block_w
    keep = {"always": False, "never": True, "auto": piped}[reshard_after_forward]
    units = [arch.block_params_on_rank(tp)] * n_layers
    kept = [keep] * n_layers
    if n_layers and reshard_after_forward == "auto":
        kept[-1] = True   # the last block's backward follows its forward at once
    if first:
        embed_f, embed_b = _embedding_costs(arch, cluster, tp, tokens)
        forward, backward = embed_f + forward, backward + embed_b
        units.insert(0, arch.embedding_params_on_rank(tp))
        kept.insert(0, keep)
    if last:
        head_f, head_b, head_w = _head_costs(arch, cluster, tp, tokens)
        forward, backward, weight = forward + head_f, head_b + backward, weight + head_w
        units.append(arch.head_params_on_rank(tp))
        kept.append(keep or reshard_after_forward == "auto")
    handoff = Cost(handoff=_handoff_seconds(cluster, BF16 * tokens * arch.d_model / tp, crosses_nodes))
    if not first:
        forward = forward + handoff
    if not last:
        backward = backward + handoff
    return _Stage(forward, backward, weight, tuple(units), tuple(kept))


@dataclass(frozen=True)
class _Sharding:
    """The data-parallel collectives of one stage's units on one rank."""

    gathers: tuple[float, ...]
    """Each unit's all-gather over dp_shard."""
    reductions: tuple[float, ...]
    """Each unit's reduce-scatter over dp_shard, its fp32 copy-in included."""
    all_reduces: tuple[float, ...]
    """Each unit's all-reduce of its shard over the replicas."""
    copy_out: float
    """Copying every gathered unit out of the flat buffer, on the compute stream."""


def _sharding(stage: _Stage, layout: Layout, cluster: Cluster, reduce_bytes: int) -> _Sharding:
    shard = layout.resolved_dp_shard
    return _unit_collectives(stage.units, shard, layout.dp // shard, layout.tp, cluster, reduce_bytes)


@functools.lru_cache(maxsize=4096)
def _unit_collectives(units: tuple[int, ...], shard: int, replicas: int, tp: int, cluster: Cluster,
                      reduce_bytes: int) -> _Sharding:
    gpu = cluster.gpu
    shard_group, replica_group = _Group(shard, tp), _Group(replicas, shard * tp)
    sizes = set(units)   # the blocks are alike: each size is timed once
    gather = {p: _ring_seconds(cluster, BF16 * p, shard_group) for p in sizes}
    reduction = {p: _ring_seconds(cluster, reduce_bytes * p, shard_group)
                 + (_memory_seconds(gpu, FSDP_REDUCE_COPY_BYTES * p) if shard > 1 else 0.0) for p in sizes}
    all_reduce = {p: _ring_seconds(cluster, reduce_bytes * p / shard, replica_group, all_reduce=True) for p in sizes}
    return _Sharding(gathers=tuple(gather[p] for p in units), reductions=tuple(reduction[p] for p in units),
                     all_reduces=tuple(all_reduce[p] for p in units),
                     copy_out=_memory_seconds(gpu, FSDP_GATHER_COPY_BYTES * sum(units)))


def _overlapped(compute: float, communication: float, unhidden: float) -> float:
    """What a pass of FSDP units adds to its compute: units prefetch their neighbours' collectives,
    so the pass takes the longer of the two, plus the one collective at its edge nothing hides."""
    slowed = compute + CONTENTION * min(communication, compute)
    return max(slowed, communication) - compute + unhidden


def step_time(arch: Architecture, layout: Layout, cluster: Cluster, reduce_bytes: int = FP32) -> StepTime:
    """The predicted step of `layout` on `cluster` for `arch` (see the module docstring).
    `reduce_bytes` is the gradient reduction's element size (the trainer's is fp32)."""
    stages = _stages(arch, layout, cluster)
    pp, m, v = layout.pp, layout.microbatches, layout.resolved_stages_per_rank
    placement = SCHEDULES[layout.schedule].placement
    ranks = [[stages[s] for s in (stage_ids(r, pp, v, placement) if pp > 1 else [0])] for r in range(pp)]
    slowest = max(ranks, key=lambda chunks: sum(c.work.seconds for c in chunks))
    work = m * sum((c.work for c in slowest), Cost())
    terms = dict.fromkeys(TERMS, 0.0)
    terms.update({"compute": work.compute, "recompute": work.recompute, "tensor parallel": work.tensor_parallel,
                  "pipeline hand-offs": work.handoff})
    if pp > 1:
        hardest = max(stages, key=lambda s: s.work.seconds)
        terms["pipeline bubble"] = bubble_seconds(layout.schedule, pp, v, m, hardest.forward.seconds,
                                                  hardest.backward.seconds, hardest.weight.seconds)
    gathers, reductions, all_reduce = _data_parallel_seconds(stages, ranks, layout, cluster, reduce_bytes)
    terms.update({"FSDP gathers": gathers, "FSDP reductions": reductions, "HSDP all-reduce": all_reduce})
    shard_elements = max(sum(sum(c.units) for c in chunks) for chunks in ranks) / layout.resolved_dp_shard
    terms["optimizer"] = (_memory_seconds(cluster.gpu, ADAMW_BYTES_PER_PARAMETER * shard_elements)
                          + _small_all_reduce_seconds(cluster, layout.world_size))
    tokens = layout.batch_size * arch.seq_len
    return StepTime(terms, tokens, layout.world_size, model_flops_per_token(arch) * tokens,
                    cluster.gpu.bf16_tflops * 1e12)


def _data_parallel_seconds(stages: list[_Stage], ranks: list[list[_Stage]], layout: Layout, cluster: Cluster,
                           reduce_bytes: int) -> tuple[float, float, float]:
    """Exposed seconds a step of FSDP's gathers, of its reductions, and of HSDP's all-reduce."""
    m = layout.microbatches
    if layout.pp == 1:
        # Every microbatch gathers each unit for its forward, again for its backward where the unit
        # was resharded, and reduce-scatters its gradients; the last also all-reduces them.
        (stage,) = stages
        dp = _sharding(stage, layout, cluster, reduce_bytes)
        regathered = [kept is False for kept in stage.kept_units]
        backward_gathers = sum(g for g, again in zip(dp.gathers, regathered) if again)
        regather_copy = _memory_seconds(cluster.gpu, FSDP_GATHER_COPY_BYTES
                                        * sum(u for u, again in zip(stage.units, regathered) if again))
        forward = _overlapped(stage.forward.seconds, sum(dp.gathers), dp.gathers[0]) + dp.copy_out + regather_copy
        backward_compute = (stage.backward + stage.weight).seconds
        gathers_alone = _overlapped(backward_compute, backward_gathers, 0.0)
        backward = _overlapped(backward_compute, backward_gathers + sum(dp.reductions), dp.reductions[0])
        last = _overlapped(backward_compute, backward_gathers + sum(dp.reductions) + sum(dp.all_reduces),
                           dp.reductions[0] + dp.all_reduces[0])
        return m * (forward + gathers_alone), m * (backward - gathers_alone), last - backward
    # Under a pipeline a stage gathers once, at its first forward: along the fill, stage after
    # stage, where the schedule runs a single stage per rank; only the first stage's chunk where
    # its runtime unshards every chunk ahead of its use.
    first_rank = [_sharding(s, layout, cluster, reduce_bytes) for s in ranks[0]]
    if SCHEDULES[layout.schedule].placement == "single":
        gathers = 0.0
        for s in stages:
            dp = _sharding(s, layout, cluster, reduce_bytes)
            gathers += _overlapped(s.forward.seconds, sum(dp.gathers), dp.gathers[0]) + dp.copy_out
    else:
        gathers = sum(first_rank[0].gathers) + sum(dp.copy_out for dp in first_rank)
    # Reduced after the rank's last backward (REDUCE_GRAD), the first rank's finishing last.
    return (gathers, sum(sum(dp.reductions) for dp in first_rank), sum(sum(dp.all_reduces) for dp in first_rank))


def predict(workload: Workload, cluster: Cluster) -> StepTime:
    """The predicted step of the trainer's model and layout in `workload` on `cluster`."""
    return step_time(architecture(workload.shape), workload.layout, cluster)


# --------------------------------------------------------------------------------------------
# The planner: the layouts that fit, fastest first


@dataclass(frozen=True)
class Ranked:
    """A layout that fits, with its memory and its predicted step."""

    candidate: mp.Candidate
    step: StepTime


def layouts(w: Workload, nodes: int, ranks_per_node: int, fixed: frozenset[str] = frozenset()) -> Iterator[Workload]:
    """Every layout the trainer runs on exactly `nodes` nodes, keeping the fields named in `fixed`
    as `w.layout` has them: tp, pp, dp_shard, microbatches, activation checkpointing and, with a
    pipeline, the schedule (each at its default stages per rank)."""
    lay = w.layout
    world = nodes * ranks_per_node

    def free(name: str, values):
        return [getattr(lay, name)] if name in fixed else list(values)

    for tp in free("tp", mp._divisors(ranks_per_node)):
        for pp in free("pp", mp._divisors(world // tp) if world % tp == 0 else []):
            dp = world // (tp * pp)
            if world % (tp * pp) or lay.batch_size % dp or ("dp" in fixed and dp != lay.dp):
                continue
            for dp_shard in free("dp_shard", mp._divisors(dp)):
                for microbatches in free("microbatches", mp._divisors(lay.batch_size // dp)):
                    for mode in free("activation_checkpoint", mp.ACTIVATION_CHECKPOINT_MODES):
                        for schedule in free("schedule", SCHEDULES if pp > 1 else [lay.schedule]):
                            trial = replace(w, layout=replace(lay, tp=tp, pp=pp, dp=dp, dp_shard=dp_shard,
                                                              microbatches=microbatches, activation_checkpoint=mode,
                                                              schedule=schedule, stages_per_rank=lay.stages_per_rank
                                                              if "schedule" in fixed else 0))
                            if mp.layout_problem(trial, ranks_per_node) is None:
                                yield trial


def fastest_layouts(w: Workload, cluster: Cluster, nodes: int, memory_gib: float,
                    fixed: frozenset[str] = frozenset(), count: int = 3) -> tuple[list[Ranked], int]:
    """The `count` fastest layouts of `w` on `nodes` nodes of `cluster` that fit in `memory_gib`
    a GPU, fastest first, and how many layouts run there at all (fitting or not). Layouts are timed
    first, which is cheap, and only the fastest checked for memory."""
    timed = sorted(((predict(trial, cluster), trial) for trial in layouts(w, nodes, cluster.gpus_per_node, fixed)),
                   key=lambda pair: -pair[0].tokens_per_second)
    fitting: list[Ranked] = []
    for step, trial in timed:
        memory = mp.fullest_rank(trial)
        if memory.total <= memory_gib * mp.GIB:
            fitting.append(Ranked(mp.Candidate(nodes, trial, memory), step))
            if len(fitting) == count:
                break
    return fitting, len(timed)


def format_step_time(step: StepTime) -> str:
    """The step's terms in seconds, with its total, tokens a second and MFU."""
    width = max(map(len, TERMS)) + 2
    lines = [f"  {name:<{width}}{step.terms[name]:10.3f} s" for name in TERMS if step.terms[name]]
    lines.append(f"  {'step':<{width}}{step.seconds:10.3f} s  {step.tokens_per_second:,.0f} tokens/s "
                 f"({step.tokens_per_second_per_gpu:,.0f} a GPU), MFU {step.mfu:.1%}")
    return "\n".join(lines)
