"""Training data: a corpus that ships with Python, byte tokens in uint32 shards, a resumable sampler.

Corpus (data.corpus=stdlib): the standard library's own `*.py` sources in name order, one document
each, so every machine with the same Python version builds the same tokens without a download.

Shards: the format of trainer/shards.py (little-endian uint16 or uint32 tokens, `index.json`
written last with the tokenizer, the dtype, each shard's sha256 and the sha256 of each block), in
a local directory or under s3://bucket/prefix, written by `trainfleet data prepare` or, where
data.corpus names it, built here from the corpus. A location without an index is refused, never
filled. Shard sets written before the index recorded a dtype hold uint16 tokens; they are still
read as such, and need no rewrite.

Token source: no rank holds the corpus; the shards read as one sequence, and a window is copied
out of the shard or shards that hold it, so windows cross shard boundaries exactly as they did
when the corpus was one tensor.
- Local shards are read-only memory maps (the page cache is shared by the ranks of a node and
  evicts as it needs), used once each shard's sha256 matched the index.
- S3 shards are read by block: a window fetches only the blocks that hold it (ranged GETs, several
  in parallel), each checked against its sha256 before it is kept, into a block cache under
  cache_dir that the ranks of a node share (one rank fetches a block while the others wait on a
  file lock) and that is bounded by cache_bytes (the least recently opened blocks go first). The
  loader knows the sampler's order ahead, so it fetches the next batches' blocks in the
  background while the current batch trains. A block that does not match is fetched once more,
  then refused naming shard, block and byte range; nothing unmatched is ever used.
- S3 shard sets whose index has no block digests (written before blocks were) are fetched whole
  into the cache before the first batch, as parallel ranged GETs, and used once their sha256
  matched.

Integrity: a local or whole-fetched shard that matched is stamped in the cache with the file's
size, mtime and inode, so a restart re-reads it only if the file changed since (or was written
too recently for its mtime to tell a later rewrite apart). A cached block is used without hashing
it again: only bytes that matched are renamed into the cache, and nothing writes a block file after.

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
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import NamedTuple

import boto3
import numpy as np
import torch

from trainer import tokenizer
from trainer.config import DataConfig
from trainer.shards import (BLOCK_BYTES, INDEX_NAME, ShardSetError, ShardStore, index_of, index_problems,
                            shard_entry, token_type)

# Index dtype -> file layout. An index without a dtype was written when tokens were uint16.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
LEGACY_DTYPE = "uint16"
PART_BYTES = 8 * 1024 * 1024
"""Size of one ranged GET of a shard fetched whole: S3 serves each connection at tens of MB/s, so a shard
comes as parts in parallel."""
FETCH_THREADS = 8
"""Ranged GETs a rank keeps in flight."""
PREFETCH_BATCHES = 4
"""Batches whose blocks are fetched ahead of the sampler: room for S3's slow requests before a step waits."""
MAPPED_BLOCKS = 128
"""Blocks a rank keeps open (memory-mapped); others are reopened from the cache directory when read again."""
EVICTION_SCANS_PER_BOUND = 64
"""A rank measures the block cache each time it has added cache_bytes / this since its last look: the
ranks of a node overshoot the bound by at most ranks / this of it."""
PARTIAL_STALE_NS = 600_000_000_000
"""A partly written block file this old was left by a killed fetch, not one in progress."""
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


def corpus_pieces(max_bytes: int, piece_chars: int) -> list[str]:
    """The corpus cut at line ends into documents a little over piece_chars each (each file's last
    piece shorter): documents of the size a user's JSON Lines records have, for tests and benches."""
    pieces = []
    for text in corpus_documents(max_bytes):
        piece = ""
        for line in text.splitlines(keepends=True):
            piece += line
            if len(piece) > piece_chars:
                pieces.append(piece)
                piece = ""
        pieces.append(piece)
    return [piece for piece in pieces if piece]


def tokenize_corpus(max_bytes: int, tok: tokenizer.Tokenizer) -> tuple[np.ndarray, int]:
    """The corpus's tokens, each document begun and ended as the tokenizer defines; and the documents' count."""
    documents = tok.encode_documents(corpus_documents(max_bytes))
    return np.array([token for document in documents for token in document], dtype=np.int64), len(documents)


