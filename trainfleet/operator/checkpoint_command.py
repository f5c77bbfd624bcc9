"""`trainfleet checkpoint` and `trainfleet sample`: what a run trained, out of its checkpoints,
and a Hugging Face model in.

    trainfleet checkpoint list RUN            every step saved: committed or not, size, layout,
                                              which one resume=latest takes
    trainfleet checkpoint export RUN --to DIR [--step N] [--dtype bfloat16] [--optimizer]
                                              the model as Hugging Face's stock class
                                              (LlamaForCausalLM, GPT2LMHeadModel) with its
                                              tokenizer (trainer/export.py), streamed
    trainfleet checkpoint import SOURCE --to LOCATION --config FILE
                                              a Hugging Face checkpoint (folder or s3:// prefix)
                                              as committed step 0 of a run whose trainer config
                                              or RunSpec FILE is (trainer/hf_import.py), streamed
    trainfleet sample --from DIR|RUN --prompt TEXT [--greedy]
                                              text the model writes after the prompt

RUN is a run of the deployed stack (--stack, or TRAINFLEET_STACK; its record names where its
checkpoints are), or a checkpoint location itself: s3://bucket/prefix or a local folder. AWS or
the local cloud as `trainfleet run` reaches them (AWS_ENDPOINT_URL). A command that cannot be done
says why in one line and exits 1, having written nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

__all__ = ["add_checkpoint_commands", "checkpoint_location"]


def checkpoint_location(run_or_location: str, stack_name: str) -> str:
    """The checkpoint location a RUN argument names: itself when it is one (s3://, or a path: a
    run's name has no slash), else the location the stack's record of that run names."""
    from trainfleet.operator.runs import OperatorError, Stack

    if run_or_location.startswith("s3://") or Path(run_or_location).is_dir():
        return run_or_location
    if "/" in run_or_location:
        raise OperatorError(f"{run_or_location}: no such folder")
    record = Stack.find(stack_name).status(run_or_location).record
    if record is None:
        raise OperatorError(f"run {run_or_location} has no record in stack {stack_name}")
    return record.spec.checkpoint.s3_uri


def _list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from trainer import checkpoint_catalog as catalog

    location = checkpoint_location(args.run, args.stack)
    store = catalog.open_store(location)
    latest = catalog.latest_committed(store)
    table = Table("step", "state", "size", "layout", "saved for", "committed (UTC)", box=None)
    for step in catalog.saved_steps(store):
        try:
            manifest = catalog.verified_manifest(store, step)
        except catalog.CheckpointInvalid as problem:
            size = sum(file.size for file in catalog.step_files(store, step).values())
            state = "not committed" if "no commit marker" in str(problem) else f"broken: {problem}"
            table.add_row(str(step), state, _size(size), "", "", "")
            continue
        table.add_row(str(step), "committed", _size(sum(file.size for file in manifest.files)),
                      _layout(manifest.layout), str(manifest.reason), manifest.committed_at[:16].replace("T", " "))
    console = Console()
    console.print(f"checkpoints at {location}")
    console.print(table if table.row_count else "none saved yet")
    console.print(f"resume=latest takes step {latest.step}" if latest is not None else
                  "resume=latest finds no committed step: a run would start from scratch")
    return 0


def _layout(layout: dict[str, int]) -> str:
    """pp=2 dp=4 tp=8; dp_shard only where it is not all of dp (FSDP over every data-parallel rank)."""
    order = ("pp", "dp", "dp_shard", "tp")
    axes = sorted(layout, key=lambda axis: order.index(axis) if axis in order else len(order))
    return " ".join(f"{axis}={layout[axis]}" for axis in axes if axis != "dp_shard" or layout[axis] != layout.get("dp"))


def _export(args: argparse.Namespace) -> int:
    from trainer.export import DTYPES, export

    location = checkpoint_location(args.run, args.stack)
    written = export(location, args.to, step=args.step, dtype=DTYPES[args.dtype], optimizer=args.optimizer)
    print(f"exported step {written.step} of {location} ({written.parameters:,} parameters, {args.dtype}) to "
          f"{written.folder} as {written.architecture}: {', '.join(written.files)}")
    return 0


def _import(args: argparse.Namespace) -> int:
    from trainer.hf_import import import_checkpoint

    imported = import_checkpoint(args.source, args.to, run_model(args.config))
    print(f"imported {args.source} ({imported.parameters:,} parameters) into {imported.location} as committed step "
          f"{imported.step}: a run resumes from it there, or names it in training.init_from")
    if imported.tokenizer:
        print(f"its tokenizer: {imported.tokenizer} (the run's data.tokenizer)")
    if imported.ignored:
        print(f"left out, the model has no use for them: {', '.join(imported.ignored)}")
    return 0


def run_model(path: Path):
    """The model section of a trainer config file (.toml, .yaml) or a RunSpec (.json, its trainer
    section), checked as the trainer checks it."""
    import json

    from trainer.config import config_from_sections, load_config

    if path.suffix != ".json":
        return load_config(["--config", str(path)]).model
    try:
        model = json.loads(path.read_text())["trainer"]["model"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a RunSpec with a trainer.model section ({error})") from None
    return config_from_sections({"model": model}, source=f"{path} trainer").model


def _sample(args: argparse.Namespace) -> int:
    import torch

    from trainer.export import export, exported_tokenizer, load_exported
    from trainer.sample import generate

    source = Path(args.source)
    if (source / "config.json").is_file():
        model, tokenizer = load_exported(source), exported_tokenizer(source)
    else:
        with tempfile.TemporaryDirectory(prefix="trainfleet-sample-") as folder:
            exported = Path(folder) / "model"
            export(checkpoint_location(args.source, args.stack), exported, dtype=torch.float32)
            model, tokenizer = load_exported(exported), exported_tokenizer(exported)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    text = generate(model.to(device), tokenizer, args.prompt, new_tokens=args.tokens, temperature=args.temperature,
                    top_k=args.top_k, seed=args.seed, greedy=args.greedy)
    print(args.prompt + text)
    return 0


def _guarded(func, what: str):
    def run(args: argparse.Namespace) -> int:
        from trainer.checkpoint import CheckpointError
        from trainer.checkpoint_catalog import CheckpointInvalid
        from trainer.export import ExportError
        from trainfleet.operator.runs import OperatorError, failure_line

        try:
            return func(args)
        except (OperatorError, ExportError, CheckpointInvalid, CheckpointError, ValueError, ClientError,
                BotoCoreError) as error:
            print(f"trainfleet {what}: {failure_line(error)}", file=sys.stderr)
            return 1
    return run


def _size(size: int) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while size >= 1024 ** (power + 1) and power < len(units) - 1:
        power += 1
    return f"{size / 1024 ** power:,.{0 if power == 0 else 1}f} {units[power]}"


def add_checkpoint_commands(commands: argparse._SubParsersAction) -> None:
    from trainfleet.operator.stack_option import stack_option

    stack = stack_option("the deployed stack whose run RUN is")
    checkpoint = commands.add_parser("checkpoint", help="a run's checkpoints: list them, export the model, "
                                                        "import one",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    listing = sub.add_parser("list", parents=[stack], help="every step saved, and which one resume=latest takes")
    listing.add_argument("run", help="a run of the stack, or a checkpoint location (s3://... or a folder)")
    listing.set_defaults(func=_guarded(_list, "checkpoint list"))
    exporting = sub.add_parser("export", parents=[stack], help="the model as safetensors, for one process")
    exporting.add_argument("run", help="a run of the stack, or a checkpoint location (s3://... or a folder)")
    exporting.add_argument("--to", type=Path, required=True, help="a new folder for the export")
    exporting.add_argument("--step", type=int, help="a committed step (default: the one resume=latest takes)")
    exporting.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default="bfloat16",
                           help="the weights' dtype (default: bfloat16)")
    exporting.add_argument("--optimizer", action="store_true", help="also AdamW's moments, as saved (float32)")
    exporting.set_defaults(func=_guarded(_export, "checkpoint export"))
    importing = sub.add_parser("import", help="a Hugging Face checkpoint as a run's committed step 0")
    importing.add_argument("source", help="a folder or s3:// prefix of config.json and safetensors "
                                          "(LlamaForCausalLM, GPT2LMHeadModel)")
    importing.add_argument("--to", required=True, help="a checkpoint location holding no checkpoint yet "
                                                       "(s3://... or a folder)")
    importing.add_argument("--config", type=Path, required=True,
                           help="the run's trainer config (.toml, .yaml) or RunSpec (.json): its model section "
                                "must be the checkpoint's")
    importing.set_defaults(func=_guarded(_import, "checkpoint import"))
    sample = commands.add_parser("sample", parents=[stack], help="text a trained model writes after a prompt")
    sample.add_argument("--from", dest="source", required=True,
                        help="an exported folder, a run of the stack, or a checkpoint location")
    sample.add_argument("--prompt", required=True, help="the text to continue")
    sample.add_argument("--tokens", type=int, default=200, help="most tokens to write (default: 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest (default: 0.8)")
    sample.add_argument("--greedy", action="store_true", help="always the likeliest token (as transformers' greedy "
                                                              "search): --temperature 0")
    sample.add_argument("--top-k", type=int, default=40, help="draw among the k likeliest (default: 40)")
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--device", help="cpu, cuda (default: cuda where there is one)")
    sample.set_defaults(func=_guarded(_sample, "sample"))
