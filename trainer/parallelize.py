"""Tensor parallel, weight init, activation checkpointing, torch.compile and FSDP2 for one model part.

Applied in torchtitan's order, each to the part a pipeline rank holds (or to the whole model):

    tensor_parallel(part, mesh["tp"])        split the matrices over tp, on the meta device
    parallelize(part, cfg, mesh, device)     checkpoint, compile and shard over data parallel
    allocate(part, device)                   this rank's shards, on its device, unfilled
    initialise(part, seed, layers)           fill them, unless a restore follows

Everything before `allocate` happens on the meta device, so a rank only ever allocates its own
shard of each parameter: sharded after allocating, every rank would first hold its whole
tensor-parallel part in fp32 (35 GB per GPU for a 70B model at tp=8). And each rank draws only
its shards' initial values, on its device (trainer/model.py initial_values): drawing each
parameter whole and keeping a shard cost Jurassic-1's second pipeline rank about two minutes of
CPU, for values a restore then overwrote.

The mesh is (pp, dp_replicate, dp_shard, tp), outermost first (trainer/train.py builds it):
tensor parallel talks twice per layer and stays inside a node; FSDP's all-gathers and
reduce-scatters run over dp_shard and its gradient all-reduce over dp_replicate; only pipeline
hand-offs and those cross nodes.
"""

import contextlib
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.config import JobConfig
from trainer.model import Decoder, initial_values

__all__ = ["tensor_parallel", "allocate", "initialise", "parallelize", "loss_context"]


