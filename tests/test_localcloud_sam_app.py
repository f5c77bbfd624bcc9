"""An ordinary SAM application, written as AWS's examples write one (tests/data/sam-app), deployed
into the local cloud and run: each construct ends as AWS documents it.

- four functions, each in its own folder with its own app.py (two with a helper module of the
  same name, rules.py) and handler app.lambda_handler; three on the local cloud's Python with
  the Powertools public layer, one on Python 3.12 with its syntax;
- a Choice comparing with a path into the context object ($$.Execution.Input...);
- a Parallel whose payment branch fails: the Parallel fails with that branch's error, which its
  Catch handles (Step Functions guide, Parallel state; Error handling);
- a JSONata state passing the context object ($states.context) to a DynamoDB integration;
- Fail states with a fixed error and with ErrorPath/CausePath.
"""

import json
import re
from pathlib import Path

import pytest

from localcloud.deploy import DeployRequest, deploy
from localcloud.glue.stepfunctions import aws_timestamp
from localcloud_helpers import history, unique, wait_for_execution

SAM_APP = Path(__file__).parent / "data" / "sam-app" / "template.yaml"

ORDERS = {
    "fulfilled": {"order": {"order_id": "o-1", "items": [{"sku": "book", "quantity": 2}, {"sku": "lamp", "quantity": 1}]},
                  "review_above": 1000},
    "declined": {"order": {"order_id": "o-2", "items": [{"sku": "desk", "quantity": 3}]}, "review_above": 1000},
    "held": {"order": {"order_id": "o-3", "items": [{"sku": "desk", "quantity": 3}]}, "review_above": 500},
    "rejected": {"order": {"order_id": "o-4", "items": [{"sku": "piano", "quantity": 1}]}, "review_above": 1000},
}


@pytest.fixture
def orders_app(local_cloud):
    return deploy(DeployRequest(SAM_APP, local_cloud.endpoint, stack_name=unique("orders")))


@pytest.mark.slow
def test_the_order_workflow_ends_as_aws_documents_each_construct(local_cloud, orders_app):
    sfn = local_cloud.client("stepfunctions")
    started = {case: sfn.start_execution(stateMachineArn=orders_app.outputs["OrderStateMachineArn"],
                                         name=unique(case), input=json.dumps(payload))["executionArn"]
               for case, payload in ORDERS.items()}
    done = {case: wait_for_execution(local_cloud, arn) for case, arn in started.items()}
    table = orders_app.outputs["OrdersTableName"]
    items = {item["order_id"]["S"]: item for item in local_cloud.client("dynamodb").scan(TableName=table)["Items"]}

    # Fulfilled: both branches' results in branch order; the JSONata state recorded the
    # context's execution name and start time; the Python 3.12 function answered.
    fulfilled = done["fulfilled"]
    assert fulfilled["status"] == "SUCCEEDED", fulfilled
    output = json.loads(fulfilled["output"])
    assert output["order"]["total"] == 64
    assert output["fulfilment"] == [{"reservation": "R-o-1-3"}, {"charge": "C-o-1-64"}]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", output["recorded_at"])
    assert output["notification"] == {"message": "Order o-1 is on its way: 2 x book, 1 x lamp", "python": "3.12"}
    assert items["o-1"]["status"] == {"S": "fulfilled"}
    assert items["o-1"]["execution"] == {"S": fulfilled["name"]}
    assert items["o-1"]["started_at"] == {"S": aws_timestamp(fulfilled["startDate"])}
    assert (items["o-1"]["reservation"], items["o-1"]["charge"]) == ({"S": "R-o-1-3"}, {"S": "C-o-1-64"})

    # Declined: the payment branch's error fails the Parallel under its own name and cause;
    # the Catch records the order and the Fail state ends the execution.
    declined = done["declined"]
    assert (declined["status"], declined["error"]) == ("FAILED", "OrderDeclined"), declined
    assert items["o-2"]["status"] == {"S": "declined"} and items["o-2"]["reason"] == {"S": "PaymentDeclined"}
    caught = next(json.loads(event["stateEnteredEventDetails"]["input"])["failure"]
                  for event in history(local_cloud, started["declined"])
                  if event.get("stateEnteredEventDetails", {}).get("name") == "RecordDeclined")
    assert caught["Error"] == "PaymentDeclined"
    assert json.loads(caught["Cause"])["errorMessage"] == "750 is over the card's limit of 500"

    # Held: the Choice compared the order's total with the execution input's limit.
    held = done["held"]
    assert held["status"] == "SUCCEEDED", held
    assert json.loads(held["output"]) == {"held": "o-3", "limit": 500}
    assert "o-3" not in items

    # Rejected: the function's exception is the error name a Catch matches; ErrorPath and
    # CausePath of the Fail state pass it on.
    rejected = done["rejected"]
    assert (rejected["status"], rejected["error"]) == ("FAILED", "InvalidOrder"), rejected
    assert json.loads(rejected["cause"])["errorMessage"] == "order o-4: no items or unknown skus ['piano']"


@pytest.mark.slow
def test_the_apps_functions_run_as_configured(local_cloud, orders_app):
    lam = local_cloud.client("lambda")
    functions = {logical_id: orders_app.resources[logical_id].physical_id for logical_id in (
        "ValidateOrderFunction", "ReserveStockFunction", "ChargePaymentFunction", "NotifyCustomerFunction")}
    configurations = {logical_id: lam.get_function_configuration(FunctionName=name)
                      for logical_id, name in functions.items()}
    assert {logical_id: c["Runtime"] for logical_id, c in configurations.items()} == {
        "ValidateOrderFunction": "python3.11", "ReserveStockFunction": "python3.11",
        "ChargePaymentFunction": "python3.11", "NotifyCustomerFunction": "python3.12"}
    assert configurations["ValidateOrderFunction"]["Layers"][0]["Arn"].endswith(
        ":layer:AWSLambdaPowertoolsPythonV3-python311-x86_64:7")

    reply = lam.invoke(FunctionName=functions["NotifyCustomerFunction"],
                       Payload=json.dumps({"order_id": "o-9", "items": [{"sku": "lamp", "quantity": 1}]}))
    assert json.loads(reply["Payload"].read())["python"] == "3.12"
    # LoggingConfig.LogGroup: the function's logs go to the group the template names.
    events = local_cloud.client("logs").filter_log_events(
        logGroupName=orders_app.outputs["NotifyCustomerLogGroup"])["events"]
    assert "Order o-9 is on its way: 1 x lamp" in [event["message"] for event in events]
