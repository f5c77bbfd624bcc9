"""DynamoDB run store on moto, with the table exactly as template.yaml declares it."""

import threading
import uuid
from pathlib import Path

import boto3
import pytest

from localcloud.deploy import load_template
from trainfleet.adapters.run_store import (NodeNotFound, RunExists, RunNotFound, RunStore,
                                           StaleAttempt, StaleRecord)
from trainfleet.core.lifecycle import ready_workers
from trainfleet.core.records import InvalidTransition, NodeRecord, NodeRole, NodeState, RunRecord, RunState, TaskWait
from trainfleet.core.runspec import RunSpec

TEMPLATE = Path(__file__).parents[1] / "template.yaml"


@pytest.fixture(scope="module")
def store(moto_endpoint):
    client = boto3.client("dynamodb", endpoint_url=moto_endpoint)
    props = load_template(TEMPLATE)["Resources"]["RunTable"]["Properties"]
    name = f"runs-{uuid.uuid4().hex[:8]}"
    client.create_table(TableName=name, BillingMode=props["BillingMode"], KeySchema=props["KeySchema"],
                        AttributeDefinitions=props["AttributeDefinitions"],
                        GlobalSecondaryIndexes=props["GlobalSecondaryIndexes"])
    return RunStore(client, name)


def spec(run_name: str) -> RunSpec:
    return RunSpec.model_validate({
        "run_name": run_name, "instance_type": "c5.large", "node_count": 2,
        "capacity": {"subnet_ids": ["subnet-0123456789abcdef0"], "security_group_ids": ["sg-0123456789abcdef0"]},
        "image_id": "ami-0123456789abcdef0",
        "trainer": {"model": {"n_layers": 4}, "training": {"batch_size": 8},
                    "parallel": {"pp": 2, "dp": 1, "schedule": "gpipe", "microbatches": 2}},
        "checkpoint": {"s3_uri": f"s3://bucket/runs/{run_name}"}})


def new_run(store: RunStore) -> str:
    name = f"run-{uuid.uuid4().hex[:8]}"
    store.create_run(RunRecord(run_name=name, spec=spec(name)))
    return name


def test_runs_are_created_once_and_read_back(store):
    name = new_run(store)
    record = store.run(name)
    assert (record.state, record.version, record.spec.run_name) == (RunState.REQUESTED, 1, name)
    assert record.created_at is not None
    with pytest.raises(RunExists, match=name):
        store.create_run(RunRecord(run_name=name, spec=spec(name)))
    with pytest.raises(RunNotFound, match="nope"):
        store.run("nope")


def test_transitions_follow_the_diagram_and_bump_the_version(store):
    name = new_run(store)
    moved = store.transition_run(name, RunState.ALLOCATING, availability_zone="us-east-1a")
    assert (moved.state, moved.version, moved.availability_zone) == (RunState.ALLOCATING, 2, "us-east-1a")
    assert store.run(name) == moved
    with pytest.raises(InvalidTransition, match="ALLOCATING -> SUCCEEDED"):
        store.transition_run(name, RunState.SUCCEEDED)
    assert store.run(name).version == 2  # the refused change wrote nothing


def test_a_write_that_lost_a_race_is_retried_on_the_fresh_record(store):
    name = new_run(store)
    raced = []

    def change(run: RunRecord) -> RunRecord:
        if not raced:  # another handler writes between our read and our write, once
            raced.append(store.modify_run(name, lambda r: r.model_copy(update={"restarts": 7})))
        return run.model_copy(update={"last_step": 42})

    result = store.modify_run(name, change)
    assert (result.restarts, result.last_step, result.version) == (7, 42, 3)


def test_a_record_that_keeps_changing_gives_up(store):
    name = new_run(store)

    def always_raced(run: RunRecord) -> RunRecord:
        store.modify_run(name, lambda r: r.model_copy(update={"restarts": r.restarts + 1}))
        return run.model_copy(update={"last_step": 1})

    with pytest.raises(StaleRecord, match="lost a race"):
        store.modify_run(name, always_raced)


