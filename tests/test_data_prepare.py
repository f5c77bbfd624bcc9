"""`trainfleet data prepare` here (trainer/prepare.py, trainfleet/operator/data_command.py): the shards
hold each document's encoding by the tokenizer in input order, whatever the format; the same bytes
whatever the number of processes; killed and run again it finishes with nothing partial listed; a
malformed record is named by file and line, or counted and skipped."""

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from tokenizers import Tokenizer

from localcloud.waiting import until
from trainer import tokenizer
from trainer.data import corpus_documents, corpus_pieces, load_tokens
from trainer.config import DataConfig
from trainer.prepare import BadRecord, PrepareError
from trainfleet.operator.data_command import prepare_here

REPO = Path(__file__).resolve().parents[1]


def documents(max_bytes: int) -> list[str]:
    """The corpus cut into documents of about 2,000 characters at line ends, a few with other scripts."""
    cut = corpus_pieces(max_bytes, 2_000)
    cut[3::50] = [f"déjà vu — 日本語 {n} 🙂\n" + doc for n, doc in enumerate(cut[3::50])]
    return cut


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    path.write_text(tokenizer.train_bpe(corpus_documents(500_000), vocab_size=700))
    return path


def jsonl(docs: list[str], field: str = "text") -> bytes:
    return "".join(json.dumps({"id": n, field: doc}) + "\n" for n, doc in enumerate(docs)).encode()


def write_every_format(folder: Path, docs: list[str]) -> list[str]:
    """Five inputs, one of each format, in name order; the documents in the order they hold them."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(docs)), 5)
    split = [[docs[i] for i in part] for part in parts]
    (folder / "a.jsonl").write_bytes(jsonl(split[0]))
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(jsonl(split[1])))
    (folder / "c.ndjson.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(split[2])))
    pq.write_table(pa.table({"text": split[3], "n": list(range(len(split[3])))}), folder / "d.parquet",
                   row_group_size=7)
    text = "".join(split[4])
    (folder / "e.txt").write_text(text)
    (folder / "_SUCCESS").write_text("")  # a marker, not an input
    return [*split[0], *split[1], *split[2], *split[3], text]


def shard_tokens(folder: Path) -> list[int]:
    index = json.loads((folder / "index.json").read_text())
    dtype = {"uint16": "<u2", "uint32": "<u4"}[index["dtype"]]
    return np.concatenate([np.fromfile(folder / s["name"], dtype=dtype) for s in index["shards"]]).tolist()


def files(folder: Path) -> dict[str, bytes]:
    """Every file of a destination but the preparation's own records (they name local paths)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and ".prepare" not in p.parts}


