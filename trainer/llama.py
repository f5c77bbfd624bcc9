"""The Llama family on trainer/model.py's decoder skeleton: rotary positions (Llama 3's frequency
scaling optional), RMSNorm, a SwiGLU MLP, grouped-query attention, no biases.

Hugging Face's LlamaForCausalLM computes the same function with the same weights, unpermuted:
rotary embeddings in its rotate-half layout (model.rotate), the norms in fp32, SiLU on the gate.
Parameter names follow the skeleton's (trainer/hf.py maps them); the MLP's down projection is
`mlp.proj`, so it starts scaled by depth like every output projection (model.initial_values).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import ModelConfig
from trainer.model import Attention, Decoder, KVCache

__all__ = ["Llama", "RMSNorm", "rotary_table"]


class RMSNorm(nn.Module):
    """x / rms(x) x weight, computed in fp32 whatever the compute dtype, as Llama's own does."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.resolved_ffn_hidden()
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, bias=False)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, *, cache: KVCache | None = None,
                layer: str = "") -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rotary, cache=cache, layer=layer)
        return x + self.mlp(self.mlp_norm(x))


def rotary_table(cfg: ModelConfig, device: torch.device) -> torch.Tensor:
    """cos and sin of every position's angles, (2, seq_len, C/H) in fp32: angle i of position p
    is p / theta^(2i / (C/H)), twice over (the rotate-half layout), with Llama 3's scaling of the
    frequencies when rope_scaling_factor is set."""
    dim = cfg.d_model // cfg.n_heads
    frequencies = 1.0 / cfg.rope_theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if cfg.rope_scaling_factor:
        frequencies = _llama3_scaled(frequencies, cfg)
    angles = torch.arange(cfg.seq_len, device=device).float()[:, None] * frequencies  # (T, C/2H)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()])


def _llama3_scaled(frequencies: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1's long-context scaling: wavelengths longer than the original context over
    low_freq_factor are stretched by the factor, those shorter than it over high_freq_factor
    are kept, and those between move smoothly from one to the other."""
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelengths = 2 * math.pi / frequencies
    smooth = (cfg.rope_original_seq_len / wavelengths - low) / (high - low)
    blended = (1 - smooth) * frequencies / factor + smooth * frequencies
    long = wavelengths > cfg.rope_original_seq_len / low
    short = wavelengths < cfg.rope_original_seq_len / high
    return torch.where(long, frequencies / factor, torch.where(short, frequencies, blended))


class Llama(Decoder):
    """The Llama family's model, or one pipeline stage of it."""

    def __init__(self, cfg: ModelConfig, layers: range | None = None, first: bool = True, last: bool = True):
        super().__init__(cfg, layers, first, last, LlamaBlock, RMSNorm)
        self._table: torch.Tensor | None = None  # made on first use, on the device used (not a buffer:
        # the model is built on the meta device and only its parameters are filled)

    def rotary(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """The table's rows from position `start` on, in x's dtype; each attention takes its first T."""
        if self._table is None or self._table.device != x.device:
            self._table = rotary_table(self.cfg, x.device)
        return self._table[:, start:].to(x.dtype)
