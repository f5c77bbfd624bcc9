"""`trainfleet data prepare`: token shards from text, on this machine's cores or on the stack.

    trainfleet data prepare corpus/ --tokenizer tokenizer.json --to s3://BUCKET/data/web
    trainfleet data prepare s3://raw/web/ --tokenizer s3://BUCKET/data/tok.json --to s3://BUCKET/data/web --on-stack
    trainfleet data prepare books.jsonl.zst --tokenizer bytes --to runs/data/books --text-field body --skip-bad

Here: the work items (trainer/prepare.py) go to one process per core, each tokenising whole items
with the tokenizer's batch encoding, so every core works on reading, parsing and encoding alike; a
progress bar shows the input read, tokens a second and the time left. Killed and run again, it
goes on where it stopped. --on-stack: the stack's DataPrep state machine does the same with a
Lambda function per item (a Distributed Map), and this command follows it.

A command that cannot be done says why in one line and exits 1.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from trainer import prepare
from trainer.prepare import Counts, Preparation, PrepareError
from trainer.tokenizer import TokenizerError

__all__ = ["add_data_commands", "prepare_here", "Prepared"]


@dataclass(frozen=True)
class Prepared:
    """What a preparation wrote."""

    index: dict
    seconds: float
    """Wall time of this invocation (a resumed one: of what was left)."""
    resumed_items: int
    """Items found done already."""
    bad_examples: tuple[str, ...]


def prepare_here(inputs: list[str], tokenizer_spec: str, destination: str, *, text_field: str = "text",
                 skip_bad: bool = False, workers: int = 0, item_bytes: int = prepare.ITEM_BYTES,
                 show_progress: bool = False) -> Prepared:
    """Prepare the inputs into `destination` with `workers` processes (0: one per core)."""
    started = time.monotonic()
    preparation = Preparation.start(inputs, tokenizer_spec, destination, text_field, item_bytes)
    index = preparation.index()
    pending = preparation.pending()
    resumed = len(preparation.plan["items"]) - len(pending)
    if index is None:
        _clear_partial_files(destination)
        if pending:
            _tokenise(preparation, pending, skip_bad, workers or os.cpu_count() or 1, show_progress)
        index = preparation.write_index()
    return Prepared(index, time.monotonic() - started, resumed, tuple(preparation.bad_examples()))


def _clear_partial_files(destination: str) -> None:
    """Files a killed run left half written (never listed: trainer/shards.py ShardStore.write)."""
    if not destination.startswith("s3://"):
        for leftover in Path(destination).rglob(".partial-*"):
            leftover.unlink(missing_ok=True)


def _tokenise(preparation: Preparation, items: list[dict], skip_bad: bool, workers: int, show: bool) -> None:
    """Every item in `items`, on `workers` processes; the first failure ends them all and is raised."""
    context = multiprocessing.get_context("spawn")  # the parent holds threads (the progress bar, AWS clients)
    counts = context.Queue()
    total_bytes = sum(item["end"] - item["start"] for item in items)
    with _Bar(show, total_bytes, len(preparation.plan["items"]) - len(items)) as bar, \
            context.Pool(min(workers, len(items)), _start_worker,
                         (preparation.store.location, skip_bad, counts)) as pool:
        results = [pool.apply_async(_tokenise_one, (item,)) for item in items]
        try:
            while not all(result.ready() for result in results):
                _drain(counts, bar, wait=0.2)
                for result in results:
                    if result.ready() and not result.successful():
                        result.get()  # raises the worker's error
            _drain(counts, bar, wait=0)
            for result in results:
                result.get()
        finally:
            pool.terminate()  # a failure, or Ctrl-C: the others stop now; their finished items are kept


def _drain(counts, bar: _Bar, wait: float) -> None:
    try:
        while True:
            bar.advance(counts.get(timeout=wait))
            wait = 0
    except queue.Empty:
        pass


_worker: dict = {}
"""In each worker process: its preparation, tokenizer, what to do with bad records and where counts go."""


def _start_worker(destination: str, skip_bad: bool, counts) -> None:
    # One thread a process: the processes already fill the cores, and the library's own threads
    # on top of them would only contend.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    preparation = Preparation.resume(destination)
    _worker.update(preparation=preparation, tokenizer=preparation.tokenizer(), skip_bad=skip_bad, counts=counts)


def _tokenise_one(item: dict) -> None:
    preparation = _worker["preparation"]
    prepare.tokenise_item(item, _worker["tokenizer"], preparation.store, _worker["skip_bad"],
                          progress=_worker["counts"].put)


class _Bar:
    """The progress bar: input bytes read of the total, tokens a second, the time left (rich)."""

    def __init__(self, show: bool, total_bytes: int, items_done: int):
        self.show, self.total_bytes, self.items_done = show, total_bytes, items_done
        self.tokens, self.started = 0, time.monotonic()

    def __enter__(self) -> _Bar:
        if self.show:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("tokenising"), BarColumn(), DownloadColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                                     TextColumn("left"), TimeRemainingColumn(), transient=False,
                                     console=_stderr_console())
            self.progress.start()
            self.task = self.progress.add_task("", total=self.total_bytes, rate="")
            if self.items_done:
                self.progress.console.print(f"resuming: {self.items_done} items were done already")
        return self

    def advance(self, done: Counts) -> None:
        self.tokens += done.tokens
        if self.show:
            rate = self.tokens / max(time.monotonic() - self.started, 1e-9)
            self.progress.update(self.task, advance=done.input_bytes, rate=f"{rate:,.0f} tokens/s")

    def __exit__(self, *exc) -> None:
        if self.show:
            self.progress.stop()


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def _prepare(args: argparse.Namespace) -> int:
    try:
        if args.on_stack:
            from trainfleet.operator.data_on_stack import prepare_on_stack

            done = prepare_on_stack(args)
        else:
            done = prepare_here(args.inputs, args.tokenizer, args.to, text_field=args.text_field,
                                skip_bad=args.skip_bad, workers=args.workers, item_bytes=args.item_mib * 2**20,
                                show_progress=True)
    except (PrepareError, TokenizerError) as error:
        print(f"trainfleet data prepare: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("trainfleet data prepare: stopped; run it again to go on where it stopped", file=sys.stderr)
        return 130
    print(summary(done, args.to))
    return 0


def summary(done: Prepared, destination: str) -> str:
    index = done.index
    rate = index["tokens"] / done.seconds if done.seconds else 0
    lines = [f"prepared {index['documents']:,} documents, {index['tokens']:,} tokens ({index['dtype']}, vocabulary "
             f"{index['vocab_size']:,}, tokenizer {index['tokenizer']}) in {len(index['shards'])} shards at "
             f"{destination}" + (f" ({done.resumed_items} items done before)" if done.resumed_items else "")
             + f"; {done.seconds:.1f} s, {rate:,.0f} tokens/s"]
    if index.get("bad_records"):
        lines.append(f"skipped {index['bad_records']:,} malformed records, among them:")
        lines.extend(f"  {example}" for example in done.bad_examples)
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_data_commands(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="prepare token shards from text", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = data.add_subparsers(dest="data_command", required=True)
    prepare_ = sub.add_parser("prepare", help="tokenise JSON Lines, Parquet or text into token shards",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare_.add_argument("inputs", nargs="+", metavar="INPUT",
                          help="files, folders or s3:// prefixes: .jsonl/.json/.ndjson (also .gz, .zst), "
                               ".parquet, .txt/.md (a document each)")
    prepare_.add_argument("--tokenizer", required=True,
                          help="a tokenizer.json (path or s3:// URI), or bytes")
    prepare_.add_argument("--to", required=True, help="the destination: a folder, or s3://BUCKET/data/NAME")
    prepare_.add_argument("--text-field", default="text", help="the field (Parquet: column) of the text (default: text)")
    prepare_.add_argument("--skip-bad", action="store_true",
                          help="count and skip malformed records instead of stopping at the first")
    prepare_.add_argument("--workers", type=_positive, default=0,
                          help="processes tokenising here (default: one per core)")
    prepare_.add_argument("--item-mib", type=_positive, default=prepare.ITEM_BYTES // 2**20,
                          help="input MiB per work item, and so about per shard (default: %(default)s)")
    prepare_.add_argument("--on-stack", action="store_true",
                          help="run it on the deployed stack (the DataPrep state machine) and follow it")
    prepare_.add_argument("--stack", default=os.environ.get("TRAINFLEET_STACK", "trainfleet"),
                          help="with --on-stack: the stack's name (default: $TRAINFLEET_STACK or trainfleet)")
    prepare_.set_defaults(func=_prepare)
