"""The trained model out of a committed checkpoint, as a Hugging Face model folder, streamed.

    written = export("s3://bucket/runs/my-run", Path("my-model"), dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained("my-model")     # transformers, no remote code
    model = load_exported(Path("my-model"))                      # or the trainer's own, on the CPU

A committed step (trainer/checkpoint.py) holds each parameter as the chunks the saving ranks
held, at whatever pp x dp x tp they trained. The export reads the parameters a group at a time,
at most `group_bytes` of them as saved (a single larger one alone): DCP's reader assembles each
whole from its chunks (on S3, ranged reads of just those bytes), each becomes its stock tensor
(trainer/hf.py: the names, GPT-2's fused and transposed matrices), cast to `dtype`, the group is
written as one safetensors file and dropped before the next is read. Host memory holds one group,
however large the model: a 405B model is 810 GB in bf16.

What it writes, the files of the model's stock class (LlamaForCausalLM for the llama family,
GPT2LMHeadModel for gpt), every file mode 0644:

    model-00001-of-00003.safetensors ...   Hugging Face's parameter names (model.layers.3.mlp.up_proj.weight)
    model.safetensors.index.json           {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    config.json                            the class's config (AutoConfig reads it); under "trainfleet",
                                           the step, where it came from and the layout it was saved at
    generation_config.json                 the tokenizer's begin and end tokens, the context
    tokenizer.json, tokenizer_config.json  the run's tokenizer (trainer/tokenizer.py), which
                                           AutoTokenizer loads as a PreTrainedTokenizerFast
    optimizer-00001-of-0000N.safetensors   with optimizer=True: AdamW's exp_avg and exp_avg_sq of
    optimizer.safetensors.index.json       each parameter ("<trainer name>.exp_avg"), as saved (fp32)

This is the one documented way to read a checkpoint outside the trainer: DCP's own tools
(dcp_to_torch_save) read a step folder only in DCP's default layout, and the trainer spreads a
step's shards over 16 prefixes (trainer/checkpoint_catalog.py). Every family the trainer builds
has a stock class, so every committed step exports.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainer import checkpoint_catalog as catalog
from trainer import hf, tokenizer
from trainer.checkpoint import storage_reader
from trainer.config import ModelConfig
from trainer.model import Decoder, build

__all__ = ["export", "load_exported", "exported_tokenizer", "ExportError", "Exported", "GROUP_BYTES", "DTYPES",
           "FILE_MODE"]

GROUP_BYTES = 2 * 2**30
"""Most bytes of saved parameters read (and held) at once: an output file's worth."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FILE_MODE = 0o644
"""Every file an export writes: readable by whoever serves the model, whatever the umask."""
_MODEL, _OPTIMIZER_STATE = "model.", "optimizer.state."

_MOMENTS = ("exp_avg", "exp_avg_sq")


class ExportError(RuntimeError):
    """The export cannot be made; nothing was left half written."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote."""

    folder: Path
    step: int
    parameters: int
    """Number of model parameters (elements)."""
    files: tuple[str, ...]
    """The files written, by name, in the folder."""
    architecture: str
    """The stock class it is (LlamaForCausalLM, GPT2LMHeadModel)."""


