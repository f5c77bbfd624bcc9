"""A node's log in CloudWatch Logs: what its agent says and what its trainer prints.

On EC2 the agent runs under systemd and torchrun writes to a file in the attempt's folder:
neither reaches the serial console that GetConsoleOutput reads. So the agent ships both to the
stack's node log group (trainfleet.core.node_access.node_log_group), one stream per node,
RUN/INSTANCE-ID, each line marked with its source ("agent" or "trainer"); `trainfleet run logs
RUN --node N` reads the stream's end. The node role may write only streams under its own run's
name.

Lines are gathered as they come (`add` from the agent, `follow` of the current attempt's
torchrun output, read every READ_INTERVAL_S: a trainer line carries its own time to within that)
and put every SHIP_INTERVAL_S by a thread of their own, in batches within PutLogEvents' limits. While CloudWatch Logs cannot be reached, lines wait, up to
BACKLOG_LIMIT_BYTES; beyond that the oldest are dropped and the next batch says how many:
shipping must never hold up training nor fill the node's memory. What the agent does it says with
`say`: one JSON line on the console, and in this log once the agent ships it (`ship`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from botocore.exceptions import BotoCoreError, ClientError

SHIP_INTERVAL_S = 5.0
"""Seconds between two shipments: 512 nodes put about 100 batches a second, far inside the
account's PutLogEvents quota."""
READ_INTERVAL_S = 0.5
"""Seconds between two reads of the followed files: a line is stamped when it is read (torchrun's
output has no times of its own), so within this of when it was written."""
EVENT_OVERHEAD_BYTES = 26
"""What CloudWatch Logs counts per event on top of its message."""
MAX_EVENT_BYTES = 256 * 1024 - EVENT_OVERHEAD_BYTES
"""The longest message an event may carry; a longer line is cut."""
MAX_BATCH_BYTES = 1_048_576
"""PutLogEvents' limit on a batch: messages plus EVENT_OVERHEAD_BYTES each."""
MAX_BATCH_EVENTS = 10_000
BACKLOG_LIMIT_BYTES = 8 * 1024 * 1024
"""Lines kept waiting while CloudWatch Logs cannot be reached."""


