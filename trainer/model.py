"""A GPT-style decoder LM, buildable whole or as one pipeline stage.

Layers live in a ModuleDict keyed by their global index and parts a stage lacks are None, so a
stage's parameter names are exactly the full model's (`layers.5.attn.q.weight`), which is what
lets a checkpoint saved at one pipeline split load into another.

Nothing here knows about parallelism: trainer/parallelize.py shards these modules in place
(tensor parallel, FSDP), and the shapes below are then the local ones - (B, T/tp, C) for the
residual stream between blocks, H/tp heads inside attention. Dtypes come from FSDP's mixed
precision policy (bf16 compute on CUDA), not from autocast.
"""

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig

INIT_STD = 0.02


class CausalSelfAttention(nn.Module):
    # Separate q, k and v projections (not one fused qkv): tensor parallel splits each by heads.
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q = nn.Linear(cfg.d_model, cfg.d_model)
        self.k = nn.Linear(cfg.d_model, cfg.d_model)
        self.v = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads from the projection's width: H, or H/tp under tensor parallel.
        q, k, v = (t(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).flatten(2))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The whole model by default; with `layers`, `first` and `last`, one pipeline stage of it.

    The first stage takes token ids (B, T) and embeds them; the others take the residual stream
    (B, T, C). The last stage returns logits (B, T, vocab); the others the residual stream.
    """

    def __init__(self, cfg: ModelConfig, layers: range | None = None, first: bool = True, last: bool = True):
        super().__init__()
        layers = range(cfg.n_layers) if layers is None else layers
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model) if first else None
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if first else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = nn.LayerNorm(cfg.d_model) if last else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last and not cfg.tie_embeddings else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # (1, T)
            x = self.tok_emb(x) + self.pos_emb(positions)  # (B, T, C)
        for layer in self.layers.values():
            x = layer(x)
        if self.norm is None:
            return x
        x = self.norm(x)
        return self.head(x) if self.head is not None else F.linear(x, self.tok_emb.weight)  # (B, T, vocab)


INIT_BLOCK = 1 << 16
"""A parameter's initial values are drawn in blocks of this many of its elements (row-major),
each block from a generator of its own: any shard is drawn without the rest (`normal_at`)."""
INIT_CHUNK = 1 << 22
"""At most this many values are drawn at once while a shard is filled (16 MiB in fp32)."""


def initial_values(name: str, shape: torch.Size, seed: int, n_layers: int,
                   region: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """The region (offset, size; the whole by default) of a parameter's initial value, drawn on
    `device` from generators seeded by (seed, its full name, the position of its values).

    A parameter gets the same values whichever stage, rank or split holds it, so a parallel run
    starts from exactly the single-process model, and each rank draws only its shard. Output
    projections are scaled down by depth (GPT-2's residual scaling). A model family gives each
    parameter name its distribution here; the drawing by position is the same for all.
    """
    offset, size = region or ((0,) * len(shape), tuple(shape))
    if name.endswith("norm.weight"):
        return torch.ones(size, device=device)
    if name.endswith("bias"):
        return torch.zeros(size, device=device)
    std = INIT_STD / (2 * n_layers) ** 0.5 if name.endswith("proj.weight") else INIT_STD
    return normal_at(seed * 1_000_003 + zlib.crc32(name.encode()), tuple(shape), offset, size, device).mul_(std)


def normal_at(key: int, shape: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...],
              device: torch.device | str) -> torch.Tensor:
    """The region (offset, size) of a standard normal tensor of `shape` whose flat elements are
    drawn in blocks of INIT_BLOCK, block b by a generator seeded by (key, b). Whole rows (all but
    the first dimension) are drawn, INIT_CHUNK values at a time: a shard split by rows costs
    its own values, one split by columns its rows' (tensor parallel's row-parallel weights)."""
    out = torch.empty(size, device=device)
    if out.numel() == 0:
        return out
    row = math.prod(shape[1:])
    rows_at_once = max(1, INIT_CHUNK // row)
    inner = tuple(slice(o, o + n) for o, n in zip(offset[1:], size[1:]))
    generator = torch.Generator(device=device)
    drawn = torch.empty((rows_at_once * row // INIT_BLOCK + 2) * INIT_BLOCK, device=device)
    for start in range(0, size[0], rows_at_once):
        rows = min(rows_at_once, size[0] - start)
        begin = (offset[0] + start) * row
        first, last = begin // INIT_BLOCK, (begin + rows * row - 1) // INIT_BLOCK
        for index, block in enumerate(range(first, last + 1)):
            generator.manual_seed(_block_seed(key, block))
            torch.randn(INIT_BLOCK, generator=generator, out=drawn[index * INIT_BLOCK:(index + 1) * INIT_BLOCK])
        skipped = begin - first * INIT_BLOCK
        out[start:start + rows] = drawn[skipped:skipped + rows * row].view(rows, *shape[1:])[(slice(None), *inner)]
    return out


def _block_seed(key: int, block: int) -> int:
    """A generator's seed for one block, its bits mixed (splitmix64's finaliser): CPU generators
    keep only a seed's low 32 bits, which (key, block) must spread over."""
    mixed = (key * 0x9E3779B97F4A7C15 + block) & 0xFFFFFFFFFFFFFFFF
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (mixed ^ (mixed >> 31)) & 0x7FFFFFFFFFFFFFFF


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all positions; logits (B, T, vocab), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
