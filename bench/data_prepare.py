"""`trainfleet data prepare` beside the tokenizer library's own batch encoding of the same text.

    python bench/data_prepare.py                     # 1 GB of JSON Lines made here, every core
    python bench/data_prepare.py --gigabytes 0.2     # a quicker look

Makes JSON Lines of about --gigabytes from the standard library's sources (documents of a few
thousand characters, shuffled with a fixed seed) and a byte-level BPE tokenizer trained here on the
same corpus (32,000 tokens), then in one run:

- prepare: `trainfleet data prepare` (prepare_here: every core, reading, parsing, encoding and
  writing the shards), wall time over the whole input;
- library: the tokenizer's own `encode_batch_fast` over the same documents, already parsed and in
  memory, in batches of the size the preparation encodes (its parallelism on, every core), encoding
  time alone;

then checks that the shards hold exactly the library's tokens (each document's encoding, in input
order, ended as the tokenizer defines). Prints tokens a second a core of each; the last line
`prepare_vs_tokenizer=<prepare / library>`. The cost lines turn the measured rate into the cost of a
billion tokens on Lambda (the DataTokenise function's memory, GB-seconds, S3 requests) and on one
c7i instance (its price per hour), with the prices below.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.aws_prices import (LAMBDA_PER_GB_SECOND, LAMBDA_PER_REQUEST, S3_PER_READ_REQUEST,  # noqa: E402
                              S3_PER_WRITE_REQUEST, STEP_FUNCTIONS_PER_TRANSITION)
from trainer import prepare, tokenizer  # noqa: E402
from trainer.data import corpus_documents, corpus_pieces  # noqa: E402

TOKENISE_MEMORY_GB = 3538 / 1024
"""template.yaml DataTokeniseFunction MemorySize: 2 vCPUs."""
LAMBDA_VCPUS = 2
C7I_INSTANCES = {"c7i.8xlarge": (32, 1.428), "c7i.48xlarge": (192, 8.568)}
"""vCPUs and on-demand USD an hour, us-east-1."""
ITEM_S3_REQUESTS = {"GET": 3 + 1, "PUT": 2}
"""An item: its byte range and the two line-edge reads, the plan; its shard and its part."""
ITEM_TRANSITIONS = 3
"""A child execution's start, task and end, as Step Functions bills a Standard child workflow."""


def make_corpus(folder: Path, gigabytes: float) -> tuple[Path, int]:
    documents = corpus_pieces(40_000_000, 3_000)
    random.Random(0).shuffle(documents)
    target, written, count = gigabytes * 1e9, 0, 0
    path = folder / "corpus.jsonl"
    with path.open("w") as out:
        while written < target:
            for document in documents:
                line = json.dumps({"id": count, "text": document}) + "\n"
                out.write(line)
                written += len(line)
                count += 1
                if written >= target:
                    break
    return path, count


def library_rate(path: Path, tokenizer_path: Path) -> tuple[int, float]:
    """Tokens and encoding seconds of the library's batch encoding over the documents of `path`."""
    from tokenizers import Tokenizer

    library = Tokenizer.from_file(str(tokenizer_path))
    tokens, seconds, batch, characters = 0, 0.0, [], 0

    def encode() -> None:
        nonlocal tokens, seconds, batch, characters
        started = time.perf_counter()
        encodings = library.encode_batch_fast(batch)
        seconds += time.perf_counter() - started
        tokens += sum(len(encoding.ids) + 1 for encoding in encodings)  # + the end of each document
        batch, characters = [], 0

    with path.open() as lines:
        for line in lines:
            batch.append(json.loads(line)["text"])
            characters += len(batch[-1])
            if characters >= prepare.BATCH_CHARACTERS:
                encode()
    encode()
    return tokens, seconds


