"""Token shards from text: the tokenising core of `trainfleet data prepare` on a machine and of the
DataPrep state machine's functions alike (torch-free; `tokenizers`, and pyarrow or zstandard only for
the inputs that need them).

    preparation = Preparation.start(["corpus/", "s3://raw/web.jsonl.zst"], "tokenizer.json", "s3://b/data/web")
    for item in preparation.pending():                    # in any order, on any machine, at once
        tokenise_item(item, tokenizer.load(...), preparation.store)
    preparation.write_index()                             # once every item's part is there

Inputs (a file, a folder or an S3 prefix, read in name order): JSON Lines (.jsonl, .json, .ndjson;
also .gz and .zst), Parquet (.parquet) and plain text (.txt, .md: one document per file). A record's
text is its `text_field`.

Work items: a plain JSON Lines object is cut into byte ranges of `item_bytes` (a record belongs to
the range its first byte is in); a compressed, Parquet or text object is one item. Item n becomes
`shard-0000n.bin` (uint16 tokens where the vocabulary allows, else uint32): its documents in input
order, each begun and ended as the tokenizer defines. The items depend on the inputs and
`item_bytes` alone, never on how many processes or functions tokenise them, so the shards are the
same bytes however the work is spread.

Resumable: each item writes its shard whole (a PUT, or a local file renamed into place), then its
part record `.prepare/part-0000n.json`; a run started again skips the items whose part is there.
The index is written last, once every part is: no shard is listed before it is whole.

A malformed record (not UTF-8, not JSON, no text field) stops the item, named by file and line
(Parquet: row); with skip_bad it is counted and skipped, and the first few are kept to be shown.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from array import array
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trainer import tokenizer
from trainer.shards import (BLOCK_BYTES, INDEX_NAME, TOKEN_TYPES, ShardStore, index_of, shard_entry, token_bytes,
                            token_type)

ITEM_BYTES = 64 * 2**20
"""Input bytes per work item (and so about per shard): a Lambda function tokenises one in well under
its 15 minutes, and a machine's cores share a few hundred of a corpus of tens of gigabytes."""
PLAN_NAME = ".prepare/plan.json"
TOKENIZER_NAME = ".prepare/tokenizer.json"
PART_PREFIX = ".prepare/part-"
ITEMS_NAME = ".prepare/items.json"
"""The items not done yet, as the Distributed Map's ItemReader reads them."""
BATCH_CHARACTERS = 1_000_000
"""Text handed to the tokenizer's batch encoding at once: large enough to keep its cores busy, small
enough that the encodings of one batch stay a few hundred megabytes."""
BAD_EXAMPLES = 10
"""Malformed records an item keeps the names of, under skip_bad."""
FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".txt": "text",
           ".text": "text", ".md": "text"}
COMPRESSIONS = (".gz", ".zst")


class PrepareError(ValueError):
    """Inputs, a destination or a record that cannot be prepared; the message names it."""


class BadRecord(PrepareError):
    """A malformed record, named by file and line (or row)."""


@dataclass(frozen=True)
class Source:
    uri: str
    """A local path or s3://bucket/key."""
    size: int
    version: str
    """What changes when the object does: a local file's mtime in ns, an S3 object's ETag."""

    @property
    def format(self) -> str:
        name = self.uri.rpartition("/")[2].lower()
        compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
        base = FORMATS.get(os.path.splitext(name.removesuffix(compression))[1])
        if base is None or (compression and base != "jsonl"):
            raise PrepareError(f"{self.uri}: not an input this reads (JSON Lines .jsonl/.json/.ndjson, also .gz or "
                               f".zst; Parquet .parquet; text .txt/.md)")
        return base + compression


# -- inputs ------------------------------------------------------------------------------------------------------


def list_sources(inputs: list[str]) -> list[Source]:
    """Every input object, in the order given; a folder's or prefix's in name order (names beginning
    with . or _ left out: hidden files and markers such as _SUCCESS)."""
    sources: list[Source] = []
    for given in inputs:
        found = _s3_sources(given) if given.startswith("s3://") else _local_sources(given)
        if not found:
            raise PrepareError(f"input {given} holds no file")
        sources.extend(found)
    for source in sources:
        source.format  # noqa: B018 - refuses an unknown format before any work
    return sources


def _local_sources(given: str) -> list[Source]:
    path = Path(given)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts))
    else:
        raise PrepareError(f"input {given} does not exist")
    return [Source(str(file), file.stat().st_size, str(file.stat().st_mtime_ns)) for file in files]


