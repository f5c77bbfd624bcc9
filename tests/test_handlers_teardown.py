"""The ends of a run, handler by handler against the local cloud (fixtures of test_handlers):
Teardown records the outcome while placement groups are still in use, and the reaper tears
down what an execution that was stopped, timed out or failed outside Teardown left behind.

Instances are real local-cloud instances without agent processes; a slow shutdown (p4d and
p5 take minutes) is the local fleet holding them in shutting-down until the test lets go."""

import json
import threading
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from test_handlers import (REPO, STACK, Context, cloud, finished, handlers, parked_token,  # noqa: F401
                           node_network, recorded_run, resources)
from trainfleet.adapters.ec2_fleet import (TAG_RUN, TAG_STACK, ensure_placement_group, placement_group_name,
                                           run_instance_ids)
from trainfleet.core.lifecycle import unaccounted_seconds
from trainfleet.core.records import FAILURE_ERROR, NodeState, RunState

ZONE = "us-east-1a"


@pytest.fixture
def slow_shutdown(cloud, monkeypatch):
    """Instances boot without agents and stay shutting-down until the event is set."""
    released = threading.Event()
    end_process = cloud.fleet._end_process

    def shut_down_slowly(instance):
        released.wait(60)
        end_process(instance)

    monkeypatch.setattr(cloud.fleet, "boot", lambda instance: None)
    monkeypatch.setattr(cloud.fleet, "_end_process", shut_down_slowly)
    yield released
    released.set()


def launched_run(cloud, resources, execution_arn: str | None = None):
    """A run in TRAINING on two real instances in its cluster placement group:
    (store, run name, instance ids, group name)."""
    store, run, _ = recorded_run(cloud, resources)
    if execution_arn is not None:
        store.modify_run(run.run_name, lambda current: current.model_copy(update={"execution_arn": execution_arn}))
    ec2 = cloud.client("ec2")
    group = placement_group_name(run.run_name, STACK, ZONE)
    ensure_placement_group(ec2, group, run.run_name, STACK)
    tags = [{"Key": TAG_RUN, "Value": run.run_name}, {"Key": TAG_STACK, "Value": STACK}]
    reservation = ec2.run_instances(ImageId="ami-0123456789abcdef0", InstanceType="c5.large", MinCount=2, MaxCount=2,
                                    Placement={"GroupName": group, "AvailabilityZone": ZONE},
                                    TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])
    return store, run.run_name, sorted(i["InstanceId"] for i in reservation["Instances"]), group


def states(cloud, instance_ids) -> set[str]:
    reservations = cloud.client("ec2").describe_instances(InstanceIds=instance_ids)["Reservations"]
    return {instance["State"]["Name"] for reservation in reservations for instance in reservation["Instances"]}


def group_names(cloud) -> set[str]:
    return {group["GroupName"] for group in cloud.client("ec2").describe_placement_groups()["PlacementGroups"]}


def payload(run_name: str, **extra) -> dict:
    return {"run": {"run_name": run_name, "attempt": 0},
            "timeouts": {"boot_seconds": 60, "late_worker_seconds": 60, "heartbeat_seconds": 60}, **extra}


def status_change(execution_arn: str, run_name: str, status: str) -> dict:
    event = json.loads((REPO / "events" / "aws" / "states-execution-status-change-aborted.json").read_text())
    event.update(id=str(uuid.uuid4()), resources=[execution_arn])
    event["detail"].update(executionArn=execution_arn, status=status, input=json.dumps({"run_name": run_name}))
    return event


# --- Teardown -------------------------------------------------------------------------------

def test_a_group_still_in_use_does_not_hold_up_the_outcome_or_the_report(handlers, cloud, resources,
                                                                         slow_shutdown):
    import functions.reaper
    import functions.report
    import functions.teardown

    store, name, instances, group = launched_run(cloud, resources)

    result = functions.teardown.handler(payload(name), Context())

    assert result == {"terminated": 2, "placement_groups_in_use": [group]}
    assert store.run(name).state is RunState.SUCCEEDED
    assert {node.state for node in store.nodes(name)} == {NodeState.TERMINATING}
    assert states(cloud, instances) == {"shutting-down"} and group in group_names(cloud)
    report = functions.report.handler(payload(name), Context())
    assert report["report_uri"].endswith(f"runs/{name}/report.html")

    # The reaper deletes the group once its instances are gone, and the outcome stays.
    assert name in functions.reaper.handler({"detail-type": "Scheduled Event"}, Context())["reaped"]
    assert group in group_names(cloud), "deleted while in use"
    slow_shutdown.set()
    cloud.wait_until(lambda: states(cloud, instances) == {"terminated"}, "the instances to terminate")
    assert name in functions.reaper.handler({"detail-type": "Scheduled Event"}, Context())["reaped"]
    assert group not in group_names(cloud)
    assert name not in functions.reaper.handler({"detail-type": "Scheduled Event"}, Context())["reaped"]
    assert store.run(name).state is RunState.SUCCEEDED


def test_a_teardown_that_cannot_write_its_records_still_terminates_the_instances(handlers, cloud, resources,
                                                                                   slow_shutdown):
    """DynamoDB out (or the run's item at its size limit): the teardown fails, for Step Functions
    to retry, but the run's instances, found by tag, are terminating; the retry records."""
    import functions.teardown

    store, name, instances, _ = launched_run(cloud, resources)
    cloud.fail_requests("dynamodb", 600.0, "error")
    try:
        with pytest.raises(Exception, match="InternalServerError"):
            functions.teardown.handler(payload(name), Context())
        assert states(cloud, instances) == {"shutting-down"}
    finally:
        cloud.stop_failing_requests()
    functions.teardown.handler(payload(name), Context())
    assert store.run(name).state is RunState.SUCCEEDED


