"""A shard set is never filled from the built-in corpus unless the config names it, and a model or
tokenizer that does not fit the shards is refused at the trainer's start, before the world forms,
naming both sides."""

import subprocess
import sys

import boto3
import numpy as np
import pytest

from trainer import tokenizer, train
from trainer.config import DataConfig
from trainer.data import corpus_documents, ensure_shards, write_shards
from trainer.shards import ShardSetError, ShardStore

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(tokenizer.train_bpe(corpus_documents(300_000), vocab_size=500))
    return path


def big_vocabulary_shards(folder) -> str:
    """Shards as a 128,256-token vocabulary (Llama 3's) would have written them."""
    write_shards(ShardStore(str(folder)), np.arange(10_000) * 12, 5_000, 128_256, "llama3.json", "ab" * 32)
    return str(folder)


def trainer_main(capsys, *overrides) -> tuple[int, str]:
    code = train.main(["--training.device=cpu", "--training.steps=2", "--optim.warmup_steps=0", *overrides])
    return code, capsys.readouterr().err.strip()


def test_a_location_without_an_index_is_refused_naming_it_and_nothing_is_written(tmp_path, capsys, moto_endpoint):
    typo = tmp_path / "tokns"
    code, error = trainer_main(capsys, f"--data.shards={typo}")
    assert code == 2 and error == (
        f"data error: data.shards={typo} holds no index.json: no shard set is there (write one with "
        "`trainfleet data prepare`, or set data.corpus=stdlib to build one from the built-in corpus)")
    assert not typo.exists()
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="shards-typo")
    with pytest.raises(ShardSetError, match=r"^data.shards=s3://shards-typo/data/tokns holds no index.json"):
        ensure_shards(DataConfig(shards="s3://shards-typo/data/tokns"))
    assert "Contents" not in s3.list_objects_v2(Bucket="shards-typo")


def test_the_corpus_is_built_only_where_the_config_names_it(tmp_path):
    index = ensure_shards(DataConfig(shards=str(tmp_path / "built"), corpus="stdlib", corpus_bytes=5_000))
    assert index["tokenizer"] == "bytes" and index["tokenizer_sha256"] == tokenizer.ByteTokenizer().sha256
    documents = corpus_documents(5_000)
    assert index["documents"] == len(documents) and index["tokens"] == sum(len(d.encode()) + 1 for d in documents)


def test_a_model_smaller_than_the_shards_vocabulary_is_refused_naming_both_sizes(tmp_path, capsys):
    shards = big_vocabulary_shards(tmp_path / "llama-shards")
    code, error = trainer_main(capsys, f"--data.shards={shards}")
    assert code == 2 and error.startswith(
        f"data error: model.vocab_size=257 is smaller than the vocabulary of the shards at {shards} "
        "(128256, tokenizer llama3.json)"), error


def test_a_run_whose_tokenizer_is_not_the_shards_is_refused_naming_both(tmp_path, capsys, bpe):
    shards = tmp_path / "bytes-shards"
    ensure_shards(DataConfig(shards=str(shards), corpus="stdlib", corpus_bytes=5_000))
    code, error = trainer_main(capsys, f"--data.shards={shards}", f"--data.tokenizer={bpe}")
    sha = tokenizer.load(str(bpe)).sha256
    assert code == 2 and error == (
        f"data error: data.tokenizer={bpe} (sha256 {sha[:12]}) is not the tokenizer the shards at {shards} were "
        f"made with (bytes, sha256 {tokenizer.ByteTokenizer().sha256[:12]})")


def test_the_corpus_tokenised_with_a_bpe_tokenizer_trains(tmp_path, bpe):
    cfg = DataConfig(shards=str(tmp_path / "bpe-shards"), corpus="stdlib", corpus_bytes=20_000, tokenizer=str(bpe))
    index = ensure_shards(cfg)
    assert (index["vocab_size"], index["dtype"], index["tokenizer"]) == (500, "uint16", "tokenizer.json")
    tokens = np.fromfile(tmp_path / "bpe-shards" / "shard-00000.bin", dtype="<u2").tolist()
    tok = tokenizer.load(str(bpe))
    first = corpus_documents(20_000)[0]
    assert tokens[:len(tok.encode(first)) + 1] == tok.encode(first) + [tok.eos_id]


def test_the_trainer_only_demo_refuses_a_vocabulary_too_small_before_the_world_forms(tmp_path):
    shards = big_vocabulary_shards(tmp_path / "llama-shards")
    done = subprocess.run([sys.executable, "-m", "trainfleet.cli", "demo", "--trainer-only", "--",
                           f"--data.shards={shards}", f"--training.metrics_file={tmp_path / 'metrics.jsonl'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert f"data error: model.vocab_size=257 is smaller than the vocabulary of the shards at {shards} (128256" \
        in done.stderr, done.stderr[-3000:]
    assert "IndexError" not in done.stderr
