"""Training data: a corpus that ships with Python, byte tokens in uint32 shards, a resumable sampler.

Corpus: the standard library's own `*.py` sources in name order, one document each, so every
machine with the same Python version builds the same tokens without a download.

Shards: `shard-00000.bin` ... (little-endian uint32 tokens, so any vocabulary up to 2**32) and
`index.json` written last (dtype, and each shard's token count and sha256), in a local directory
or under s3://bucket/prefix. Shard sets written before the index recorded a dtype hold uint16
tokens; they are still read as such, and need no rewrite.

Token source: no rank holds the corpus. Every shard is a read-only memory map (the page cache is
shared by the ranks of a node and evicts as it needs); the shards read as one sequence, and a
window is copied out of the shard or shards that hold it, so windows cross shard boundaries
exactly as they did when the corpus was one tensor. S3 shards are fetched whole, as parallel
ranged GETs, into the local cache first: a shard is needed by some batch of nearly every epoch,
so fetching it once beats fetching ranges of it again and again, and a whole shard is what its
sha256 covers.

Integrity: a shard is used only once its sha256 matched the index. A match is stamped in the
cache with the file's size, mtime and inode, so a restart re-reads a shard only if the file
changed since (or was written too recently for its mtime to tell a later rewrite apart).

Sampler: sequence windows of seq_len + 1 tokens are visited in a seeded random order, epoch after
epoch. Its whole state is the number of sequences already drawn, the same on every rank, so a
resumed run at any pp x dp sees exactly the batches an uninterrupted run would.
"""

import fcntl
import hashlib
import json
import os
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import boto3
import numpy as np
import torch

from trainer import tokenizer
from trainer.config import DataConfig

INDEX_NAME = "index.json"
SHARD_DTYPE = "uint32"
# Index dtype -> file layout. An index without a dtype was written when tokens were uint16.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
LEGACY_DTYPE = "uint16"
PART_BYTES = 8 * 1024 * 1024
"""Size of one ranged GET: S3 serves each connection at tens of MB/s, so a shard comes as parts in parallel."""
FETCH_THREADS = 8
RACY_NS = 2_000_000_000
"""A file modified this recently may be rewritten within the same mtime tick: hash it, do not stamp it."""


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


