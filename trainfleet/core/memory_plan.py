"""Memory per GPU of a training layout, and the smallest fleet whose layout fits.

Pure functions over plain numbers (no torch, no boto3): `trainfleet plan` prints them and the
control plane's Validate refuses a RunSpec whose layout would run out of accelerator memory before
anything is allocated. What is modelled is how the trainer holds memory:

- The two families of trainer/model.py, d wide with an MLP h wide and key/value projections kv
  wide (n_kv_heads heads). gpt: token + position embeddings, pre-norm blocks (LayerNorm, q, k, v,
  proj, fc Linear(d, h), GELU, proj Linear(h, d), all with biases), a final LayerNorm. llama: a
  token embedding, blocks of RMSNorm, q Linear(d, d), k and v Linear(d, kv), proj, three MLP
  matrices (gate and up Linear(d, h), SiLU, down Linear(h, d)), no biases, a final RMSNorm, and
  its rotary table. Both: an untied head Linear(d, vocab) without bias, unless tied.
- Pipeline stages split by `split_layers` (embeddings on the first stage, norm + head on the last)
  and placed on ranks by `stage_ids`; the fullest rank decides.
- Tensor parallel over tp: q, k, v and the MLP's input matrices column-wise (weights and biases
  split), both projections row-wise (weights split, biases replicated), token embedding and head
  split over vocabulary rows, position embedding and norms replicated; sequence parallel between
  the matmul regions.
- FSDP2 over dp_shard: fp32 parameters, gradients and AdamW's two moments sharded, 16 bytes per
  parameter over dp_shard. On CUDA, bf16 unsharded copies of the parameters being computed
  (mixed precision) and fp32 unsharded gradients until their reduce-scatter. Without a pipeline
  each microbatch's gradients are reduce-scattered as its backward makes them (one unit's
  unsharded gradient at a time; with dp_replicate a sharded partial sum waits for the last
  microbatch's all-reduce). Under a pipeline a stage keeps both its unsharded parameters and its
  unsharded gradients from its first backward to the end of the step (torch's PipelineStage turns
  resharding after backward and gradient sync off until the step's last backward), whatever
  reshard_after_forward says.
- Activations per layer and microbatch derived for this block (`activation_bytes`), times the
  microbatches the schedule keeps in flight on a rank (`in_flight`); the logits of the last
  stage in fp32 for the loss; the pipeline's receive buffers, one per microbatch.
- The peak is one moment of the step, not the sum of every tensor that ever lives in it: either
  while the most activations are held (with the gradients of earlier microbatches, when the
  schedule runs a backward before its last forward) or when the gradients are complete and the
  activations are gone. Within a moment, the loss's backward and a layer's backward are
  transients one after the other, never both. The larger moment is the rank's peak.
- Start-up is never the peak: the trainer shards over FSDP on the meta device and allocates only
  its shards (trainer/parallelize.py), filling them from full values made on the host.
- On CPU everything is fp32 and unsharded copies exist only when dp_shard > 1.
- On CUDA, an allowance outside the tensors (`allowance_bytes`): the CUDA context with cuBLAS's
  workspaces, NCCL's buffers per communicator the layout opens, and the caching allocator's
  fragmentation. The device's memory is what CUDA reports as its total (the catalogue's figure),
  not the data sheet's.

Offers:
    ModelShape, Layout, Workload        the plain inputs (Workload.from_sections reads a trainer config)
    parameter_count(shape)              exact parameters of the whole model
    in_flight, last_stage_in_flight     microbatches a schedule keeps alive on a rank
    activation_bytes                    saved activations of one layer and microbatch
    rank_memory, fullest_rank           per-component bytes on one rank / on the fullest rank
    fits, plan_layouts, smallest_fleet  the check and the planner
    memory_problem                      the check with its figures and a proposal, for Validate
    host_memory_per_node, host_memory_problem   the in-memory checkpoints' share of a node's RAM
    format_memory                       the figures as a table in GiB
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace

from trainer.config import ModelConfig
from trainer.schedules import SCHEDULES, split_layers, stage_ids
from trainfleet.core.runspec import pipeline_layout_problem

GIB = 1024 ** 3

CUDA_CONTEXT_BYTES = int(0.75 * GIB)
"""Per GPU, outside PyTorch's allocator: the CUDA context and its kernels (300-800 MiB on A100/H100
with PyTorch 2.x, per the PyTorch CUDA semantics notes and nvidia-smi after `torch.cuda.init()`) and
cuBLAS's workspaces (a few tens of MiB per stream). An allowance to confirm with
torch.cuda.mem_get_info on the hardware (bench/gpu.py prints it)."""

NCCL_COMMUNICATOR_BYTES = {"A100": int(0.7 * GIB), "H100": int(2.0 * GIB), "H200": int(2.0 * GIB)}
"""GPU memory NCCL allocates per communicator once it has run collectives: 544-688 MB per
communicator measured on 4x A100 with NVLink (NVIDIA/nccl issue 964); about 1.6 GB for one
communicator and 6 GB for three or more on H100 systems, whose NVLink SHARP (NVLS) buffers are the
bulk (NVIDIA/nccl issue 864; NeMo and JAX-Toolbox set NCCL_NVLS_ENABLE=0 to save it). The trainer
opens one for the world and one per mesh dimension larger than one (`communicators`)."""

FRAGMENTATION_FRACTION = 0.10
"""Memory the caching allocator reserves but cannot hand out (blocks split by differently sized
tensors), as a fraction of the tensors' own peak: torch.cuda.memory_reserved() over
max_memory_allocated() is typically 1.05-1.2 in large-model training (PyTorch memory management
notes; expandable_segments lowers it). An allowance, like CUDA_CONTEXT_BYTES."""

ACTIVATION_CHECKPOINT_MODES = ("none", "selective", "full")
"""Least recompute first: the planner's order of preference."""

