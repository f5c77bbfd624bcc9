"""The model out of a checkpoint (trainer/export.py): a world of two tensor-parallel ranks trains and
commits; the export, read with plain safetensors into the trainer's model class in one process,
gives the loss the trainer itself gives once it resumed the same checkpoint."""

import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import free_port, spawn_ranks
from trainer.tokenizer import ByteTokenizer
from trainer.checkpoint import Checkpointer
from trainer.config import load_config
from trainer import hf
from trainer.export import ExportError, export, load_exported
from trainer.model import cross_entropy_loss
from trainer.train import build, environment

pytestmark = pytest.mark.slow

STEPS = 6


def trainer_args(folder: Path, *overrides: str) -> list[str]:
    return ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=2", "--model.seq_len=16", "--model.vocab_size=258",
            "--training.batch_size=4", "--parallel.microbatches=1", f"--training.steps={STEPS}",
            "--optim.warmup_steps=2", "--training.threads=1", "--training.device=cpu",
            f"--data.shards={folder / 'shards'}", "--data.corpus=stdlib", "--data.corpus_bytes=20000",
            f"--training.metrics_file={folder / 'metrics.jsonl'}", f"--checkpoint.uri={folder / 'checkpoints'}",
            "--checkpoint.interval=3", *overrides]


def _train_rank(rank: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer.train import main

    assert main(trainer_args(Path(folder), "--parallel.tp=2")) == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("trained")
    spawn_ranks(_train_rank, (free_port(), str(folder)), nprocs=2)
    return folder


def a_batch(seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    text = "def export(location, to):\n    return written  # the model, out of its checkpoint\n" * 2
    tokens = torch.tensor(ByteTokenizer().encode(text)[:2 * (seq_len + 1)]).view(2, seq_len + 1)
    return tokens[:, :-1], tokens[:, 1:]


def test_the_export_gives_the_loss_of_the_checkpoint_resumed_by_the_trainer(trained, tmp_path):
    written = export(str(trained / "checkpoints"), tmp_path / "model", dtype=torch.float32, group_bytes=20_000)
    assert written.step == STEPS
    shards = sorted(name for name in written.files if name.startswith("model-"))
    assert len(shards) > 2, "streamed in several groups"
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["n_layer"] == 2
    assert config["trainfleet"]["step"] == STEPS and config["trainfleet"]["saved_layout"]["tp"] == 2
    index = json.loads((tmp_path / "model" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert sum(tensor.numel() for shard in shards for tensor in load_file(tmp_path / "model" / shard).values()) == (
        written.parameters)

    inputs, targets = a_batch()
    with torch.no_grad():
        exported_loss = cross_entropy_loss(load_exported(str(tmp_path / "model"))(inputs), targets).item()

    cfg = load_config(trainer_args(trained, "--checkpoint.resume=latest"))
    run = build(cfg, environment(cfg, torch.device("cpu")))
    assert Checkpointer(cfg.checkpoint).resume(run.state) == STEPS
    (model,) = run.pipeline.model_parts
    with torch.no_grad():
        resumed_loss = cross_entropy_loss(model(inputs), targets).item()
    assert exported_loss == pytest.approx(resumed_loss, abs=1e-5)


def test_bf16_and_the_optimizer_state(trained, tmp_path):
    written = export(str(trained / "checkpoints"), tmp_path / "model", dtype=torch.bfloat16, optimizer=True)
    weights = load_file(tmp_path / "model" / "model-00001-of-00001.safetensors")
    moments = load_file(tmp_path / "model" / "optimizer-00001-of-00001.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert set(weights) >= {"transformer.h.1.attn.c_attn.weight", "lm_head.weight"}, "Hugging Face's names"
    trainer_names = {name for link in hf.links(load_exported(tmp_path / "model").cfg) for name in link.trainer}
    assert set(moments) == {f"{name}.{moment}" for name in trainer_names for moment in ("exp_avg", "exp_avg_sq")}
    assert {tensor.dtype for tensor in moments.values()} == {torch.float32}, "moments stay as saved"
    assert "optimizer.safetensors.index.json" in written.files


def test_an_export_is_refused_whole_into_a_folder_in_use_or_of_a_step_not_committed(trained, tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not empty"):
        export(str(trained / "checkpoints"), tmp_path / "used")
    assert sorted(path.name for path in (tmp_path / "used").iterdir()) == ["notes.txt"]
    with pytest.raises(ExportError, match="no commit marker"):
        export(str(trained / "checkpoints"), tmp_path / "model", step=4)
    assert not (tmp_path / "model").exists() and not (tmp_path / "model.partial").exists()


def test_every_file_of_an_export_has_the_mode_a_new_file_gets_and_no_warning_is_printed(trained, tmp_path):
    """A server running as another user reads the weights as it reads the config beside them."""
    umask = os.umask(0o022)
    os.umask(umask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's or safetensors' warnings would be the user's to read
        written = export(str(trained / "checkpoints"), tmp_path / "model", optimizer=True)
    modes = {name: stat.S_IMODE((tmp_path / "model" / name).stat().st_mode) for name in written.files}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_the_cli_refuses_an_export_onto_a_file_in_one_line_and_leaves_it(trained, tmp_path, capsys):
    from trainfleet.cli import main

    readme = tmp_path / "README.md"
    readme.write_text("mine")
    assert main(["checkpoint", "export", str(trained / "checkpoints"), "--to", str(readme)]) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == (f"trainfleet checkpoint export: {readme} is a file, not a folder: "
                                                 "export into a new folder\n")
    assert readme.read_text() == "mine" and sorted(path.name for path in tmp_path.iterdir()) == ["README.md"]


def test_the_cli_lists_the_steps_exports_and_samples(trained, tmp_path, capsys):
    from trainfleet.cli import main

    assert main(["checkpoint", "list", str(trained / "checkpoints")]) == 0
    listing = capsys.readouterr().out
    rows = {line.split()[0]: line for line in listing.splitlines() if line.split() and line.split()[0].isdigit()}
    assert set(rows) == {"3", "6"}
    assert rows["6"].split()[:6] == ["6", "committed", "1.5", "MiB", "pp=1", "dp=1"] and "tp=2 " in rows["6"]
    assert "resume=latest takes step 6" in listing and max(len(line) for line in listing.splitlines()) <= 80

    assert main(["checkpoint", "export", str(trained / "checkpoints"), "--to", str(tmp_path / "model")]) == 0
    assert f"exported step {STEPS}" in capsys.readouterr().out
    assert main(["checkpoint", "export", str(trained / "checkpoints"), "--to", str(tmp_path / "model")]) == 1
    assert "is not empty" in capsys.readouterr().err

    prompt = "def main("
    for source in (tmp_path / "model", trained / "checkpoints"):  # an export, or a checkpoint location
        assert main(["sample", "--from", str(source), "--prompt", prompt, "--tokens", "40", "--seed", "3"]) == 0
        text = capsys.readouterr().out
        assert text.startswith(prompt) and len(text.encode()) > len(prompt)
