"""Corpus, shards (local, and S3 through moto: by block, or whole for older indexes), the token source, and the
resumable sampler."""

import dataclasses
import functools
import hashlib
import json
import os
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import boto3
import numpy as np
import pytest
import torch

import trainer.data
from trainer.tokenizer import ByteTokenizer
from trainer.config import DataConfig
from trainer.data import (BatchSampler, DataLoader, ShardStore, TokenShards, corpus_documents, ensure_shards,
                          load_tokens, tokenize_corpus, write_shards)


def all_tokens(tokens: TokenShards) -> np.ndarray:
    return tokens.windows(np.array([0]), np.empty((1, len(tokens)), dtype=np.int64))[0]


def age(folder, seconds=60):
    """Date the files back, as shards written before this start would be."""
    past = time.time() - seconds
    for path in folder.iterdir():
        os.utime(path, (past, past))


def test_corpus_is_real_python_source_in_a_fixed_order():
    documents = corpus_documents(50_000)
    assert sum(map(len, documents)) == 50_000
    assert "def " in documents[0] and "import" in documents[0]
    assert documents == corpus_documents(50_000)


def test_local_shards_are_built_once_and_read_back(tmp_path):
    cfg = DataConfig(shards=str(tmp_path / "shards"), corpus="stdlib", corpus_bytes=30_000, shard_tokens=8_000)
    index = ensure_shards(cfg)
    assert [s["tokens"] for s in index["shards"]][:3] == [8_000] * 3
    assert index["dtype"] == "uint16" and (tmp_path / "shards" / "shard-00000.bin").stat().st_size == 2 * 8_000
    tokens = load_tokens(cfg)
    assert len(tokens) == sum(s["tokens"] for s in index["shards"])
    assert ByteTokenizer().decode(all_tokens(tokens)[:200].tolist()) == corpus_documents(200)[0]
    assert ensure_shards(cfg) == index


def test_a_vocabulary_above_65535_round_trips(tmp_path):
    written = np.array([0, 65_535, 65_536, 128_000, 256_000, 2**31, 2**32 - 1, 7], dtype=np.int64)
    write_shards(ShardStore(str(tmp_path / "shards")), written, shard_tokens=3, vocab_size=2**32,
                 tokenizer_name="test")
    assert np.array_equal(all_tokens(load_tokens(DataConfig(shards=str(tmp_path / "shards")))), written)


def test_tokens_beyond_the_shard_dtype_are_refused(tmp_path):
    with pytest.raises(ValueError, match="token 4294967296 does not fit in uint32"):
        write_shards(ShardStore(str(tmp_path)), np.array([1, 2**32]), shard_tokens=4, vocab_size=2**32,
                     tokenizer_name="test")


def test_a_shard_set_written_as_uint16_without_a_dtype_is_still_read(tmp_path):
    tokens = np.array([3, 256, 65_535, 9, 10], dtype="<u2")
    (tmp_path / "shard-00000.bin").write_bytes(tokens[:3].tobytes())
    (tmp_path / "shard-00001.bin").write_bytes(tokens[3:].tobytes())
    index = {"tokenizer": "bytes+eod", "vocab_size": 257, "shards": [
        {"name": f"shard-0000{n}.bin", "tokens": len(part), "sha256": hashlib.sha256(part.tobytes()).hexdigest()}
        for n, part in enumerate((tokens[:3], tokens[3:]))]}
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert all_tokens(load_tokens(DataConfig(shards=str(tmp_path)))).tolist() == [3, 256, 65_535, 9, 10]


def test_an_unknown_shard_dtype_is_refused_naming_the_set(tmp_path):
    (tmp_path / "index.json").write_text(json.dumps({"dtype": "float16", "shards": []}))
    with pytest.raises(ValueError, match=f"{tmp_path}/index.json: token dtype 'float16'"):
        load_tokens(DataConfig(shards=str(tmp_path)))


def test_a_rank_memory_maps_the_shards_instead_of_holding_the_corpus(tmp_path):
    cfg = DataConfig(shards=str(tmp_path / "shards"), corpus="stdlib", cache_dir=str(tmp_path / "cache"), corpus_bytes=2_000_000,
                     shard_tokens=500_000)
    ensure_shards(cfg)
    corpus_bytes = sum(p.stat().st_size for p in (tmp_path / "shards").glob("*.bin"))
    seq_len, batch_size = 16, 4
    assert corpus_bytes > 100 * 4 * batch_size * (seq_len + 1)
    tracemalloc.start()
    try:
        loader = DataLoader(load_tokens(cfg), seq_len, batch_size, dp=1, dp_index=0, seed=0)
        for _ in range(20):
            loader.next_batch()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < corpus_bytes / 8