FP32, BF16 = 4, 2


@dataclass(frozen=True)
class ModelShape:
    """trainer/config.py's model section, with the widths it resolves."""

    n_layers: int
    d_model: int
    n_heads: int
    vocab_size: int
    seq_len: int
    mlp_ratio: int = 4
    tie_embeddings: bool = False
    architecture: str = "gpt"
    """gpt or llama (trainer/config.py ARCHITECTURES)."""
    n_kv_heads: int = 0
    """Key/value heads; 0 = n_heads."""
    ffn_hidden: int = 0
    """The MLP's hidden width; 0 = mlp_ratio x d_model."""

    @classmethod
    def of(cls, model: ModelConfig) -> ModelShape:
        """The shape of a trainer model section, its widths resolved as the trainer resolves them."""
        return cls(model.n_layers, model.d_model, model.n_heads, model.vocab_size, model.seq_len, model.mlp_ratio,
                   model.tie_embeddings, model.architecture, model.resolved_kv_heads(), model.resolved_ffn_hidden())

    @property
    def llama(self) -> bool:
        return self.architecture == "llama"

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or self.mlp_ratio * self.d_model

    @property
    def kv_width(self) -> int:
        return (self.n_kv_heads or self.n_heads) * (self.d_model // self.n_heads)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class Layout:
    """trainer/config.py's parallel section plus what the memory depends on in the training section."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    dp_shard: int = 0
    """0 = all of dp."""
    schedule: str = "1f1b"
    microbatches: int = 1
    stages_per_rank: int = 0
    """0 = what the schedule needs."""
    layers_per_stage: tuple[int, ...] = ()
    reshard_after_forward: str = "auto"
    activation_checkpoint: str = "none"
    batch_size: int = 1
    """Global batch in sequences."""

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def resolved_dp_shard(self) -> int:
        return self.dp_shard or self.dp

    @property
    def resolved_stages_per_rank(self) -> int:
        return self.stages_per_rank or SCHEDULES[self.schedule].stages_per_rank

    @property
    def n_stages(self) -> int:
        return self.pp * self.resolved_stages_per_rank if self.pp > 1 else 1

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // (self.dp * self.microbatches)

    @property
    def keeps_gathered_parameters(self) -> bool:
        """FSDP keeps a part's unsharded parameters through the step: under a pipeline always (a
        stage does not reshard after a backward until the step's last), without one when
        reshard_after_forward is never."""
        return self.pp > 1 or self.reshard_after_forward == "never"

    @property
    def communicators(self) -> int:
        """NCCL communicators a rank opens: the world's, and one per mesh dimension larger than one."""
        dims = (self.pp, self.dp // self.resolved_dp_shard, self.resolved_dp_shard, self.tp)
        return 1 + sum(size > 1 for size in dims)

    def describe(self) -> str:
        return (f"pp={self.pp} dp={self.dp} tp={self.tp} dp_shard={self.resolved_dp_shard} "
                f"schedule={self.schedule} microbatches={self.microbatches} "
                f"(microbatch of {self.microbatch_size} sequence{'s' if self.microbatch_size != 1 else ''}) activation_checkpoint={self.activation_checkpoint}")


@dataclass(frozen=True)
class Workload:
    """A model, its layout and whether compute is mixed precision (CUDA) or fp32 (CPU)."""

    shape: ModelShape
    layout: Layout
    mixed_precision: bool = True
    accelerator: str = "H100"
    """The GPU (the catalogue's accelerator name): NCCL's buffers per communicator depend on it."""

    @classmethod
    def from_sections(cls, sections: dict, mixed_precision: bool = True, accelerator: str = "H100") -> Workload:
        """From a trainer config as plain sections ({"model": {...}, "parallel": {...}, "training":
        {...}}, e.g. dataclasses.asdict of trainer/config.py's JobConfig); other fields are ignored."""
        model, par, training = sections["model"], sections["parallel"], sections["training"]
        shape = ModelShape.of(ModelConfig(**{f: model[f] for f in ModelConfig.__dataclass_fields__ if f in model}))
        layout = Layout(**{f: par[f] for f in Layout.__dataclass_fields__ if f in par},
                        activation_checkpoint=training.get("activation_checkpoint", "none"),
                        batch_size=training["batch_size"])
        return cls(shape, replace(layout, layers_per_stage=tuple(layout.layers_per_stage)), mixed_precision,
                   accelerator)


# --------------------------------------------------------------------------------------------
# Parameters


def _block_params(m: ModelShape, tp: int) -> int:
    """One transformer block's parameters on one tensor-parallel rank."""
    d, hidden, kv = m.d_model, m.hidden, m.kv_width
    bias = 0 if m.llama else 1
    norms = 2 * (1 + bias) * d                         # two norms (LayerNorm's bias too), replicated
    qkv = (d * (d + 2 * kv) + bias * (d + 2 * kv)) // tp  # column-wise: weights and biases split
    attn_proj = d * d // tp + bias * d                 # row-wise: weight split, bias replicated
    mlp_in = (2 if m.llama else 1) * (d * hidden + bias * hidden) // tp  # llama: gate and up
    mlp_proj = hidden * d // tp + bias * d
    return norms + qkv + attn_proj + mlp_in + mlp_proj


def _embedding_params(m: ModelShape, tp: int) -> int:
    return m.vocab_size * m.d_model // tp + (0 if m.llama else m.seq_len * m.d_model)


def _head_params(m: ModelShape, tp: int) -> int:
    norm = m.d_model * (1 if m.llama else 2)
    return norm + (0 if m.tie_embeddings else m.vocab_size * m.d_model // tp)


def parameter_count(m: ModelShape) -> int:
    """Every parameter of the whole model (trainer/model.py's families), exactly."""
    return _embedding_params(m, 1) + m.n_layers * _block_params(m, 1) + _head_params(m, 1)


# --------------------------------------------------------------------------------------------
# Stages: split and placed on ranks as the trainer does (trainer/schedules.py's split_layers, stage_ids)


def _layers_per_stage(w: Workload) -> list[int]:
    m, lay = w.shape, w.layout
    if lay.layers_per_stage:
        return list(lay.layers_per_stage)
    # Balanced on the whole model's parameter counts, as trainer/pipeline_parallel.py does.
    return split_layers(_block_params(m, 1), m.n_layers, _embedding_params(m, 1), _head_params(m, 1), lay.n_stages)


# --------------------------------------------------------------------------------------------
# Schedules: microbatches in flight, counted in stage-microbatches whose activations a rank holds
# at its peak. Each formula matches torch.distributed.pipelining's own pipeline_order (2.13),
# replayed action by action in tests/test_memory_plan.py: a forward adds one, a full backward or
# a weight-gradient step (zero-bubble schedules) releases one.


def in_flight(schedule: str, pp: int, stages_per_rank: int, microbatches: int, pp_rank: int) -> int:
    """Stage-microbatches whose activations pipeline rank `pp_rank` holds at its peak."""
    m, v = microbatches, stages_per_rank
    if pp == 1:
        return 1                                             # one microbatch after another
    if schedule == "gpipe":
        return m                                             # every forward before any backward
    if schedule == "1f1b":
        # Its own loop (Schedule1F1B._step_microbatches): pp - rank forwards of warm-up, then a
        # backward before each further forward. (Its pipeline_order, only printed, puts the
        # forward first and would show 2 on the last rank.)
        return min(m, pp - pp_rank)
    per_round = m // max(1, m // pp)                         # torch's microbatches_per_round
    if schedule == "interleaved-1f1b":
        # torch's warm-up, (v - 1) rounds + 2 per hop from the last rank, then one more forward.
        return min(v * m, (v - 1) * per_round + 2 * (pp - 1 - pp_rank) + 1)
    if schedule == "looped-bfs":
        return v * m                                         # each stage's forwards, then backwards
    if schedule == "interleaved-zero-bubble":
        # A warm-up of 1 per hop; weight steps lag so that every rank ends up as full as rank 0.
        return min(v * m, (v - 1) * per_round + pp)
    if schedule == "zbv-zero-bubble":
        return min(v * m, 2 * pp)
    if schedule == "dualpipev":
        return min(v * m, 2 * pp + 1)
    raise ValueError(f"schedule {schedule!r} is unknown; choose one of {sorted(SCHEDULES)}")


def last_stage_in_flight(schedule: str, pp: int, microbatches: int) -> int:
    """Microbatches whose logits the last stage holds at once (its loss waits for backward)."""
    if pp == 1:
        return 1
    return {"gpipe": microbatches, "looped-bfs": microbatches, "1f1b": 1,
            "interleaved-zero-bubble": min(microbatches, pp)}.get(schedule, 1)


# --------------------------------------------------------------------------------------------
# Activations


def activation_bytes(m: ModelShape, microbatch: int, tp: int, mode: str, mixed_precision: bool) -> int:
    """Bytes one layer keeps for backward per microbatch (u = microbatch x seq x d_model elements;
    u_kv and u_h the same with the key/value and the MLP's hidden widths).

    Derived for this block the way Korthikanti et al. 2022 derive sbh(34 + 5as/h) for Megatron's
    GPT, with three differences: no dropout (no masks), SDPA's flash / memory-efficient kernels keep
    no seq x seq scores (only a logsumexp per head and position), and each norm keeps an fp32 copy
    of its input (LayerNorm under CUDA autocast; llama's RMSNorm computes in fp32). e = bytes of a
    compute activation (bf16 2, fp32 4); tp splits all but the two matmul inputs, which torch's
    sequence-parallel Colwise plans all-gather to the full sequence before the matmul saves them:

    none:      2 norms' inputs 4u/tp each; the attention's and the MLP's inputs e u each; q (after
               the rotation, for llama), k and v e (u + 2 u_kv)/tp; attention output e u/tp (also
               the proj input); the MLP's hidden tensors: gpt fc output and GELU output 2 e u_h/tp,
               llama gate, SiLU, up and their product 4 e u_h/tp
    selective: what torchtitan's op policy saves: the block input, the outputs of the matmuls and
               of attention, e (5u + 2u_kv)/tp and e u_h/tp per MLP input matrix (gpt's fc,
               llama's gate and up); norms, rotations and activations are recomputed
    full:      the block input only, e u/tp
    """
    u = microbatch * m.seq_len * m.d_model
    u_kv = microbatch * m.seq_len * m.kv_width
    u_h = microbatch * m.seq_len * m.hidden
    e = BF16 if mixed_precision else FP32
    if mode == "none":
        return 2 * FP32 * u // tp + 2 * e * u + e * (2 * u + 2 * u_kv + (4 if m.llama else 2) * u_h) // tp
    if mode == "selective":
        return e * (5 * u + 2 * u_kv + (2 if m.llama else 1) * u_h) // tp
    if mode == "full":
        return e * u // tp
    raise ValueError(f"activation_checkpoint {mode!r} must be one of {', '.join(ACTIVATION_CHECKPOINT_MODES)}")


def _backward_working_bytes(m: ModelShape, microbatch: int, tp: int, mode: str, mixed_precision: bool) -> int:
    """Transient in one layer's backward: what recompute rebuilds (checkpointed modes), plus the
    gradient of the residual stream and of the MLP's hidden activations, e (u + u_h)/tp for gpt
    and e (u + 2u_h)/tp for llama, whose gate and up gradients live together (the MLP's saved
    outputs are freed as their gradients are made)."""
    u = microbatch * m.seq_len * m.d_model
    u_h = microbatch * m.seq_len * m.hidden
    e = BF16 if mixed_precision else FP32
    recomputed = 0 if mode == "none" else (activation_bytes(m, microbatch, tp, "none", mixed_precision)
                                           - activation_bytes(m, microbatch, tp, mode, mixed_precision))
    return recomputed + e * (u + (2 if m.llama else 1) * u_h) // tp


def rotary_bytes(m: ModelShape, microbatch_in_flight: int, stages: int, mixed_precision: bool) -> int:
    """llama's rotary tables: each stage's fp32 cos and sin of every position (2 x seq x head width),
    and on CUDA its bf16 copy for each microbatch whose backward is pending (every layer's
    rotation keeps it); none for gpt."""
    if not m.llama:
        return 0
    table = 2 * m.seq_len * m.head_dim
    return stages * table * FP32 + (microbatch_in_flight * table * BF16 if mixed_precision else 0)


# --------------------------------------------------------------------------------------------
# Per rank


COMPONENTS = ("parameters", "gradients", "optimizer", "gathered parameters", "unsharded gradients",
              "activations", "pipeline buffers", "logits")

PEAKS = {"activations": "while its most activations are held",
         "gradients": "when its gradients are complete"}
"""The moments of a step that can be a rank's peak (see the module docstring)."""


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds at its peak, by component; `allowance` is added on CUDA."""

    pp_rank: int
    components: dict[str, int]
    """What is alive at the peak."""
    allowance: int = 0
    peak: str = "activations"
    """Which moment of the step (a key of PEAKS)."""

    @property
    def tensors(self) -> int:
        return sum(self.components.values())

    @property
    def total(self) -> int:
        return self.tensors + self.allowance


def allowance_bytes(tensor_bytes: int, communicators: int, accelerator: str) -> int:
    """CUDA context, NCCL's buffers and allocator fragmentation on top of the tensors (see the constants)."""
    return (CUDA_CONTEXT_BYTES + communicators * NCCL_COMMUNICATOR_BYTES.get(accelerator, 0)
            + int(FRAGMENTATION_FRACTION * tensor_bytes))


def grads_alive_at_activation_peak(held: int, stages_here: int, microbatches: int) -> bool:
    """Whether gradients of an earlier microbatch are alive when a rank holds its most activations:
    whenever its schedule runs a backward before its last forward (pp=1 with several microbatches,
    1F1B past its warm-up), the peak comes back with them. Only when every forward comes first
    (one microbatch, GPipe, looped BFS) do the gradients grow only as the activations shrink."""
    return held < stages_here * microbatches


def rank_memory(w: Workload, pp_rank: int) -> RankMemory:
    """Peak bytes on pipeline rank `pp_rank` (every dp and tp position of it alike)."""
    m, lay = w.shape, w.layout
    tp, shard, b = lay.tp, lay.resolved_dp_shard, lay.microbatch_size
    rule = SCHEDULES[lay.schedule]
    layers = _layers_per_stage(w)
    n_stages = len(layers)
    mine = stage_ids(pp_rank, lay.pp, lay.resolved_stages_per_rank, rule.placement) if lay.pp > 1 else [0]
    block = _block_params(m, tp)
    # The embeddings and the norm + head are FSDP units of their own, as each block is.
    edge_units = [_embedding_params(m, tp) for s in mine if s == 0] + [_head_params(m, tp) for s in mine
                                                                       if s == n_stages - 1]
    local = sum(edge_units) + block * sum(layers[s] for s in mine)
    largest_unit = max([block, *edge_units])
    sharded = math.ceil(local / shard)

    # FSDP's unsharded copies: bf16 on CUDA (mixed precision); on CPU only when sharded at all.
    fsdp = w.mixed_precision or shard > 1
    gathered_dtype = BF16 if w.mixed_precision else FP32
    if not fsdp:
        gathered = 0
    elif lay.keeps_gathered_parameters:
        gathered = local * gathered_dtype
    else:
        gathered = (largest_unit + block) * gathered_dtype     # the unit computed and the next, prefetched
    # One unit's gradient in the compute dtype and its fp32 copy for the reduce-scatter, in each backward.
    unit_gradient = largest_unit * (gathered_dtype + FP32 if w.mixed_precision else FP32) if fsdp else 0

    sharded_grads = sharded * FP32
    layer_backward = _backward_working_bytes(m, b, tp, lay.activation_checkpoint, w.mixed_precision)
    if fsdp and lay.pp > 1:
        # Accumulated unsharded over the step's microbatches; reduce-scattered into the sharded
        # gradients after the last backward, when no layer's backward is running any more.
        accumulated = {"unsharded gradients": local * FP32}
        complete = {**accumulated, **({"gradients": sharded_grads} if sharded_grads > layer_backward
                                      else {"activations": layer_backward})}
    else:
        replicas = lay.dp // shard
        partial = sharded * FP32 if fsdp and replicas > 1 and lay.microbatches > 1 else 0
        accumulated = {"gradients": sharded_grads + partial, "unsharded gradients": unit_gradient}
        complete = {**accumulated, "activations": layer_backward}  # the first layer's backward, the last to run

    e = BF16 if w.mixed_precision else FP32
    hidden = b * m.seq_len * m.d_model * e // tp               # one microbatch of the residual stream
    held = in_flight(lay.schedule, lay.pp, lay.resolved_stages_per_rank, lay.microbatches, pp_rank)
    per_layer = activation_bytes(m, b, tp, lay.activation_checkpoint, w.mixed_precision)
    held_activations = held * max(layers[s] for s in mine) * per_layer + rotary_bytes(m, held, len(mine),
                                                                                    w.mixed_precision)

    buffers = 0
    if lay.pp > 1:
        for s in mine:
            # One receive buffer per microbatch for activations (not the first stage) and for their
            # gradients (not the last); a stage's outputs are held until their backward.
            buffers += lay.microbatches * hidden * ((s > 0) + (s < n_stages - 1))
            buffers += held * hidden * (s < n_stages - 1)

    logits = loss_backward = 0
    if n_stages - 1 in mine:
        last_held = last_stage_in_flight(lay.schedule, lay.pp, lay.microbatches)
        logit_elems = b * m.seq_len * m.vocab_size // tp
        # The final norm keeps its fp32 input and the head its input (gathered over the sequence).
        held_activations += last_held * (FP32 * hidden // e + e * b * m.seq_len * m.d_model)
        # The head's output (e) and its fp32 log-softmax per microbatch awaiting backward; the fp32
        # gradients of both while one microbatch's loss is differentiated, before any layer's backward.
        logits = last_held * (e + FP32) * logit_elems
        loss_backward = 2 * FP32 * logit_elems

    resident = {"parameters": sharded * FP32, "optimizer": 2 * sharded * FP32,  # AdamW exp_avg and exp_avg_sq
                "gathered parameters": gathered, "pipeline buffers": buffers}
    loss_transient = loss_backward >= layer_backward  # the larger of the two, which never overlap
    stages_here = len(mine)
    moments = {
        "activations": {**resident, "logits": logits + (loss_backward if loss_transient else 0),
                        "activations": held_activations + (0 if loss_transient else layer_backward),
                        **(accumulated if grads_alive_at_activation_peak(held, stages_here, lay.microbatches)
                           else {"unsharded gradients": unit_gradient if lay.pp == 1 else 0})},
        "gradients": {**resident, **complete},
    }
    peak, alive = max(moments.items(), key=lambda moment: sum(moment[1].values()))
    components = {name: alive.get(name, 0) for name in COMPONENTS}
    tensors = sum(components.values())
    allowance = allowance_bytes(tensors, lay.communicators, w.accelerator) if w.mixed_precision else 0
    return RankMemory(pp_rank, components, allowance, peak)


def fullest_rank(w: Workload) -> RankMemory:
    """The pipeline rank that needs the most memory: it decides whether the layout fits."""
    return max((rank_memory(w, r) for r in range(w.layout.pp)), key=lambda mem: mem.total)


# --------------------------------------------------------------------------------------------
# Layouts and the planner


def layout_problem(w: Workload, ranks_per_node: int) -> str | None:
    """Why the trainer could not run this layout at all (before memory), else None: tensor
    parallel's own rules here, the pipeline's and the batch's those of trainfleet/core/runspec.py."""
    m, lay = w.shape, w.layout
    if lay.tp > ranks_per_node or ranks_per_node % lay.tp:
        return f"tp={lay.tp} must divide the {ranks_per_node} GPUs of a node (tensor parallel stays on NVLink)"
    if m.n_heads % lay.tp or m.vocab_size % lay.tp or m.seq_len % lay.tp:
        return f"tp={lay.tp} must divide n_heads={m.n_heads}, vocab_size={m.vocab_size} and seq_len={m.seq_len}"
    return pipeline_layout_problem(n_layers=m.n_layers, tie_embeddings=m.tie_embeddings, batch_size=lay.batch_size,
                                   pp=lay.pp, dp=lay.dp, schedule=lay.schedule, stages_per_rank=lay.stages_per_rank,
                                   layers_per_stage=lay.layers_per_stage, microbatches=lay.microbatches,
                                   dp_shard=lay.dp_shard)


def fits(w: Workload, accelerator_memory_gib: float) -> bool:
    return fullest_rank(w).total <= accelerator_memory_gib * GIB


@dataclass(frozen=True)
class Candidate:
    """A runnable layout on a number of nodes, with its fullest rank."""

    nodes: int
    workload: Workload
    memory: RankMemory


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan_layouts(w: Workload, nodes: int, ranks_per_node: int, fixed: frozenset[str] = frozenset(),
                 ) -> Iterator[Candidate]:
    """Every runnable layout on exactly `nodes` nodes, keeping the fields named in `fixed` as
    `w.layout` has them, in the planner's order of preference: least recompute
    (activation_checkpoint none, then selective, then full), then the smallest tp, then the
    smallest pp. A free dp_shard shards over all of dp (least memory); free microbatches are the
    most the schedule can run, the smallest microbatch (least activation memory, least bubble)."""
    lay = w.layout
    world = nodes * ranks_per_node
    modes = [lay.activation_checkpoint] if "activation_checkpoint" in fixed else list(ACTIVATION_CHECKPOINT_MODES)
    tps = [lay.tp] if "tp" in fixed else _divisors(ranks_per_node)
    for mode in modes:
        for tp in tps:
            for pp in ([lay.pp] if "pp" in fixed else _divisors(world // tp)):
                if world % (tp * pp) or ("dp" in fixed and world // (tp * pp) != lay.dp):
                    continue
                dp = world // (tp * pp)
                if lay.batch_size % dp:
                    continue
                counts = ([lay.microbatches] if "microbatches" in fixed
                          else sorted(_divisors(lay.batch_size // dp), reverse=True))
                for microbatches in counts:
                    trial = replace(w, layout=replace(lay, pp=pp, dp=dp, tp=tp, microbatches=microbatches,
                                                      activation_checkpoint=mode,
                                                      dp_shard=lay.dp_shard if "dp_shard" in fixed else 0))
                    if layout_problem(trial, ranks_per_node) is None:
                        yield Candidate(nodes, trial, fullest_rank(trial))
                        break


def _too_few(w: Workload, nodes: int, ranks_per_node: int, memory_gib: float) -> bool:
    """Even spread over every GPU of the fleet, the parameters, gradients and AdamW state
    (16 bytes a parameter) exceed one GPU's memory."""
    return 4 * FP32 * parameter_count(w.shape) / (nodes * ranks_per_node) > memory_gib * GIB


def best_fit(w: Workload, nodes: int, ranks_per_node: int, memory_gib: float,
             fixed: frozenset[str] = frozenset()) -> Candidate | None:
    """The planner's first layout on `nodes` nodes that fits, else None."""
    limit = memory_gib * GIB
    return next((c for c in plan_layouts(w, nodes, ranks_per_node, fixed) if c.memory.total <= limit), None)


def smallest_fleet(w: Workload, ranks_per_node: int, memory_gib: float, max_nodes: int,
                   fixed: frozenset[str] = frozenset()) -> Candidate | None:
    """Fewest nodes (up to max_nodes) on which some layout fits, with the planner's best layout there."""
    for nodes in range(1, max_nodes + 1):
        if _too_few(w, nodes, ranks_per_node, memory_gib):
            continue
        found = best_fit(w, nodes, ranks_per_node, memory_gib, fixed)
        if found:
            return found
    return None


# --------------------------------------------------------------------------------------------
# Host memory: the in-memory checkpoints (trainer/memory_checkpoint.py)

HOST_COPIES = 4
"""Copies of a node's share of the training state in its tmpfs: its own ranks' shards and its
previous node's, each at two steps (the last copy whole everywhere and the one being written)."""
HOST_BUFFERS = 2
"""And in its trainer processes, kept from one copy or save to the next: the state staged for the
in-memory copies and the state staged for the S3 saves (pinned on GPU nodes), each stager's own.
A copy is serialised straight into the tmpfs and streamed from file to file in 64 MiB chunks
(trainer/memory_checkpoint.py), so it adds no buffer of a shard's size."""
TMPFS_SHARE = 0.5
"""Of the host's memory, what /dev/shm may hold: a tmpfs's default size."""


def state_bytes(w: Workload, pp_rank: int) -> int:
    """What one rank's shard of the training state takes in a checkpoint: its fp32 parameters and
    AdamW's two moments."""
    components = rank_memory(w, pp_rank).components
    return components["parameters"] + components["optimizer"]


def host_memory_per_node(w: Workload, ranks_per_node: int) -> tuple[int, int]:
    """Bytes of the fullest node's host memory that the checkpoints take: the in-memory copies in
    its tmpfs, and the staged states in its processes (a node runs ranks_per_node ranks of one
    pipeline rank, the fullest pipeline rank's shards decide)."""
    share = max(state_bytes(w, r) for r in range(w.layout.pp)) * ranks_per_node
    return HOST_COPIES * share, HOST_BUFFERS * share


def host_memory_problem(w: Workload, instance_name: str, ranks_per_node: int, host_memory_gib: float) -> str | None:
    """Why the in-memory checkpoints of `w` would not fit a node's host memory, with the figures;
    None when they fit."""
    copies, buffers = host_memory_per_node(w, ranks_per_node)
    tmpfs = TMPFS_SHARE * host_memory_gib * GIB
    if copies <= tmpfs and copies + buffers <= host_memory_gib * GIB:
        return None
    return (f"the in-memory checkpoints need {copies / GIB:.1f} GiB of a node's tmpfs (/dev/shm: {tmpfs / GIB:.0f} "
            f"GiB, half of {instance_name}'s {host_memory_gib:g} GiB) and {buffers / GIB:.1f} GiB more in its "
            f"processes: {HOST_COPIES} copies of the node's {copies / HOST_COPIES / GIB:.1f} GiB share of the state, "
            f"and the {HOST_BUFFERS} the copies and the S3 saves stage. Spread the state over more nodes, or set "
            "checkpoint.memory_interval_steps to 0 (S3 only)")


MAX_PROPOSED_NODES = 512
"""The largest fleet the planner proposes when a layout does not fit."""


def memory_problem(w: Workload, instance_name: str, ranks_per_node: int, memory_gib: float) -> str | None:
    """Why `w` would run out of accelerator memory, with the fullest GPU's figures and the smallest
    fleet and layout that fit instead; None when it fits."""
    memory = fullest_rank(w)
    if memory.total <= memory_gib * GIB:
        return None
    lines = [f"the layout needs {memory.total / GIB:.2f} GiB on its fullest GPU (pipeline rank {memory.pp_rank}), "
             f"{memory_gib} GiB on {instance_name}: {w.layout.describe()}", format_memory(memory, memory_gib)]
    smallest = smallest_fleet(w, ranks_per_node, memory_gib, MAX_PROPOSED_NODES)
    if smallest is None:
        lines.append(f"no layout fits on up to {MAX_PROPOSED_NODES} x {instance_name}")
    else:
        lines.append(f"smallest fleet that fits: {smallest.nodes} x {instance_name}, "
                     f"{smallest.workload.layout.describe()} ({smallest.memory.total / GIB:.2f} GiB on the fullest GPU)")
    return "\n".join(lines)


def format_memory(memory: RankMemory, memory_gib: float | None) -> str:
    """A table of the fullest rank's figures in GiB, with its total against the device's memory."""
    rows = [(name, memory.components[name]) for name in COMPONENTS]
    if memory.allowance:
        rows.append(("CUDA context, NCCL, fragmentation", memory.allowance))
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"  {name:<{width}}{value / GIB:10.2f} GiB" for name, value in rows]
    lines.append(f"  {'total (pipeline rank ' + str(memory.pp_rank) + ')':<{width}}{memory.total / GIB:10.2f} GiB"
                 f"  at its peak, {PEAKS[memory.peak]}")
    if memory_gib is not None:
        lines.append(f"  {'device memory':<{width}}{memory_gib:10.2f} GiB")
    return "\n".join(lines)
