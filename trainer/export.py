"""The trained model out of a committed checkpoint: safetensors files one process can load, streamed.

    written = export("s3://bucket/runs/my-run", Path("my-model"), dtype=torch.bfloat16)
    model = load_exported(Path("my-model"))          # the trainer's GPT, on the CPU

A committed step (trainer/checkpoint.py) holds each parameter as the chunks the saving ranks
held, at whatever pp x dp x tp they trained. The export reads the parameters a group at a time,
at most `group_bytes` of them as saved (a single larger one alone): DCP's reader assembles each
whole from its chunks (on S3, ranged reads of just those bytes), each is cast to `dtype`, the
group is written as one safetensors file and dropped before the next is read. Host memory holds
one group, however large the model: a 178B model is about 360 GB in bf16.

What it writes, in the layout Hugging Face's loaders read (the index, the shard names):

    model-00001-of-00003.safetensors ...   parameters by the trainer's names (layers.3.mlp.fc.weight)
    model.safetensors.index.json           {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    config.json                            the architecture: the trainer's model section, the dtype,
                                           the step and where it came from
    optimizer-00001-of-0000N.safetensors   with optimizer=True: AdamW's exp_avg and exp_avg_sq of
    optimizer.safetensors.index.json       each parameter ("<name>.exp_avg"), as saved (fp32)

This is the one documented way to read a checkpoint outside the trainer: DCP's own tools
(dcp_to_torch_save) read a step folder only in DCP's default layout, and the trainer spreads a
step's shards over 16 prefixes (trainer/checkpoint_catalog.py).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from trainer import checkpoint_catalog as catalog
from trainer.checkpoint import storage_reader
from trainer.config import ModelConfig
from trainer.model import GPT

__all__ = ["export", "load_exported", "model_config_of", "ExportError", "Exported", "ARCHITECTURE",
           "GROUP_BYTES", "DTYPES"]

ARCHITECTURE = "TrainfleetGPT"
"""config.json's name for trainer/model.py's GPT."""
GROUP_BYTES = 2 * 2**30
"""Most bytes of saved parameters read (and held) at once: an output file's worth."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MODEL, _OPTIMIZER_STATE = "model.", "optimizer.state."


def _new_file_mode() -> int:
    """The mode open() gives a new file: 0666 less the umask (read by setting it, so once, at import)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


_NEW_FILE_MODE = _new_file_mode()
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


def export(location: str, to: Path, *, step: int | None = None, dtype: torch.dtype = torch.bfloat16,
           optimizer: bool = False, group_bytes: int = GROUP_BYTES) -> Exported:
    """Export committed step `step` (None: the newest committed and whole, as resume=latest takes
    it) of the checkpoints at `location` into the new folder `to`. ExportError names what stops it."""
    manifest = _manifest(location, step)
    if not manifest.model:
        raise ExportError(f"{location} step {manifest.step}: its commit marker does not name the model's "
                          "architecture (saved before markers recorded it)")
    if to.exists() and not to.is_dir():
        raise ExportError(f"{to} is a file, not a folder: export into a new folder")
    if to.exists() and any(to.iterdir()):
        raise ExportError(f"{to} is not empty: export into a new folder")
    reader = _reader(location, manifest.step)
    entries = reader.read_metadata().state_dict_metadata
    model = {key.removeprefix(_MODEL): meta for key, meta in entries.items()
             if key.startswith(_MODEL) and isinstance(meta, TensorStorageMetadata)}
    moments = {f"{name}.{moment}": f"{_OPTIMIZER_STATE}{name}.{moment}"
               for name in model for moment in _MOMENTS} if optimizer else {}
    missing = sorted(key for key in moments.values() if key not in entries)
    if missing:
        raise ExportError(f"{location} step {manifest.step} holds no optimizer state {missing[0]} "
                          f"({len(missing)} missing)")
    partial = to.with_name(to.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    written = _write_set(reader, "model", {name: _MODEL + name for name in model}, model, partial, dtype,
                         group_bytes)
    if moments:
        written += _write_set(reader, "optimizer", moments, {name: entries[key] for name, key in moments.items()},
                              partial, None, group_bytes)
    config = {"architectures": [ARCHITECTURE], "model_type": "trainfleet-gpt", **manifest.model,
              "torch_dtype": str(dtype).removeprefix("torch."), "step": manifest.step,
              "source": f"{location.rstrip('/')}/{catalog.step_dir_name(manifest.step)}",
              "saved_layout": manifest.layout}
    (partial / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    if to.exists():
        to.rmdir()  # empty: checked above
    os.replace(partial, to)
    parameters = sum(meta.size.numel() for meta in model.values())
    return Exported(to, manifest.step, parameters, (*written, "config.json"))


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


def _reader(location: str, step: int) -> dcp.StorageReader:
    """The step's DCP reader, its metadata read once: dcp.load reads it again at every call, a
    GET of a file of every chunk's offsets on S3 for each group."""
    reader = storage_reader(location, catalog.step_dir_name(step))
    metadata: Metadata = reader.read_metadata()
    reader.read_metadata = lambda *args, **kwargs: metadata
    return reader


