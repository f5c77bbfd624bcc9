"""The decoder LMs the trainer trains, buildable whole or as one pipeline stage: the skeleton both
families share, and the GPT family (GPT-2's shape). The Llama family is trainer/llama.py's;
`build` makes either from the model section.

Layers live in a ModuleDict keyed by their global index and parts a stage lacks are None, so a
stage's parameter names are exactly the full model's (`layers.5.attn.q.weight`), which is what
lets a checkpoint saved at one pipeline split load into another. Both families name their
parameters alike where they are alike (tok_emb, layers.N.attn.{q,k,v,proj}, layers.N.attn_norm,
layers.N.mlp_norm, layers.N.mlp.proj, norm, head), so tensor parallel, FSDP and the initial values
treat them by one rule; trainer/hf.py maps both to Hugging Face's names.

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


class KVCache:
    """Keys and values of every position seen so far, per layer, for generation (trainer/sample.py):
    the whole model is fed a prompt once, then one token at a time. Training passes none."""

    def __init__(self):
        self.length = 0
        """Positions cached: the position of the next token fed."""
        self._layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def extend(self, layer: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add a layer's keys and values of the new positions (B, KV, T, C/H); all of them so far."""
        if layer in self._layers:
            keys, values = (torch.cat([old, new], dim=2) for old, new in zip(self._layers[layer], (keys, values)))
        self._layers[layer] = keys, values
        return keys, values


class Attention(nn.Module):
    """Causal self-attention with n_kv_heads key/value heads shared by groups of query heads
    (grouped-query attention; gpt has one per query head) and, for llama, rotary positions.

    Separate q, k and v projections (not one fused qkv): tensor parallel splits each by heads.
    """

    def __init__(self, cfg: ModelConfig, bias: bool):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        kv_width = cfg.resolved_kv_heads() * self.head_dim
        self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)
        self.k = nn.Linear(cfg.d_model, kv_width, bias=bias)
        self.v = nn.Linear(cfg.d_model, kv_width, bias=bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor | None, *, cache: KVCache | None = None,
                layer: str = "") -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads from the projections' widths: H and KV, or H/tp and KV/tp under tensor parallel.
        q, k, v = (t(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v))
        start = cache.length if cache is not None else 0
        if rotary is not None:  # (2, positions from `start` on, C/H): cos and sin
            q, k = rotate(q, rotary[:, :seq]), rotate(k, rotary[:, :seq])
        if cache is not None:
            k, v = cache.extend(layer, k, v)
        # A cached step feeds one new position, which sees every one before it: no mask.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0, enable_gqa=k.shape[1] != q.shape[1])
        return self.proj(y.transpose(1, 2).flatten(2))  # (B, T, C)


def rotate(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    """Rotary positions in the rotate-half layout (Hugging Face's Llama): dimension i of a head
    pairs with i + C/2H. x (B, H, T, C/H), rotary (2, T, C/H) holding cos and sin."""
    first, second = x.chunk(2, dim=-1)
    return x * rotary[0] + torch.cat([-second, first], dim=-1) * rotary[1]


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.resolved_ffn_hidden())
        self.proj = nn.Linear(cfg.resolved_ffn_hidden(), cfg.d_model)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)). `rotary` and `cache`
    pass through to the attention; `layer` names the block in the cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, bias=True)
        self.mlp_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor | None, *, cache: KVCache | None = None,
                layer: str = "") -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rotary, cache=cache, layer=layer)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """One pipeline stage of a decoder, or the whole model: the token embedding on the first
    stage, `layers` of `block` keyed by global index, the final norm and the head on the last.

    The first stage takes token ids (B, T) and embeds them; the others take the residual stream
    (B, T, C). The last stage returns logits (B, T, vocab); the others the residual stream. A
    family says how it embeds (`embed`) and what every block takes besides the stream (`rotary`).
    """

    def __init__(self, cfg: ModelConfig, layers: range | None, first: bool, last: bool, block: type[nn.Module],
                 norm: type[nn.Module]):
        super().__init__()
        self.cfg = cfg
        layers = range(cfg.n_layers) if layers is None else layers
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model) if first else None
        self.layers = nn.ModuleDict({str(i): block(cfg) for i in layers})
        self.norm = norm(cfg.d_model, eps=cfg.norm_eps) if last else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if last and not cfg.tie_embeddings else None

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        return self.tok_emb(tokens)  # (B, T, C)

    def rotary(self, x: torch.Tensor, start: int) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        start = cache.length if cache is not None else 0  # the position of x's first token
        if self.tok_emb is not None:
            x = self.embed(x, start)
        rotary = self.rotary(x, start)
        for name, layer in self.layers.items():
            x = layer(x, rotary) if cache is None else layer(x, rotary, cache=cache, layer=name)
        if cache is not None:
            cache.length += x.shape[1]
        if self.norm is None:
            return x
        x = self.norm(x)
        return self.head(x) if self.head is not None else F.linear(x, self.tok_emb.weight)  # (B, T, vocab)


class GPT(Decoder):
    """GPT-2's shape: learned positions added to the token embedding, LayerNorm, a GELU MLP, biases."""

    def __init__(self, cfg: ModelConfig, layers: range | None = None, first: bool = True, last: bool = True):
        super().__init__(cfg, layers, first, last, Block, nn.LayerNorm)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if first else None

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device).unsqueeze(0)  # (1, T)
        return self.tok_emb(tokens) + self.pos_emb(positions)  # (B, T, C)


def build(cfg: ModelConfig, layers: range | None = None, first: bool = True, last: bool = True) -> Decoder:
    """The model of cfg.architecture: whole, or the stage holding `layers` (and the embedding when
    `first`, the norm and head when `last`)."""
    if cfg.architecture == "llama":
        from trainer.llama import Llama  # it builds on this module's skeleton

        return Llama(cfg, layers, first, last)
    return GPT(cfg, layers, first, last)


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
    projections (attention's and the MLP's, `proj` in both families) are scaled down by depth
    (GPT-2's residual scaling). Both families name their parameters alike where they are alike, so
    one set of rules by name serves both; the drawing by position is the same for all.
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