def _s3_sources(given: str) -> list[Source]:
    bucket, _, key = given[len("s3://"):].partition("/")
    s3 = _s3()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
    try:
        objects = [item for page in pages for item in page.get("Contents", [])]
    except s3.exceptions.NoSuchBucket:
        raise PrepareError(f"input {given}: no bucket {bucket}") from None
    exact = [o for o in objects if o["Key"] == key]
    if exact:
        objects = exact
    else:
        folder = key if key.endswith("/") or not key else key + "/"
        objects = [o for o in objects if o["Key"].startswith(folder)
                   and not any(part.startswith((".", "_")) for part in o["Key"][len(folder):].split("/"))]
    return [Source(f"s3://{bucket}/{o['Key']}", o["Size"], o["ETag"].strip('"')) for o in sorted(objects, key=lambda o: o["Key"])]


def _s3():
    import boto3  # here: local inputs need no AWS client

    return boto3.client("s3")


class Reader:
    """Bytes of one input object by range, local or in S3; and the object as a stream."""

    def __init__(self, source: Source):
        self.source = source
        if source.uri.startswith("s3://"):
            self.bucket, _, self.key = source.uri[len("s3://"):].partition("/")
            self.s3 = _s3()
        else:
            self.s3 = None

    def read(self, start: int, end: int) -> bytes:
        """Bytes start .. end (exclusive)."""
        if end <= start:
            return b""
        if self.s3 is not None:
            return self.s3.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={start}-{end - 1}")["Body"].read()
        with open(self.source.uri, "rb") as file:
            file.seek(start)
            return file.read(end - start)

    def stream(self) -> io.BufferedIOBase:
        if self.s3 is not None:
            return self.s3.get_object(Bucket=self.bucket, Key=self.key)["Body"]
        return open(self.source.uri, "rb")

    def line_start_after(self, at: int) -> int:
        """Where the first line beginning after byte `at` begins: past the first newline at or after it."""
        chunk = 1 << 20
        while at < self.source.size:
            data = self.read(at, min(at + chunk, self.source.size))
            found = data.find(b"\n")
            if found >= 0:
                return at + found + 1
            at += len(data)
        return self.source.size

    def lines_before(self, at: int) -> int:
        """Newlines in bytes 0 .. at: counted only to name a malformed record's line."""
        chunk, lines = 16 << 20, 0
        for start in range(0, at, chunk):
            lines += self.read(start, min(start + chunk, at)).count(b"\n")
        return lines


# -- planning ----------------------------------------------------------------------------------------------------


def plan_items(sources: list[Source], item_bytes: int = ITEM_BYTES) -> list[dict]:
    """The work items, numbered in input order: plain JSON Lines in byte ranges, any other object whole."""
    items: list[dict] = []
    for source in sources:
        ranges = [(start, min(start + item_bytes, source.size)) for start in range(0, source.size, item_bytes)] \
            if source.format == "jsonl" else [(0, source.size)]
        for start, end in ranges or [(0, 0)]:
            items.append({"number": len(items), "uri": source.uri, "size": source.size, "version": source.version,
                          "start": start, "end": end})
    return items


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.bin"


def part_name(number: int) -> str:
    return f"{PART_PREFIX}{number:05d}.json"


