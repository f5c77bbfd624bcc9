"""SQS event source mappings: Lambda polls a queue and invokes a function with batches.

moto 5.2.5 invoked the function from inside SendMessage, once per message (a batch of one),
whatever the mapping's BatchSize and MaximumBatchingWindowInSeconds, and ignored the function's
answer. Now, as the Lambda developer guide documents for Amazon SQS:

- CreateEventSourceMapping refuses what Lambda refuses: a BatchSize outside 1..10000 (1..10 for
  a FIFO queue), one above 10 without a batching window of at least a second, a window above
  300 s, a queue whose visibility timeout is shorter than the function's timeout, and an
  execution role whose policies do not allow sqs:ReceiveMessage, sqs:DeleteMessage and
  sqs:GetQueueAttributes on the queue.
- A poller per enabled mapping long-polls the queue; from the first message it gathers more
  until the batch is full or the window (nominal seconds, scaled) has passed, then invokes the
  function synchronously with `{"Records": [...]}` in SQS's record format. Batches run
  concurrently as Lambda scales them: five at first, five more each second that every one is
  busy and messages wait, up to the mapping's ScalingConfig.MaximumConcurrency or LOCAL_CONCURRENCY
  (Lambda goes on to 1,250; the local endpoints are the limit here).
- A batch the function handled is deleted. With FunctionResponseTypes ReportBatchItemFailures,
  the records named in `batchItemFailures` stay (all of them when an identifier names no record
  of the batch); after an error every record stays. What stays becomes visible again when the
  queue's visibility timeout lapses (a retry interval, so on the cloud's scaled time, like
  Lambda's retries of an asynchronous invocation), and the queue's redrive policy moves a
  message to its dead-letter queue after maxReceiveCount receives (moto's SQS does that).
- The poller's ReceiveMessage calls (at most ten messages each, as SQS returns) and
  DeleteMessageBatch calls are counted in `LocalCloud.requests`, as AWS bills a mapping's SQS
  requests to the account; records handed over again in `LocalCloud.sqs_redelivered`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from moto.awslambda.exceptions import InvalidParameterValueException
from moto.awslambda.models import EventSourceMapping, LambdaBackend

from localcloud.glue import active_cloud

if TYPE_CHECKING:
    from localcloud.parts import QueueCloud

log = logging.getLogger(__name__)

_moto_create = LambdaBackend.create_event_source_mapping

INITIAL_CONCURRENCY = 5
SCALE_UP_PER_SECOND = 5
LOCAL_CONCURRENCY = 20
LONG_POLL_S = 20
RECEIVE_MOST = 10
DELETE_BATCH = 10
QUEUE_ACTIONS = ("sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes")


def _queue_of(backend: LambdaBackend, arn: str) -> Any:
    from moto.sqs.models import sqs_backends

    return next((queue for queue in sqs_backends[backend.account_id][backend.region_name].queues.values()
                 if queue.queue_arn == arn), None)


def check_mapping(spec: dict[str, Any], queue: Any, function: Any) -> None:
    """Refuse a mapping Lambda would refuse (see the module docstring)."""
    from localcloud.glue.iam import role_allows

    batch_size = int(spec.get("BatchSize") or 10)
    window = int(spec.get("MaximumBatchingWindowInSeconds") or 0)
    largest = 10 if queue.fifo_queue else 10000
    if not 1 <= batch_size <= largest:
        raise InvalidParameterValueException(f"BatchSize {batch_size} is outside 1..{largest} for queue {queue.name}")
    if batch_size > 10 and window < 1:
        raise InvalidParameterValueException(
            f"Maximum batch window in seconds must be greater than 0 if maximum batch size is greater than 10 "
            f"(BatchSize {batch_size})")
    if not 0 <= window <= 300:
        raise InvalidParameterValueException(f"MaximumBatchingWindowInSeconds {window} is outside 0..300")
    visibility = int(queue.visibility_timeout)
    if visibility < int(function.timeout):
        raise InvalidParameterValueException(
            f"Queue visibility timeout: {visibility} seconds is less than Function timeout: {function.timeout} "
            f"seconds")
    for action in QUEUE_ACTIONS:
        if not role_allows(function.account_id, function.role, action, queue.queue_arn):
            raise InvalidParameterValueException(
                f"The provided execution role does not have permissions to call {action.split(':')[1]} on SQS")


def _create_event_source_mapping(self: LambdaBackend, spec: dict[str, Any]) -> EventSourceMapping:
    cloud = active_cloud()
    queue = _queue_of(self, spec.get("EventSourceArn", ""))
    if cloud is None or queue is None:
        return _moto_create(self, spec)
    function = self._lambdas.get_function_by_name_or_arn_with_qualifier(spec.get("FunctionName", ""))
    check_mapping(spec, queue, function)
    mapping = _moto_create(self, spec)
    # The poller below serves the mapping; moto's own would invoke from inside SendMessage.
    queue.lambda_event_source_mappings.pop(mapping.function_arn, None)
    QueuePoller(cloud, self, mapping, queue, function).start()
    return mapping


def sqs_record(message: Any, queue: Any) -> dict[str, Any]:
    """One message as Lambda hands it to a function."""
    return {
        "messageId": message.id,
        "receiptHandle": message.receipt_handle,
        "body": message.body,
        "attributes": {
            "ApproximateReceiveCount": str(message.approximate_receive_count),
            "SentTimestamp": str(message.sent_timestamp),
            "SenderId": message.sender_id,
            "ApproximateFirstReceiveTimestamp": str(message.approximate_first_receive_timestamp),
        },
        "messageAttributes": message.message_attributes,
        "md5OfBody": message.body_md5,
        "eventSource": "aws:sqs",
        "eventSourceARN": queue.queue_arn,
        "awsRegion": queue.region,
    }


def failed_message_ids(answer: str, batch_ids: list[str], reports_failures: bool) -> set[str]:
    """The records of a handled batch that stay on the queue: those the function named in
    batchItemFailures (with ReportBatchItemFailures), every one if it named one not in the batch."""
    if not reports_failures:
        return set()
    try:
        failures = (json.loads(answer) or {}).get("batchItemFailures") or []
        named = {failure["itemIdentifier"] for failure in failures}
    except (ValueError, TypeError, AttributeError, KeyError):
        return set(batch_ids)  # an answer Lambda cannot read fails the whole batch
    return set(batch_ids) if not named <= set(batch_ids) else named


class QueuePoller(threading.Thread):
    """Gathers batches from one queue for one mapping and invokes its function with them."""

    def __init__(self, cloud: QueueCloud, backend: LambdaBackend, mapping: EventSourceMapping, queue: Any,
                 function: Any) -> None:
        super().__init__(name=f"sqs-poller-{queue.name}", daemon=True)
        from moto.sqs.models import sqs_backends

        self.cloud, self.backend, self.mapping, self.queue, self.function = cloud, backend, mapping, queue, function
        self.sqs = sqs_backends[queue.account_id][queue.region]
        self.batch_size = int(mapping.batch_size or 10)
        self.window_s = cloud.scaled(float(mapping.max_batch_window or 0))
        self.reports_failures = "ReportBatchItemFailures" in (mapping.function_response_types or [])
        most = int((mapping.scaling_config or {}).get("MaximumConcurrency") or LOCAL_CONCURRENCY)
        self.most = min(most, LOCAL_CONCURRENCY)
        self.concurrency = min(INITIAL_CONCURRENCY, self.most)
        self.in_flight, self.scaled_at = 0, time.monotonic()
        self.changed = threading.Condition()
        self.invokers = ThreadPoolExecutor(self.most, thread_name_prefix=f"sqs-invoke-{queue.name}")

    def serving(self) -> bool:
        return active_cloud() is self.cloud and self.mapping.uuid in self.backend._event_source_mappings

    def take_slot(self) -> None:
        """Wait for a batch's turn; every second all batches are busy while messages wait, five
        more may run."""
        with self.changed:
            while self.in_flight >= self.concurrency:
                if self.queue.messages and self.concurrency < self.most and time.monotonic() - self.scaled_at >= 1:
                    self.concurrency = min(self.most, self.concurrency + SCALE_UP_PER_SECOND)
                    self.scaled_at = time.monotonic()
                    continue
                self.changed.wait(0.25)
            self.in_flight += 1

    def release_slot(self) -> None:
        with self.changed:
            self.in_flight -= 1
            self.changed.notify()

    def receive(self, wanted: int, wait_s: float) -> list[Any]:
        """One ReceiveMessage: at most ten messages, as SQS returns."""
        self.cloud.count(self.cloud.requests, ("sqs", "ReceiveMessage"))
        return self.sqs.receive_message(self.queue.name, min(RECEIVE_MOST, wanted), wait_s,
                                        int(self.queue.visibility_timeout))

    def gather(self) -> list[Any]:
        """A batch: what a long poll brings, then more until full or the window has passed; each
        wait inside the window is a long poll that ends when a message arrives."""
        batch = self.receive(self.batch_size, LONG_POLL_S)
        deadline = time.monotonic() + self.window_s
        while batch and len(batch) < self.batch_size and self.serving():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if not self.queue.messages:
                self.queue.wait_for_messages(left)
            batch += self.receive(self.batch_size - len(batch), 0)
        return batch

    def run(self) -> None:
        while self.serving():
            if not self.mapping.enabled:
                time.sleep(1)
                continue
            self.take_slot()
            batch = self.gather()
            if not batch:
                self.release_slot()
                continue
            self.invokers.submit(self.invoke, batch)
        self.invokers.shutdown(wait=False)

    def invoke(self, batch: list[Any]) -> None:
        from localcloud.glue.awslambda import invoke_function

        for message in batch:
            if message.approximate_receive_count > 1:
                self.cloud.count(self.cloud.sqs_redelivered, self.queue.name)
        try:
            result = invoke_function(self.function, {"Records": [sqs_record(message, self.queue) for message in batch]})
            ids = [message.id for message in batch]
            if result.errored:
                log.warning("Lambda %s failed a batch of %d from %s: %s", self.function.function_name, len(batch),
                            self.queue.name, result.payload)
            kept = set(ids) if result.errored else failed_message_ids(result.payload, ids, self.reports_failures)
            done = [message for message in batch if message.id not in kept]
            for start in range(0, len(done), DELETE_BATCH):  # SQS deletes ten messages a request
                self.cloud.count(self.cloud.requests, ("sqs", "DeleteMessageBatch"))
                for message in done[start:start + DELETE_BATCH]:
                    self.sqs.delete_message(self.queue.name, message.receipt_handle)
            # What stays is tried again once the visibility timeout lapses: a retry interval,
            # so on the cloud's scaled time (whole seconds, as SQS takes them).
            again_s = max(1, math.ceil(self.cloud.scaled(int(self.queue.visibility_timeout))))
            for message in batch:
                if message.id in kept:
                    self.sqs.change_message_visibility(self.queue.name, message.receipt_handle, again_s)
        except Exception:
            log.exception("the poller of %s could not hand a batch to %s", self.queue.name,
                          self.function.function_name)
        finally:
            self.release_slot()


def apply() -> None:
    LambdaBackend.create_event_source_mapping = _create_event_source_mapping