class NodeLog:
    """Gathers a node's lines and ships them to one CloudWatch Logs stream."""

    def __init__(self, logs: Any, group: str, stream: str, clock: Callable[[], float] = time.time):
        self.logs, self.group, self.stream, self.clock = logs, group, stream, clock
        self._lines: deque[tuple[int, str]] = deque()
        """(milliseconds since the epoch, message), oldest first."""
        self._bytes = 0
        self._dropped = 0
        self._followed: dict[str, tuple[Path, int]] = {}
        """source -> (file, offset of its first byte not read yet)."""
        self._lock = threading.Lock()
        self._stream_made = False

    def add(self, source: str, line: str) -> None:
        """One line, stamped now."""
        message = f"{source} {line.rstrip()}".encode()[:MAX_EVENT_BYTES].decode(errors="ignore")
        with self._lock:
            self._append(int(self.clock() * 1000), message)
            while self._bytes > BACKLOG_LIMIT_BYTES:
                self._take_oldest()
                self._dropped += 1

    def follow(self, source: str, path: Path) -> None:
        """Ship the lines written to `path` from its start on (an attempt's output), in place of
        what `source` followed before."""
        with self._lock:
            self._followed[source] = (path, 0)

    def ship(self) -> int:
        """Read the followed files' new lines and put every line gathered; the events put. A
        failed put keeps its lines for the next shipment."""
        self.read()
        sent = 0
        while batch := self._next_batch():
            try:
                self._put(batch)
            except (ClientError, BotoCoreError):
                with self._lock:
                    for timestamp, message in reversed(batch):
                        self._append(timestamp, message, oldest=True)
                return sent
            sent += len(batch)
        return sent

    def run(self, stop: threading.Event) -> None:
        """Read every READ_INTERVAL_S and ship every SHIP_INTERVAL_S until `stop`, then ship once more."""
        next_shipment = time.monotonic() + SHIP_INTERVAL_S
        while not stop.wait(READ_INTERVAL_S):
            if time.monotonic() < next_shipment:
                self.read()
                continue
            self.ship()
            next_shipment = time.monotonic() + SHIP_INTERVAL_S
        self.ship()

    def _append(self, timestamp: int, message: str, oldest: bool = False) -> None:
        (self._lines.appendleft if oldest else self._lines.append)((timestamp, message))
        self._bytes += _cost(message)

    def _take_oldest(self) -> tuple[int, str]:
        timestamp, message = self._lines.popleft()
        self._bytes -= _cost(message)
        return timestamp, message

    def read(self) -> None:
        """Gather the followed files' new complete lines, each stamped now."""
        with self._lock:
            followed = dict(self._followed)
        for source, (path, offset) in followed.items():
            try:
                with path.open("rb") as file:
                    file.seek(offset)
                    chunk = file.read()
            except FileNotFoundError:
                continue
            complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
            for line in complete.decode(errors="replace").splitlines():
                self.add(source, line)
            with self._lock:
                if self._followed.get(source, (None, 0))[0] == path:
                    self._followed[source] = (path, offset + len(complete))

    def _next_batch(self) -> list[tuple[int, str]]:
        """The oldest lines within PutLogEvents' limits, taken from the backlog; first a note of
        the lines dropped, if any were."""
        with self._lock:
            if self._dropped:
                at = self._lines[0][0] if self._lines else int(self.clock() * 1000)
                self._append(at, f"agent {self._dropped} line(s) dropped: CloudWatch Logs was out of reach",
                             oldest=True)
                self._dropped = 0
            batch, size = [], 0
            while self._lines and len(batch) < MAX_BATCH_EVENTS:
                if batch and size + _cost(self._lines[0][1]) > MAX_BATCH_BYTES:
                    break
                batch.append(self._take_oldest())
                size += _cost(batch[-1][1])
            return batch

    def _put(self, batch: list[tuple[int, str]]) -> None:
        if not self._stream_made:
            try:
                self.logs.create_log_stream(logGroupName=self.group, logStreamName=self.stream)
            except self.logs.exceptions.ResourceAlreadyExistsException:
                pass
            self._stream_made = True
        self.logs.put_log_events(logGroupName=self.group, logStreamName=self.stream,
                                 logEvents=[{"timestamp": at, "message": message} for at, message in batch])


def _cost(message: str) -> int:
    """What CloudWatch Logs counts of an event toward a batch's size."""
    return len(message.encode()) + EVENT_OVERHEAD_BYTES


def say(message: str, /, **fields: Any) -> None:
    """One JSON line on stdout (the instance's console) and in the node's log: what the agent did."""
    line = json.dumps({"agent": message, **fields}, default=str)
    print(line, flush=True)
    if _shipping is not None:
        _shipping.log.add("agent", line)


@dataclass(frozen=True)
class Shipping:
    """The node's log and the thread that ships it."""

    log: NodeLog
    stop: threading.Event
    thread: threading.Thread


_shipping: Shipping | None = None


def ship(log: NodeLog) -> None:
    """Ship what the agent says and its trainers print to `log`, on a thread of its own."""
    global _shipping
    stop = threading.Event()
    thread = threading.Thread(target=log.run, args=(stop,), name="node-log", daemon=True)
    _shipping = Shipping(log, stop, thread)
    thread.start()


def follow(source: str, path: Path) -> None:
    """Ship the lines a trainer writes to `path` too, while the node's log is shipped."""
    if _shipping is not None:
        _shipping.log.follow(source, path)


def stop_node_log() -> None:
    """Ship what is left, once: before the instance ends."""
    global _shipping
    shipping, _shipping = _shipping, None
    if shipping is not None:
        shipping.stop.set()
        shipping.thread.join(timeout=30.0)