def write_shards(store: ShardStore, tokens: np.ndarray, shard_tokens: int, vocab_size: int,
                 tokenizer_name: str, tokenizer_sha256: str = "", block_bytes: int = BLOCK_BYTES,
                 documents: int = 0) -> dict:
    """Store tokens (of `documents` documents) as shards of shard_tokens each, then the index that marks the
    set complete."""
    dtype = DTYPES[token_type(vocab_size)]
    if block_bytes <= 0 or block_bytes % dtype.itemsize:
        raise ValueError(f"block_bytes={block_bytes} is not a positive multiple of {dtype.itemsize}, "
                         f"the size of a {dtype.name} token")
    unfit = tokens[(tokens < 0) | (tokens > np.iinfo(dtype).max)]
    if len(unfit):
        raise ValueError(f"token {unfit[0]} does not fit in {dtype.name}, the shards' token type")
    shards = []
    for number, start in enumerate(range(0, len(tokens), shard_tokens)):
        data = tokens[start:start + shard_tokens].astype(dtype).tobytes()
        name = f"shard-{number:05d}.bin"
        store.write(name, data)
        shards.append(shard_entry(name, data, dtype.itemsize, block_bytes))
    index = index_of(shards, tokenizer_name, tokenizer_sha256, vocab_size, block_bytes, documents=documents)
    store.write(INDEX_NAME, json.dumps(index, indent=1).encode())  # last: the index marks the set complete
    return index


def ensure_shards(cfg: DataConfig) -> dict:
    """The shard set's index, the set built from the corpus first where data.corpus names one and no
    index is there. ShardSetError names a location that holds no shard set."""
    store = ShardStore(cfg.shards)
    index = store.read_index()
    if index is not None:
        return index
    if not cfg.corpus:
        raise ShardSetError(f"data.shards={cfg.shards} holds no {INDEX_NAME}: no shard set is there (write one with "
                            f"`trainfleet data prepare`, or set data.corpus=stdlib to build one from the built-in corpus)")
    tok = tokenizer.load(cfg.tokenizer)
    tokens, documents = tokenize_corpus(cfg.corpus_bytes, tok)
    return write_shards(store, tokens, cfg.shard_tokens, tok.vocab_size, tok.label, tok.sha256, documents=documents)


def checked_index(cfg: DataConfig, vocab_size: int) -> dict:
    """The shard set's index (ensure_shards), once the model's vocabulary and data.tokenizer fit it;
    ShardSetError names what does not, before anything is allocated."""
    index = ensure_shards(cfg)
    problems = index_problems(index, cfg.shards, vocab_size, cfg.tokenizer, tokenizer.sha256_of(cfg.tokenizer))
    if problems:
        raise ShardSetError("; ".join(problems))
    return index