def shards_match_library(folder: Path, corpus: Path, tokenizer_path: Path, sample_every: int) -> bool:
    """The shards' tokens are the library's encoding of each document in order, for every
    `sample_every`-th shard checked whole (each shard begins at a document)."""
    import numpy as np
    from tokenizers import Tokenizer

    library = Tokenizer.from_file(str(tokenizer_path))
    end = library.token_to_id("<|end_of_text|>")
    plan = json.loads((folder / prepare.PLAN_NAME).read_text())
    index = json.loads((folder / "index.json").read_text())
    by_name = {shard["name"]: shard for shard in index["shards"]}
    for item in plan["items"][::sample_every]:
        name = prepare.shard_name(item["number"])
        with corpus.open("rb") as file:
            if item["start"]:
                file.seek(item["start"] - 1)
                file.readline()  # past the newline at or after the item's start: the previous item's line

            texts = []
            while file.tell() < item["end"]:
                texts.append(json.loads(file.readline())["text"])
        expected = [t for e in library.encode_batch_fast(texts) for t in [*e.ids, end]]
        got = np.fromfile(folder / name, dtype="<u2").tolist() if name in by_name else []
        if got != expected:
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--workdir", type=Path, help="keep the corpus and shards here (default: a temporary folder)")
    args = parser.parse_args()
    from trainfleet.operator.data_command import prepare_here

    with tempfile.TemporaryDirectory() as temporary:
        folder = args.workdir or Path(temporary)
        folder.mkdir(parents=True, exist_ok=True)
        cores = os.cpu_count() or 1
        tokenizer_path = folder / "tokenizer.json"
        tokenizer_path.write_text(tokenizer.train_bpe(corpus_documents(20_000_000), vocab_size=32_000))
        corpus, documents = make_corpus(folder, args.gigabytes)
        size = corpus.stat().st_size
        print(f"corpus: {size / 1e9:.2f} GB of JSON Lines, {documents:,} documents; tokenizer: byte-level BPE, "
              f"32,000 tokens; {cores} cores", flush=True)

        out = folder / "shards"
        done = prepare_here([str(corpus)], str(tokenizer_path), str(out), workers=cores)
        prepared = done.index["tokens"] / done.seconds
        print(f"prepare: {done.index['tokens']:,} tokens in {done.seconds:.1f} s: {prepared:,.0f} tokens/s, "
              f"{prepared / cores:,.0f} a core; {len(done.index['shards'])} shards", flush=True)

        library_tokens, library_seconds = library_rate(corpus, tokenizer_path)
        library = library_tokens / library_seconds
        print(f"library: {library_tokens:,} tokens in {library_seconds:.1f} s of encode_batch_fast: "
              f"{library:,.0f} tokens/s, {library / cores:,.0f} a core", flush=True)
        same = library_tokens == done.index["tokens"] and shards_match_library(out, corpus, tokenizer_path, 5)
        print(f"shards hold the library's tokens: {same}")

        per_vcpu = prepared / cores
        lambda_s = 1e9 / (per_vcpu * LAMBDA_VCPUS)
        items = 1e9 / (done.index["tokens"] / len(done.index["shards"]))
        requests = items * (ITEM_S3_REQUESTS["GET"] * S3_PER_READ_REQUEST
                            + ITEM_S3_REQUESTS["PUT"] * S3_PER_WRITE_REQUEST)
        lambda_usd = lambda_s * TOKENISE_MEMORY_GB * LAMBDA_PER_GB_SECOND
        other = items * (LAMBDA_PER_REQUEST + ITEM_TRANSITIONS * STEP_FUNCTIONS_PER_TRANSITION)
        print(f"cost of 1e9 tokens on Lambda ({LAMBDA_VCPUS} vCPUs, {TOKENISE_MEMORY_GB:.2f} GB, "
              f"{per_vcpu:,.0f} tokens/s a vCPU): {lambda_s * TOKENISE_MEMORY_GB:,.0f} GB-s = ${lambda_usd:.3f}, "
              f"{items:,.0f} items: S3 ${requests:.4f}, invocations and transitions ${other:.4f}; "
              f"total ${lambda_usd + requests + other:.3f}")
        for name, (vcpus, hourly) in C7I_INSTANCES.items():
            hours = 1e9 / (per_vcpu * vcpus) / 3600
            print(f"cost of 1e9 tokens on one {name} ({vcpus} vCPUs at the same rate a vCPU): {hours * 60:.1f} min, "
                  f"${hours * hourly:.3f}")
        print(f"prepare_vs_tokenizer={prepared / library:.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
