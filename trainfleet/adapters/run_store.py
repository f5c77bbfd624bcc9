"""DynamoDB run store: run and node records, every change a conditional write, task tokens.

Table (template.yaml RunTable): pk = "RUN#<run>", sk = "RUN" for the run, "NODE#<instance id>" for
each node, "WORLD#<attempt>" for the count of workers ready for that attempt,
"PROGRESS#<attempt>#<step>" for the steps one TrainingProgress reported (the run's history: the
report's curves); GSI "by-instance" on instance_id finds a node from an EC2 or Health event. The record itself is the item's `doc` (the
contracts model as JSON); `state` and `version` sit beside it so that conditions can name them.

    store = RunStore(boto3.client("dynamodb"), settings.run_table)
    store.create_run(RunRecord(...))                         fails if the run exists
    store.transition_run(name, RunState.TRAINING, attempt=2)  checked against the diagram
    store.modify_run(name, lambda run: ...)                   any other change, retried on conflict
    store.add_node(NodeRecord(...)), store.transition_node(name, instance_id, NodeState.READY)
    store.nodes(name), store.node(name, instance_id), store.node_by_instance(instance_id)
    store.ready_workers(name, attempt)                         workers ready for it: one item, any fleet size
    store.record_progress(name, attempt, samples, reporter), store.progress_reports(name),
    store.progress(name), store.latest_progress(name)
    store.park_task(name, TaskWait(...))                       remember the token (StaleAttempt if old)
    store.parked_token(name, "train", attempt)                 the token, still parked
    store.clear_task_token(name, token)                        once its answer was sent

Every write carries `version = :expected`: two handlers racing on one record cannot both win;
the loser gets StaleRecord (modify_* re-read and retry a few times). A state change is recorded
before the action it announces, so a handler that dies half way is resumed from the record.

The world counts: a node write that moves the node into or out of an attempt's world
(lifecycle.world_attempt: an addressed READY worker, by the attempt it confirmed) adds or takes
one from that attempt's WORLD item in the same transaction (TransactWriteItems), so the count is
exact under redelivered, reordered and concurrent events, and the handler that asks whether a
world is complete reads one item instead of every node. Only those writes are transactions
(a few per node per attempt); the run record is never in one, so the agents' reads and the
run's own writes do not contend with them. A transaction that meets another on the same item
is cancelled (TransactionConflict) and retried like a lost race, after a jittered pause.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import TypeAdapter

from trainfleet.core.events import ProgressSample
from trainfleet.core.lifecycle import world_attempt
from trainfleet.core.run_history import ProgressReport
from trainfleet.core.records import (NodeRecord, NodeState, RunRecord, RunState, TaskWait, check_node_transition,
                                     check_run_transition)

__all__ = ["RunStore", "RunNotFound", "NodeNotFound", "RunExists", "StaleRecord", "StaleAttempt",
           "INSTANCE_INDEX"]

INSTANCE_INDEX = "by-instance"
_RUN_SK = "RUN"
_MODIFY_ATTEMPTS = 5
_RETRY_PAUSE_S = 0.01
"""First pause before writing again after a lost race; it doubles, drawn with full jitter."""


class RunNotFound(LookupError):
    """No record of that run."""


class NodeNotFound(LookupError):
    """No record of that node in that run."""


class RunExists(ValueError):
    """A run of that name was recorded before: run names are unique."""


class StaleRecord(RuntimeError):
    """The record changed since it was read (its version moved on); re-read and decide again."""


class StaleAttempt(ValueError):
    """A token or event of an attempt that is no longer the run's current one."""


def _run_key(run_name: str) -> dict[str, Any]:
    return {"pk": {"S": f"RUN#{run_name}"}, "sk": {"S": _RUN_SK}}


def _node_key(run_name: str, instance_id: str) -> dict[str, Any]:
    return {"pk": {"S": f"RUN#{run_name}"}, "sk": {"S": f"NODE#{instance_id}"}}


def _world_key(run_name: str, attempt: int) -> dict[str, Any]:
    return {"pk": {"S": f"RUN#{run_name}"}, "sk": {"S": f"WORLD#{attempt}"}}