def export(location: str, to: Path, *, step: int | None = None, dtype: torch.dtype = torch.bfloat16,
           optimizer: bool = False, group_bytes: int = GROUP_BYTES, tokenizer_spec: str | None = None) -> Exported:
    """Export committed step `step` (None: the newest committed and whole, as resume=latest takes
    it) of the checkpoints at `location` into the new folder `to`, with the tokenizer
    `tokenizer_spec` (None: the one the step's marker names). ExportError names what stops it."""
    manifest = _manifest(location, step)
    if not manifest.model:
        raise ExportError(f"{location} step {manifest.step}: its commit marker does not name the model's "
                          "architecture (saved before markers recorded it)")
    if to.exists() and not to.is_dir():
        raise ExportError(f"{to} is a file, not a folder: export into a new folder")
    if to.exists() and any(to.iterdir()):
        raise ExportError(f"{to} is not empty: export into a new folder")
    model = ModelConfig(**manifest.model)
    tok = _tokenizer(tokenizer_spec or manifest.tokenizer or tokenizer.BYTES, model)
    reader = _reader(location, manifest.step)
    entries = reader.read_metadata().state_dict_metadata
    saved = {key.removeprefix(_MODEL): meta for key, meta in entries.items()
             if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)}
    links = hf.links(model)
    missing = sorted({name for link in links for name in link.trainer} - set(saved))
    if missing:
        raise ExportError(f"{location} step {manifest.step} holds no parameter {missing[0]} of its model "
                          f"({len(missing)} missing)")
    moments = [f"{name}.{moment}" for name in saved for moment in _MOMENTS] if optimizer else []
    absent = sorted(key for key in moments if _OPTIMIZER_STATE + key not in entries)
    if absent:
        raise ExportError(f"{location} step {manifest.step} holds no optimizer state {absent[0]} "
                          f"({len(absent)} missing)")
    partial = to.with_name(to.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    size = {name: meta.size.numel() * meta.properties.dtype.itemsize for name, meta in saved.items()}
    by_name = {link.hf: link for link in links}
    written = _write_set(reader, "model", [(link.hf, link.trainer) for link in links], saved, size, partial,
                         lambda name, tensors: hf.to_hf(by_name[name], tensors), dtype, group_bytes)
    if moments:
        moment_meta = {key: entries[_OPTIMIZER_STATE + key] for key in moments}
        written += _write_set(reader, "optimizer", [(key, (key,)) for key in moments], moment_meta,
                              {key: size[key.rpartition(".")[0]] for key in moments}, partial,
                              lambda name, tensors: tensors[0], None, group_bytes, _OPTIMIZER_STATE)
    dtype_name = str(dtype).removeprefix("torch.")
    origin = {"step": manifest.step, "source": f"{location.rstrip('/')}/{catalog.step_dir_name(manifest.step)}",
              "saved_layout": manifest.layout}
    _write_json(partial / "config.json", hf.config_json(model, dtype_name, tok.bos_id, tok.eos_id, origin))
    _write_json(partial / "generation_config.json",
                {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "max_length": model.seq_len})
    written += _write_tokenizer(tok, model, partial)
    for file in partial.iterdir():
        file.chmod(FILE_MODE)
    if to.exists():
        to.rmdir()  # empty: checked above
    os.replace(partial, to)
    parameters = sum(saved[name].size.numel() for link in links for name in link.trainer)
    return Exported(to, manifest.step, parameters, (*written, "config.json", "generation_config.json"),
                    hf.STOCK_CLASSES[model.architecture])


def _manifest(location: str, step: int | None) -> catalog.Manifest:
    try:
        if step is None:
            found = catalog.latest_committed(location)
            if found is None:
                raise ExportError(f"{location}: no committed checkpoint")
            return found
        return catalog.verified_manifest(catalog.open_store(location), step)
    except catalog.CheckpointInvalid as error:
        raise ExportError(str(error)) from error


def _tokenizer(spec: str, model: ModelConfig):
    try:
        tok = tokenizer.load(spec)
    except tokenizer.TokenizerError as error:
        raise ExportError(f"the run's tokenizer: {error}") from error
    if tok.vocab_size > model.vocab_size:
        raise ExportError(f"tokenizer {spec} has {tok.vocab_size} tokens, more than the model's "
                          f"{model.vocab_size} embedding rows")
    return tok


def _reader(location: str, step: int) -> dcp.StorageReader:
    """The step's DCP reader, its metadata read once: dcp.load reads it again at every call, a
    GET of a file of every chunk's offsets on S3 for each group."""
    reader = storage_reader(location, catalog.step_dir_name(step))
    metadata: Metadata = reader.read_metadata()
    reader.read_metadata = lambda *args, **kwargs: metadata
    return reader


def _write_set(reader: dcp.StorageReader, prefix: str, outputs: list[tuple[str, tuple[str, ...]]],
               metas: dict[str, TensorStorageMetadata], sizes: dict[str, int], folder: Path, make,
               dtype: torch.dtype | None, group_bytes: int, key_prefix: str = _MODEL) -> list[str]:
    """Output tensors (name, the saved tensors it is made of, by `make(name, tensors)`), in groups
    of at most `group_bytes` as saved, each group one file `<prefix>-0000i-of-0000n.safetensors`,
    then the set's index."""
    groups: list[list[tuple[str, tuple[str, ...]]]] = [[]]
    held = 0
    for output in outputs:
        size = sum(sizes[name] for name in output[1])
        if groups[-1] and held + size > group_bytes:
            groups.append([])
            held = 0
        groups[-1].append(output)
        held += size
    files, weight_map, total = [], {}, 0
    for number, group in enumerate(groups, start=1):
        saved = {name: torch.empty(tuple(metas[name].size), dtype=metas[name].properties.dtype)
                 for _, names in group for name in names}
        with warnings.catch_warnings():
            # dcp.load warns that it loads in one process even when told to (no_dist): it is meant.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({key_prefix + name: tensor for name, tensor in saved.items()}, storage_reader=reader, no_dist=True)
        tensors = {}
        for output, names in group:
            tensor = make(output, [saved.pop(name) for name in names])
            tensors[output] = tensor.to(dtype) if dtype is not None else tensor
        file = f"{prefix}-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, folder / file, metadata={"format": "pt"})
        files.append(file)
        weight_map |= {name: file for name in tensors}
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        del tensors
    index = f"{prefix}.safetensors.index.json"
    _write_json(folder / index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*files, index]


def _write_tokenizer(tok, model: ModelConfig, folder: Path) -> list[str]:
    """tokenizer.json and the tokenizer_config.json that has AutoTokenizer load it as a
    PreTrainedTokenizerFast with its begin and end tokens."""
    text = tok.tokenizer_json()
    (folder / "tokenizer.json").write_text(text)
    names = {token["id"]: token["content"] for token in json.loads(text).get("added_tokens", [])}
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.seq_len,
        "bos_token": names.get(tok.bos_id), "eos_token": names.get(tok.eos_id),
        "clean_up_tokenization_spaces": False})
    return ["tokenizer.json", "tokenizer_config.json"]