def test_a_corrupted_shard_is_refused(tmp_path):
    cfg = DataConfig(shards=str(tmp_path / "shards"), corpus="stdlib", cache_dir=str(tmp_path / "cache"), corpus_bytes=10_000,
                     shard_tokens=4_000)
    ensure_shards(cfg)
    age(tmp_path / "shards")
    load_tokens(cfg)  # verified and stamped: a later change must still be seen
    (tmp_path / "shards" / "shard-00001.bin").write_bytes(b"\0\0\0\0" * 4_000)
    with pytest.raises(RuntimeError, match="shard-00001.bin in .*shards is missing or does not match its index"):
        load_tokens(cfg)


def test_verified_local_shards_are_not_hashed_again_on_the_next_start(tmp_path, monkeypatch):
    cfg = DataConfig(shards=str(tmp_path / "shards"), corpus="stdlib", cache_dir=str(tmp_path / "cache"), corpus_bytes=10_000,
                     shard_tokens=4_000)
    ensure_shards(cfg)
    age(tmp_path / "shards")
    hashed = []
    sha256_of_file = trainer.data.sha256_of_file
    monkeypatch.setattr(trainer.data, "sha256_of_file", lambda path: hashed.append(path.name) or sha256_of_file(path))
    first = all_tokens(load_tokens(cfg))
    assert sorted(hashed) == ["shard-00000.bin", "shard-00001.bin", "shard-00002.bin"]
    hashed.clear()
    assert np.array_equal(all_tokens(load_tokens(cfg)), first) and hashed == []


def shard_gets(monkeypatch) -> list[tuple[str, str | None]]:
    """(key, Range) of every GetObject the code under test sends from now on."""
    session = boto3.Session()
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", session)
    gets = []
    session.events.register("before-parameter-build.s3.GetObject",
                            lambda params, **_: gets.append((params["Key"], params.get("Range"))))
    return gets


SHARD_TOKENS, BLOCK_BYTES = 8_000, 4_096  # 1,024 tokens a block: 8 + 8 + 4 blocks for the 20,005 tokens


@functools.cache
def corpus() -> np.ndarray:
    return tokenize_corpus(20_000, ByteTokenizer())[0]


def s3_shard_set(bucket: str, tmp_path, block_digests=True, **config) -> DataConfig:
    """The corpus as shards of SHARD_TOKENS in blocks of BLOCK_BYTES under s3://bucket/v1; without block
    digests, the index a writer of the whole-shard era left."""
    boto3.client("s3").create_bucket(Bucket=bucket)
    cfg = DataConfig(shards=f"s3://{bucket}/v1", cache_dir=str(tmp_path / "cache"), **config)
    # A vocabulary past 16 bits: uint32 tokens, which the block arithmetic of these tests counts.
    index = write_shards(ShardStore(cfg.shards), corpus(), SHARD_TOKENS, 2**17, "bytes+eod", block_bytes=BLOCK_BYTES)
    if not block_digests:
        del index["block_bytes"]
        for shard in index["shards"]:
            del shard["block_sha256"]
        ShardStore(cfg.shards).write("index.json", json.dumps(index).encode())
    return cfg


def block_ranges(starts, length: int) -> set[tuple[str, str]]:
    """(key, Range) of the blocks that hold windows of `length` tokens at `starts`, from the layout alone."""
    ranges = set()
    for token in (t for start in starts for t in range(start, start + length)):
        shard, byte = divmod(token, SHARD_TOKENS)
        shard_bytes = 4 * min(SHARD_TOKENS, len(corpus()) - shard * SHARD_TOKENS)
        first = 4 * byte // BLOCK_BYTES * BLOCK_BYTES
        ranges.add((f"v1/shard-{shard:05d}.bin", f"bytes={first}-{min(first + BLOCK_BYTES, shard_bytes) - 1}"))
    return ranges