def _progress_key(run_name: str, attempt: int, step: int) -> dict[str, Any]:
    # Zero-padded, so that the items sort by attempt, then step.
    return {"pk": {"S": f"RUN#{run_name}"}, "sk": {"S": f"{_PROGRESS}{attempt:06d}#{step:012d}"}}


_PROGRESS = "PROGRESS#"
_SAMPLES = TypeAdapter(list[ProgressSample])


def _now() -> datetime:
    return datetime.now(timezone.utc)


class RunStore:
    """Run and node records of one table."""

    def __init__(self, dynamodb: Any, table_name: str):
        self.db = dynamodb
        self.table = table_name

    # --- runs -------------------------------------------------------------------------------

    def create_run(self, record: RunRecord) -> RunRecord:
        """Record a new run (version 1); RunExists if the name is taken."""
        now = _now()
        record = record.model_copy(update={"version": 1, "created_at": now, "updated_at": now})
        try:
            self.db.put_item(TableName=self.table, Item=self._item(_run_key(record.run_name), record),
                             ConditionExpression="attribute_not_exists(pk)")
        except self.db.exceptions.ConditionalCheckFailedException:
            raise RunExists(f"run {record.run_name!r} already exists") from None
        return record

    def run(self, run_name: str, consistent: bool = True) -> RunRecord:
        """The run's record; RunNotFound. Strongly consistent unless `consistent` is False (half
        the read capacity, and a write may take about a second to show: what a poll can take)."""
        item = self.db.get_item(TableName=self.table, Key=_run_key(run_name),
                                ConsistentRead=consistent).get("Item")
        if item is None:
            raise RunNotFound(f"no run {run_name!r}")
        return RunRecord.model_validate_json(item["doc"]["S"])

    def modify_run(self, run_name: str, change: Callable[[RunRecord], RunRecord]) -> RunRecord:
        """Read, apply `change` (a pure function of the record), write; retried on a race.

        A state change in it is checked against the diagram (InvalidTransition)."""
        return self._modify(lambda: self.run(run_name), change, check_run_transition, _run_key(run_name))

    def transition_run(self, run_name: str, new_state: RunState, **changes: Any) -> RunRecord:
        """Move the run to `new_state` (InvalidTransition if the diagram forbids it) with changes."""
        return self.modify_run(run_name, lambda run: run.model_copy(update={"state": new_state, **changes}))

    # --- task tokens ------------------------------------------------------------------------

    def park_task(self, run_name: str, wait: TaskWait) -> RunRecord:
        """Remember the token the current attempt waits on; a token of an old attempt is refused."""
        def park(run: RunRecord) -> RunRecord:
            if wait.attempt != run.attempt:
                raise StaleAttempt(f"run {run_name!r} is at attempt {run.attempt}, not {wait.attempt}")
            return run.model_copy(update={"waiting": wait})
        return self.modify_run(run_name, park)

    def parked_token(self, run_name: str, purpose: Literal["await_nodes", "train"], attempt: int) -> str | None:
        """The parked token if it is for (purpose, attempt), else None. Reading it leaves it
        parked: it is cleared (clear_task_token) only once its answer has been sent, so an
        answer that could not be sent is sent by the retry of whatever tried."""
        wait = self.run(run_name).waiting
        if wait is None or (wait.purpose, wait.attempt) != (purpose, attempt):
            return None
        return wait.token

    def clear_task_token(self, run_name: str, token: str) -> None:
        """Forget `token` once it is answered; a newer token parked meanwhile is kept."""
        self.modify_run(run_name, lambda run: run.model_copy(update={"waiting": None})
                        if run.waiting is not None and run.waiting.token == token else run)

    # --- nodes ------------------------------------------------------------------------------

    def add_node(self, record: NodeRecord) -> NodeRecord:
        """Record a launched node (version 1); a node recorded before is left as it is."""
        now = _now()
        record = record.model_copy(update={"version": 1, "launched_at": record.launched_at or now,
                                           "updated_at": now})
        put = {"TableName": self.table, "Item": self._item(_node_key(record.run_name, record.instance_id), record),
               "ConditionExpression": "attribute_not_exists(pk)"}
        try:
            self._write(put, self._world_counts(None, record))
        except StaleRecord:
            return self.node(record.run_name, record.instance_id)
        return record

    def node(self, run_name: str, instance_id: str) -> NodeRecord:
        item = self.db.get_item(TableName=self.table, Key=_node_key(run_name, instance_id),
                                ConsistentRead=True).get("Item")
        if item is None:
            raise NodeNotFound(f"no node {instance_id} in run {run_name!r}")
        return NodeRecord.model_validate_json(item["doc"]["S"])

    def node_by_instance(self, instance_id: str) -> NodeRecord | None:
        """The node record of an instance, whatever its run (None for instances of no run).

        Reads the index, which is eventually consistent; the record is then read directly."""
        items = self.db.query(TableName=self.table, IndexName=INSTANCE_INDEX,
                              KeyConditionExpression="instance_id = :id",
                              ExpressionAttributeValues={":id": {"S": instance_id}})["Items"]
        if not items:
            return None
        found = NodeRecord.model_validate_json(items[0]["doc"]["S"])
        return self.node(found.run_name, instance_id)

    def nodes(self, run_name: str) -> list[NodeRecord]:
        """Every node of the run, in instance id order."""
        paginator = self.db.get_paginator("query")
        pages = paginator.paginate(TableName=self.table, ConsistentRead=True,
                                   KeyConditionExpression="pk = :pk AND begins_with(sk, :node)",
                                   ExpressionAttributeValues={":pk": {"S": f"RUN#{run_name}"},
                                                              ":node": {"S": "NODE#"}})
        return [NodeRecord.model_validate_json(item["doc"]["S"]) for page in pages for item in page["Items"]]

    def ready_workers(self, run_name: str, attempt: int) -> int:
        """How many workers are ready for `attempt` (lifecycle.world_attempt): while the run is at
        that attempt, what lifecycle.ready_workers would count over every addressed node."""
        item = self.db.get_item(TableName=self.table, Key=_world_key(run_name, attempt), ConsistentRead=True,
                                ProjectionExpression="ready_workers").get("Item")
        return int(item["ready_workers"]["N"]) if item else 0

    def modify_node(self, run_name: str, instance_id: str,
                    change: Callable[[NodeRecord], NodeRecord]) -> NodeRecord:
        """Like modify_run, for one node."""
        return self._modify(lambda: self.node(run_name, instance_id), change, check_node_transition,
                            _node_key(run_name, instance_id))

    def transition_node(self, run_name: str, instance_id: str, new_state: NodeState, **changes: Any) -> NodeRecord:
        """Move a node to `new_state` (InvalidTransition if the diagram forbids it) with changes."""
        return self.modify_node(run_name, instance_id,
                                lambda node: node.model_copy(update={"state": new_state, **changes}))

    # --- progress ---------------------------------------------------------------------------

    def record_progress(self, run_name: str, attempt: int, samples: list[ProgressSample],
                        reporter: str | None = None) -> None:
        """Keep the steps one TrainingProgress reported, as one item keyed by its last step, with
        the instance whose agent reported them: a redelivered event writes the same item again."""
        if samples:
            self.db.put_item(TableName=self.table, Item={
                **_progress_key(run_name, attempt, samples[-1].step), "doc": {"S": _SAMPLES.dump_json(samples).decode()},
                **({"reporter": {"S": reporter}} if reporter else {})})

    def progress_reports(self, run_name: str) -> Iterator[ProgressReport]:
        """Every report of steps recorded, by attempt, then step: read a page at a time as they
        are taken (a run of weeks has hundreds of thousands of steps)."""
        for page in self.db.get_paginator("query").paginate(**self._progress_query(run_name)):
            for item in page["Items"]:
                yield _report(item)

    def progress(self, run_name: str) -> Iterator[tuple[int, ProgressSample]]:
        """Every step recorded, as (attempt, sample), by attempt, then step."""
        for report in self.progress_reports(run_name):
            yield from ((report.attempt, sample) for sample in report.samples)

    def latest_progress(self, run_name: str) -> tuple[int, ProgressSample] | None:
        """The newest step recorded, as (attempt, sample)."""
        items = self.db.query(**self._progress_query(run_name), ScanIndexForward=False, Limit=1)["Items"]
        if not items:
            return None
        report = _report(items[0])
        return report.attempt, report.samples[-1]

    def _progress_query(self, run_name: str) -> dict[str, Any]:
        return {"TableName": self.table, "KeyConditionExpression": "pk = :pk AND begins_with(sk, :progress)",
                "ExpressionAttributeValues": {":pk": {"S": f"RUN#{run_name}"}, ":progress": {"S": _PROGRESS}}}

    # --- plumbing ---------------------------------------------------------------------------

    def _item(self, key: dict[str, Any], record: RunRecord | NodeRecord) -> dict[str, Any]:
        item = {**key, "state": {"S": record.state.value}, "version": {"N": str(record.version)},
                "doc": {"S": record.model_dump_json()}}
        if isinstance(record, NodeRecord):
            item["instance_id"] = {"S": record.instance_id}
        return item

    def _replace(self, key: dict[str, Any], old: Any, new: Any) -> Any:
        """Write `new` over the item at `old.version`, as version + 1, with the world counts it moves."""
        updated = new.model_copy(update={"version": old.version + 1, "updated_at": _now()})
        put = {"TableName": self.table, "Item": self._item(key, updated), "ConditionExpression": "version = :seen",
               "ExpressionAttributeValues": {":seen": {"N": str(old.version)}}}
        try:
            self._write(put, self._world_counts(old, updated) if isinstance(updated, NodeRecord) else [])
        except StaleRecord as exc:
            raise StaleRecord(f"{key['pk']['S']} {key['sk']['S']} changed since version {old.version} ({exc})") from None
        return updated

    def _write(self, put: dict[str, Any], counts: list[dict[str, Any]]) -> None:
        """A conditional PutItem, in one transaction with the count updates when there are any;
        StaleRecord when its condition failed or it met another transaction."""
        errors = self.db.exceptions
        try:
            if counts:
                self.db.transact_write_items(TransactItems=[{"Put": put}, *counts])
            else:
                self.db.put_item(**put)
        except (errors.ConditionalCheckFailedException, errors.TransactionCanceledException,
                errors.TransactionConflictException) as exc:
            raise StaleRecord(exc.response["Error"]["Code"]) from None

    def _world_counts(self, old: NodeRecord | None, new: NodeRecord) -> list[dict[str, Any]]:
        """The count updates of a node write: one from the world it leaves, one to the world it joins."""
        left, joined = world_attempt(old) if old else None, world_attempt(new)
        if left == joined:
            return []
        return [{"Update": {"TableName": self.table, "Key": _world_key(new.run_name, attempt),
                            "UpdateExpression": "ADD ready_workers :change",
                            "ExpressionAttributeValues": {":change": {"N": str(change)}}}}
                for attempt, change in ((left, -1), (joined, 1)) if attempt is not None]

    def _modify(self, read: Callable[[], Any], change: Callable[[Any], Any],
                check_transition: Callable[[Any, Any], None], key: dict[str, Any]) -> Any:
        for tries in range(_MODIFY_ATTEMPTS):
            old = read()
            new = change(old).model_copy(update={"version": old.version})
            if new == old:
                # Nothing to write: a no-op change must not race the writers that do change it.
                return old
            if new.state is not old.state:
                check_transition(old.state, new.state)
            try:
                return self._replace(key, old, new)
            except StaleRecord:
                time.sleep(random.uniform(0, _RETRY_PAUSE_S * 2 ** tries))
        raise StaleRecord(f"{key['pk']['S']} {key['sk']['S']}: {_MODIFY_ATTEMPTS} writes in a row lost a race")


def _report(item: dict[str, Any]) -> ProgressReport:
    return ProgressReport(attempt=int(item["sk"]["S"].removeprefix(_PROGRESS).split("#")[0]),
                          reporter=item.get("reporter", {}).get("S"),
                          samples=_SAMPLES.validate_json(item["doc"]["S"]))
