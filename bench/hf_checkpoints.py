"""A Hugging Face checkpoint in and out (trainer/hf_import.py, trainer/export.py): peak host memory
against the model's size, and throughput.

    .venv/bin/python bench/hf_checkpoints.py                     # a 308M-parameter Llama, 1.23 GB in fp32
    .venv/bin/python bench/hf_checkpoints.py --layers 32 --group-mib 256

transformers makes a LlamaForCausalLM with random weights (grouped-query attention) and saves it
in fp32, sharded as released checkpoints are (--shard-mib). Then, each in a fresh process whose peak
resident memory (VmHWM) is read as it exits: a baseline that imports what the others import and
reads the source's tensor headers (Python, torch, the trainer's modules); the import into a
checkpoint location (the step written in fp32, as the trainer holds its weights); and the export
of that step back to a Hugging Face folder in fp32; both in groups of --group-mib. Throughput
is the bytes of the model (fp32) over each one's wall time, on this machine's disk. The last lines
are `model_bytes=`, `import_peak_over_baseline=`, `export_peak_over_baseline=` (bytes),
`import_gb_per_s=` and `export_gb_per_s=`.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import torch
from trainer.config import load_config
from trainer.export import export
from trainer.hf_import import import_checkpoint, SafetensorsSource
mode, source, location, out, group, config = sys.argv[1:7]
model = load_config(["--config", config]).model
started = time.perf_counter()
if mode == "baseline":
    SafetensorsSource(source).entries()
elif mode == "import":
    import_checkpoint(source, location, model, group_bytes=int(group))
else:
    export(location, Path(out), dtype=torch.float32, group_bytes=int(group))
seconds = time.perf_counter() - started
# VmHWM, not ru_maxrss: the latter keeps the peak of the forked parent across exec.
peak = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM:"))
print(json.dumps({{"peak_kib": int(peak.split()[1]), "seconds": seconds}}))
"""


def make_model(folder: Path, layers: int, width: int, shard_mib: int) -> tuple[int, Path]:
    """A random LlamaForCausalLM saved by transformers, and a trainer config of its model; its fp32 bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    heads, kv_heads, hidden, vocab = width // 64, width // 256, 4 * width, 32000
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with torch.device("meta"):
        parameters = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder / "hf", max_shard_size=f"{shard_mib}MB")
    del model
    trainer_config = folder / "run.toml"
    trainer_config.write_text(
        f'[model]\narchitecture = "llama"\nn_layers = {layers}\nd_model = {width}\nn_heads = {heads}\n'
        f'n_kv_heads = {kv_heads}\nffn_hidden = {hidden}\nvocab_size = {vocab}\nseq_len = 2048\n'
        f'rope_theta = 500000.0\n')
    return 4 * parameters, trainer_config


def measure(mode: str, folder: Path, config: Path, group_bytes: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode, str(folder / "hf"),
                           str(folder / "checkpoints"), str(folder / "out"), str(group_bytes), str(config)],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--shard-mib", type=int, default=300)
    parser.add_argument("--group-mib", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as folder:
        folder = Path(folder)
        model_bytes, config = make_model(folder, args.layers, args.width, args.shard_mib)
        baseline = measure("baseline", folder, config, 0)
        imported = measure("import", folder, config, args.group_mib * 2**20)
        exported = measure("export", folder, config, args.group_mib * 2**20)
        shards = len(list((folder / "hf").glob("*.safetensors")))
        files = len(list((folder / "out").glob("model-*.safetensors")))
    mib, kib = 2**20, 1024
    print(f"model: {model_bytes / mib:,.0f} MiB in fp32 ({model_bytes / 4 / 1e6:,.0f} M parameters), saved by "
          f"transformers as {shards} shards; exported in groups of {args.group_mib} MiB into {files} files")
    print(f"peak resident memory: baseline {baseline['peak_kib'] / kib:,.0f} MiB, import "
          f"{imported['peak_kib'] / kib:,.0f} MiB, export {exported['peak_kib'] / kib:,.0f} MiB")
    print(f"import {imported['seconds']:.1f} s, export {exported['seconds']:.1f} s")
    print(f"model_bytes={model_bytes}")
    print(f"import_peak_over_baseline={(imported['peak_kib'] - baseline['peak_kib']) * kib}")
    print(f"export_peak_over_baseline={(exported['peak_kib'] - baseline['peak_kib']) * kib}")
    print(f"import_gb_per_s={model_bytes / imported['seconds'] / 1e9:.3f}")
    print(f"export_gb_per_s={model_bytes / exported['seconds'] / 1e9:.3f}")


if __name__ == "__main__":
    main()
