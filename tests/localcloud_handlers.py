"""Lambda handlers the local-cloud tests deploy (zipped as module `localcloud_test_handlers`).

Each records what it was given to the file named by its function's RECORD_FILE variable,
so a test sees both the event and that the function's own environment reached it."""

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import boto3


class CapacityError(Exception):
    """Raised on purpose so Retry/Catch can match a Python exception name."""


def _record(entry):
    with open(os.environ["RECORD_FILE"], "a") as record:
        record.write(json.dumps(entry) + "\n")


def echo(event, context):
    _record({"event": event, "function_name": context.function_name,
             "request_id": context.aws_request_id, "arn": context.invoked_function_arn,
             "remaining_ms": context.get_remaining_time_in_millis(),
             "color": os.environ.get("COLOR")})
    return event


def echo_from_a_thread_pool(event, context):
    """What a thread the handler starts sees of the function's environment."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda name: os.environ.get(name), event["variables"]))


def double(event, context):
    return {"value": event["value"] * 2}


def fail_until(event, context):
    """Fails with CapacityError until it has been called `succeed_on` times."""
    _record({"attempt": True})
    with open(os.environ["RECORD_FILE"]) as record:
        attempts = sum(1 for _ in record)
    if attempts < event["succeed_on"]:
        raise CapacityError(f"attempt {attempts}: no capacity")
    return {"attempts": attempts}


def always_fail(event, context):
    raise CapacityError("never any capacity")


def sleep(event, context):
    time.sleep(event["seconds"])
    return "woke"


def list_queues(event, context):
    """Calls the local endpoint from inside a handler."""
    return boto3.client("sqs").list_queues(QueueNamePrefix=event["prefix"]).get("QueueUrls", [])


def store_token(event, context):
    """What a .waitForTaskToken task's function does: park the token somewhere."""
    _record({"token": event["token"]})
    return {}


def unserializable(event, context):
    return {1, 2}


def report_progress(event, context):
    """Prints a plain line and an EMF document, as a Powertools-instrumented handler does."""
    print(f"step {event['step']} done")
    print(json.dumps({
        "_aws": {"Timestamp": int(time.time() * 1000), "CloudWatchMetrics": [{
            "Namespace": event["namespace"], "Dimensions": [["RunName"]],
            "Metrics": [{"Name": "Loss", "Unit": "None"}]}]},
        "RunName": "run-1", "Loss": event["loss"]}))
    return {}


_s3 = None


def read_objects(event, context):
    """Get each of event["keys"] from event["bucket"] with the function's own credentials,
    through one client kept at module level as handlers keep theirs; the body or the error."""
    global _s3
    _s3 = _s3 or boto3.client("s3")
    outcomes = {}
    for key in event["keys"]:
        try:
            outcomes[key] = _s3.get_object(Bucket=event["bucket"], Key=key)["Body"].read().decode()
        except _s3.exceptions.ClientError as error:
            outcomes[key] = error.response["Error"]["Message"]
    return outcomes


def sqs_batch(event, context):
    """Records the bodies of an SQS batch; reports the records whose body is "fail" as failed."""
    bodies = [record["body"] for record in event["Records"]]
    _record({"bodies": bodies, "receive_counts": [record["attributes"]["ApproximateReceiveCount"]
                                                  for record in event["Records"]],
             "source": {record["eventSource"] for record in event["Records"]}.pop()})
    return {"batchItemFailures": [{"itemIdentifier": record["messageId"]} for record in event["Records"]
                                  if record["body"] == "fail"]}


def slow_batch(event, context):
    """Takes a second and a half over a batch; records when it started and ended."""
    started = time.time()
    time.sleep(1.5)
    _record({"started": started, "ended": time.time()})
    return {}
