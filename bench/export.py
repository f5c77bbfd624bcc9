"""Host memory of a streamed export (trainer/export.py) against the size of the model it exports.

    .venv/bin/python bench/export.py                          # a 103M-parameter model (412 MB fp32)
    .venv/bin/python bench/export.py --layers 16 --group-mib 32

A model of the trainer's GPT is saved as a committed checkpoint in a temporary folder (one
process, the trainer's Checkpointer), then exported three ways, each in a fresh process whose
peak resident memory (VmHWM) is read as it exits: a process that only reads the checkpoint's
metadata (the baseline: Python, torch, the reader), a streamed export in groups of --group-mib,
and an export whose one group holds the whole model (what an export that is not streamed holds).
The last lines are `model_bytes=`, `largest_file_bytes=`, `peak_over_baseline_streamed=` and
`peak_over_baseline_whole=` (bytes).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
from trainer.export import export
from trainer.checkpoint import storage_reader
from trainer import checkpoint_catalog as catalog
mode, location, to, group = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "metadata":
    storage_reader(location, catalog.step_dir_name(catalog.latest_committed(location).step)).read_metadata()
else:
    export(location, Path(to), dtype=torch.bfloat16, group_bytes=group)
# VmHWM, not ru_maxrss: the latter keeps the peak of the forked parent across exec.
peak = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
print(json.dumps({{"peak_kib": int(peak.split()[1])}}))
"""


def save_model(folder: Path, layers: int, width: int) -> int:
    """A committed checkpoint of an untrained GPT at `folder`; its model's bytes (fp32)."""
    import torch

    from trainer.checkpoint import Checkpointer
    from trainer.config import load_config
    from trainer.train import build, environment

    args = [f"--model.n_layers={layers}", f"--model.d_model={width}", "--model.n_heads=16", "--model.seq_len=64",
            "--training.batch_size=4", "--training.steps=1", "--optim.warmup_steps=0", f"--data.shards={folder / 'shards'}",
            "--data.corpus=stdlib", "--data.corpus_bytes=20000", f"--checkpoint.uri={folder / 'checkpoints'}", "--checkpoint.async_save=false"]
    cfg = load_config(args)
    run = build(cfg, environment(cfg, torch.device("cpu")))
    checkpointer = Checkpointer(cfg.checkpoint, model={"n_layers": layers, "d_model": width, "n_heads": 16,
                                                       "seq_len": 64})
    checkpointer.maybe_save(1, run.state, final=True)
    checkpointer.close()
    return sum(p.numel() * 4 for part in run.pipeline.model_parts for p in part.parameters())


def peak_kib(mode: str, location: Path, to: Path, group_bytes: int) -> int:
    done = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode, str(location), str(to),
                           str(group_bytes)], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_kib"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--group-mib", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-export-") as folder:
        folder = Path(folder)
        model_bytes = save_model(folder, args.layers, args.width)
        location = folder / "checkpoints"
        baseline = peak_kib("metadata", location, folder / "none", 0)
        streamed = peak_kib("export", location, folder / "streamed", args.group_mib * 2**20)
        whole = peak_kib("export", location, folder / "whole", 2 * model_bytes)
        largest = max(path.stat().st_size for path in (folder / "streamed").glob("model-*.safetensors"))
        files = len(list((folder / "streamed").glob("model-*.safetensors")))
    kib = 1024
    print(f"model: {model_bytes / 2**20:,.0f} MiB fp32; streamed export in groups of {args.group_mib} MiB: "
          f"{files} files, the largest {largest / 2**20:,.0f} MiB (bf16)")
    print(f"peak resident memory: baseline (metadata only) {baseline / kib:,.0f} MiB, streamed "
          f"{streamed / kib:,.0f} MiB, one group {whole / kib:,.0f} MiB")
    print(f"model_bytes={model_bytes}")
    print(f"largest_file_bytes={largest}")
    print(f"peak_over_baseline_streamed={(streamed - baseline) * kib}")
    print(f"peak_over_baseline_whole={(whole - baseline) * kib}")


if __name__ == "__main__":
    main()