def test_a_run_given_up_has_its_wait_for_teardown_on_the_books_by_cause(handlers, cloud, resources):
    import functions.report
    import functions.teardown

    store, run, _ = recorded_run(cloud, resources)
    now = datetime.now(timezone.utc)
    # 20 s of start-up, 30 s of training without a checkpoint, then a failure retrying cannot help.
    store.modify_run(run.run_name, lambda current: current.model_copy(update={
        "created_at": now - timedelta(seconds=50), "first_step_at": now - timedelta(seconds=30)}))
    refused = {"failure_class": "CONFIG_ERROR", "attempt": 0, "instance_ids": [], "message": "bad config"}
    caught = {"Error": FAILURE_ERROR, "Cause": json.dumps(refused)}
    with pytest.raises(handlers.errors.RecoveryGaveUp):
        handlers.recover.handler(payload(run.run_name, failure=caught), Context())
    gave_up = store.run(run.run_name)
    assert set(gave_up.ledger.lost_by_cause) == {"startup", "redone:CONFIG_ERROR"}
    # The trainer still reports a step before Teardown: the run is over all the same.
    store.modify_run(run.run_name, lambda current: current.model_copy(
        update={"first_step_at": datetime.now(timezone.utc)}))
    functions.teardown.handler(payload(run.run_name, failure=caught), Context())
    torn_down = store.run(run.run_name)
    ledger = torn_down.ledger
    assert set(ledger.lost_by_cause) == {"startup", "redone:CONFIG_ERROR", "give_up:CONFIG_ERROR"}
    assert ledger.productive_seconds == 0 and ledger.lost_by_cause["redone:CONFIG_ERROR"] == pytest.approx(30, abs=5)
    assert unaccounted_seconds(torn_down) == pytest.approx(0, abs=1e-3)
    functions.report.handler(payload(run.run_name), Context())
    report = json.loads(cloud.client("s3").get_object(Bucket=resources["bucket"],
                                                      Key=f"runs/{run.run_name}/report.json")["Body"].read())
    assert report["ledger"]["lost_by_cause"] == pytest.approx(ledger.lost_by_cause)


# --- the reaper -----------------------------------------------------------------------------

def test_a_stopped_execution_has_its_run_torn_down_by_its_status_event(handlers, cloud, resources, slow_shutdown):
    import functions.reaper

    execution, _ = parked_token(cloud)
    store, name, instances, _ = launched_run(cloud, resources, execution_arn=execution)
    cloud.client("stepfunctions").stop_execution(executionArn=execution)

    # A status event of another execution (say one refused for reusing this run's name) is not this run's.
    other = status_change(execution + "-other", name, "FAILED")
    assert functions.reaper.handler(other, Context())["reaped"] == []
    assert states(cloud, instances) <= {"pending", "running"}

    assert functions.reaper.handler(status_change(execution, name, "ABORTED"), Context())["reaped"] == [name]
    run = store.run(name)
    assert run.state is RunState.STOPPED and run.error is None, "stopped on purpose: nothing failed"
    report = json.loads(cloud.client("s3").get_object(Bucket=resources["bucket"],
                                                      Key=f"runs/{name}/report.json")["Body"].read())
    assert (report["state"], report["error"]) == ("STOPPED", None)
    assert run_instance_ids(cloud.client("ec2"), name, STACK) == []
    assert {node.state for node in store.nodes(name)} == {NodeState.TERMINATING}
    # Never reached a step: all of it start-up, from its creation to the reaper's booking.
    assert set(run.ledger.lost_by_cause) == {"startup"} and unaccounted_seconds(run) == pytest.approx(0, abs=1e-3)


def test_the_schedule_tears_down_runs_whose_execution_ended_and_leaves_running_ones(handlers, cloud, resources,
                                                                                   slow_shutdown):
    import functions.reaper

    sfn = cloud.client("stepfunctions")
    ended, running = parked_token(cloud)[0], parked_token(cloud)[0]
    _, ended_run, ended_instances, _ = launched_run(cloud, resources, execution_arn=ended)
    store, live_run, live_instances, _ = launched_run(cloud, resources, execution_arn=running)
    sfn.stop_execution(executionArn=ended)

    reaped = functions.reaper.handler({"detail-type": "Scheduled Event"}, Context())["reaped"]

    assert ended_run in reaped and live_run not in reaped
    assert states(cloud, ended_instances) == {"shutting-down"}
    assert states(cloud, live_instances) <= {"pending", "running"}
    assert store.run(live_run).state is RunState.TRAINING
    sfn.stop_execution(executionArn=running)
    assert finished(cloud, running)["status"] == "ABORTED"


def test_a_run_that_cannot_be_reaped_does_not_keep_the_others_running(handlers, cloud, resources, slow_shutdown):
    import functions.reaper

    stopped = parked_token(cloud)[0]
    cloud.client("stepfunctions").stop_execution(executionArn=stopped)
    store, broken, _, _ = launched_run(cloud, resources, execution_arn="not-an-execution-arn")
    _, ended, ended_instances, _ = launched_run(cloud, resources, execution_arn=stopped)

    with pytest.raises(handlers.errors.ReapIncomplete, match=broken) as raised:
        functions.reaper.handler({"detail-type": "Scheduled Event"}, Context())

    assert ended in str(raised.value).split("not reaped")[0]
    assert states(cloud, ended_instances) == {"shutting-down"}
    # Once the record is mended, the next sweep takes it (and leaves nothing for other tests).
    store.modify_run(broken, lambda run: run.model_copy(update={"execution_arn": stopped}))
    assert broken in functions.reaper.handler({"detail-type": "Scheduled Event"}, Context())["reaped"]
