"""Corpus, shards (local and S3 through moto), and the resumable sampler."""

import boto3
import pytest
import torch

from trainer import tokenizer
from trainer.config import DataConfig
from trainer.data import BatchSampler, DataLoader, ShardStore, corpus_documents, ensure_shards, load_tokens


def test_byte_tokens_round_trip_any_text():
    text = "déjà vu — 日本語\n"
    tokens = tokenizer.encode(text)
    assert max(tokens) < 256 and tokenizer.decode(tokens + [tokenizer.END_OF_DOCUMENT]) == text


def test_corpus_is_real_python_source_in_a_fixed_order():
    documents = corpus_documents(50_000)
    assert sum(map(len, documents)) == 50_000
    assert "def " in documents[0] and "import" in documents[0]
    assert documents == corpus_documents(50_000)


def test_local_shards_are_built_once_and_read_back(tmp_path):
    cfg = DataConfig(shards=str(tmp_path / "shards"), corpus_bytes=30_000, shard_tokens=8_000)
    index = ensure_shards(cfg)
    assert [s["tokens"] for s in index["shards"]][:3] == [8_000] * 3
    tokens = load_tokens(cfg)
    assert len(tokens) == sum(s["tokens"] for s in index["shards"])
    assert tokenizer.decode(tokens[:200].tolist()) == corpus_documents(200)[0]
    assert ensure_shards(cfg) == index


def test_a_corrupted_shard_is_refused(tmp_path):
    cfg = DataConfig(shards=str(tmp_path / "shards"), corpus_bytes=10_000, shard_tokens=4_000)
    ensure_shards(cfg)
    (tmp_path / "shards" / "shard-00001.bin").write_bytes(b"\0\0" * 4_000)
    with pytest.raises(RuntimeError, match="shard-00001.bin .* does not match its index"):
        load_tokens(cfg)


def test_s3_shards_through_a_real_endpoint(moto_endpoint, tmp_path):
    boto3.client("s3").create_bucket(Bucket="corpus")
    cfg = DataConfig(shards="s3://corpus/bytes/v1", cache_dir=str(tmp_path / "cache"), corpus_bytes=20_000,
                     shard_tokens=8_000)
    tokens = load_tokens(cfg)
    keys = [o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket="corpus")["Contents"]]
    assert "bytes/v1/index.json" in keys and "bytes/v1/shard-00000.bin" in keys
    assert ShardStore(cfg.shards).read("missing.bin") is None
    local = load_tokens(DataConfig(shards=str(tmp_path / "local"), corpus_bytes=20_000, shard_tokens=8_000))
    assert torch.equal(tokens, local)
    assert torch.equal(load_tokens(cfg), tokens)  # now from the local cache


def test_a_resumed_sampler_draws_the_batches_the_uninterrupted_one_would():
    uninterrupted = BatchSampler(n_windows=10, batch_size=4, seed=7)
    batches = [uninterrupted.next_batch() for _ in range(6)]  # crosses two epoch boundaries
    first_run = BatchSampler(10, 4, seed=7)
    for _ in range(2):
        first_run.next_batch()
    resumed = BatchSampler(10, 4, seed=7)
    resumed.load_state_dict(first_run.state_dict())
    assert all(torch.equal(a, resumed.next_batch()) for a in batches[2:])
    assert sorted(torch.cat(batches[:3])[:10].tolist()) == list(range(10))  # an epoch visits each window once


def test_a_sampler_refuses_another_seeds_position():
    with pytest.raises(ValueError, match="seeded with 1, this run with training.seed=2"):
        BatchSampler(10, 4, seed=2).load_state_dict(BatchSampler(10, 4, seed=1).state_dict())


def test_data_parallel_replicas_split_the_global_batch():
    tokens = torch.arange(1000)
    whole_inputs, whole_targets = DataLoader(tokens, 8, batch_size=6, dp=1, dp_index=0, seed=3).next_batch()
    halves = [DataLoader(tokens, 8, batch_size=6, dp=2, dp_index=i, seed=3).next_batch() for i in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole_inputs)
    assert torch.equal(whole_targets[:, :-1], whole_inputs[:, 1:]) and whole_inputs.shape == (6, 8)