def settle(tokens: TokenShards) -> None:
    """Wait until the blocks asked for ahead have come."""
    cache, deadline = tokens.shards[0].cache, time.monotonic() + 60
    while cache._pending:
        assert time.monotonic() < deadline, f"blocks still pending: {list(cache._pending)}"
        time.sleep(0.01)


def test_a_window_fetches_only_the_blocks_that_hold_it(moto_endpoint, tmp_path, monkeypatch):
    cfg = s3_shard_set("corpus-blocks", tmp_path)
    gets = shard_gets(monkeypatch)
    tokens = load_tokens(cfg)
    assert [key for key, _ in gets] == ["v1/index.json"]
    gets.clear()
    across = tokens.windows(np.array([7_990]), np.empty((1, 20), dtype=np.int64))  # shard 0's end, shard 1's start
    assert sorted(gets) == [("v1/shard-00000.bin", "bytes=28672-31999"), ("v1/shard-00001.bin", "bytes=0-4095")]
    assert across.tolist() == [corpus()[7_990:8_010].tolist()]
    gets.clear()
    within = tokens.windows(np.array([2_050, 7_995]), np.empty((2, 10), dtype=np.int64))
    assert gets == [("v1/shard-00000.bin", "bytes=8192-12287")]  # the last block of shard 0 is held already
    assert within.tolist() == [corpus()[2_050:2_060].tolist(), corpus()[7_995:8_005].tolist()]


def test_s3_blocks_read_the_tokens_of_local_and_whole_fetched_shards(moto_endpoint, tmp_path):
    by_block = load_tokens(s3_shard_set("corpus-same", tmp_path / "blocks"))
    whole = load_tokens(s3_shard_set("corpus-same-whole", tmp_path / "whole", block_digests=False))
    write_shards(ShardStore(str(tmp_path / "local")), corpus(), SHARD_TOKENS, ByteTokenizer.vocab_size, "bytes+eod")
    local = load_tokens(DataConfig(shards=str(tmp_path / "local")))
    assert np.array_equal(all_tokens(by_block), corpus()) and np.array_equal(all_tokens(whole), corpus())
    assert np.array_equal(all_tokens(local), corpus())
    loaders = [DataLoader(tokens, 32, batch_size=6, dp=1, dp_index=0, seed=4) for tokens in (by_block, local)]
    for _ in range(30):  # over an epoch of 625 windows
        (inputs, targets), (local_inputs, local_targets) = (loader.next_batch() for loader in loaders)
        assert torch.equal(inputs, local_inputs) and torch.equal(targets, local_targets)


def test_the_next_batches_blocks_are_fetched_before_the_sampler_reaches_them(moto_endpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer.data, "PREFETCH_BATCHES", 2)
    cfg = s3_shard_set("corpus-ahead", tmp_path)
    gets = shard_gets(monkeypatch)
    loader = DataLoader(load_tokens(cfg), 32, batch_size=4, dp=1, dp_index=0, seed=1)
    reference = BatchSampler(loader.sampler.n_windows, 4, seed=1)
    batch_blocks = [block_ranges(reference.next_batch().numpy() * 32, 33) for _ in range(8)]
    gets.clear()  # the index
    for step in range(6):
        fetched_before = len(gets)
        loader.next_batch()
        if step > 0:  # the batch was in the cache before it was drawn: no step waits on S3
            assert not set(gets[fetched_before:]) & batch_blocks[step]
        settle(loader.tokens)
        assert set(gets) == set().union(*batch_blocks[:step + 3])  # this batch and the 2 after it, nothing more
        assert len(gets) == len(set(gets))


def test_a_resumed_loader_reads_the_batches_of_the_uninterrupted_one(moto_endpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer.data, "PREFETCH_BATCHES", 2)
    cfg = s3_shard_set("corpus-resume", tmp_path / "first")
    uninterrupted = DataLoader(load_tokens(cfg), 32, batch_size=4, dp=1, dp_index=0, seed=5)
    batches = [uninterrupted.next_batch() for _ in range(12)]
    first_run = DataLoader(load_tokens(cfg), 32, batch_size=4, dp=1, dp_index=0, seed=5)
    for _ in range(5):
        first_run.next_batch()
    gets = shard_gets(monkeypatch)
    replacement = dataclasses.replace(cfg, cache_dir=str(tmp_path / "replacement"))  # a new node: an empty cache
    resumed = DataLoader(load_tokens(replacement), 32, batch_size=4, dp=1, dp_index=0, seed=5)
    resumed.sampler.load_state_dict(first_run.sampler.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), batches[5]))
    settle(resumed.tokens)
    reference = BatchSampler(resumed.sampler.n_windows, 4, seed=5)
    reference.load_state_dict(first_run.sampler.state_dict())
    assert set(gets) - {("v1/index.json", None)} == set().union(
        *(block_ranges(reference.next_batch().numpy() * 32, 33) for _ in range(3)))  # batches 5-7, not 0-2
    for expected in batches[6:]:
        assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), expected))


