"""The trainer's models in Hugging Face's stock classes and back: LlamaForCausalLM for the llama
family, GPT2LMHeadModel for gpt. Plain data and tensor reshuffles; the export and the import
(trainer/export.py, trainer/hf_import.py) stream through them a tensor at a time.

    model_section(config_json)      the trainer's model fields a config.json determines (HfError
                                    naming the field a stock config has that the trainer cannot hold)
    mismatch(model, section)        the first field where a run's model section differs, else None
    model_config(config_json)       the ModelConfig of an exported model
    config_json(model, ...)         config.json for the model, in the class's own keys
    links(model)                    every stock tensor and the trainer's tensors it is made of
    to_hf(link, tensors), from_hf(link, tensor)   one tensor each way

The Llama family needs no reshuffle: the trainer's rotary layout is Hugging Face's (rotate-half),
so q and k go through unpermuted. GPT-2 fuses q, k and v into one `c_attn` and stores every
matrix as Conv1D does, (in, out): the transpose of nn.Linear's weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.config import ModelConfig

__all__ = ["HfError", "Link", "STOCK_CLASSES", "model_section", "model_config", "mismatch", "config_json", "links",
           "to_hf", "from_hf"]

STOCK_CLASSES = {"llama": "LlamaForCausalLM", "gpt": "GPT2LMHeadModel"}
"""The transformers class that holds each family."""
_MODEL_TYPES = {"llama": "llama", "gpt": "gpt2"}
_GPT2_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
"""GPT-2's activation_function values the trainer computes: exact GELU, and the tanh approximation
under its two names (gelu_new spells the formula out, gelu_pytorch_tanh is torch's own kernel)."""


class HfError(ValueError):
    """A Hugging Face checkpoint or config the trainer cannot hold, or one unlike the run's model;
    the message names the field."""


@dataclass(frozen=True)
class Link:
    """One stock tensor: the trainer's tensors it is made of, joined along the rows in order, then
    transposed for GPT-2's Conv1D matrices."""

    hf: str
    trainer: tuple[str, ...]
    transposed: bool = False


def links(model: ModelConfig) -> list[Link]:
    """Every tensor of the model's stock class (its tied head omitted, as the class saves it)."""
    layers = range(model.n_layers)
    if model.architecture == "llama":
        per_layer = {"attn_norm.weight": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
                     "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
                     "attn.proj.weight": "self_attn.o_proj.weight",
                     "mlp_norm.weight": "post_attention_layernorm.weight",
                     "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
                     "mlp.proj.weight": "mlp.down_proj.weight"}
        found = [Link("model.embed_tokens.weight", ("tok_emb.weight",))]
        found += [Link(f"model.layers.{i}.{hf}", (f"layers.{i}.{ours}",))
                  for i in layers for ours, hf in per_layer.items()]
        found.append(Link("model.norm.weight", ("norm.weight",)))
    else:
        found = [Link("transformer.wte.weight", ("tok_emb.weight",)),
                 Link("transformer.wpe.weight", ("pos_emb.weight",))]
        for i in layers:
            ours, hf = f"layers.{i}.", f"transformer.h.{i}."
            found += [Link(hf + f"ln_1.{p}", (ours + f"attn_norm.{p}",)) for p in ("weight", "bias")]
            found += [Link(hf + "attn.c_attn.weight", tuple(ours + f"attn.{t}.weight" for t in "qkv"), True),
                      Link(hf + "attn.c_attn.bias", tuple(ours + f"attn.{t}.bias" for t in "qkv")),
                      Link(hf + "attn.c_proj.weight", (ours + "attn.proj.weight",), True),
                      Link(hf + "attn.c_proj.bias", (ours + "attn.proj.bias",))]
            found += [Link(hf + f"ln_2.{p}", (ours + f"mlp_norm.{p}",)) for p in ("weight", "bias")]
            found += [Link(hf + "mlp.c_fc.weight", (ours + "mlp.fc.weight",), True),
                      Link(hf + "mlp.c_fc.bias", (ours + "mlp.fc.bias",)),
                      Link(hf + "mlp.c_proj.weight", (ours + "mlp.proj.weight",), True),
                      Link(hf + "mlp.c_proj.bias", (ours + "mlp.proj.bias",))]
        found += [Link("transformer.ln_f.weight", ("norm.weight",)), Link("transformer.ln_f.bias", ("norm.bias",))]
    if not model.tie_embeddings:
        found.append(Link("lm_head.weight", ("head.weight",)))
    return found


def to_hf(link: Link, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The stock tensor from the trainer's, in `link.trainer`'s order."""
    joined = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    return joined.t().contiguous() if link.transposed else joined


def from_hf(link: Link, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The trainer's tensors, in `link.trainer`'s order, from the stock one (GPT-2's fused q, k, v
    are equal thirds)."""
    rows = tensor.t() if link.transposed else tensor
    return [part.contiguous() for part in rows.chunk(len(link.trainer))]


def model_section(config: dict[str, Any]) -> dict[str, Any]:
    """The trainer's model fields that a stock config.json determines. seq_len only for gpt, whose
    position table has that many rows: a llama's context is the run's choice."""
    architectures = config.get("architectures") or []
    family = next((name for name, cls in STOCK_CLASSES.items() if cls in architectures), None)
    if family is None:
        raise HfError(f"config.json: architectures={architectures} holds none of {', '.join(STOCK_CLASSES.values())}")
    return _llama_section(config) if family == "llama" else _gpt2_section(config)


def _require(config: dict[str, Any], key: str, wanted: Any, why: str) -> None:
    """Refuse a value the trainer cannot hold; absent (or null: the class's default) is `wanted`."""
    if config.get(key) not in (None, wanted):
        raise HfError(f"config.json: {key}={config[key]!r} is not supported: {why}")


def _llama_section(c: dict[str, Any]) -> dict[str, Any]:
    _require(c, "hidden_act", "silu", "the llama family's SwiGLU gates with SiLU")
    _require(c, "attention_bias", False, "the llama family has no biases")
    _require(c, "mlp_bias", False, "the llama family has no biases")
    _require(c, "pretraining_tp", 1, "weights split for another tensor-parallel layout")
    heads, width = c["num_attention_heads"], c["hidden_size"]
    _require(c, "head_dim", width // heads, "heads must be hidden_size / num_attention_heads wide")
    rope = dict(c.get("rope_parameters") or {})
    rope.setdefault("rope_theta", c.get("rope_theta", 10000.0))  # older configs keep these two outside
    rope.update(c.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HfError(f"config.json: rope_type={kind!r} is not supported: the llama family scales rotary "
                      f"frequencies as Llama 3 does, or not at all")
    _require(rope, "partial_rotary_factor", 1.0, "rotary embeddings turn every dimension of a head")
    section = {"architecture": "llama", "n_layers": c["num_hidden_layers"], "d_model": width, "n_heads": heads,
               "n_kv_heads": c.get("num_key_value_heads") or heads, "vocab_size": c["vocab_size"],
               "ffn_hidden": c["intermediate_size"], "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
               "tie_embeddings": bool(c.get("tie_word_embeddings", False)), "rope_theta": float(rope["rope_theta"])}
    if kind == "llama3":
        section |= {"rope_scaling_factor": float(rope["factor"]),
                    "rope_low_freq_factor": float(rope["low_freq_factor"]),
                    "rope_high_freq_factor": float(rope["high_freq_factor"]),
                    "rope_original_seq_len": int(rope["original_max_position_embeddings"])}
    else:
        section["rope_scaling_factor"] = 0.0
    return section


def _gpt2_section(c: dict[str, Any]) -> dict[str, Any]:
    activation = c.get("activation_function", "gelu_new")
    if activation not in _GPT2_ACTIVATIONS:
        raise HfError(f"config.json: activation_function={activation!r} is not supported: the gpt family computes "
                      f"{', '.join(_GPT2_ACTIVATIONS)}")
    _require(c, "scale_attn_weights", True, "attention scores are scaled by 1/sqrt(head width)")
    _require(c, "scale_attn_by_inverse_layer_idx", False, "attention scores are not scaled by depth")
    width = c["n_embd"]
    inner = c.get("n_inner") or 4 * width
    if inner % width:
        raise HfError(f"config.json: n_inner={inner} is not supported: the gpt family's MLP is a whole multiple "
                      f"of n_embd={width} wide (model.mlp_ratio)")
    return {"architecture": "gpt", "n_layers": c["n_layer"], "d_model": width, "n_heads": c["n_head"],
            "vocab_size": c["vocab_size"], "seq_len": c["n_positions"], "mlp_ratio": inner // width,
            "activation": _GPT2_ACTIVATIONS[activation], "norm_eps": float(c.get("layer_norm_epsilon", 1e-5)),
            "tie_embeddings": bool(c.get("tie_word_embeddings", True))}


def mismatch(model: ModelConfig, section: dict[str, Any]) -> str | None:
    """The first field of `section` (model_section's) unlike the run's `model`, as
    'model.FIELD=RUN's value, the checkpoint has VALUE', else None. Key/value heads and the MLP's
    width compare as resolved (0 means n_heads, Llama's rule)."""
    resolved = {"n_kv_heads": model.resolved_kv_heads(), "ffn_hidden": model.resolved_ffn_hidden()}
    for name, value in section.items():
        ours = resolved.get(name, getattr(model, name))
        if ours != value:
            shown = f"{getattr(model, name)!r}" + (f" ({ours})" if ours != getattr(model, name) else "")
            return f"model.{name}={shown} in the run's model section, but the checkpoint has {value!r}"
    return None


def config_json(model: ModelConfig, dtype: str, bos_id: int | None, eos_id: int | None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of the model's stock class, which transformers' AutoConfig reads; `extra` goes
    under the key "trainfleet" (where it came from)."""
    common = {"architectures": [STOCK_CLASSES[model.architecture]], "model_type": _MODEL_TYPES[model.architecture],
              "vocab_size": model.vocab_size, "tie_word_embeddings": model.tie_embeddings, "dtype": dtype,
              "bos_token_id": bos_id, "eos_token_id": eos_id, "use_cache": True}
    if model.architecture == "llama":
        rope = {"rope_type": "default", "rope_theta": model.rope_theta}
        if model.rope_scaling_factor:
            rope |= {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                     "low_freq_factor": model.rope_low_freq_factor, "high_freq_factor": model.rope_high_freq_factor,
                     "original_max_position_embeddings": model.rope_original_seq_len}
        family = {"hidden_size": model.d_model, "intermediate_size": model.resolved_ffn_hidden(),
                  "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
                  "num_key_value_heads": model.resolved_kv_heads(), "head_dim": model.d_model // model.n_heads,
                  "max_position_embeddings": model.seq_len, "rms_norm_eps": model.norm_eps, "hidden_act": "silu",
                  "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "rope_parameters": rope}
    else:
        activation = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[model.activation]
        family = {"n_embd": model.d_model, "n_layer": model.n_layers, "n_head": model.n_heads,
                  "n_positions": model.seq_len, "n_inner": model.resolved_ffn_hidden(),
                  "activation_function": activation, "layer_norm_epsilon": model.norm_eps,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return common | family | ({"trainfleet": extra} if extra else {})


def model_config(config: dict[str, Any]) -> ModelConfig:
    """The trainer's ModelConfig of a stock config.json (a llama's context: its max_position_embeddings)."""
    section = model_section(config)
    if section["architecture"] == "llama":
        section["seq_len"] = config.get("max_position_embeddings", ModelConfig.seq_len)
    return ModelConfig(**section)
