"""SQS event source mappings in the local cloud: batches gathered over the window, partial
batch failures, the dead-letter queue, and what CreateEventSourceMapping refuses."""

import json
import time

import pytest
from botocore.exceptions import ClientError

from localcloud.glue.sqs_lambda import failed_message_ids
from localcloud_helpers import deploy_function, lambda_role, records, unique

QUEUE_ACCESS = {"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Action": ["sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:GetQueueAttributes"],
    "Resource": "*"}]}


@pytest.fixture
def queue_role(local_cloud):
    local_cloud.client("iam").put_role_policy(RoleName=lambda_role(local_cloud).rsplit("/", 1)[1],
                                              PolicyName="queue-access", PolicyDocument=json.dumps(QUEUE_ACCESS))
    yield
    local_cloud.client("iam").delete_role_policy(RoleName="localcloud-tests", PolicyName="queue-access")


def queue(cloud, visibility_s=5, **attributes):
    sqs = cloud.client("sqs")
    url = sqs.create_queue(QueueName=unique("batches"), Attributes={"VisibilityTimeout": str(visibility_s),
                                                                    **attributes})["QueueUrl"]
    return url, sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]


def send(cloud, url, bodies):
    sqs = cloud.client("sqs")
    for start in range(0, len(bodies), 10):
        sqs.send_message_batch(QueueUrl=url, Entries=[{"Id": str(index), "MessageBody": body}
                                                      for index, body in enumerate(bodies[start:start + 10])])


def wait_for(predicate, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def visible(cloud, url):
    attributes = cloud.client("sqs").get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])
    return int(attributes["Attributes"]["ApproximateNumberOfMessages"]) + int(
        attributes["Attributes"]["ApproximateNumberOfMessagesNotVisible"])


def test_messages_sent_within_the_window_reach_the_function_as_one_batch(local_cloud, queue_role, tmp_path):
    url, arn = queue(local_cloud)
    record_file = tmp_path / "batches.jsonl"
    function = deploy_function(local_cloud, "sqs_batch", record_file, timeout=5)
    # 50 nominal seconds are one real second at the fixture's time scale.
    local_cloud.client("lambda").create_event_source_mapping(
        EventSourceArn=arn, FunctionName=function, BatchSize=100, MaximumBatchingWindowInSeconds=50,
        FunctionResponseTypes=["ReportBatchItemFailures"])
    bodies = [f"event-{index}" for index in range(25)]
    invoked_before = sum(local_cloud.lambda_invocations.values())
    received_before = local_cloud.requests[("sqs", "ReceiveMessage")]

    send(local_cloud, url, bodies)

    wait_for(lambda: sorted(body for batch in records(record_file) for body in batch["bodies"]) == sorted(bodies))
    wait_for(lambda: visible(local_cloud, url) == 0)
    batches = records(record_file)
    assert len(batches) == 1 and batches[0]["source"] == "aws:sqs"
    assert sum(local_cloud.lambda_invocations.values()) - invoked_before == 1
    # SQS hands out ten messages a request, and a wait inside the window is one long poll per
    # arrival (three SendMessageBatch calls), not a request every few milliseconds.
    received = local_cloud.requests[("sqs", "ReceiveMessage")] - received_before
    assert 3 <= received <= 3 + 3 + 2


def test_a_record_the_function_reports_failed_is_retried_then_dead_lettered(local_cloud, queue_role, tmp_path):
    dead_url, dead_arn = queue(local_cloud)
    url, arn = queue(local_cloud, visibility_s=1,
                     RedrivePolicy=json.dumps({"deadLetterTargetArn": dead_arn, "maxReceiveCount": 2}))
    record_file = tmp_path / "batches.jsonl"
    function = deploy_function(local_cloud, "sqs_batch", record_file, timeout=1)
    local_cloud.client("lambda").create_event_source_mapping(
        EventSourceArn=arn, FunctionName=function, BatchSize=10, FunctionResponseTypes=["ReportBatchItemFailures"])

    send(local_cloud, url, ["ok", "fail"])

    wait_for(lambda: visible(local_cloud, dead_url) == 1)
    seen = [(body, count) for batch in records(record_file) for body, count in zip(batch["bodies"],
                                                                                 batch["receive_counts"])]
    assert ("ok", "1") in seen and [body for body, _ in seen].count("ok") == 1  # deleted after its batch
    assert [count for body, count in seen if body == "fail"] == ["1", "2"]
    assert local_cloud.sqs_redelivered[url.rsplit("/", 1)[1]] == 1, "the failed record, handed over again once"
    assert visible(local_cloud, url) == 0
    [dead] = local_cloud.client("sqs").receive_message(QueueUrl=dead_url)["Messages"]
    assert dead["Body"] == "fail"


