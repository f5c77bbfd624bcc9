"""A Hugging Face checkpoint in, as a committed trainfleet step 0 that a run resumes from, streamed.

    imported = import_checkpoint("s3://bucket/models/Llama-3.1-8B", "s3://bucket/models/llama3-8b", run_model)
    # a run whose checkpoint.uri is that location resumes from it, or names it in training.init_from

The source is a folder or s3:// prefix holding config.json and the safetensors shards (with their
index, or a single model.safetensors) of LlamaForCausalLM (the llama family) or GPT2LMHeadModel
(gpt). Before anything is written: config.json must describe the run's model section
(`trainer/hf.py` names the first field that differs), every tensor the model needs must be there
in its shape, and the destination must hold no checkpoint.

The step holds the weights alone, in fp32 under the trainer's parameter names, as DCP files in the
trainer's layout (trainer/checkpoint.py) with a commit marker whose reason is `imported`: a run
resumed from it takes the weights and starts its optimizer, learning-rate schedule and data
position afresh, at step 0. The source's tokenizer.json, if any, is copied beside the steps
(`tokenizer/tokenizer.json`) and named in the marker.

Streaming: the step is written as if by many ranks, each a group of at most `group_bytes` of
parameters, one after another, with DCP's own planner and storage writer (dcp.save's protocol,
its collectives replaced by a loop): DCP's file writer keeps a file's tensors until it is closed,
so one save of the whole model would hold all of it. Each group is planned from meta tensors
(shapes, no data), and each tensor is read from its source when DCP writes it: a ranged read of its
bytes (S3 GetObject with a Range, or a file read), made into the trainer's tensor. Host memory holds
one group, never the model (a 405B model is 810 GB in bf16, 1.6 TB as written in fp32); the
metadata the groups share is written last, as the coordinator's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from trainer import checkpoint_catalog as catalog
from trainer import hf
from trainer.checkpoint import manifest_files, storage_writer
from trainer.config import ModelConfig
from trainer.model import build

__all__ = ["import_checkpoint", "Imported", "ImportRefused", "SafetensorsSource", "GROUP_BYTES", "TOKENIZER_FOLDER"]

GROUP_BYTES = 2 * 2**30
"""Most bytes of the step (fp32) written as one pretended rank's shard: what host memory holds at
once, since DCP's file writer keeps every tensor of a file until the file is closed."""
TOKENIZER_FOLDER = "tokenizer"
"""Where, under the destination, the source's tokenizer.json is kept."""
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_READ_BYTES = 64 * 2**20
"""Bytes read from the source per request or file read: a tensor arrives in parts into its own buffer."""


class ImportRefused(ValueError):
    """The checkpoint cannot become the run's; nothing was written. The message names why."""


@dataclass(frozen=True)
class Imported:
    """What an import wrote."""

    location: str
    step: int
    parameters: int
    """Number of model parameters (elements)."""
    bytes_read: int
    """Bytes read from the source's safetensors."""
    bytes_written: int
    """Bytes of the step's files."""
    tokenizer: str
    """Where the source's tokenizer.json was copied ("" when it had none)."""
    ignored: tuple[str, ...]
    """Source tensors the model does not use (GPT-2's stored attention masks, a tied head's copy)."""


