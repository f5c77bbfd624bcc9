"""DynamoDB run store: run and node records, every change a conditional write, task tokens.

Table (template.yaml RunTable): pk = "RUN#<run>", sk = "RUN" for the run, "NODE#<instance id>" for
each node; GSI "by-instance" on instance_id finds a node from an EC2 or Health event. The record
itself is the item's `doc` (the contracts model as JSON); `state` and `version` sit beside it so
that conditions can name them.

    store = RunStore(boto3.client("dynamodb"), settings.run_table)
    store.create_run(RunRecord(...))                         fails if the run exists
    store.transition_run(name, RunState.TRAINING, attempt=2)  checked against the diagram
    store.modify_run(name, lambda run: ...)                   any other change, retried on conflict
    store.add_node(NodeRecord(...)), store.transition_node(name, instance_id, NodeState.READY)
    store.nodes(name), store.node(name, instance_id), store.node_by_instance(instance_id)
    store.park_task(name, TaskWait(...))                       remember the token (StaleAttempt if old)
    store.parked_token(name, "train", attempt)                 the token, still parked
    store.clear_task_token(name, token)                        once its answer was sent

Every write carries `version = :expected`: two handlers racing on one record cannot both win;
the loser gets StaleRecord (modify_* re-read and retry a few times). A state change is recorded
before the action it announces, so a handler that dies half way is resumed from the record.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Literal

from trainfleet.contracts import (NodeRecord, NodeState, RunRecord, RunState, TaskWait,
                                  check_node_transition, check_run_transition)

__all__ = ["RunStore", "RunNotFound", "NodeNotFound", "RunExists", "StaleRecord", "StaleAttempt",
           "INSTANCE_INDEX"]

INSTANCE_INDEX = "by-instance"
_RUN_SK = "RUN"
_MODIFY_ATTEMPTS = 5


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
        item = self._item(_node_key(record.run_name, record.instance_id), record)
        item["instance_id"] = {"S": record.instance_id}
        try:
            self.db.put_item(TableName=self.table, Item=item, ConditionExpression="attribute_not_exists(pk)")
        except self.db.exceptions.ConditionalCheckFailedException:
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

    def modify_node(self, run_name: str, instance_id: str,
                    change: Callable[[NodeRecord], NodeRecord]) -> NodeRecord:
        """Like modify_run, for one node."""
        return self._modify(lambda: self.node(run_name, instance_id), change, check_node_transition,
                            _node_key(run_name, instance_id))

    def transition_node(self, run_name: str, instance_id: str, new_state: NodeState, **changes: Any) -> NodeRecord:
        """Move a node to `new_state` (InvalidTransition if the diagram forbids it) with changes."""
        return self.modify_node(run_name, instance_id,
                                lambda node: node.model_copy(update={"state": new_state, **changes}))

    # --- plumbing ---------------------------------------------------------------------------

    def _item(self, key: dict[str, Any], record: RunRecord | NodeRecord) -> dict[str, Any]:
        return {**key, "state": {"S": record.state.value}, "version": {"N": str(record.version)},
                "doc": {"S": record.model_dump_json()}}

    def _replace(self, key: dict[str, Any], record: Any) -> Any:
        """Write `record` over the item at `record.version`, as version + 1."""
        updated = record.model_copy(update={"version": record.version + 1, "updated_at": _now()})
        item = self._item(key, updated)
        if isinstance(updated, NodeRecord):
            item["instance_id"] = {"S": updated.instance_id}
        try:
            self.db.put_item(TableName=self.table, Item=item, ConditionExpression="version = :seen",
                             ExpressionAttributeValues={":seen": {"N": str(record.version)}})
        except self.db.exceptions.ConditionalCheckFailedException:
            raise StaleRecord(f"{key['pk']['S']} {key['sk']['S']} changed since version {record.version}") from None
        return updated

    def _modify(self, read: Callable[[], Any], change: Callable[[Any], Any],
                check_transition: Callable[[Any, Any], None], key: dict[str, Any]) -> Any:
        for _ in range(_MODIFY_ATTEMPTS):
            old = read()
            new = change(old).model_copy(update={"version": old.version})
            if new == old:
                # Nothing to write: a no-op change must not race the writers that do change it.
                return old
            if new.state is not old.state:
                check_transition(old.state, new.state)
            try:
                return self._replace(key, new)
            except StaleRecord:
                continue
        raise StaleRecord(f"{key['pk']['S']} {key['sk']['S']}: {_MODIFY_ATTEMPTS} writes in a row lost a race")