def sha256_of_file(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


class Block(NamedTuple):
    """Bytes start .. start + size of a shard, whose sha256 the index holds."""
    shard: str
    number: int
    start: int
    size: int
    sha256: str


class BlockCache:
    """Blocks of S3 shards, each checked against its sha256, kept under cache_dir for the ranks of a node.

    A block file is named by its sha256 and renamed into place only once its bytes matched, so a
    file there is whole and right. The files total at most cache_bytes (the least recently opened
    go first). Each rank keeps the blocks it read last memory-mapped: the ranks of a node that map
    one file share one copy of it in the page cache.
    """

    def __init__(self, cfg: DataConfig, store: ShardStore, dtype: np.dtype):
        self.location, self.store, self.dtype, self.bound = cfg.shards, store, dtype, cfg.cache_bytes
        self.files, self.locks = _cache_root(cfg) / "blocks", _cache_root(cfg) / "block-locks"
        self.files.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)
        self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="block-fetch")
        self._lock = threading.Lock()  # guards the three below against the fetching threads
        self._mapped: OrderedDict[str, np.ndarray] = OrderedDict()  # sha256 -> tokens, least recently read first
        self._pending: dict[str, Future] = {}
        self._added_since_scan = 0

    def prefetch(self, blocks: list[Block]) -> None:
        """Start fetching (or opening) these blocks in the background, in this order."""
        with self._lock:
            for block in blocks:
                if block.sha256 not in self._mapped and block.sha256 not in self._pending:
                    self._pending[block.sha256] = self._pool.submit(self._load_ahead, block)

    def tokens(self, block: Block) -> np.ndarray:
        """The block's tokens; fetched and checked first if no rank of the node has them."""
        with self._lock:
            tokens = self._mapped.get(block.sha256)
            if tokens is not None:
                self._mapped.move_to_end(block.sha256)
                return tokens
            pending = self._pending.get(block.sha256)
        if pending is not None:
            return pending.result()
        # Not queued: load it on this thread rather than behind the prefetches of later batches.
        tokens = self._load(block)
        self._remember(block, tokens)
        return tokens

    def _load_ahead(self, block: Block) -> np.ndarray:
        tokens = self._load(block)  # a failure stays pending: the read that needs the block raises it
        self._remember(block, tokens)
        return tokens

    def _remember(self, block: Block, tokens: np.ndarray) -> None:
        with self._lock:
            self._pending.pop(block.sha256, None)
            self._mapped[block.sha256] = tokens
            self._mapped.move_to_end(block.sha256)
            while len(self._mapped) > MAPPED_BLOCKS:
                self._mapped.popitem(last=False)

    def _load(self, block: Block) -> np.ndarray:
        path = self.files / block.sha256
        try:
            return self._open(path)
        except FileNotFoundError:
            pass
        with _locked(self.locks / block.sha256[:3]):  # one rank of the node fetches, the others wait
            try:
                return self._open(path)  # another rank fetched it meanwhile
            except FileNotFoundError:
                tokens = self._store(path, self._fetch(block))
        self._added(block.size)
        return tokens

    def _open(self, path: Path) -> np.ndarray:
        with path.open("rb") as file:
            os.utime(file.fileno())  # the eviction order: least recently opened first
            return _mapped_tokens(file, self.dtype)

    def _fetch(self, block: Block) -> bytes:
        """The block's bytes from S3, fetched once more if they do not match (damaged on the way)."""
        for _ in range(2):
            data = self.store.read_range(block.shard, block.start, block.start + block.size - 1)
            if hashlib.sha256(data).hexdigest() == block.sha256:
                return data
        raise RuntimeError(f"shard {block.shard} in {self.location}: block {block.number} (bytes {block.start}.."
                           f"{block.start + block.size - 1}) does not match its index, fetched twice")

    def _store(self, path: Path, data: bytes) -> np.ndarray:
        """Write matched bytes under a temporary name, map them, and rename the file into place."""
        with tempfile.NamedTemporaryFile(dir=self.files, prefix=".partial-", delete=False) as partial:
            try:
                partial.write(data)
                partial.flush()
                tokens = _mapped_tokens(partial, self.dtype)  # mapped before the rename: eviction cannot take it
                os.replace(partial.name, path)
            except BaseException:
                os.unlink(partial.name)
                raise
        return tokens

    def _added(self, size: int) -> None:
        with self._lock:
            self._added_since_scan += size
            if self._added_since_scan < self.bound / EVICTION_SCANS_PER_BOUND:
                return
            self._added_since_scan = 0
        self._evict()

    def _evict(self) -> None:
        """Delete the least recently opened blocks until the files fit the bound; one rank of the node at a time."""
        with _locked(self.locks / "eviction"):
            now, files = time.time_ns(), []
            for entry in os.scandir(self.files):
                with suppress(FileNotFoundError):  # a partial file renamed since the listing
                    stat = entry.stat()
                    files.append((stat.st_mtime_ns, stat.st_size, entry.name))
            total = sum(size for _, size, _ in files)
            for mtime_ns, size, name in sorted(files):
                if total <= self.bound:
                    break
                if name.startswith(".partial-") and now - mtime_ns < PARTIAL_STALE_NS:
                    continue  # a fetch in progress
                # A rank that has the file mapped goes on reading it; the disk is freed when it lets go.
                with suppress(FileNotFoundError):
                    os.unlink(self.files / name)
                total -= size