def test_an_answer_naming_no_record_of_the_batch_fails_the_whole_batch():
    assert failed_message_ids('{"batchItemFailures": [{"itemIdentifier": "b"}]}', ["a", "b"], True) == {"b"}
    assert failed_message_ids('{"batchItemFailures": [{"itemIdentifier": "z"}]}', ["a", "b"], True) == {"a", "b"}
    assert failed_message_ids('{"batchItemFailures": [{"itemIdentifier": "b"}]}', ["a", "b"], False) == set()
    assert failed_message_ids("null", ["a"], True) == set()


@pytest.mark.parametrize("mapping, visibility_s, timeout_s, message", [
    ({"BatchSize": 100}, 30, 5, "Maximum batch window in seconds must be greater than 0"),
    ({"BatchSize": 10001, "MaximumBatchingWindowInSeconds": 1}, 30, 5, "BatchSize 10001 is outside 1..10000"),
    ({"BatchSize": 10, "MaximumBatchingWindowInSeconds": 301}, 30, 5, "MaximumBatchingWindowInSeconds 301"),
    ({"BatchSize": 10}, 5, 30, "Queue visibility timeout: 5 seconds is less than Function timeout: 30 seconds"),
])
def test_create_event_source_mapping_refuses_what_lambda_refuses(local_cloud, queue_role, mapping, visibility_s,
                                                                 timeout_s, message):
    _, arn = queue(local_cloud, visibility_s=visibility_s)
    function = deploy_function(local_cloud, "sqs_batch", timeout=timeout_s)
    with pytest.raises(ClientError, match="InvalidParameterValueException") as refused:
        local_cloud.client("lambda").create_event_source_mapping(EventSourceArn=arn, FunctionName=function, **mapping)
    assert message in str(refused.value)


def test_a_role_that_cannot_read_the_queue_is_refused(local_cloud):
    _, arn = queue(local_cloud)
    function = deploy_function(local_cloud, "sqs_batch", timeout=5)
    with pytest.raises(ClientError, match="does not have permissions to call ReceiveMessage on SQS"):
        local_cloud.client("lambda").create_event_source_mapping(EventSourceArn=arn, FunctionName=function)


def most_at_once(spans):
    moments = sorted([(span["started"], 1) for span in spans] + [(span["ended"], -1) for span in spans])
    running = most = 0
    for _, change in moments:
        running += change
        most = max(most, running)
    return most


@pytest.mark.parametrize("scaling, expected", [({}, range(6, 21)), ({"MaximumConcurrency": 2}, range(1, 3))])
def test_batches_run_concurrently_more_of_them_while_messages_wait(local_cloud, queue_role, tmp_path, scaling,
                                                                     expected):
    url, arn = queue(local_cloud)
    record_file = tmp_path / "spans.jsonl"
    function = deploy_function(local_cloud, "slow_batch", record_file, timeout=5)
    local_cloud.client("lambda").create_event_source_mapping(
        EventSourceArn=arn, FunctionName=function, BatchSize=1, **({"ScalingConfig": scaling} if scaling else {}))

    send(local_cloud, url, [f"event-{index}" for index in range(24 if scaling else 40)])

    wait_for(lambda: visible(local_cloud, url) == 0, timeout_s=60)
    assert most_at_once(records(record_file)) in expected
