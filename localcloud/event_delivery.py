"""What EventBridge hands a target: the event itself, Input, InputPath or InputTransformer.

Pure functions over plain data, following the EventBridge user guide: a target gets the whole
event unless it sets exactly one of Input (constant JSON text), InputPath (one JSONPath into
the event) or InputTransformer (InputPathsMap of names to JSONPaths, and an InputTemplate with
<name> placeholders). A placeholder inside a JSON string takes the value's text; outside a
string it takes the value as JSON. A template that is not JSON is delivered as text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from jsonpath_ng.ext import parse as parse_jsonpath

__all__ = ["bus_event", "target_input", "render_input_template"]

_PLACEHOLDER = re.compile(r"<([A-Za-z0-9_.\-]+)>")


def bus_event(message: dict[str, Any]) -> dict[str, Any]:
    """The event as AWS delivers it: ISO-8601 `time`, none of moto's internal fields."""
    event = {key: value for key, value in message.items() if key != "ingestion-time"}
    when = event.get("time")
    if isinstance(when, (int, float)):
        event["time"] = datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    elif isinstance(when, datetime):
        event["time"] = when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return event


def _select(path: str, event: dict[str, Any], field: str) -> Any:
    try:
        matches = parse_jsonpath(path).find(event)
    except Exception as exc:  # jsonpath_ng raises bare Exceptions for a bad expression
        raise ValueError(f"{field}: invalid JSONPath {path!r}: {exc}") from exc
    if not matches:
        return None
    return matches[0].value if len(matches) == 1 else [match.value for match in matches]


def target_input(target: dict[str, Any], event: dict[str, Any], rule_name: str,
                 rule_arn: str) -> Any:
    """The payload a target receives for `event` (a dict/list/scalar, or text)."""
    given = [name for name in ("Input", "InputPath", "InputTransformer") if target.get(name)]
    if len(given) > 1:
        raise ValueError(f"target {target.get('Id')!r}: Input, InputPath and InputTransformer "
                         f"are exclusive, got {given}")
    if target.get("Input"):
        try:
            return json.loads(target["Input"])
        except ValueError as exc:
            raise ValueError(f"target {target.get('Id')!r}: Input is not JSON: {exc}") from exc
    if target.get("InputPath"):
        return _select(target["InputPath"], event, "InputPath")
    transformer = target.get("InputTransformer")
    if transformer:
        values = {name: _select(path, event, f"InputPathsMap.{name}")
                  for name, path in (transformer.get("InputPathsMap") or {}).items()}
        values |= {"aws.events.event.json": event, "aws.events.rule-name": rule_name,
                   "aws.events.rule-arn": rule_arn,
                   "aws.events.event.ingestion-time": event.get("time")}
        text = render_input_template(transformer["InputTemplate"], values)
        try:
            return json.loads(text)
        except ValueError:
            return text
    return event


def render_input_template(template: str, values: dict[str, Any]) -> str:
    """Fill <name> placeholders: raw text inside a JSON string, JSON outside one."""
    out: list[str] = []
    in_string = False
    index = 0
    while index < len(template):
        char = template[index]
        if char == "\\" and in_string:
            out.append(template[index:index + 2])
            index += 2
            continue
        if char == '"':
            in_string = not in_string
        if char == "<":
            match = _PLACEHOLDER.match(template, index)
            if match and match.group(1) in values:
                value = values[match.group(1)]
                if in_string:
                    text = value if isinstance(value, str) else json.dumps(value)
                    out.append(json.dumps(text)[1:-1])
                else:
                    out.append(json.dumps(value))
                index = match.end()
                continue
        out.append(char)
        index += 1
    return "".join(out)


@dataclass
class DeliveryFailure:
    """A target that could not be reached, kept so tests can assert none happened."""

    target_arn: str
    error: str
    event: Any = field(repr=False)