class Preparation:
    """A destination's preparation: its plan, the parts done, the index once all are."""

    def __init__(self, store: ShardStore, plan: dict):
        self.store, self.plan = store, plan

    @classmethod
    def start(cls, inputs: list[str], tokenizer_spec: str, destination: str, text_field: str = "text",
              item_bytes: int = ITEM_BYTES) -> Preparation:
        """The preparation of these inputs into `destination`: begun now, or the one begun there before
        with the same inputs and tokenizer (resumed). PrepareError where the destination holds another."""
        if item_bytes < 1:
            raise PrepareError(f"item bytes must be >= 1, got {item_bytes}")
        tok = tokenizer.load(tokenizer_spec)
        sources = list_sources(inputs)
        plan = {"tokenizer": tok.label, "tokenizer_sha256": tok.sha256, "vocab_size": tok.vocab_size,
                "text_field": text_field, "item_bytes": item_bytes,
                "sources": [{"uri": s.uri, "size": s.size, "version": s.version} for s in sources],
                "items": plan_items(sources, item_bytes)}
        store = ShardStore(destination)
        existing = store.read(PLAN_NAME)
        if existing is None:
            if store.read(INDEX_NAME) is not None:
                raise PrepareError(f"{destination} holds a shard set already, not prepared here: prepare into "
                                   f"another destination")
            store.write(TOKENIZER_NAME, tok.tokenizer_json().encode())
            store.write(PLAN_NAME, json.dumps(plan, indent=1).encode())  # last: the preparation is begun
        else:
            before = json.loads(existing)
            differs = next((key for key in plan if plan[key] != before.get(key)), None)
            if differs:
                raise PrepareError(f"{destination} holds a preparation of other inputs ({differs} differs: "
                                   f"{_short(before.get(differs))} there, {_short(plan[differs])} now): prepare into "
                                   f"another destination, or delete it")
        return cls(store, plan)

    @classmethod
    def resume(cls, destination: str) -> Preparation:
        """The preparation begun at `destination` (where its items run: a process, a function)."""
        store = ShardStore(destination)
        plan = store.read(PLAN_NAME)
        if plan is None:
            raise PrepareError(f"{destination} holds no preparation ({PLAN_NAME})")
        return cls(store, json.loads(plan))

    def tokenizer(self) -> tokenizer.Tokenizer:
        """The tokenizer, as the destination keeps it: every item tokenises with the same bytes."""
        return tokenizer.load(f"{self.store.location.rstrip('/')}/{TOKENIZER_NAME}")

    def done(self) -> set[int]:
        """The numbers of the items whose part is written."""
        return {int(name[len(PART_PREFIX):].split(".")[0]) for name in self.store.names(PART_PREFIX)}

    def pending(self) -> list[dict]:
        done = self.done()
        return [dict(item, text_field=self.plan["text_field"]) for item in self.plan["items"]
                if item["number"] not in done]

    def index(self) -> dict | None:
        return self.store.read_index()

    def write_index(self) -> dict:
        """The index of every item's shard, written last; PrepareError if an item has no part yet."""
        missing = sorted({item["number"] for item in self.plan["items"]} - self.done())
        if missing:
            items = self.plan["items"]
            raise PrepareError(f"{len(missing)} of {len(items)} items are not done (first: item {missing[0]}, "
                               f"{_describe(items[missing[0]])}): run the preparation again to finish them")
        with ThreadPoolExecutor(16) as pool:  # thousands of small GETs on S3
            parts = list(pool.map(lambda item: json.loads(self.store.read(part_name(item["number"]))),
                                  self.plan["items"]))
        shards = [{key: part[key] for key in ("name", "tokens", "documents", "sha256", "block_sha256")}
                  for part in parts if part["tokens"]]
        index = index_of(shards, self.plan["tokenizer"], self.plan["tokenizer_sha256"], self.plan["vocab_size"],
                         BLOCK_BYTES, bad_records=sum(part["bad_records"] for part in parts))
        self.store.write(INDEX_NAME, json.dumps(index, indent=1).encode())
        return index

    def bad_examples(self) -> list[str]:
        """The malformed records skipped, as the parts name them (at most BAD_EXAMPLES an item)."""
        parts = (json.loads(self.store.read(name)) for name in self.store.names(PART_PREFIX))
        return [example for part in parts for example in part["bad_examples"]]


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(item: dict) -> str:
    whole = item["start"] == 0 and item["end"] == item["size"]
    return item["uri"] if whole else f"{item['uri']} bytes {item['start']}..{item['end']}"


# -- tokenising --------------------------------------------------------------------------------------------------


@dataclass
class Counts:
    input_bytes: int = 0
    documents: int = 0
    tokens: int = 0
    bad_records: int = 0


def tokenise_item(item: dict, tok: tokenizer.Tokenizer, store: ShardStore, skip_bad: bool = False,
                  progress: Callable[[Counts], None] | None = None) -> dict:
    """Tokenise one item into its shard, then write its part record; return the part. `progress`
    hears the counts of each batch encoded. BadRecord names the first malformed record unless skip_bad."""
    source = Source(item["uri"], item["size"], item["version"])
    tokens = array(TOKEN_TYPES[token_type(tok.vocab_size)])
    total, bad_examples = Counts(), []

    def bad(problem: str) -> None:
        if not skip_bad:
            raise BadRecord(problem)
        total.bad_records += 1
        if len(bad_examples) < BAD_EXAMPLES:
            bad_examples.append(problem)

    batch: list[str] = []
    batch_bytes = batch_characters = 0

    def encode() -> None:
        nonlocal batch, batch_bytes, batch_characters
        encoded = tok.encode_documents(batch)
        done = Counts(batch_bytes, len(batch), sum(map(len, encoded)))
        for ids in encoded:
            tokens.extend(ids)
        total.input_bytes += done.input_bytes
        total.documents += done.documents
        total.tokens += done.tokens
        if progress:
            progress(done)
        batch, batch_bytes, batch_characters = [], 0, 0

    for text, size in _documents(source, item, bad):
        if text is not None:
            batch.append(text)
            batch_characters += len(text)
        batch_bytes += size
        if batch_characters >= BATCH_CHARACTERS:
            encode()
    encode()
    name = shard_name(item["number"])
    data = token_bytes(tokens)
    if data:
        store.write(name, data)  # whole, before the part that says it is done
    part = {**shard_entry(name, data, tokens.itemsize, BLOCK_BYTES, documents=total.documents),
            "number": item["number"], "input_bytes": item["end"] - item["start"],
            "bad_records": total.bad_records, "bad_examples": bad_examples}
    store.write(part_name(item["number"]), json.dumps(part).encode())
    return part