class RangedShard:
    """One S3 shard read block by block through the node's BlockCache; sliced like a 1-D token array."""

    def __init__(self, shard: dict, block_bytes: int, cache: BlockCache):
        self.cache, self.tokens = cache, shard["tokens"]
        size, itemsize = shard["tokens"] * cache.dtype.itemsize, cache.dtype.itemsize
        if block_bytes % itemsize or len(shard["block_sha256"]) != -(-size // block_bytes):
            raise ValueError(f"{cache.location}/{INDEX_NAME}: shard {shard['name']} of {size} bytes has "
                             f"{len(shard['block_sha256'])} block digests for blocks of {block_bytes} bytes")
        self.block_tokens = block_bytes // itemsize
        self.blocks = [Block(shard["name"], number, start, min(block_bytes, size - start), digest)
                       for number, (start, digest) in enumerate(zip(range(0, size, block_bytes),
                                                                    shard["block_sha256"]))]

    def __len__(self) -> int:
        return self.tokens

    def __getitem__(self, tokens: slice) -> np.ndarray:
        """Tokens start .. stop (a non-empty slice, step 1), copied out of the blocks that hold them."""
        start, stop, _ = tokens.indices(self.tokens)
        parts = [self.cache.tokens(block)[max(start - first, 0):stop - first]
                 for block, first in self._blocks_of(start, stop)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def prefetch(self, start: int, stop: int) -> None:
        self.cache.prefetch([block for block, _ in self._blocks_of(start, stop)])

    def _blocks_of(self, start: int, stop: int) -> list[tuple[Block, int]]:
        """(block, its first token) of each block that holds some of tokens start .. stop."""
        return [(self.blocks[number], number * self.block_tokens)
                for number in range(start // self.block_tokens, (stop - 1) // self.block_tokens + 1)]


class TokenShards:
    """The shard set's tokens as one sequence, over memory-mapped arrays, S3 shards read by block, or any
    1-D integer arrays."""

    def __init__(self, shards: list[np.ndarray | RangedShard]):
        self.shards = shards
        self.starts = np.cumsum([0] + [len(shard) for shard in shards])  # starts[i]: first token of shard i
        self.by_block = any(isinstance(shard, RangedShard) for shard in shards)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def windows(self, starts: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill row i of out, (n, length), with tokens starts[i] .. starts[i] + length, across shard boundaries."""
        self.prefetch(starts, out.shape[1])  # the blocks missing come in parallel, not one after another
        for row, filled, shard, offset, length in self._pieces(starts, out.shape[1]):
            out[row, filled:filled + length] = self.shards[shard][offset:offset + length]
        return out

    def prefetch(self, starts: np.ndarray, length: int) -> None:
        """Start fetching the blocks that windows of `length` tokens at `starts` read (S3 shards read by block)."""
        if self.by_block:
            for _, _, shard, offset, piece in self._pieces(starts, length):
                self.shards[shard].prefetch(offset, offset + piece)

    def _pieces(self, starts: np.ndarray, length: int):
        """(row, filled, shard, offset, n): tokens filled .. filled + n of window `row` are the shard's tokens
        offset .. offset + n."""
        shards = np.searchsorted(self.starts, starts, side="right") - 1
        offsets = starts - self.starts[shards]
        for row, (shard, offset) in enumerate(zip(shards.tolist(), offsets.tolist())):
            filled = 0
            while filled < length:  # once, unless the window runs on into the next shard
                piece = min(length - filled, len(self.shards[shard]) - offset)
                yield row, filled, shard, offset, piece
                filled, shard, offset = filled + piece, shard + 1, 0


class ShardCache:
    """Shards checked against the index, fetched from S3 into cache_dir when they are not local."""

    def __init__(self, cfg: DataConfig, store: ShardStore):
        self.location, self.store = cfg.shards, store
        root = _cache_root(cfg)
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


def _cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir) / hashlib.sha256(cfg.shards.encode()).hexdigest()[:16]


def _mapped_tokens(file, dtype: np.dtype) -> np.ndarray:
    # np.asarray: a plain array over the same mapping, whose slices skip np.memmap's per-slice bookkeeping.
    return np.asarray(np.memmap(file, dtype=dtype, mode="r"))


def _signature(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


@contextmanager
def _locked(path: Path):
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def load_tokens(cfg: DataConfig, index: dict | None = None) -> TokenShards:
    """The shard set of `index` (read here if not given) as one token sequence: S3 shards read by block as windows
    need them, local shards (and S3 shards whose index has no block digests, fetched whole first) memory-mapped
    once checked against the index."""
    index = index or ensure_shards(cfg)
    dtype_name = index.get("dtype", LEGACY_DTYPE)
    if dtype_name not in DTYPES:
        raise ValueError(f"{cfg.shards}/{INDEX_NAME}: token dtype {dtype_name!r} is not one of {sorted(DTYPES)}; "
                         f"rebuild the shard set with this version of trainer/data.py")
    dtype = DTYPES[dtype_name]
    store = ShardStore(cfg.shards)
    if store.s3 is not None and "block_bytes" in index:
        blocks = BlockCache(cfg, store, dtype)
        return TokenShards([RangedShard(shard, index["block_bytes"], blocks) for shard in index["shards"]])
    cache = ShardCache(cfg, store)
    shards = []
    for shard in index["shards"]:
        with cache.checked(shard, dtype.itemsize).open("rb") as file:
            shards.append(_mapped_tokens(file, dtype))
    return TokenShards(shards)


class BatchSampler:
    """Global batches of sequence-window indices in a seeded shuffled order; state = sequences drawn."""

    def __init__(self, n_windows: int, batch_size: int, seed: int):
        if n_windows < batch_size:
            raise ValueError(f"the corpus has {n_windows} sequences, fewer than training.batch_size={batch_size}")
        self.n_windows, self.batch_size, self.seed = n_windows, batch_size, seed
        self.sequences_drawn = 0
        self._orders: dict[int, torch.Tensor] = {}  # epoch -> its order; two kept, as a look ahead may cross one

    def _order_for(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(self.n_windows, generator=generator)
            if len(self._orders) > 2:
                del self._orders[min(self._orders)]
        return self._orders[epoch]

    def batch_at(self, sequences_drawn: int) -> torch.Tensor:
        """Window indices of the global batch drawn once sequences_drawn sequences were, (batch_size,)."""
        positions = range(sequences_drawn, sequences_drawn + self.batch_size)
        return torch.stack([self._order_for(p // self.n_windows)[p % self.n_windows] for p in positions])

    def next_batch(self) -> torch.Tensor:
        """Window indices of the next global batch, (batch_size,)."""
        batch = self.batch_at(self.sequences_drawn)
        self.sequences_drawn += self.batch_size
        return batch

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
    the copy is queued behind the GPU's work instead of stalling the host. With S3 shards read by
    block, the blocks of the next PREFETCH_BATCHES batches are being fetched while a batch trains.
    """

    def __init__(self, tokens: TokenShards, seq_len: int, batch_size: int, dp: int, dp_index: int, seed: int,
                 device: torch.device = torch.device("cpu")):
        self.tokens, self.seq_len, self.device = tokens, seq_len, torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.rows = slice(dp_index * batch_size // dp, (dp_index + 1) * batch_size // dp)
        self.sampler = BatchSampler((len(tokens) - 1) // seq_len, batch_size, seed)
        self._prefetched_to = 0
        """Sequences drawn when the last batch whose blocks were asked for ahead is done."""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._window_starts(self.sampler.next_batch())
        windows = torch.empty((len(starts), self.seq_len + 1), dtype=torch.int64, pin_memory=self.pinned)
        self.tokens.windows(starts, windows.numpy())  # (B/dp, T+1) in host memory
        if self.tokens.by_block:
            self._prefetch_ahead()
        windows = windows.to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def _window_starts(self, batch: torch.Tensor) -> np.ndarray:
        return (batch[self.rows] * self.seq_len).numpy()

    def _prefetch_ahead(self) -> None:
        """Ask for the blocks of the next PREFETCH_BATCHES batches that were not asked for yet."""
        drawn, size = self.sampler.sequences_drawn, self.sampler.batch_size
        ahead_to = drawn + PREFETCH_BATCHES * size
        # After a resume (a new position) everything ahead is new; otherwise only the batch that came into reach.
        first = self._prefetched_to if drawn <= self._prefetched_to <= ahead_to else drawn
        for position in range(first, ahead_to, size):
            self.tokens.prefetch(self._window_starts(self.sampler.batch_at(position)), self.seq_len + 1)
        self._prefetched_to = ahead_to
