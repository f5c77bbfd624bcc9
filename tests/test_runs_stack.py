"""The operator's commands against a stack's AWS resources (moto): a run is reached however its
execution was started, and its logs are read from its end."""

import json
import uuid

import boto3

from test_adapters_run_store import TEMPLATE, spec
from localcloud.deploy import load_template
from trainfleet.adapters.run_store import RunStore
from trainfleet.core.records import RunRecord
from trainfleet.operator.runs import Stack

PASS = {"StartAt": "Wait", "States": {"Wait": {"Type": "Wait", "Seconds": 3600, "End": True}}}


def stack_with_a_run(moto_endpoint, **execution_name) -> tuple[Stack, str, str]:
    """A Stack over a run table, a state machine and one running execution whose run is
    recorded as Validate records it; (stack, run name, execution ARN)."""
    session = boto3.session.Session(region_name="us-east-1")
    dynamodb, sfn = (session.client(service, endpoint_url=moto_endpoint) for service in ("dynamodb", "stepfunctions"))
    props = load_template(TEMPLATE)["Resources"]["RunTable"]["Properties"]
    table = f"runs-{uuid.uuid4().hex[:8]}"
    dynamodb.create_table(TableName=table, BillingMode=props["BillingMode"], KeySchema=props["KeySchema"],
                          AttributeDefinitions=props["AttributeDefinitions"],
                          GlobalSecondaryIndexes=props["GlobalSecondaryIndexes"])
    machine = sfn.create_state_machine(name=f"training-{uuid.uuid4().hex[:8]}", definition=json.dumps(PASS),
                                       roleArn="arn:aws:iam::123456789012:role/states")["stateMachineArn"]
    name = f"console-{uuid.uuid4().hex[:6]}"
    document = spec(name).model_dump(mode="json")
    arn = sfn.start_execution(stateMachineArn=machine, name=execution_name.get("name", name),
                              input=json.dumps(document))["executionArn"]
    RunStore(dynamodb, table).create_run(RunRecord(run_name=name, spec=spec(name), execution_arn=arn))  # as Validate
    return Stack("stack", machine, table, "bucket", (f"/aws/lambda/events-{name}",), session, moto_endpoint), name, arn


def test_a_run_started_from_the_console_is_found_by_its_name(moto_endpoint):
    """`trainfleet run start` names the execution after the run; the Step Functions console names
    it as it likes (a UUID by default), and the run's name is only in its input and its record."""
    stack, name, arn = stack_with_a_run(moto_endpoint, name=str(uuid.uuid4()))
    sfn = stack.client("stepfunctions")
    assert stack.execution_arn(name) == arn
    status = stack.status(name)
    assert status.execution_status == "RUNNING" and status.record.run_name == name
    (listed,) = stack.runs()
    assert (listed.run_name, listed.execution_status) == (name, "RUNNING")
    stack.stop(name)
    assert sfn.describe_execution(executionArn=arn)["status"] == "ABORTED"


def test_the_logs_of_a_long_run_are_read_from_its_end(moto_endpoint):
    """Three days of a run's log lines (one every four minutes): its last lines come from the
    last windows alone, not from a read of everything since the start."""
    from datetime import datetime, timedelta, timezone

    from moto.stepfunctions.models import stepfunctions_backends

    stack, name, arn = stack_with_a_run(moto_endpoint)
    now = datetime.now(timezone.utc)
    execution = stepfunctions_backends["123456789012"]["us-east-1"].describe_execution(arn)
    execution.start_date = (now - timedelta(days=3)).isoformat()  # a run three days old
    logs, (group,) = stack.client("logs"), stack.log_groups
    logs.create_log_group(logGroupName=group)
    logs.create_log_stream(logGroupName=group, logStreamName="s")
    times = [now - timedelta(minutes=4 * n) for n in reversed(range(3 * 24 * 15))]
    for start in range(0, len(times), 500):
        logs.put_log_events(logGroupName=group, logStreamName="s", logEvents=[
            {"timestamp": int(at.timestamp() * 1000), "message": f"{name} line {start + index}"}
            for index, at in enumerate(times[start:start + 500])])
    read = []  # lines FilterLogEvents returned, call by call
    logs.meta.events.register("after-call.cloudwatch-logs.FilterLogEvents",
                              lambda parsed, **_: read.append(len(parsed["events"])))

    last = stack.logs(name, limit=10)
    assert [line.rsplit(" ", 1)[1] for line in last] == [str(n) for n in range(len(times) - 10, len(times))]
    assert read == [15], "the last hour holds them: 15 lines read of 1,080"
    read.clear()
    assert len(stack.logs(name, limit=200)) == 200 and read == [15, 60, 240]  # the last hour, 4 h, 16 h before