def tokenize_corpus(max_bytes: int) -> np.ndarray:
    tokens: list[int] = []
    for document in corpus_documents(max_bytes):
        tokens.extend(tokenizer.encode(document))
        tokens.append(tokenizer.END_OF_DOCUMENT)
    return np.array(tokens, dtype=np.int64)


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

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes start..end (inclusive, as HTTP ranges count) of an S3 object."""
        body = self.s3.get_object(Bucket=self.bucket, Key=self._key(name), Range=f"bytes={start}-{end}")["Body"]
        return body.read()

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


def write_shards(store: ShardStore, tokens: np.ndarray, shard_tokens: int, vocab_size: int,
                 tokenizer_name: str) -> dict:
    """Store tokens as uint32 shards of shard_tokens each, then the index that marks the set complete."""
    dtype = DTYPES[SHARD_DTYPE]
    unfit = tokens[(tokens < 0) | (tokens > np.iinfo(dtype).max)]
    if len(unfit):
        raise ValueError(f"token {unfit[0]} does not fit in {SHARD_DTYPE}, the shards' token type")
    shards = []
    for number, start in enumerate(range(0, len(tokens), shard_tokens)):
        data = tokens[start:start + shard_tokens].astype(dtype).tobytes()
        name = f"shard-{number:05d}.bin"
        store.write(name, data)
        shards.append({"name": name, "tokens": len(data) // dtype.itemsize, "sha256": hashlib.sha256(data).hexdigest()})
    index = {"tokenizer": tokenizer_name, "vocab_size": vocab_size, "dtype": SHARD_DTYPE, "shards": shards}
    store.write(INDEX_NAME, json.dumps(index, indent=1).encode())  # last: the index marks the set complete
    return index


def ensure_shards(cfg: DataConfig) -> dict:
    """Build the shards from the corpus unless an index is already there; return the index."""
    store = ShardStore(cfg.shards)
    existing = store.read(INDEX_NAME)
    if existing is not None:
        return json.loads(existing)
    return write_shards(store, tokenize_corpus(cfg.corpus_bytes), cfg.shard_tokens, tokenizer.VOCAB_SIZE,
                        "bytes+eod")


def sha256_of_file(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


class TokenShards:
    """The shard set's tokens as one sequence, over memory-mapped (or any 1-D integer) arrays."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        self.starts = np.cumsum([0] + [len(shard) for shard in shards])  # starts[i]: first token of shard i

    def __len__(self) -> int:
        return int(self.starts[-1])

    def windows(self, starts: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill row i of out, (n, length), with tokens starts[i] .. starts[i] + length, across shard boundaries."""
        shards = np.searchsorted(self.starts, starts, side="right") - 1
        offsets = starts - self.starts[shards]
        for row, shard, offset in zip(out, shards.tolist(), offsets.tolist()):
            filled = 0
            while filled < len(row):  # once, unless the window runs on into the next shard
                piece = self.shards[shard][offset:offset + len(row) - filled]
                row[filled:filled + len(piece)] = piece
                filled, shard, offset = filled + len(piece), shard + 1, 0
        return out


class ShardCache:
    """Shards checked against the index, fetched from S3 into cache_dir when they are not local."""

    def __init__(self, cfg: DataConfig, store: ShardStore):
        self.location, self.store = cfg.shards, store
        root = Path(cfg.cache_dir) / hashlib.sha256(cfg.shards.encode()).hexdigest()[:16]
        self.files = root if store.s3 is not None else store.root
        self.stamps = ShardStore(str(root / "verified"))

    def checked(self, shard: dict, itemsize: int) -> Path:
        """The local path of a shard whose contents match the index; fetched first if it must be."""
        path = self.files / shard["name"]
        if self.store.s3 is None:
            if not self._matches(path, shard):
                raise RuntimeError(f"shard {shard['name']} in {self.location} is missing or does not match its index")
            return path
        self.files.mkdir(parents=True, exist_ok=True)
        with _locked(self.files / f"{shard['name']}.lock"):  # one rank of the node fetches, the others wait
            if not self._matches(path, shard):
                self._fetch(shard, shard["tokens"] * itemsize, path)
        return path

    def _matches(self, path: Path, shard: dict) -> bool:
        if not path.exists():
            return False
        stamp = self.stamps.read(f"{shard['sha256']}.json")
        if stamp is not None and json.loads(stamp) == _signature(path):
            return True
        hashing_started = time.time_ns()
        if sha256_of_file(path) != shard["sha256"]:
            return False
        if hashing_started - path.stat().st_mtime_ns > RACY_NS:
            self.stamps.write(f"{shard['sha256']}.json", json.dumps(_signature(path)).encode())
        return True

    def _fetch(self, shard: dict, size: int, path: Path) -> None:
        """The whole shard as parallel ranged GETs into a temporary file, renamed into place once it matches."""
        descriptor, partial = tempfile.mkstemp(dir=self.files, prefix=f"{shard['name']}.")
        try:
            os.ftruncate(descriptor, size)

            def fetch_part(start: int) -> None:
                end = min(start + PART_BYTES, size) - 1
                os.pwrite(descriptor, self.store.read_range(shard["name"], start, end), start)

            with ThreadPoolExecutor(FETCH_THREADS) as pool:
                list(pool.map(fetch_part, range(0, size, PART_BYTES)))
            if sha256_of_file(Path(partial)) != shard["sha256"]:
                raise RuntimeError(f"shard {shard['name']} in {self.location} does not match its index")
            os.replace(partial, path)
        except BaseException:
            os.unlink(partial)  # a failed or interrupted fetch leaves nothing behind in the cache
            raise
        finally:
            os.close(descriptor)


def _signature(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


@contextmanager
def _locked(path: Path):
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def load_tokens(cfg: DataConfig) -> TokenShards:
    """The shard set as one token sequence, every shard checked against the index and memory-mapped."""
    index = ensure_shards(cfg)
    dtype_name = index.get("dtype", LEGACY_DTYPE)
    if dtype_name not in DTYPES:
        raise ValueError(f"{cfg.shards}/{INDEX_NAME}: token dtype {dtype_name!r} is not one of {sorted(DTYPES)}; "
                         f"rebuild the shard set with this version of trainer/data.py")
    dtype = DTYPES[dtype_name]
    cache = ShardCache(cfg, ShardStore(cfg.shards))
    # np.asarray: a plain array over the same mapping, whose slices skip np.memmap's per-slice bookkeeping.
    return TokenShards([np.asarray(np.memmap(cache.checked(shard, dtype.itemsize), dtype=dtype, mode="r",
                                             shape=(shard["tokens"],)))
                        for shard in index["shards"]])


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
    """This data-parallel replica's share of each global batch: (inputs, targets), int64 on `device`, each (B/dp, T).

    On CUDA the windows are gathered into pinned host memory and copied with non_blocking=True, so
    the copy is queued behind the GPU's work instead of stalling the host.
    """

    def __init__(self, tokens: TokenShards, seq_len: int, batch_size: int, dp: int, dp_index: int, seed: int,
                 device: torch.device = torch.device("cpu")):
        self.tokens, self.seq_len, self.device = tokens, seq_len, torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.rows = slice(dp_index * batch_size // dp, (dp_index + 1) * batch_size // dp)
        self.sampler = BatchSampler((len(tokens) - 1) // seq_len, batch_size, seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = (self.sampler.next_batch()[self.rows] * self.seq_len).numpy()
        windows = torch.empty((len(starts), self.seq_len + 1), dtype=torch.int64, pin_memory=self.pinned)
        self.tokens.windows(starts, windows.numpy())  # (B/dp, T+1) in host memory
        windows = windows.to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]
