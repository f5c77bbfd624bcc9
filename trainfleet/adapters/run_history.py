"""Read a run's history from AWS: its records and reported steps (DynamoDB) and the states its
execution entered (Step Functions' execution history); trainfleet.core.run_history builds it.

    history = read_history(store, sfn, run, nodes, now)

The Report function (at the end of a run) and `trainfleet run status / watch / report` (at any
time) read it the same way.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from trainfleet.adapters.run_store import RunStore
from trainfleet.core.records import NodeRecord, RunRecord
from trainfleet.core.run_history import RunHistory, StateEntry, build_history

__all__ = ["read_history", "execution_states"]

_EXECUTION_ENDS = frozenset({"ExecutionSucceeded", "ExecutionFailed", "ExecutionAborted", "ExecutionTimedOut"})


def read_history(store: RunStore, sfn: Any, run: RunRecord, nodes: list[NodeRecord], now: datetime) -> RunHistory:
    """The run's history up to `now` (its records already read: the caller uses them too)."""
    states = execution_states(sfn, run.execution_arn) if run.execution_arn else []
    return build_history(run, nodes, store.progress_reports(run.run_name), states, now)


def execution_states(sfn: Any, execution_arn: str) -> list[StateEntry]:
    """The states the execution entered, oldest first, and its end as a state no phase has.
    An execution runs up to 25,000 history events (a few per state): a few pages of 1,000."""
    entries = []
    for page in sfn.get_paginator("get_execution_history").paginate(executionArn=execution_arn, maxResults=1000):
        for event in page["events"]:
            entered = event.get("stateEnteredEventDetails")
            if entered is not None:
                entries.append(StateEntry(entered["name"], event["timestamp"], _attempt(entered.get("input"))))
            elif event["type"] in _EXECUTION_ENDS:
                entries.append(StateEntry(event["type"], event["timestamp"], None))
    return entries


def _attempt(state_input: str | None) -> int | None:
    """The attempt a state's input names (`run.attempt` of the payload after Validate)."""
    try:
        attempt = json.loads(state_input or "")["run"]["attempt"]
    except (ValueError, TypeError, KeyError):
        return None
    return attempt if isinstance(attempt, int) else None