def _write_set(reader: dcp.StorageReader, prefix: str, keys: dict[str, str], metas: dict[str, TensorStorageMetadata],
               folder: Path, dtype: torch.dtype | None, group_bytes: int) -> list[str]:
    """Tensors `keys` (output name -> checkpoint key), in groups of at most `group_bytes` as saved,
    each group one file `<prefix>-0000i-of-0000n.safetensors`, then the set's index."""
    groups: list[list[str]] = [[]]
    held = 0
    for name in keys:
        size = metas[name].size.numel() * metas[name].properties.dtype.itemsize
        if groups[-1] and held + size > group_bytes:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    files, weight_map, total = [], {}, 0
    for number, group in enumerate(groups, start=1):
        tensors = {name: torch.empty(tuple(metas[name].size), dtype=metas[name].properties.dtype) for name in group}
        with warnings.catch_warnings():
            # dcp.load warns that it loads in one process even when told to (no_dist): it is meant.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({keys[name]: tensor for name, tensor in tensors.items()}, storage_reader=reader, no_dist=True)
        if dtype is not None:
            tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
        file = f"{prefix}-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, folder / file, metadata={"format": "pt"})
        # safetensors writes its file owner-only (0600); a server running as another user must
        # read it as it reads the index and config beside it: the mode open() gives them.
        os.chmod(folder / file, _NEW_FILE_MODE)
        files.append(file)
        weight_map |= {name: file for name in group}
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        del tensors
    index = f"{prefix}.safetensors.index.json"
    (folder / index).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return [*files, index]


def load_exported(folder: str | Path, dtype: torch.dtype = torch.float32) -> GPT:
    """The trainer's GPT with an export's weights, on the CPU in `dtype`: plain safetensors, one
    file at a time."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != [ARCHITECTURE]:
        raise ExportError(f"{folder}/config.json names {config.get('architectures')}, not {ARCHITECTURE}")
    model = GPT(model_config_of(config))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    expected = set(model.state_dict())
    if set(index["weight_map"]) != expected:
        raise ExportError(f"{folder}: the export's parameters are not the model's "
                          f"(missing {sorted(expected - set(index['weight_map']))[:3]}, "
                          f"extra {sorted(set(index['weight_map']) - expected)[:3]})")
    for file in sorted(set(index["weight_map"].values())):
        model.load_state_dict(load_file(folder / file), strict=False)
    return model.to(dtype).eval()


def model_config_of(config: dict[str, Any]) -> ModelConfig:
    """The trainer's ModelConfig from an export's config.json (its other keys ignored)."""
    return ModelConfig(**{key: value for key, value in config.items() if key in ModelConfig.__dataclass_fields__})