def test_a_block_damaged_in_transit_is_fetched_again(moto_endpoint, tmp_path, monkeypatch):
    cfg = s3_shard_set("corpus-flaky", tmp_path)
    read_range, damaged = ShardStore.read_range, []

    def damage_first(store, name, start, end):
        data = read_range(store, name, start, end)
        if (name, start) not in damaged:
            damaged.append((name, start))
            return b"\xff" + data[1:]
        return data

    monkeypatch.setattr(ShardStore, "read_range", damage_first)
    gets = shard_gets(monkeypatch)
    assert np.array_equal(all_tokens(load_tokens(cfg)), corpus())
    assert len(damaged) == 20 and len(gets) == 1 + 2 * 20  # the index, then every block twice


def test_a_corrupt_s3_block_is_refused_naming_shard_block_and_bytes(moto_endpoint, tmp_path, monkeypatch):
    cfg = s3_shard_set("corpus-bad-block", tmp_path)
    shard = bytearray(boto3.client("s3").get_object(Bucket="corpus-bad-block", Key="v1/shard-00001.bin")["Body"].read())
    shard[12_300] ^= 1  # in block 3: bytes 12,288 .. 16,383
    boto3.client("s3").put_object(Bucket="corpus-bad-block", Key="v1/shard-00001.bin", Body=bytes(shard))
    gets = shard_gets(monkeypatch)
    tokens = load_tokens(cfg)
    with pytest.raises(RuntimeError, match=r"shard shard-00001.bin in s3://corpus-bad-block/v1: block 3 "
                                           r"\(bytes 12288..16383\) does not match its index, fetched twice"):
        tokens.windows(np.array([SHARD_TOKENS + 3_100]), np.empty((1, 8), dtype=np.int64))
    assert gets.count(("v1/shard-00001.bin", "bytes=12288-16383")) == 2
    assert sorted(p.name for p in (tmp_path / "cache").rglob("blocks/*")) == []  # nothing of it was kept
    block_4 = tokens.windows(np.array([SHARD_TOKENS + 4_096]), np.empty((1, 8), dtype=np.int64))
    assert block_4.tolist() == [corpus()[SHARD_TOKENS + 4_096:SHARD_TOKENS + 4_104].tolist()]  # the rest reads


def test_the_block_cache_keeps_within_its_bound_and_serves_a_restart(moto_endpoint, tmp_path, monkeypatch):
    cfg = s3_shard_set("corpus-bound", tmp_path, cache_bytes=5 * BLOCK_BYTES)
    blocks = tmp_path / "cache"
    gets = shard_gets(monkeypatch)
    tokens = load_tokens(cfg)
    for start in range(0, len(corpus()) - 100, 1_024):  # every block once, in order
        tokens.windows(np.array([start]), np.empty((1, 100), dtype=np.int64))
        assert sum(p.stat().st_size for p in blocks.rglob("blocks/*")) <= 5 * BLOCK_BYTES
    assert len(gets) == 1 + 20
    gets.clear()
    restarted = load_tokens(cfg)
    last = len(corpus()) - 100
    assert restarted.windows(np.array([last]), np.empty((1, 100), dtype=np.int64)).tolist() == [
        corpus()[last:].tolist()]
    assert gets == [("v1/index.json", None)]  # recent blocks come from the cache
    first = restarted.windows(np.array([0]), np.empty((1, 100), dtype=np.int64))
    assert first.tolist() == [corpus()[:100].tolist()] and gets[1:] == [("v1/shard-00000.bin", "bytes=0-4095")]


