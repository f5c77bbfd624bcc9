"""CloudWatch embedded metric format: the metrics CloudWatch Logs extracts from a log line.

In Lambda, a JSON line with an `_aws.CloudWatchMetrics` directive that reaches the function's
log group becomes metric data points, with no PutMetricData call. The local cloud does the
same with the output its in-process handlers print. Pure functions over plain data, after
the EMF specification: each directive names a namespace, dimension sets (lists of keys whose
values sit at the document's root) and metrics (names whose values, a number or a list of
numbers, sit at the root).
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import Any

__all__ = ["metric_data"]


def metric_data(line: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(namespace, PutMetricData entries) for each directive of an EMF line; [] for a line
    that is not EMF or breaks the specification (CloudWatch drops such lines' metrics)."""
    try:
        document = json.loads(line)
    except ValueError:
        return []
    if not isinstance(document, dict) or not isinstance(document.get("_aws"), dict):
        return []
    metadata = document["_aws"]
    timestamp_ms = metadata.get("Timestamp")
    directives = metadata.get("CloudWatchMetrics")
    if not isinstance(timestamp_ms, (int, float)) or not isinstance(directives, list):
        return []
    when = datetime.fromtimestamp(timestamp_ms / 1000, timezone.utc)
    published = []
    for directive in directives:
        entries = _directive_entries(document, directive, when)
        if entries:
            published.append((directive["Namespace"], entries))
    return published


def _directive_entries(document: dict[str, Any], directive: Any, when: datetime) -> list[dict[str, Any]]:
    if not isinstance(directive, dict) or not isinstance(directive.get("Namespace"), str):
        return []
    dimension_sets = directive.get("Dimensions") or [[]]
    entries = []
    for dimension_keys in dimension_sets:
        if not all(isinstance(document.get(key), str) for key in dimension_keys):
            return []  # a dimension without a string value invalidates the directive
        dimensions = [{"Name": key, "Value": document[key]} for key in dimension_keys]
        for metric in directive.get("Metrics", []):
            values = document.get(metric.get("Name"))
            values = values if isinstance(values, list) else [values]
            if not values or not all(_is_number(value) for value in values):
                continue
            entry = {"MetricName": metric["Name"], "Dimensions": dimensions,
                     "Timestamp": when, "Values": [float(value) for value in values]}
            if metric.get("Unit"):
                entry["Unit"] = metric["Unit"]
            entries.append(entry)
    return entries


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