def _write_json(path: Path, document: dict) -> None:
    path.write_text(json.dumps(document, indent=1) + "\n")


def exported_tokenizer(folder: Path) -> tokenizer.Tokenizer:
    """The tokenizer of a stock model folder (its tokenizer.json)."""
    try:
        return tokenizer.load(str(folder / "tokenizer.json"))
    except tokenizer.TokenizerError as error:
        raise ExportError(f"{folder}: {error}") from error


def load_exported(folder: str | Path, dtype: torch.dtype = torch.float32) -> Decoder:
    """The trainer's model of a stock model folder (an export, or one transformers saved), on the
    CPU in `dtype`: its safetensors read a tensor at a time."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
        model_config = hf.model_config(config)
    except (OSError, ValueError, KeyError) as error:  # HfError is a ValueError
        classes = " or ".join(hf.STOCK_CLASSES.values())
        raise ExportError(f"{folder}: not a model folder of {classes}: {error}") from error
    model = build(model_config)
    index = folder / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    stock: dict[str, str] = {}
    for file in files:
        with safe_open(folder / file, "pt") as opened:
            stock |= {name: file for name in opened.keys()}
    state = {}
    for link in hf.links(model_config):
        if link.hf not in stock:
            raise ExportError(f"{folder}: holds no {link.hf}")
        with safe_open(folder / stock[link.hf], "pt") as opened:
            state |= dict(zip(link.trainer, hf.from_hf(link, opened.get_tensor(link.hf))))
    model.load_state_dict(state)
    return model.to(dtype).eval()