def test_a_parked_token_stays_until_its_answer_is_sent(store):
    """Reading the token leaves it parked (an answer that failed to send is sent by the retry);
    clearing forgets only that token, not one parked after it."""
    name = new_run(store)
    store.park_task(name, TaskWait(purpose="train", attempt=0, token="token-0"))
    assert store.parked_token(name, "await_nodes", 0) is None  # another purpose
    assert store.parked_token(name, "train", 1) is None  # another attempt
    assert store.parked_token(name, "train", 0) == "token-0"
    assert store.parked_token(name, "train", 0) == "token-0", "read, not taken"

    store.clear_task_token(name, "token-0")
    assert store.run(name).waiting is None
    store.park_task(name, TaskWait(purpose="await_nodes", attempt=0, token="token-1"))
    store.clear_task_token(name, "token-0")  # a late clear of the answered token
    assert store.run(name).waiting.token == "token-1"


def test_a_token_of_an_old_attempt_is_refused(store):
    name = new_run(store)
    store.modify_run(name, lambda run: run.model_copy(update={"attempt": 3}))
    with pytest.raises(StaleAttempt, match="attempt 3, not 2"):
        store.park_task(name, TaskWait(purpose="await_nodes", attempt=2, token="old"))


def test_nodes_are_recorded_listed_found_by_instance_and_moved(store):
    name = new_run(store)
    for instance_id, role in (("i-0a", NodeRole.WORKER), ("i-0b", NodeRole.SPARE)):
        store.add_node(NodeRecord(run_name=name, instance_id=f"{instance_id}-{name}", role=role))
    worker = f"i-0a-{name}"
    assert store.add_node(NodeRecord(run_name=name, instance_id=worker, role=NodeRole.SPARE)).role \
        is NodeRole.WORKER  # a second add changes nothing
    assert [node.role for node in store.nodes(name)] == [NodeRole.WORKER, NodeRole.SPARE]
    assert store.node_by_instance(worker).run_name == name
    assert store.node_by_instance("i-unknown") is None

    registered = store.transition_node(name, worker, NodeState.REGISTERED, private_ip="10.0.0.7")
    assert (registered.state, registered.private_ip, registered.version) == (NodeState.REGISTERED, "10.0.0.7", 2)
    with pytest.raises(InvalidTransition, match="REGISTERED -> LAUNCHED"):
        store.transition_node(name, worker, NodeState.LAUNCHED)
    with pytest.raises(NodeNotFound):
        store.node(name, "i-missing")


def test_the_workers_ready_for_each_attempt_are_counted_as_their_records_change(store):
    name = new_run(store)
    first, second, spare = (f"i-{n}-{name}" for n in range(3))
    for instance_id, role in ((first, NodeRole.WORKER), (second, NodeRole.WORKER), (spare, NodeRole.SPARE)):
        store.add_node(NodeRecord(run_name=name, instance_id=instance_id, role=role))
        store.transition_node(name, instance_id, NodeState.REGISTERED)

    def confirm(instance_id: str, attempt: int) -> None:
        store.transition_node(name, instance_id, NodeState.READY, ready_attempt=attempt)

    def counts() -> tuple[int, int]:
        counted = (store.ready_workers(name, 0), store.ready_workers(name, 1))
        addressed = [node for node in store.nodes(name) if node.private_ip]
        # What reading every node says, while no node confirmed past the attempt asked about.
        for attempt, count in enumerate(counted):
            confirmed_so_far = [node for node in addressed if (node.ready_attempt or 0) <= attempt]
            assert count == len(ready_workers(confirmed_so_far, attempt)), (attempt, count)
        return counted

    assert counts() == (0, 0)
    confirm(first, 0)  # readiness overtook the address: not counted yet
    assert counts() == (0, 0)
    store.modify_node(name, first, lambda node: node.model_copy(update={"private_ip": "10.0.0.1"}))
    assert counts() == (1, 0)
    store.modify_node(name, second, lambda node: node.model_copy(update={"private_ip": "10.0.0.2"}))
    confirm(second, 0)
    confirm(second, 0)  # a second confirmation changes nothing
    store.modify_node(name, spare, lambda node: node.model_copy(update={"private_ip": "10.0.0.3"}))
    confirm(spare, 0)  # a spare is no worker
    assert counts() == (2, 0)
    confirm(second, 1)  # the run moved on: second confirms attempt 1 and leaves attempt 0's world
    assert counts() == (1, 1)
    store.transition_node(name, first, NodeState.UNHEALTHY)
    assert counts() == (0, 1)
    store.modify_node(name, spare, lambda node: node.model_copy(update={"role": NodeRole.WORKER}))
    assert counts() == (1, 1), "a promoted spare ready for attempt 0 joins its world"
    assert store.run(name).version == 1, "the counts never write the run record"