def test_a_malformed_block_layout_is_refused(moto_endpoint, tmp_path):
    with pytest.raises(ValueError, match="block_bytes=4099 is not a positive multiple of 2"):
        write_shards(ShardStore(str(tmp_path)), np.arange(10), 4, 257, "test", block_bytes=4_099)
    cfg = s3_shard_set("corpus-short-index", tmp_path)
    index = json.loads(ShardStore(cfg.shards).read("index.json"))
    index["shards"][1]["block_sha256"].pop()
    ShardStore(cfg.shards).write("index.json", json.dumps(index).encode())
    with pytest.raises(ValueError, match="index.json: shard shard-00001.bin of 32000 bytes has 7 block digests"):
        load_tokens(cfg)


def test_s3_shards_indexed_without_blocks_are_fetched_whole_once_and_memory_mapped(moto_endpoint, tmp_path,
                                                                                  monkeypatch):
    cfg = s3_shard_set("corpus-whole", tmp_path, block_digests=False)
    monkeypatch.setattr(trainer.data, "PART_BYTES", 5_000)
    gets = shard_gets(monkeypatch)
    tokens = all_tokens(load_tokens(cfg))
    ranges = sorted((key, int(r.split("=")[1].split("-")[0]), int(r.split("-")[1]))
                    for key, r in gets if key.endswith(".bin"))
    shard0 = [(start, end) for key, start, end in ranges if key == "v1/shard-00000.bin"]
    assert shard0 == [(0, 4_999), (5_000, 9_999), (10_000, 14_999), (15_000, 19_999), (20_000, 24_999),
                      (25_000, 29_999), (30_000, 31_999)]
    assert {key for key, _, _ in ranges} == {f"v1/shard-0000{n}.bin" for n in range(3)}
    assert ShardStore(cfg.shards).read("missing.bin") is None
    assert np.array_equal(tokens, corpus())

    gets.clear()
    assert np.array_equal(all_tokens(load_tokens(cfg)), tokens)  # a restart reads the cache
    assert [key for key, _ in gets] == ["v1/index.json"]

    cached = next((tmp_path / "cache").rglob("shard-00002.bin"))
    cached.write_bytes(b"\1" * cached.stat().st_size)
    gets.clear()
    assert np.array_equal(all_tokens(load_tokens(cfg)), tokens)  # a damaged cache file is fetched again
    assert sorted(set(key for key, _ in gets)) == ["v1/index.json", "v1/shard-00002.bin"]


@pytest.mark.parametrize("block_digests", [True, False], ids=["blocks", "whole"])
def test_ranks_starting_together_on_one_node_fetch_each_byte_once(moto_endpoint, tmp_path, monkeypatch,
                                                                   block_digests):
    cfg = s3_shard_set(f"corpus-shared-{block_digests}".lower(), tmp_path, block_digests)
    gets = shard_gets(monkeypatch)
    with ThreadPoolExecutor(4) as ranks:
        loaded = list(ranks.map(lambda _: all_tokens(load_tokens(cfg)), range(4)))
    assert all(np.array_equal(tokens, corpus()) for tokens in loaded)
    shard_reads = [get for get in gets if get[0].endswith(".bin")]
    assert len(shard_reads) == len(set(shard_reads)) == (20 if block_digests else 3)


def test_a_corrupted_s3_shard_indexed_without_blocks_is_refused_naming_it(moto_endpoint, tmp_path):
    cfg = s3_shard_set("corpus-bad", tmp_path, block_digests=False)
    boto3.client("s3").put_object(Bucket="corpus-bad", Key="v1/shard-00001.bin", Body=b"\0" * 32_000)
    with pytest.raises(RuntimeError, match=r"shard shard-00001.bin in s3://corpus-bad/v1 does not match its index"):
        load_tokens(cfg)
    assert not list((tmp_path / "cache").rglob("shard-00001.bin"))


def test_windows_are_read_across_shard_boundaries():
    tokens = TokenShards([np.arange(0, 5, dtype="<u4"), np.arange(5, 7, dtype="<u4"), np.arange(7, 20, dtype="<u4")])
    assert len(tokens) == 20
    assert tokens.windows(np.array([3, 5, 0, 14]), np.empty((4, 6), dtype=np.int64)).tolist() == [
        [3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10], [0, 1, 2, 3, 4, 5], [14, 15, 16, 17, 18, 19]]
    assert tokens.windows(np.array([5]), np.empty((1, 2), dtype=np.int64)).tolist() == [[5, 6]]
    one_shard = TokenShards([np.arange(20)])
    for seed in range(3):
        a, b = DataLoader(tokens, 4, 2, 1, 0, seed), DataLoader(one_shard, 4, 2, 1, 0, seed)
        assert all(torch.equal(x, y) for _ in range(6) for x, y in zip(a.next_batch(), b.next_batch()))


