"""Bytes a fresh node fetches from S3 before its first batch: shards fetched whole, or blocks as the sampler needs them.

    .venv/bin/python bench/data_fetch.py                      # a moto server in this process, 16 shards of 8 MiB
    .venv/bin/python bench/data_fetch.py --shards 32 --shard-mib 16 --rows 16

A synthetic corpus (random tokens) is written once as a shard set with block digests, in blocks of
the trainer's BLOCK_BYTES; a copy of it gets the index a writer of the whole-shard era left (no block
digests). A node with an empty cache then loads each and draws its first batch (--rows windows of
--seq-len + 1 tokens, seed 0): the whole-shard set is fetched entire before any window is read; the
blocked set fetches the blocks that hold the batch's windows. Bytes and GETs are counted at the
store, as the reads return; time is wall time with moto in this process, indicative only. The
blocked set is also counted once the blocks of the PREFETCH_BATCHES batches after the first have
come. Whole-shard bytes grow with the corpus; blocked bytes with rows x block size. The last two
lines are `first_batch_bytes_whole=<n>` and `first_batch_bytes_by_block=<n>`.
"""

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer.data  # noqa: E402
from trainer.config import DataConfig  # noqa: E402
from trainer.data import PREFETCH_BATCHES, DataLoader, ShardStore, load_tokens, write_shards  # noqa: E402
from trainer.local_ports import free_port  # noqa: E402


class Fetched:
    """Bytes and GETs of shard reads, counted as each read returns."""

    def __init__(self):
        self.bytes = self.gets = 0
        self._lock = threading.Lock()
        read_range = ShardStore.read_range

        def counted(store: ShardStore, name: str, start: int, end: int) -> bytes:
            data = read_range(store, name, start, end)
            with self._lock:
                self.bytes, self.gets = self.bytes + len(data), self.gets + 1
            return data

        ShardStore.read_range = counted

    def since(self, mark: tuple[int, int]) -> tuple[int, int]:
        return self.bytes - mark[0], self.gets - mark[1]


def write_corpus(bucket: str, shards: int, shard_tokens: int) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 2**16, size=shards * shard_tokens, dtype=np.int64)
    index = write_shards(ShardStore(f"s3://{bucket}/blocks"), tokens, shard_tokens, 2**16, "random")
    whole = ShardStore(f"s3://{bucket}/whole")
    for shard in index["shards"]:
        boto3.client("s3").copy_object(Bucket=bucket, Key=f"whole/{shard['name']}",
                                       CopySource={"Bucket": bucket, "Key": f"blocks/{shard['name']}"})
        del shard["block_sha256"]
    del index["block_bytes"]
    whole.write(trainer.data.INDEX_NAME, json.dumps(index).encode())


def first_batch(cfg: DataConfig, fetched: Fetched, seq_len: int, rows: int) -> tuple[int, int, float, DataLoader]:
    mark, started = (fetched.bytes, fetched.gets), time.perf_counter()
    loader = DataLoader(load_tokens(cfg), seq_len, batch_size=rows, dp=1, dp_index=0, seed=0)
    loader.next_batch()
    return *fetched.since(mark), time.perf_counter() - started, loader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-mib", type=int, default=8, help="size of each shard (uint32 tokens)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=8, help="windows of the first batch that this node reads")
    args = parser.parse_args()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the server's line per request
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
        boto3.client("s3").create_bucket(Bucket="corpus")
        shard_tokens = args.shard_mib * 2**20 // 4
        write_corpus("corpus", args.shards, shard_tokens)
        fetched = Fetched()
        with tempfile.TemporaryDirectory() as cache:
            whole = first_batch(DataConfig(shards="s3://corpus/whole", cache_dir=f"{cache}/whole"), fetched,
                                args.seq_len, args.rows)
            mark = (fetched.bytes, fetched.gets)
            blocks = first_batch(DataConfig(shards="s3://corpus/blocks", cache_dir=f"{cache}/blocks"), fetched,
                                 args.seq_len, args.rows)
            loader = blocks[3]
            for ahead in range(1, PREFETCH_BATCHES + 1):  # reading a batch waits for its blocks asked for ahead
                starts = loader.sampler.batch_at(loader.sampler.sequences_drawn + (ahead - 1) * args.rows)
                loader.tokens.windows(starts.numpy() * args.seq_len, np.empty((args.rows, args.seq_len + 1), np.int64))
            with_ahead = fetched.since(mark)
    finally:
        server.stop()

    mib = 2**20
    print(f"corpus: {args.shards} shards x {args.shard_mib} MiB = {args.shards * args.shard_mib} MiB, blocks of "
          f"{trainer.data.BLOCK_BYTES // mib} MiB; first batch: {args.rows} windows of {args.seq_len + 1} tokens")
    print(f"whole shards: {whole[0] / mib:8.1f} MiB in {whole[1]:4d} GETs before the first batch, {whole[2]:.2f} s")
    print(f"by block:     {blocks[0] / mib:8.1f} MiB in {blocks[1]:4d} GETs before the first batch, {blocks[2]:.2f} s; "
          f"{with_ahead[0] / mib:.1f} MiB in {with_ahead[1]} GETs with the {PREFETCH_BATCHES} batches ahead")
    print(f"first_batch_bytes_whole={whole[0]}")
    print(f"first_batch_bytes_by_block={blocks[0]}")


if __name__ == "__main__":
    main()