def test_a_long_runs_failures_stay_within_one_dynamodb_item(store):
    """A month of failures (300, each with a trainer's 3 KB message): the record keeps the newest
    and those the rules count, the messages clipped, and DynamoDB (400 KB an item) takes it;
    about 175 of them overflowed it before. The record only grows, so its last write is the one
    that must fit."""
    from datetime import datetime, timedelta, timezone

    from trainfleet.core.lifecycle import apply_decision, decide_recovery
    from trainfleet.core.records import CheckpointRef, FailureClass, FailureReport

    name = f"run-{uuid.uuid4().hex[:8]}"
    run = RunRecord(run_name=name, spec=spec(name))
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    for index in range(300):
        now = start + timedelta(hours=3 * index)  # 8 a day: within the budget of 10
        failure = FailureReport(failure_class=FailureClass.PROCESS_CRASH, attempt=run.attempt,
                                message="raised above: RuntimeError: NCCL watchdog ... " + "x" * 3000)
        run = run.model_copy(update={"latest_checkpoint": CheckpointRef(step=index, uri=f"s3://b/{index}")})
        run = apply_decision(run, failure, decide_recovery(run, [], failure, jitter_draw=0.0, now=now), now)
    store.create_run(run)
    run = store.run(name)
    assert run.restarts == 300 and len(run.failures) + run.earlier_failures == 300
    assert len(run.failures) <= 60 and all(len(failure.message) <= 605 for failure in run.failures)
    assert run.failures[-1].message.startswith("raised above: RuntimeError")
    assert len(run.model_dump_json()) < 100_000


def test_agents_read_a_control_item_of_a_few_hundred_bytes_whatever_the_run_record_holds(store):
    """Every agent look read the whole run record: 104 KB with its kept failures, 272 KB with 50
    failures naming 128 nodes each: 13 to 34 read units a look, ~3,500 a second at 2,048 nodes,
    past the 3,000 one partition serves. The agents read the CONTROL item instead, kept in step
    with the record in the writes that change it."""
    from datetime import datetime, timedelta, timezone

    from trainfleet.core.lifecycle import apply_decision, decide_recovery
    from trainfleet.core.records import CheckpointRef, FailureClass, FailureReport, WorldRepair

    name = f"run-{uuid.uuid4().hex[:8]}"
    nodes = [f"i-{n:017x}" for n in range(2048)]
    run = RunRecord(run_name=name, spec=spec(name))
    start = datetime(2026, 11, 1, tzinfo=timezone.utc)
    for index in range(60):
        now = start + timedelta(hours=3 * index)
        failure = FailureReport(failure_class=FailureClass.CAPACITY_BLOCK_END if index % 2 else FailureClass.HANG,
                                attempt=run.attempt, instance_ids=nodes[:128], message="x" * 3000)
        run = run.model_copy(update={"latest_checkpoint": CheckpointRef(step=index, uri=f"s3://b/{index}")})
        run = apply_decision(run, failure, decide_recovery(run, [], failure, jitter_draw=0.0, now=now), now)
    run = run.model_copy(update={"repair": WorldRepair(generation=1, launched_attempt=0, survivor_ids=nodes[1:])})
    assert max(len(failure.instance_ids) for failure in run.failures) == 16, "id lists clipped"
    assert run.failures[-1].instances_blamed == 128
    store.create_run(run)
    record = store.db.get_item(TableName=store.table, Key={"pk": {"S": f"RUN#{name}"}, "sk": {"S": "RUN"}})["Item"]
    control = store.db.get_item(TableName=store.table, Key={"pk": {"S": f"RUN#{name}"}, "sk": {"S": "CONTROL"}})["Item"]
    assert len(record["doc"]["S"]) > 100_000 and len(control["doc"]["S"]) < 500  # half a read unit a look
    assert store.run_control(name) == store.run(name).control()
    asked = datetime.now(timezone.utc)
    changes = [{"checkpoint_requested_at": asked}, {"state": RunState.ALLOCATING}, {"attempt": run.attempt + 1},
               {"latest_checkpoint": CheckpointRef(step=99, uri="s3://b/99", committed_at=asked)}]
    for change in changes:
        store.modify_run(name, lambda current, change=change: current.model_copy(update=change))
        assert store.run_control(name) == store.run(name).control(), change
    store.modify_run(name, lambda current: current.model_copy(update={"last_step": 7}))  # the agents need not know
    assert store.run_control(name).checkpoint_committed_at == asked and store.run(name).last_step == 7


