"""A node's log in CloudWatch Logs (node/node_log.py), against the local cloud: what the
agent says and what its trainer prints reach the node's stream in order, in batches within
PutLogEvents' limits, and survive CloudWatch Logs being out of reach without filling memory."""

import time
import uuid

import pytest
from botocore.config import Config

from node import node_log
from node.node_log import NodeLog


@pytest.fixture
def shipper(local_cloud):
    logs = local_cloud.client("logs", config=Config(retries={"max_attempts": 1}))
    group = f"/trainfleet/test-{uuid.uuid4().hex[:6]}/nodes"
    logs.create_log_group(logGroupName=group)
    return NodeLog(logs, group, "run-1/i-0123456789abcdef0"), logs


def stream(logs, log: NodeLog) -> list[str]:
    return [event["message"] for event in logs.get_log_events(
        logGroupName=log.group, logStreamName=log.stream, startFromHead=True)["events"]]


def test_the_agents_lines_and_the_trainers_output_reach_the_nodes_stream_in_order(shipper, tmp_path):
    log, logs = shipper
    output = tmp_path / "attempt-0" / "torchrun.log"
    output.parent.mkdir()
    output.write_text("[rank0] step 1 loss 5.1\n[rank0] step 2")  # the last line is still being written
    log.add("agent", '{"agent": "starting torchrun"}')
    log.follow("trainer", output)
    assert log.ship() == 2
    with output.open("a") as file:
        file.write(" loss 4.9\n")
    log.add("agent", '{"agent": "checkpoint committed"}')
    assert log.ship() == 2
    # A new attempt's output replaces the old one's.
    later = tmp_path / "attempt-1" / "torchrun.log"
    later.parent.mkdir()
    later.write_text("[rank0] resumed at step 2\n")
    log.follow("trainer", later)
    with output.open("a") as file:
        file.write("[rank0] a line of the old attempt, after it was left\n")
    assert log.ship() == 1
    assert log.ship() == 0, "nothing is shipped twice"
    # A file's lines are stamped when a shipment reads them: after what the agent said meanwhile.
    assert stream(logs, log) == ['agent {"agent": "starting torchrun"}', "trainer [rank0] step 1 loss 5.1",
                                 'agent {"agent": "checkpoint committed"}', "trainer [rank0] step 2 loss 4.9",
                                 "trainer [rank0] resumed at step 2"]


def test_a_trainer_line_carries_the_time_it_was_read_not_the_time_it_was_shipped(local_cloud, tmp_path):
    logs = local_cloud.client("logs")
    group = f"/trainfleet/test-{uuid.uuid4().hex[:6]}/nodes"
    logs.create_log_group(logGroupName=group)
    start = int(time.time())  # CloudWatch Logs takes events of the last 14 days, up to 2 h ahead
    now = [float(start)]
    log = NodeLog(logs, group, "run-1/i-0123456789abcdef0", clock=lambda: now[0])
    output = tmp_path / "torchrun.log"
    log.follow("trainer", output)
    output.write_text("step 1\n")
    log.read()
    now[0] += node_log.SHIP_INTERVAL_S - node_log.READ_INTERVAL_S
    with output.open("a") as file:
        file.write("step 2\n")
    log.read()
    now[0] += node_log.READ_INTERVAL_S
    assert log.ship() == 2
    events = logs.get_log_events(logGroupName=group, logStreamName=log.stream, startFromHead=True)["events"]
    assert [(event["message"], event["timestamp"]) for event in events] == [
        ("trainer step 1", start * 1000),
        ("trainer step 2", int((start + node_log.SHIP_INTERVAL_S - node_log.READ_INTERVAL_S) * 1000))]


def test_a_flood_of_lines_goes_in_batches_within_the_limits_of_a_put(shipper, local_cloud, monkeypatch):
    log, logs = shipper
    monkeypatch.setattr(node_log, "MAX_BATCH_EVENTS", 100)
    before = local_cloud.requests[("logs", "PutLogEvents")]
    for n in range(250):
        log.add("trainer", f"line {n}")
    log.add("trainer", "x" * (300 * 1024))  # longer than an event may be: cut
    assert log.ship() == 251
    assert local_cloud.requests[("logs", "PutLogEvents")] - before == 3
    messages = stream(logs, log)
    assert messages[:250] == [f"trainer line {n}" for n in range(250)]
    assert len(messages[-1].encode()) == node_log.MAX_EVENT_BYTES


def test_lines_wait_while_cloudwatch_logs_is_out_of_reach_and_the_oldest_go_past_the_limit(
        shipper, local_cloud, monkeypatch):
    log, logs = shipper
    log.add("agent", "first")
    local_cloud.fail_requests("logs", 3600, "error")
    assert log.ship() == 0
    monkeypatch.setattr(node_log, "BACKLOG_LIMIT_BYTES", 50 * (node_log.EVENT_OVERHEAD_BYTES + len("agent line 00")))
    for n in range(60):
        log.add("agent", f"line {n:02d}")
    assert log.ship() == 0
    local_cloud.stop_failing_requests("logs")
    log.ship()
    messages = stream(logs, log)
    assert messages[0] == "agent 11 line(s) dropped: CloudWatch Logs was out of reach"
    assert messages[1:] == [f"agent line {n:02d}" for n in range(10, 60)], "the newest lines are kept, in order"