@dataclass(frozen=True)
class _Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Offset of its bytes in the file."""
    end: int


class SafetensorsSource:
    """The files of a model folder or s3:// prefix; its safetensors read a tensor at a time."""

    def __init__(self, source: str):
        self.source = source.rstrip("/")
        self._s3 = None
        if self.source.startswith("s3://"):
            import boto3  # here: a local folder needs no AWS client

            self._s3 = boto3.client("s3")
            self._bucket, _, prefix = self.source.removeprefix("s3://").partition("/")
            self._prefix = f"{prefix}/" if prefix else ""
        self.bytes_read = 0

    def read_text(self, name: str) -> str | None:
        """A small file's text (config.json, an index, tokenizer.json), or None when absent."""
        data = self._read(name, 0, None)
        return data.decode() if data is not None else None

    def entries(self) -> dict[str, _Entry]:
        """Every tensor of the safetensors set, from the files' headers."""
        index = self.read_text("model.safetensors.index.json")
        files = sorted(set(json.loads(index)["weight_map"].values())) if index else ["model.safetensors"]
        found: dict[str, _Entry] = {}
        for file in files:
            prefix = self._read(file, 0, 8)
            if prefix is None:
                raise ImportRefused(f"{self.source}: holds no {file}"
                                    + ("" if index else " (and no model.safetensors.index.json)"))
            length = int.from_bytes(prefix, "little")
            header = json.loads(self._read(file, 8, 8 + length))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                if entry["dtype"] not in _DTYPES:
                    raise ImportRefused(f"{self.source}/{file}: {name} is {entry['dtype']}, "
                                        f"not a float the model holds")
                begin, end = entry["data_offsets"]
                found[name] = _Entry(file, _DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + begin,
                                     8 + length + end)
        return found

    def tensor(self, entry: _Entry) -> torch.Tensor:
        """The tensor's bytes, read in parts straight into its buffer."""
        buffer = torch.empty(entry.end - entry.begin, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        for at in range(0, len(view), _READ_BYTES):
            part = self._read(entry.file, entry.begin + at, entry.begin + min(at + _READ_BYTES, len(view)))
            view[at:at + len(part)] = part
        self.bytes_read += len(view)
        return buffer.view(entry.dtype).view(entry.shape)

    def _read(self, name: str, begin: int, end: int | None) -> bytes | None:
        """Bytes [begin, end) of a file (end None: to its end), or None when it does not exist."""
        if self._s3 is None:
            try:
                with open(f"{self.source}/{name}", "rb") as file:
                    file.seek(begin)
                    return file.read() if end is None else file.read(end - begin)
            except FileNotFoundError:
                return None
        ranged = {} if end is None and begin == 0 else {"Range": f"bytes={begin}-{'' if end is None else end - 1}"}
        try:
            return self._s3.get_object(Bucket=self._bucket, Key=self._prefix + name, **ranged)["Body"].read()
        except self._s3.exceptions.NoSuchKey:
            return None


class _StreamedSavePlanner(DefaultSavePlanner):
    """DCP's planner over a state dict of meta tensors: it plans from their shapes, and each
    tensor is made by `make(key)` only when the writer asks for its data."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self._make(write_item.index.fqn)


def import_checkpoint(source: str, to: str, model: ModelConfig, *, group_bytes: int = GROUP_BYTES) -> Imported:
    """Import the Hugging Face checkpoint at `source` into the checkpoint location `to` as step 0
    of a run whose model section is `model`, at most `group_bytes` held at once. ImportRefused says
    why not, before anything is written."""
    origin = SafetensorsSource(source)
    config_text = origin.read_text("config.json")
    if config_text is None:
        raise ImportRefused(f"{source}: holds no config.json")
    try:
        problem = hf.mismatch(model, hf.model_section(json.loads(config_text)))
    except hf.HfError as error:
        raise ImportRefused(f"{source}/{error}") from error
    if problem:
        raise ImportRefused(f"{source}/config.json does not describe the run's model: {problem}")
    links = hf.links(model)
    entries = origin.entries()
    with torch.device("meta"):
        params = dict(build(model).named_parameters())
    for link in links:
        wanted = tuple(hf.to_hf(link, [params[name] for name in link.trainer]).shape)
        if link.hf not in entries:
            raise ImportRefused(f"{source}: holds no {link.hf}, which the model needs")
        if entries[link.hf].shape != wanted:
            raise ImportRefused(f"{source}: {link.hf} is {list(entries[link.hf].shape)}, the model's is {list(wanted)}")
    store = catalog.open_store(to)
    if catalog.saved_steps(store) or store.read(TOKENIZER_FOLDER, "tokenizer.json") is not None:
        raise ImportRefused(f"{to} holds checkpoints already: import into a location of its own")

    by_name = {name: (link, position) for link in links for position, name in enumerate(link.trainer)}
    recent: dict[str, torch.Tensor] = {}  # the source tensor read last: GPT-2's c_attn makes q, k and v

    def make(key: str) -> torch.Tensor:
        link, position = by_name[key.removeprefix("model.")]
        if link.hf not in recent:
            recent.clear()
            recent[link.hf] = origin.tensor(entries[link.hf])
        return hf.from_hf(link, recent[link.hf])[position].float()

    total = 4 * sum(param.numel() for param in params.values())
    step_dir = catalog.step_dir_name(0)
    tokenizer_text = origin.read_text("tokenizer.json")
    tokenizer = f"{store.step_uri(TOKENIZER_FOLDER)}/tokenizer.json" if tokenizer_text is not None else ""
    try:
        if tokenizer_text is not None:
            store.create(TOKENIZER_FOLDER, "tokenizer.json", tokenizer_text.encode())
        metadata = _save_in_groups(params, make, storage_writer(to, step_dir), group_bytes)
        stored = manifest_files(metadata, step_dir, catalog.step_files(store, 0), f"{to}/{step_dir}")
        manifest = catalog.Manifest(step=0, layout={"pp": 1, "dp": 1, "dp_shard": 1, "tp": 1}, files=stored,
                                    reason=catalog.SaveReason.IMPORTED, model=asdict(model), tokenizer=tokenizer)
        store.create(step_dir, catalog.MARKER_NAME, manifest.to_json())
    except BaseException:
        # A half-written import would read as a location with checkpoints, refusing the next try.
        catalog.delete_step(store, 0)
        store.delete_folder(TOKENIZER_FOLDER)
        raise
    used = {link.hf for link in links}
    return Imported(to, 0, total // 4, origin.bytes_read, sum(file.size for file in stored), tokenizer,
                    tuple(sorted(set(entries) - used)))



def _save_in_groups(params: dict[str, torch.Tensor], make, writer, group_bytes: int):
    """DCP's save of {"model": params} (their fp32 values made by `make`), a group of at most
    `group_bytes` after another, each as one rank's shard; DCP's metadata of the whole."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    held = 0
    for name, param in params.items():
        size = 4 * param.numel()
        if groups[-1] and held + size > group_bytes:
            groups.append({})
            held = 0
        groups[-1][name] = torch.empty(param.shape, dtype=torch.float32, device="meta")
        held += size
    planners = [_StreamedSavePlanner(make) for _ in groups]
    for rank, (planner, group) in enumerate(zip(planners, groups)):
        planner.set_up_planner({"model": group}, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(True)
    plans = [writer.prepare_local_plan(planner.create_local_plan()) for planner in planners]
    plans, metadata = planners[0].create_global_plan(plans)
    plans = writer.prepare_global_plan(plans)
    results = []
    for planner, plan in zip(planners, plans):
        written = writer.write_data(planner.finish_plan(plan), planner)
        written.wait()
        results.append(written.value())
    writer.finish(metadata, results)
    return metadata
