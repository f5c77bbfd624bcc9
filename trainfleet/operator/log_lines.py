"""Log lines for people: `trainfleet run logs` shows each line as time, source, level and message,
one line each (`--json` shows the records as CloudWatch Logs holds them).

    line = function_line(event_ms, log_group, message)    # a function's line; None for a metrics record
    line = node_line(event_ms, message)                    # a node's line: its agent's or its trainer's
    str(line)   # "2026-12-07 16:55:20 Allocate INFO fleet allocated instances=2 zone=us-east-1a"

What the functions log: Powertools' JSON records (their own fields shown after the message as
key=value, Powertools' context left out), the Lambda runtime's line for an error the handler
raised (`[ERROR] Type: message` in the text log format, a record with errorType in the JSON
one), and CloudWatch embedded-metric records, which are metrics, not lines for people. What a
node logs: its agent's JSON lines and its trainer's output, each behind its source's name
(node/node_log.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

__all__ = ["LogLine", "function_line", "node_line", "recovered_failures", "retried", "FIELD_CHARS"]

FIELD_CHARS = 160
"""Most characters of a field's value on a line."""

_POWERTOOLS_KEYS = frozenset({
    "level", "location", "message", "timestamp", "service", "cold_start", "function_name", "function_memory_size",
    "function_arn", "function_request_id", "xray_trace_id", "sampling_rate", "exception", "exception_name",
    "stack_trace", "run_name", "requestId", "errorType", "errorMessage", "stackTrace"})
"""Fields of a function's record that are context, not what the line says (the run is the one asked for)."""
_RUNTIME_ERROR = re.compile(r"^\[ERROR\] (?P<type>[\w.]+): (?P<message>.*)$", re.DOTALL)
_LOG_GROUP_SOURCE = re.compile(r"(?:^|-)(?P<name>[A-Za-z0-9]+)LogGroup(?:-|$)")
_TRAINER_ERROR = re.compile(r"^(Traceback |\S*(Error|Exception)\b)")


@dataclass(frozen=True)
class LogLine:
    at: datetime
    source: str
    """The function (Allocate, Recover ...) or, for a node, agent or trainer."""
    level: str
    message: str
    error: tuple[str, str] | None = None
    """(type, message) of the error a handler raised, on the Lambda runtime's line for it."""

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.source} {self.level} {self.message}"


def function_line(timestamp_ms: int, log_group: str, message: str) -> LogLine | None:
    """A line of a function's log group; None for an embedded-metric record (`_aws`)."""
    at, source = _time(timestamp_ms), _source(log_group)
    record = _json_object(message)
    if record is None:
        raised = _RUNTIME_ERROR.match(message.strip())
        if raised is None:
            return LogLine(at, source, "INFO", _one_line(message))
        return _error_line(at, source, raised["type"], raised["message"])
    if "_aws" in record:
        return None
    if "errorType" in record:  # the runtime's record of a raised error, in the JSON log format
        return _error_line(at, source, str(record["errorType"]),
                           str(record.get("errorMessage") or record.get("message") or ""))
    text = str(record.get("message", ""))
    if record.get("exception_name"):
        last = str(record.get("exception", "")).strip().splitlines()[-1:] or [""]
        text += f" ({record['exception_name']}: {last[0].split(': ', 1)[-1]})"
    return LogLine(at, source, str(record.get("level", "INFO")).upper(), _with_fields(text, record))


def node_line(timestamp_ms: int, message: str) -> LogLine:
    """A line of a node's stream: `agent {json}` or `trainer <output>` (node/node_log.py). A
    trainer line is ERROR when it starts a traceback or names an error, WARNING when it is a
    Python warning, else INFO: its output has no levels of its own."""
    source, _, text = message.partition(" ")
    at = _time(timestamp_ms)
    record = _json_object(text) if source == "agent" else None
    if record is not None and "agent" in record:
        return LogLine(at, source, str(record.get("level", "INFO")).upper(),
                       _with_fields(str(record["agent"]), record, skip=frozenset({"agent", "level"})))
    if source == "trainer":
        level = "ERROR" if _TRAINER_ERROR.match(text) else "WARNING" if "Warning: " in text else "INFO"
        return LogLine(at, source, level, _one_line(text))
    return LogLine(at, source or "node", "INFO", _one_line(text))


def retried(line: LogLine, recovered: set[tuple[str, str]]) -> LogLine:
    """`line` at WARNING, said retried, when it is the runtime's error line of a failure the
    state machine retried and then succeeded past (`recovered`: (error, message) of those)."""
    if line.error is None or line.error not in recovered:
        return line
    return replace(line, level="WARNING", message=f"{line.message} (retried, then succeeded)")


def recovered_failures(history: Iterable[dict[str, Any]]) -> set[tuple[str, str]]:
    """(error, message) of every task failure in an execution's history (its events, oldest
    first) that its state retried and then succeeded past: a Task state's TaskFailed events
    before its TaskSucceeded."""
    recovered: set[tuple[str, str]] = set()
    pending: list[tuple[str, str]] = []
    for event in history:
        if event["type"] == "TaskFailed":
            details = event.get("taskFailedEventDetails", {})
            pending.append((details.get("error", ""), _error_message(details.get("cause", ""))))
        elif event["type"] == "TaskSucceeded":
            recovered.update(pending)
            pending = []
        elif event["type"] == "TaskStateEntered":
            pending = []
    return recovered


def _error_message(cause: str) -> str:
    """The errorMessage of a Lambda task failure's cause (the function's error object, as JSON)."""
    found = _json_object(cause)
    return str(found.get("errorMessage", cause)).strip() if found is not None else cause.strip()


def _error_line(at: datetime, source: str, error_type: str, text: str) -> LogLine:
    return LogLine(at, source, "ERROR", _one_line(f"{error_type}: {text}"), (error_type, text.strip()))


def _with_fields(text: str, record: dict[str, Any], skip: frozenset[str] = _POWERTOOLS_KEYS) -> str:
    fields = " ".join(f"{key}={_value(value)}" for key, value in record.items() if key not in skip and value is not None)
    return _one_line(f"{text} {fields}" if fields else text)


def _value(value: Any) -> str:
    """A field's value, short: a list of more than a few items by its length, a long value cut
    (--json has them whole)."""
    if isinstance(value, list) and len(value) > 3:
        return f"[{len(value)} items]"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= FIELD_CHARS else text[:FIELD_CHARS - 1] + "…"


def _json_object(text: str) -> dict[str, Any] | None:
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        found = json.loads(text)
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip()).replace("\t", " ")


def _source(log_group: str) -> str:
    """The function a log group is of: `STACK-AllocateLogGroup-XYZ` -> Allocate."""
    name = log_group.rsplit("/", 1)[-1]
    found = _LOG_GROUP_SOURCE.search(name)
    return found["name"] if found else name


def _time(timestamp_ms: int) -> datetime:
    return datetime.fromtimestamp(timestamp_ms / 1000, timezone.utc)