def _run_table(client) -> str:
    props = load_template(TEMPLATE)["Resources"]["RunTable"]["Properties"]
    name = f"runs-{uuid.uuid4().hex[:8]}"
    client.create_table(TableName=name, BillingMode=props["BillingMode"], KeySchema=props["KeySchema"],
                        AttributeDefinitions=props["AttributeDefinitions"],
                        GlobalSecondaryIndexes=props["GlobalSecondaryIndexes"])
    return name


def test_workers_confirming_at_once_never_conflict_and_are_counted_exactly(local_cloud):
    """Hundreds of NodeReady at a (re)start, in concurrent batches: DynamoDB (and the local cloud)
    cancels concurrent transactions on one item, and a count kept in the node write's transaction
    made every confirmation meet on the WORLD item until some lost all their tries."""
    client = local_cloud.client("dynamodb")
    store = RunStore(client, _run_table(client))
    name = new_run(store)
    ids = [f"i-{n:03d}" for n in range(192)]
    for instance_id in ids:
        store.add_node(NodeRecord(run_name=name, instance_id=instance_id, role=NodeRole.WORKER,
                                  state=NodeState.REGISTERED, private_ip="10.0.0.1"))
    lost, barrier = [], threading.Barrier(32)

    def confirm_some(share: list[str]) -> None:
        own = RunStore(local_cloud.client("dynamodb"), store.table)  # a handler of its own
        barrier.wait(timeout=60)
        for instance_id in share:
            try:
                own.transition_node(name, instance_id, NodeState.READY, ready_attempt=0)
            except StaleRecord as exc:
                lost.append(str(exc))

    threads = [threading.Thread(target=confirm_some, args=(ids[n::32],)) for n in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert lost == [] and store.ready_workers(name, 0) == len(ids)


def test_a_count_change_its_write_left_unsettled_is_made_once_by_the_next_write(store, monkeypatch):
    """The node write records what the count owes: an invocation that fails after it (DynamoDB
    down, a timeout) leaves the count to the event's retry, which finds nothing to change."""
    name = new_run(store)
    instance_id = f"i-1-{name}"
    store.add_node(NodeRecord(run_name=name, instance_id=instance_id, role=NodeRole.WORKER,
                              state=NodeState.REGISTERED, private_ip="10.0.0.1"))
    update_item = store.db.update_item

    def down(**request):
        raise store.db.exceptions.InternalServerError({"Error": {"Code": "InternalServerError"}}, "UpdateItem")

    monkeypatch.setattr(store.db, "update_item", down)
    with pytest.raises(store.db.exceptions.InternalServerError):
        store.transition_node(name, instance_id, NodeState.READY, ready_attempt=0)
    assert store.ready_workers(name, 0) == 0 and store.node(name, instance_id).state is NodeState.READY
    monkeypatch.setattr(store.db, "update_item", update_item)
    store.transition_node(name, instance_id, NodeState.READY, ready_attempt=0)  # the event's retry: no change
    assert store.ready_workers(name, 0) == 1
    store.transition_node(name, instance_id, NodeState.READY, ready_attempt=0)
    store.modify_node(name, instance_id, lambda node: node.model_copy(update={"reason": "again"}))
    assert store.ready_workers(name, 0) == 1, "counted once"
    store.transition_node(name, instance_id, NodeState.UNHEALTHY)
    assert store.ready_workers(name, 0) == 0