def tensor_parallel(part: Decoder, tp_mesh: DeviceMesh) -> None:
    """Megatron-style tensor parallel with sequence parallel, in place, for either family.

    Inside each block q, k, v and the MLP's input matrices (gpt's fc, llama's gate and up) are
    split by output columns (heads, key/value heads, hidden units) and the two output projections
    by input rows, so each half of a block needs one all-gather in and one reduce-scatter out.
    Between those regions the residual stream, the norms and the pipeline hand-offs hold T/tp of
    the sequence (Shard(1)); llama's rotary table goes to the attention whole. Embedding tables
    are split by rows (vocabulary, positions), the head by vocabulary; its logits stay split by
    vocabulary (a DTensor), for the loss to be computed under `loss_parallel` without gathering
    them.
    """
    seq_sharded = (Shard(1),)
    mlp_inputs = ("gate", "up") if part.cfg.architecture == "llama" else ("fc",)
    for block in part.layers.values():
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=seq_sharded, desired_input_layouts=(Replicate(),)),
            **{f"mlp.{name}": ColwiseParallel() for name in mlp_inputs},
            "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    plan = {}
    if part.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(part, "pos_emb", None) is not None:
        # Positions come in as (1, T), so Shard(1) splits the sequence of both embeddings alike.
        plan["pos_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if part.norm is not None:
        plan["norm"] = SequenceParallel()
        plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(part, tp_mesh, plan)


def loss_context(cfg: JobConfig):
    """Where the loss and its backward run: under loss_parallel with tensor parallel, so the
    cross-entropy works on vocabulary-split logits (a few scalars exchanged per position instead
    of the whole logits gathered)."""
    return loss_parallel() if cfg.parallel.tp > 1 else contextlib.nullcontext()


def allocate(part: nn.Module, device: torch.device) -> None:
    """Give the part's parameters (on the meta device) storage on `device`, unfilled."""
    part.to_empty(device=device)


def initialise(part: nn.Module, seed: int, n_layers: int) -> None:
    """Fill the part's parameters, where they are, with their initial values: each rank draws its
    own shard of each (trainer/model.py initial_values), without communication, so any layout
    starts from exactly the single-process weights."""
    with torch.no_grad():
        for name, param in part.named_parameters():
            local, region = param, None
            if isinstance(param, DTensor):
                shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                local, region = param.to_local(), (tuple(offset), tuple(shape))
            local.copy_(initial_values(_model_name(name), param.shape, seed, n_layers, region, local.device))


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly distributed) tensor this rank holds."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _model_name(name: str) -> str:
    """A parameter's name in trainer/model.py's models, without the wrappers' module levels."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _uses_fsdp(cfg: JobConfig, device: torch.device) -> bool:
    """FSDP2 wraps each part when there are data-parallel ranks to shard or reduce over, and on
    CUDA, where its mixed precision policy gives bf16 compute."""
    return cfg.parallel.dp > 1 or device.type == "cuda"


def parallelize(part: Decoder, cfg: JobConfig, mesh: DeviceMesh | None, device: torch.device) -> None:
    """Activation checkpointing, torch.compile and FSDP2 on a part still on the meta device, in place."""
    mode = cfg.training.activation_checkpoint
    for name, block in list(part.layers.items()):
        if mode != "none":
            block = _checkpointed(block, mode)
        if cfg.training.compile:
            block = torch.compile(block, fullgraph=True)
        part.layers[name] = block
    if mesh is not None and _uses_fsdp(cfg, device):
        _fully_shard(part, cfg, mesh, device)


# Selective activation checkpointing keeps the outputs of the matmuls, attention and tensor
# parallel's reduce-scatters, and recomputes the cheap elementwise work (norms, GELU, adds, views).
# Under tensor parallel it keeps nothing of the full sequence: not the all-gathers' outputs (the
# backward gathers again, as torchtitan's policy does), nor a row-parallel matmul's output, a
# partial sum of the whole sequence whose reduce-scatter (T/tp of it) is kept instead. Each would
# hold tp times the memory of what is kept.
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
_SAVED_OPS = _MATMULS | {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _is_row_parallel(op, args) -> bool:
    """A matmul whose input is split along its last (contracted) dimension: its output is partial."""
    matrix = args[-2]
    return (op in _MATMULS and isinstance(matrix, DTensor)
            and any(isinstance(p, Shard) and p.dim in (-1, matrix.ndim - 1) for p in matrix.placements))


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in _SAVED_OPS and not _is_row_parallel(op, args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(block: nn.Module, mode: str) -> nn.Module:
    # The model draws no random numbers, so the RNG state need not be saved for recomputation.
    if mode == "full":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    return checkpoint_wrapper(block, preserve_rng_state=False,
                              context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls))


def _fully_shard(part: Decoder, cfg: JobConfig, mesh: DeviceMesh, device: torch.device) -> None:
    """ZeRO-3 (or ZeRO-2) over dp_shard, replicated over dp_replicate.

    Each block is an FSDP unit, and so are the embeddings and the final norm with the head, so
    that only one unit's (bf16) parameters are gathered at a time: the root unit's would stay
    gathered from forward to backward, and a large vocabulary's tables are the largest units.
    A head tied to the token embedding reads that table outside the embedding's own forward,
    so with tied embeddings both stay in the root.

    reshard_after_forward "auto" reshards without a pipeline (ZeRO-3: each unit is gathered for
    its forward and again for its backward), except the last block and the norm with the head:
    their backward comes straight after their forward, so a second gather would fetch what was
    just freed (torchtitan's default too). Under a pipeline a stage keeps its parameters
    gathered for the step anyway (PipelineStage does not reshard after backward), so resharding
    after forward would only gather them again for the first backward.
    """
    p = cfg.parallel
    dp_mesh = mesh["dp_replicate", "dp_shard"] if p.dp // p.resolved_dp_shard() > 1 else mesh["dp_shard"]
    reshard = {"always": True, "never": False, "auto": p.pp == 1}[p.reshard_after_forward]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    blocks = list(part.layers.values())
    units = [(block, reshard) for block in blocks]
    if p.reshard_after_forward == "auto" and blocks:
        units[-1] = (blocks[-1], False)
    if part.head is not None:
        units += [([module for module in (part.tok_emb, getattr(part, "pos_emb", None)) if module is not None], reshard),
                  ([part.norm, part.head], reshard and p.reshard_after_forward != "auto")]
    for unit, reshard_unit in units:
        if unit:
            fully_shard(unit, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_unit)
    fully_shard(part, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
