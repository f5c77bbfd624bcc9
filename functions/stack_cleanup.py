"""StackCleanup: a CloudFormation custom resource that deletes every run's node role and instance
profile when the stack is deleted.

Allocate makes a role per run with the stack's NodePolicy attached; Teardown and the reaper
delete it. A run whose teardown never finished, or one still going, leaves its role, and IAM
refuses to delete a managed policy attached to a role (DeleteConflict): the stack's deletion
then failed on NodePolicy. The custom resource depends on NodePolicy, so CloudFormation deletes
it first: its Delete request deletes the roles under the stack's path, then NodePolicy goes.
Create and Update do nothing. The answer goes to the request's pre-signed ResponseURL, as
CloudFormation documents for custom resources; a failure is answered too, with its reason, so
the stack's deletion stops naming it instead of waiting an hour for an answer.
"""

import json
import urllib.request
from typing import Any

from aws_lambda_powertools.utilities.typing import LambdaContext

from functions.common import aws, logger, tracer
from trainfleet.adapters.node_roles import delete_stack_node_profiles

RESPONSE_TIMEOUT_S = 30


def answer(event: dict[str, Any], status: str, reason: str = "") -> None:
    """PUT the custom resource's answer to CloudFormation's pre-signed URL."""
    body = json.dumps({"Status": status, "Reason": reason or status, "StackId": event["StackId"],
                       "RequestId": event["RequestId"], "LogicalResourceId": event["LogicalResourceId"],
                       "PhysicalResourceId": f"{aws().settings.stack_name}-node-roles"}).encode()
    request = urllib.request.Request(event["ResponseURL"], data=body, method="PUT",
                                     headers={"Content-Type": "", "Content-Length": str(len(body))})
    with urllib.request.urlopen(request, timeout=RESPONSE_TIMEOUT_S):
        pass


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def handler(event: dict[str, Any], context: LambdaContext) -> None:
    try:
        if event["RequestType"] == "Delete":
            deleted = delete_stack_node_profiles(aws().iam, aws().settings.stack_name)
            logger.info("the stack's node roles deleted", deleted=deleted)
    except Exception as error:  # answered, not raised: CloudFormation would wait an hour for an answer
        logger.exception("the stack's node roles could not all be deleted")
        answer(event, "FAILED", f"{type(error).__name__}: {error}"[:1000])
        return
    answer(event, "SUCCESS")