def test_the_shards_hold_each_documents_encoding_in_input_order_in_every_format(tmp_path, bpe):
    in_order = write_every_format(tmp_path / "in", documents(400_000))
    done = prepare_here([str(tmp_path / "in")], str(bpe), str(tmp_path / "out"), item_bytes=20_000, workers=2)
    library = Tokenizer.from_file(str(bpe))  # the library itself, not our wrapper: begun with BOS, ended with EOS
    expected = [token for doc in in_order for token in library.encode(doc).ids + [library.token_to_id("<|end_of_text|>")]]
    assert shard_tokens(tmp_path / "out") == expected
    index = done.index
    assert (index["documents"], index["tokens"], index["dtype"], index["vocab_size"]) == (
        len(in_order), len(expected), "uint16", 700)
    assert index["tokenizer"] == "tokenizer.json" and index["tokenizer_sha256"] == hashlib.sha256(bpe.read_bytes()).hexdigest()
    assert len(index["shards"]) > 5  # a.jsonl was cut into byte ranges
    # What the trainer reads back is the same sequence.
    loaded = load_tokens(DataConfig(shards=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache")))
    assert np.concatenate([np.asarray(s) for s in loaded.shards]).tolist() == expected


def test_the_same_bytes_whatever_the_number_of_processes(tmp_path, bpe):
    write_every_format(tmp_path / "in", documents(300_000))
    for workers in (1, 2, 3):
        prepare_here([str(tmp_path / "in")], str(bpe), str(tmp_path / f"out-{workers}"), item_bytes=15_000,
                     workers=workers)
    assert files(tmp_path / "out-1") == files(tmp_path / "out-2") == files(tmp_path / "out-3")
    assert len(files(tmp_path / "out-1")) > 6


def test_bytes_and_a_large_vocabulary_give_the_token_type_that_fits(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(jsonl(["héllo", "wörld"]))
    index = prepare_here([str(tmp_path / "in.jsonl")], "bytes", str(tmp_path / "out"), workers=1).index
    assert shard_tokens(tmp_path / "out") == [*"héllo".encode(), 256, *"wörld".encode(), 256]
    assert (index["dtype"], index["tokenizer"], index["vocab_size"]) == ("uint16", "bytes", 257)
    large = Tokenizer.from_str(tokenizer.train_bpe(corpus_documents(100_000), vocab_size=400))
    large.add_special_tokens([f"<|reserved_{n}|>" for n in range(70_000)])  # Llama 3's reserve its specials so
    (tmp_path / "large.json").write_text(large.to_str())
    index = prepare_here([str(tmp_path / "in.jsonl")], str(tmp_path / "large.json"), str(tmp_path / "out32"),
                         workers=1).index
    assert (index["dtype"], index["vocab_size"]) == ("uint32", 70_400)
    assert shard_tokens(tmp_path / "out32") == [*large.encode("héllo").ids, 1, *large.encode("wörld").ids, 1]


def lines_with(docs: list[str], bad: dict[int, bytes]) -> bytes:
    """JSON Lines of the documents with line n (from 1) replaced by bad[n]."""
    lines = jsonl(docs).splitlines(keepends=True)
    for number, line in bad.items():
        lines[number - 1] = line + b"\n"
    return b"".join(lines)


BAD = {40: b'{"text": "cut off', 75: b'{"id": 3}', 90: b'{"text": "caf\xe9"}', 120: b'{"text": 42}',
       130: b'["text"]', 140: b'{"text": "\\ud800 alone"}'}
BAD_NAMED = {40: "not JSON: Unterminated string starting at: line 1 column 10 (char 9)", 75: "no 'text' field",
             90: "invalid UTF-8 (invalid continuation byte)", 120: "'text' is not a string", 130: "not an object",
             140: "invalid UTF-8 (surrogates not allowed)"}


def test_a_malformed_record_stops_the_run_named_by_file_and_line(tmp_path, bpe):
    docs = documents(300_000)[:200]
    source = tmp_path / "in" / "web.jsonl"
    source.parent.mkdir()
    source.write_bytes(lines_with(docs, {90: BAD[90]}))
    with pytest.raises(BadRecord, match=f"^{source}:90: invalid UTF-8 \\(invalid continuation byte\\)$"):
        prepare_here([str(source)], str(bpe), str(tmp_path / "out"), item_bytes=10_000, workers=2)
    assert not (tmp_path / "out" / "index.json").exists()
    # From the command line: one line, exit 1.
    done = subprocess.run([sys.executable, "-m", "trainfleet.cli", "data", "prepare", str(source), "--tokenizer", str(bpe),
                           "--to", str(tmp_path / "out-cli")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1] == (
        f"trainfleet data prepare: {source}:90: invalid UTF-8 (invalid continuation byte)"), done.stderr


def test_skip_bad_counts_and_skips_each_kind_of_malformed_record(tmp_path, bpe):
    docs = documents(300_000)[:200]
    source = tmp_path / "web.jsonl"
    source.write_bytes(lines_with(docs, BAD))
    done = prepare_here([str(source)], str(bpe), str(tmp_path / "out"), item_bytes=10_000, workers=2, skip_bad=True)
    kept = [doc for number, doc in enumerate(docs, start=1) if number not in BAD]
    library = Tokenizer.from_file(str(bpe))
    assert shard_tokens(tmp_path / "out") == [t for doc in kept for t in library.encode(doc).ids + [1]]
    assert (done.index["bad_records"], done.index["documents"]) == (len(BAD), len(kept))
    # Named by file and line though the file was cut into many items (the line counted from the file's start).
    assert sorted(done.bad_examples) == sorted(f"{source}:{n}: {problem}" for n, problem in BAD_NAMED.items())


def test_a_destination_holding_another_preparation_is_refused(tmp_path, bpe):
    (tmp_path / "in.jsonl").write_bytes(jsonl(["one", "two"]))
    prepare_here([str(tmp_path / "in.jsonl")], str(bpe), str(tmp_path / "out"), workers=1)
    with pytest.raises(PrepareError, match=r"out holds a preparation of other inputs \(tokenizer differs: "):
        prepare_here([str(tmp_path / "in.jsonl")], "bytes", str(tmp_path / "out"), workers=1)
    with pytest.raises(PrepareError, match=r"^input .*/missing.jsonl does not exist$"):
        prepare_here([str(tmp_path / "missing.jsonl")], "bytes", str(tmp_path / "out2"), workers=1)
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(PrepareError, match=r"notes.csv: not an input this reads"):
        prepare_here([str(tmp_path / "notes.csv")], "bytes", str(tmp_path / "out3"), workers=1)


def killed_and_resumed(tmp_path: Path, bpe: Path, source: Path, kill_after_parts: int) -> Path:
    """The command killed (-9, every process) once `kill_after_parts` items are done, then run to its end."""
    out = tmp_path / f"killed-{kill_after_parts}"
    command = [sys.executable, "-m", "trainfleet.cli", "data", "prepare", str(source), "--tokenizer", str(bpe),
               "--to", str(out), "--item-mib", "1", "--workers", "2"]
    process = subprocess.Popen(command, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    parts = lambda: sorted((out / ".prepare").glob("part-*.json")) if (out / ".prepare").exists() else []  # noqa: E731
    until(lambda: len(parts()) >= kill_after_parts or process.poll() is not None, lambda: len(parts()),
          what=f"{kill_after_parts} items done")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "finished before the kill: give it more items"
    assert not (out / "index.json").exists()
    for part in parts():  # every item said to be done has its shard whole
        record = json.loads(part.read_text())
        assert hashlib.sha256((out / record["name"]).read_bytes()).hexdigest() == record["sha256"]
    again = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"items done before" in again.stdout
    assert not list(out.rglob(".partial-*"))
    return out


def test_killed_at_any_moment_it_finishes_with_the_bytes_of_an_uninterrupted_run(tmp_path, bpe):
    source = tmp_path / "web.jsonl"
    source.write_bytes(jsonl(documents(4_000_000) * 2))  # about 9 MB: 9 items of 1 MiB
    reference = tmp_path / "reference"
    prepare_here([str(source)], str(bpe), str(reference), item_bytes=2**20, workers=2)
    for kill_after in (1, 5):
        assert files(killed_and_resumed(tmp_path, bpe, source, kill_after)) == files(reference)


def test_a_shard_written_without_its_part_is_redone_not_listed(tmp_path, bpe):
    """A kill between an item's shard and its part: the shard is not listed, and the item is done again."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(documents(200_000)))
    reference = prepare_here([str(source)], str(bpe), str(tmp_path / "reference"), item_bytes=30_000, workers=1).index
    out = tmp_path / "out"
    prepare_here([str(source)], str(bpe), str(out), item_bytes=30_000, workers=1)
    (out / "index.json").unlink()
    (out / ".prepare" / "part-00002.json").unlink()
    (out / "shard-00002.bin").write_bytes(b"\x00\x01" * 7)  # torn, as no writer here leaves one; never listed
    (out / ".partial-x").write_bytes(b"half")
    assert prepare_here([str(source)], str(bpe), str(out), item_bytes=30_000, workers=1).index == reference
    assert files(out) == files(tmp_path / "reference")


def test_inputs_and_destination_in_s3_give_the_bytes_of_local_ones(tmp_path, bpe, moto_endpoint):
    write_every_format(tmp_path / "in", documents(200_000))
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="prep-in")
    s3.create_bucket(Bucket="prep-out")
    for path in (tmp_path / "in").iterdir():
        s3.put_object(Bucket="prep-in", Key=f"raw/{path.name}", Body=path.read_bytes())
    s3.put_object(Bucket="prep-in", Key="tok/tokenizer.json", Body=bpe.read_bytes())
    local = prepare_here([str(tmp_path / "in")], str(bpe), str(tmp_path / "out"), item_bytes=20_000, workers=2)
    remote = prepare_here(["s3://prep-in/raw/"], "s3://prep-in/tok/tokenizer.json", "s3://prep-out/data/web",
                          item_bytes=20_000, workers=2)
    assert remote.index == local.index
    for shard in local.index["shards"]:
        assert s3.get_object(Bucket="prep-out", Key=f"data/web/{shard['name']}")["Body"].read() == \
            (tmp_path / "out" / shard["name"]).read_bytes()