def test_the_loader_draws_the_same_windows_as_before_shards_were_memory_mapped():
    # Window starts drawn by the loader that held the corpus as one tensor (seeds 3 and 11).
    tokens = TokenShards([np.arange(0, 600, dtype="<u4"), np.arange(600, 1000, dtype="<u4")])
    loader = DataLoader(tokens, 8, batch_size=6, dp=1, dp_index=0, seed=3)
    assert [loader.next_batch()[0][:, 0].tolist() for _ in range(4)] == [
        [448, 856, 512, 616, 608, 184], [928, 472, 680, 376, 712, 536],
        [216, 112, 344, 0, 496, 656], [592, 296, 176, 136, 456, 504]]
    loader = DataLoader(TokenShards([np.arange(100)]), 8, batch_size=4, dp=1, dp_index=0, seed=11)
    assert [loader.next_batch()[0][:, 0].tolist() for _ in range(5)] == [
        [56, 88, 32, 72], [8, 24, 64, 16], [80, 48, 40, 0], [0, 48, 80, 8], [24, 32, 88, 64]]


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


def test_a_loader_resumed_at_another_dp_gives_the_same_batches(tmp_path):
    cfg = DataConfig(shards=str(tmp_path / "shards"), corpus="stdlib", corpus_bytes=6_000, shard_tokens=1_000)
    uninterrupted = DataLoader(load_tokens(cfg), 32, batch_size=8, dp=1, dp_index=0, seed=5)
    batches = [uninterrupted.next_batch() for _ in range(40)]  # several epochs of 187 windows
    first_run = DataLoader(load_tokens(cfg), 32, batch_size=8, dp=1, dp_index=0, seed=5)
    for _ in range(17):
        first_run.next_batch()
    replicas = [DataLoader(load_tokens(cfg), 32, batch_size=8, dp=2, dp_index=i, seed=5) for i in range(2)]
    for replica in replicas:
        replica.sampler.load_state_dict(first_run.sampler.state_dict())
    for inputs, targets in batches[17:]:
        halves = [replica.next_batch() for replica in replicas]
        assert torch.equal(torch.cat([h[0] for h in halves]), inputs)
        assert torch.equal(torch.cat([h[1] for h in halves]), targets)


def test_a_sampler_refuses_another_seeds_position():
    with pytest.raises(ValueError, match="seeded with 1, this run with training.seed=2"):
        BatchSampler(10, 4, seed=2).load_state_dict(BatchSampler(10, 4, seed=1).state_dict())


def test_data_parallel_replicas_split_the_global_batch():
    tokens = TokenShards([np.arange(1000)])
    whole_inputs, whole_targets = DataLoader(tokens, 8, batch_size=6, dp=1, dp_index=0, seed=3).next_batch()
    halves = [DataLoader(tokens, 8, batch_size=6, dp=2, dp_index=i, seed=3).next_batch() for i in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), whole_inputs)
    assert torch.equal(whole_targets[:, :-1], whole_inputs[:, 1:]) and whole_inputs.shape == (6, 8)
    assert whole_inputs.dtype == torch.int64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_batches_reach_a_cuda_device_from_pinned_memory():
    tokens = TokenShards([np.arange(70_000, 71_000, dtype="<u4")])
    on_cpu = DataLoader(tokens, 8, batch_size=6, dp=1, dp_index=0, seed=3)
    on_gpu = DataLoader(tokens, 8, batch_size=6, dp=1, dp_index=0, seed=3, device=torch.device("cuda"))
    for _ in range(3):
        (cpu_inputs, cpu_targets), (gpu_inputs, gpu_targets) = on_cpu.next_batch(), on_gpu.next_batch()
        assert gpu_inputs.is_cuda and gpu_inputs.dtype == torch.int64
        assert torch.equal(gpu_inputs.cpu(), cpu_inputs) and torch.equal(gpu_targets.cpu(), cpu_targets)
    assert on_gpu.pinned and not on_cpu.pinned
