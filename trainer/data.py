"""Training data: a corpus that ships with Python, byte tokens in uint16 shards, a resumable sampler.

Corpus: the standard library's own `*.py` sources in name order, one document each, so every
machine with the same Python version builds the same tokens without a download.

Shards: `shard-00000.bin` ... (little-endian uint16 tokens) and `index.json` written last, in a
local directory or under s3://bucket/prefix. S3 shards are downloaded into a local cache once.

Sampler: sequence windows of seq_len + 1 tokens are visited in a seeded random order, epoch after
epoch. Its whole state is the number of sequences already drawn, the same on every rank, so a
resumed run at any pp x dp sees exactly the batches an uninterrupted run would.
"""

import hashlib
import json
import os
import sysconfig
import tempfile
from pathlib import Path

import boto3
import torch

from trainer import tokenizer
from trainer.config import DataConfig

INDEX_NAME = "index.json"
TOKEN_DTYPE = torch.uint16


def corpus_documents(max_bytes: int) -> list[str]:
    """Standard-library sources in a fixed order until max_bytes of text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        documents.append(text[: max_bytes - total])
        total += len(documents[-1])
        if total >= max_bytes:
            break
    return documents


def tokenize_corpus(max_bytes: int) -> torch.Tensor:
    tokens: list[int] = []
    for document in corpus_documents(max_bytes):
        tokens.extend(tokenizer.encode(document))
        tokens.append(tokenizer.END_OF_DOCUMENT)
    return torch.tensor(tokens, dtype=TOKEN_DTYPE)


class ShardStore:
    """Shard files in a local directory or under an S3 prefix: list, read, write by name."""

    def __init__(self, location: str):
        self.location = location
        if location.startswith("s3://"):
            self.bucket, _, prefix = location[len("s3://"):].partition("/")
            self.prefix = prefix.strip("/")
            self.s3 = boto3.client("s3")
        else:
            self.s3 = None
            self.root = Path(location)

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def read(self, name: str) -> bytes | None:
        if self.s3 is None:
            path = self.root / name
            return path.read_bytes() if path.exists() else None
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def write(self, name: str, data: bytes) -> None:
        if self.s3 is not None:
            self.s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        # Write then rename: several ranks may build the same shard at once, none sees half a file.
        with tempfile.NamedTemporaryFile(dir=self.root, delete=False) as tmp:
            tmp.write(data)
        os.chmod(tmp.name, 0o644)
        os.replace(tmp.name, self.root / name)


def ensure_shards(cfg: DataConfig) -> dict:
    """Build the shards from the corpus unless an index is already there; return the index."""
    store = ShardStore(cfg.shards)
    existing = store.read(INDEX_NAME)
    if existing is not None:
        return json.loads(existing)
    tokens = tokenize_corpus(cfg.corpus_bytes)
    shards = []
    for number, start in enumerate(range(0, len(tokens), cfg.shard_tokens)):
        data = tokens[start:start + cfg.shard_tokens].numpy().astype("<u2").tobytes()
        name = f"shard-{number:05d}.bin"
        store.write(name, data)
        shards.append({"name": name, "tokens": len(data) // 2, "sha256": hashlib.sha256(data).hexdigest()})
    index = {"tokenizer": "bytes+eod", "vocab_size": tokenizer.VOCAB_SIZE, "shards": shards}
    store.write(INDEX_NAME, json.dumps(index, indent=1).encode())  # last: the index marks the set complete
    return index


def load_tokens(cfg: DataConfig) -> torch.Tensor:
    """All shards as one int64 tensor, checked against the index."""
    index = ensure_shards(cfg)
    store = ShardStore(cfg.shards)
    cache = Path(cfg.cache_dir) / hashlib.sha256(cfg.shards.encode()).hexdigest()[:16]
    parts = []
    for shard in index["shards"]:
        local = cache / shard["name"] if store.s3 is not None else store.root / shard["name"]
        data = local.read_bytes() if local.exists() else None
        if data is None or hashlib.sha256(data).hexdigest() != shard["sha256"]:
            data = store.read(shard["name"])
            if data is None or hashlib.sha256(data).hexdigest() != shard["sha256"]:
                raise RuntimeError(f"shard {shard['name']} in {cfg.shards} is missing or does not match its index")
            if store.s3 is not None:
                ShardStore(str(cache)).write(shard["name"], data)
        parts.append(torch.frombuffer(bytearray(data), dtype=TOKEN_DTYPE).to(torch.int64))
    return torch.cat(parts)


class BatchSampler:
    """Global batches of sequence-window indices in a seeded shuffled order; state = sequences drawn."""

    def __init__(self, n_windows: int, batch_size: int, seed: int):
        if n_windows < batch_size:
            raise ValueError(f"the corpus has {n_windows} sequences, fewer than training.batch_size={batch_size}")
        self.n_windows, self.batch_size, self.seed = n_windows, batch_size, seed
        self.sequences_drawn = 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def _order_for(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order_epoch, self._order = epoch, torch.randperm(self.n_windows, generator=generator)
        return self._order

    def next_batch(self) -> torch.Tensor:
        """Window indices of the next global batch, (batch_size,)."""
        positions = range(self.sequences_drawn, self.sequences_drawn + self.batch_size)
        self.sequences_drawn += self.batch_size
        return torch.stack([self._order_for(p // self.n_windows)[p % self.n_windows] for p in positions])

    def state_dict(self) -> dict:
        return {"sequences_drawn": self.sequences_drawn, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"the checkpoint's data order was seeded with {state['seed']}, "
                             f"this run with training.seed={self.seed}")
        self.sequences_drawn = int(state["sequences_drawn"])


class DataLoader:
    """This data-parallel replica's share of each global batch: (inputs, targets), each (B/dp, T)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, dp: int, dp_index: int, seed: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.rows = slice(dp_index * batch_size // dp, (dp_index + 1) * batch_size // dp)
        self.sampler = BatchSampler((len(tokens) - 1) // seq_len, batch_size, seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.sampler.next_batch()[self.rows] * self.seq_len
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]
