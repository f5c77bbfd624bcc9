"""The token shard format, torch-free and numpy-free: what writes shards (the trainer's built-in
corpus, `trainfleet data prepare`, the DataPrep functions) and what checks a shard set against a run
(the trainer's start, Validate) share it.

    <location>/shard-00000.bin ...   little-endian tokens, uint16 where the vocabulary fits in 16 bits
    <location>/index.json            written last: the set is complete once it exists

The index:

    tokenizer, tokenizer_sha256      the tokenizer's name, and the sha256 of its tokenizer.json text
    vocab_size                       the tokenizer's vocabulary: a model needs at least as many rows
    dtype, block_bytes               the token type, the bytes under one block digest
    documents, tokens                totals over the shards
    shards                           [{name, tokens, documents, sha256, block_sha256: [per block]}]

A location is a local directory or s3://bucket/prefix (`ShardStore`).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from array import array
from pathlib import Path

import boto3

INDEX_NAME = "index.json"
BLOCK_BYTES = 4 * 1024 * 1024
"""Bytes of shard under one sha256 of the index, and what one read fetches from S3. Smaller blocks
fetch fewer unused bytes around a window (a 4 MiB block holds 128 windows of 8K uint32 tokens) but
lengthen the index by about 70 bytes a block: 4 MiB keeps a 1.2 TB corpus's index near 20 MB."""
TOKEN_TYPES = {"uint16": "H", "uint32": "I"}
"""Token type names of the index -> array typecodes."""
LEGACY_TOKENIZER = "bytes+eod"
"""The name indexes written before they held the tokenizer's sha256 gave the byte tokenizer."""


class ShardSetError(ValueError):
    """A shard set that cannot be used as asked; the message names the location and what is wrong."""


def token_type(vocab_size: int) -> str:
    """uint16 where every id fits (half the bytes to store and read), else uint32."""
    if vocab_size > 2**32:
        raise ShardSetError(f"a vocabulary of {vocab_size} does not fit in uint32 tokens")
    return "uint16" if vocab_size <= 2**16 else "uint32"


def token_bytes(ids: array) -> bytes:
    """Tokens as the shard stores them: little-endian."""
    if sys.byteorder == "big":
        ids = array(ids.typecode, ids)
        ids.byteswap()
    return ids.tobytes()


def shard_entry(name: str, data: bytes, itemsize: int, block_bytes: int = BLOCK_BYTES, documents: int = 0) -> dict:
    """The index's entry for a shard of these bytes."""
    return {"name": name, "tokens": len(data) // itemsize, "documents": documents,
            "sha256": hashlib.sha256(data).hexdigest(),
            "block_sha256": [hashlib.sha256(data[at:at + block_bytes]).hexdigest()
                             for at in range(0, len(data), block_bytes)]}


def index_of(shards: list[dict], tokenizer_name: str, tokenizer_sha256: str, vocab_size: int,
             block_bytes: int = BLOCK_BYTES, **extra) -> dict:
    """The index of these shard entries, in the order training reads them."""
    return {"tokenizer": tokenizer_name, "tokenizer_sha256": tokenizer_sha256, "vocab_size": vocab_size,
            "dtype": token_type(vocab_size), "block_bytes": block_bytes,
            "documents": sum(shard.get("documents", 0) for shard in shards),
            "tokens": sum(shard["tokens"] for shard in shards), **extra, "shards": shards}


def index_problems(index: dict, location: str, vocab_size: int, tokenizer_spec: str, tokenizer_sha256: str) -> list[str]:
    """Why a model of `vocab_size` rows with this tokenizer cannot train on the shard set of `index`
    (empty: it can). Each names both sides."""
    problems = []
    if index["vocab_size"] > vocab_size:
        problems.append(f"model.vocab_size={vocab_size} is smaller than the vocabulary of the shards at {location} "
                        f"({index['vocab_size']}, tokenizer {index['tokenizer']})")
    shards_sha256 = index.get("tokenizer_sha256") or (_bytes_sha256() if index["tokenizer"] == LEGACY_TOKENIZER else "")
    if shards_sha256 != tokenizer_sha256:
        problems.append(f"data.tokenizer={tokenizer_spec} (sha256 {tokenizer_sha256[:12]}) is not the tokenizer the "
                        f"shards at {location} were made with ({index['tokenizer']}, sha256 {shards_sha256[:12] or 'unknown'})")
    return problems


def _bytes_sha256() -> str:
    from trainer.tokenizer import ByteTokenizer

    return ByteTokenizer().sha256


class ShardStore:
    """Files in a local directory or under an S3 prefix: read, write and list by name."""

    def __init__(self, location: str):
        self.location = location
        if location.startswith("s3://"):
            self.bucket, _, prefix = location[len("s3://"):].partition("/")
            self.prefix = prefix.strip("/")
            self.s3 = boto3.client("s3")
        else:
            self.s3 = None
            self.root = Path(location)

    def key(self, name: str) -> str:
        """The S3 key of `name`."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def read(self, name: str) -> bytes | None:
        if self.s3 is None:
            path = self.root / name
            return path.read_bytes() if path.exists() else None
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.key(name))["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes start..end (inclusive, as HTTP ranges count) of an S3 object."""
        body = self.s3.get_object(Bucket=self.bucket, Key=self.key(name), Range=f"bytes={start}-{end}")["Body"]
        return body.read()

    def write(self, name: str, data: bytes) -> None:
        """Whole or not at all: a PUT is, and a local file is written aside and renamed into place."""
        if self.s3 is not None:
            self.s3.put_object(Bucket=self.bucket, Key=self.key(name), Body=data)
            return
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        # Several ranks may build the same shard at once, and a kill may come mid-write: none sees half a file.
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".partial-", delete=False) as tmp:
            tmp.write(data)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, path)

    def delete(self, name: str) -> None:
        if self.s3 is not None:
            self.s3.delete_object(Bucket=self.bucket, Key=self.key(name))
        else:
            (self.root / name).unlink(missing_ok=True)

    def names(self, prefix: str) -> list[str]:
        """The names under `prefix` (e.g. ".prepare/part-"), sorted."""
        if self.s3 is None:
            folder, _, start = (self.root / prefix).as_posix().rpartition("/")
            if not Path(folder).is_dir():
                return []
            return sorted(f"{prefix.rpartition('/')[0]}/{p.name}".lstrip("/") for p in Path(folder).iterdir()
                          if p.name.startswith(start) and not p.name.startswith(".partial-"))
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.key(prefix))
        cut = len(self.key("")) if self.prefix else 0
        return sorted(item["Key"][cut:] for page in pages for item in page.get("Contents", []))

    def read_index(self) -> dict | None:
        data = self.read(INDEX_NAME)
        return None if data is None else json.loads(data)