def _documents(source: Source, item: dict, bad: Callable[[str], None]) -> Iterator[tuple[str | None, int]]:
    """(text, input bytes it took) of each document of the item in order; (None, bytes) for a record
    skipped as malformed or blank."""
    kind = source.format
    reader = Reader(source)
    if kind == "parquet":
        yield from _parquet_documents(reader, item["text_field"], bad)
    elif kind == "text":
        yield from _text_document(reader, bad)
    elif kind == "jsonl":
        first = item["start"] if item["start"] == 0 else reader.line_start_after(item["start"] - 1)
        last = reader.line_start_after(item["end"] - 1) if first < item["end"] else first
        lines = reader.read(first, last).split(b"\n")
        first_line = _LazyLineNumber(reader, first)
        yield from _jsonl_documents(lines, source.uri, first_line, item["text_field"], bad)
    else:
        with reader.stream() as raw:
            stream = gzip.GzipFile(fileobj=raw) if kind.endswith(".gz") else _zstd_stream(raw)
            yield from _jsonl_documents(stream, source.uri, lambda: 1, item["text_field"], bad)


class _LazyLineNumber:
    """The line number of the byte `at` of a file, counted only when a malformed record asks for it."""

    def __init__(self, reader: Reader, at: int):
        self.reader, self.at, self.number = reader, at, None

    def __call__(self) -> int:
        if self.number is None:
            self.number = self.reader.lines_before(self.at) + 1
        return self.number


def _zstd_stream(raw) -> io.BufferedReader:
    import zstandard  # here: only .zst inputs need it

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))


def _jsonl_documents(lines, uri: str, first_line: Callable[[], int], field: str,
                     bad: Callable[[str], None]) -> Iterator[tuple[str | None, int]]:
    loads = json.loads
    for offset, line in enumerate(lines):
        size = len(line) + 1
        if not line.strip():
            yield None, size  # a blank line, or the end of the last line
            continue
        try:
            record = loads(line.decode("utf-8"))
            text = record[field] if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise TypeError
            text.encode("utf-8")  # a lone surrogate escaped in the JSON (\ud800) is no text a tokenizer takes
        except UnicodeError as error:
            bad(f"{uri}:{first_line() + offset}: invalid UTF-8 ({error.reason})")
        except json.JSONDecodeError as error:
            bad(f"{uri}:{first_line() + offset}: not JSON: {error}")
        except (KeyError, TypeError):
            what = "not an object" if not isinstance(record, dict) else \
                f"no {field!r} field" if field not in record else f"{field!r} is not a string"
            bad(f"{uri}:{first_line() + offset}: {what}")
        else:
            yield text, size
            continue
        yield None, size


def _parquet_documents(reader: Reader, field: str, bad: Callable[[str], None]) -> Iterator[tuple[str | None, int]]:
    import pyarrow as pa  # here: only Parquet inputs need it
    import pyarrow.parquet as pq

    uri = reader.source.uri
    source = uri if reader.s3 is None else pa.BufferReader(reader.read(0, reader.source.size))
    try:
        file = pq.ParquetFile(source)
    except pa.ArrowException as error:
        raise PrepareError(f"{uri}: not a Parquet file Arrow can read ({error})") from None
    column = file.schema_arrow.field(field) if field in file.schema_arrow.names else None
    if column is None or not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise PrepareError(f"{uri}: no string column {field!r} (columns: {', '.join(file.schema_arrow.names)})")
    rows, share = 0, reader.source.size / max(file.metadata.num_rows, 1)
    for batch in file.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            rows += 1
            if text is None:
                bad(f"{uri}: row {rows}: {field!r} is null")
            yield text, share


def _text_document(reader: Reader, bad: Callable[[str], None]) -> Iterator[tuple[str | None, int]]:
    data = reader.read(0, reader.source.size)
    try:
        yield data.decode("utf-8"), len(data)
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        bad(f"{reader.source.uri}:{line}: invalid UTF-8 ({error.reason})")
        yield None, len(data)
