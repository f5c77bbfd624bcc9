"""A user's path from text to a trained Llama and back to text, on this machine, as the commands run it:
a byte-level BPE tokenizer trained here (trainer/tokenizer.py train_bpe), `trainfleet data prepare`
turning JSON Lines into shards with it, the trainer under torchrun (`trainfleet demo --trainer-only`
with trainer/configs/llama-tiny.toml at pp=2) learning from those shards, the export a stock
LlamaForCausalLM carrying that tokenizer, and `trainfleet sample` writing text decoded with it."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from test_data_prepare import documents, jsonl
from trainer import demo, tokenizer
from trainer.data import corpus_documents
from trainer.export import load_exported
from trainer.sample import generate
from trainfleet.cli import main as trainfleet

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512
STEPS = 120
PROMPT = "def "


def unigram_entropy(shards: Path) -> float:
    """Nats a token of the shards, by their tokens' frequencies alone."""
    tokens = np.concatenate([np.fromfile(path, dtype="<u2") for path in sorted(shards.glob("shard-*.bin"))])
    frequencies = np.bincount(tokens) / len(tokens)
    frequencies = frequencies[frequencies > 0]
    return float(-(frequencies * np.log(frequencies)).sum())


def test_a_llama_trains_on_shards_prepared_with_a_bpe_tokenizer_and_samples_with_it(tmp_path, capsys):
    bpe_path = tmp_path / "tokenizer.json"
    bpe_path.write_text(tokenizer.train_bpe(corpus_documents(300_000), vocab_size=VOCAB))
    bpe = tokenizer.load(str(bpe_path))
    (tmp_path / "corpus.jsonl").write_bytes(jsonl(documents(600_000)))

    assert trainfleet(["data", "prepare", str(tmp_path / "corpus.jsonl"), "--tokenizer", str(bpe_path),
                       "--to", str(tmp_path / "shards"), "--workers", "1"]) == 0
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert (index["tokenizer_sha256"], index["vocab_size"], index["dtype"]) == (bpe.sha256, VOCAB, "uint16")

    metrics = tmp_path / "metrics.jsonl"
    assert demo.main(["--", "--config", str(REPO / "trainer" / "configs" / "llama-tiny.toml"), "--parallel.pp=2",
                      f"--model.vocab_size={VOCAB}", f"--data.shards={tmp_path / 'shards'}",
                      f"--data.tokenizer={bpe_path}", f"--training.steps={STEPS}", "--optim.warmup_steps=5",
                      f"--training.metrics_file={metrics}", f"--checkpoint.uri={tmp_path / 'checkpoints'}",
                      f"--checkpoint.interval={STEPS}"]) == 0
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == STEPS
    assert losses[0] == pytest.approx(math.log(VOCAB), abs=0.5)  # uniform over the BPE's tokens at the start
    # and below the entropy of the shards' token frequencies, which no model blind to context goes under
    assert sum(losses[-10:]) / 10 < unigram_entropy(tmp_path / "shards") - 0.3, losses
    capsys.readouterr()

    assert trainfleet(["checkpoint", "export", str(tmp_path / "checkpoints"), "--to", str(tmp_path / "model"),
                       "--dtype", "float32"]) == 0
    assert json.loads((tmp_path / "model" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (tmp_path / "model" / "tokenizer.json").read_text() == bpe.tokenizer_json()  # the run's, from its marker
    capsys.readouterr()

    assert trainfleet(["sample", "--from", str(tmp_path / "checkpoints"), "--prompt", PROMPT, "--greedy",
                       "--tokens", "24"]) == 0
    written = capsys.readouterr().out.removesuffix("\n")
    assert written.startswith(PROMPT) and len(written) > len(PROMPT)
    ids = bpe.encode(written)[len(bpe.encode(PROMPT)):]
    assert any(len(bpe.decode([token])) > 1 for token in ids), "decoded from the BPE's merged tokens"
    assert written == PROMPT + generate(load_exported(tmp_path / "model"), bpe, PROMPT, new_tokens=24, greedy=True)
