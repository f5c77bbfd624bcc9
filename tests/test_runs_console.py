"""The operator's commands reach a run however its execution was started: `trainfleet run
start` names the execution after the run, the Step Functions console names it as it likes (a
UUID by default) and the run's name is only in its input and its record."""

import json
import uuid

import boto3

from test_adapters_run_store import TEMPLATE, spec
from localcloud.deploy import load_template
from trainfleet.adapters.run_store import RunStore
from trainfleet.contracts import RunRecord
from trainfleet.runs import Stack

PASS = {"StartAt": "Wait", "States": {"Wait": {"Type": "Wait", "Seconds": 3600, "End": True}}}


def test_a_run_started_from_the_console_is_found_by_its_name(moto_endpoint):
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
    arn = sfn.start_execution(stateMachineArn=machine, name=str(uuid.uuid4()), input=json.dumps(document))["executionArn"]
    RunStore(dynamodb, table).create_run(RunRecord(run_name=name, spec=spec(name), execution_arn=arn))  # as Validate
    stack = Stack("stack", machine, table, "bucket", (), session, moto_endpoint)

    assert stack.execution_arn(name) == arn
    status = stack.status(name)
    assert status.execution_status == "RUNNING" and status.record.run_name == name
    (listed,) = stack.runs()
    assert (listed.run_name, listed.execution_status) == (name, "RUNNING")
    stack.stop(name)
    assert sfn.describe_execution(executionArn=arn)["status"] == "ABORTED"
