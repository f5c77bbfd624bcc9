"""Another process answering a Step Functions task token, as a node agent does.

    python localcloud_task_client.py TOKEN heartbeat|success|failure [ERROR]

It reaches the local cloud through AWS_ENDPOINT_URL and the region in its environment."""

import json
import sys

import boto3


def main(token: str, action: str, error: str = "") -> None:
    sfn = boto3.client("stepfunctions")
    if action == "heartbeat":
        sfn.send_task_heartbeat(taskToken=token)
    elif action == "success":
        sfn.send_task_success(taskToken=token, output=json.dumps({"answered_by": "agent"}))
    elif action == "failure":
        sfn.send_task_failure(taskToken=token, error=error, cause="reported by the agent")
    else:
        raise SystemExit(f"unknown action {action!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
