"""CloudWatch metric alarms in the local cloud: the decision against the CloudWatch User Guide's
examples (pure), datapoints from metric data, then alarms evaluated in a running LocalCloud
notifying their SNS topics, the project's NoProgressAlarm among them."""

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
from localcloud_helpers import remove_rules, unique
from moto.cloudwatch.models import MetricAggregatedDatum, MetricDatum

from localcloud.glue.cloudwatch import (
    ALARM,
    INSUFFICIENT_DATA,
    OK,
    AlarmRule,
    Datapoint,
    Decision,
    decide,
    evaluate_alarms,
    period_datapoints,
    period_starts,
    state_reason,
)

REPO = Path(__file__).resolve().parents[1]


# --- the decision ---------------------------------------------------------------------------

RETAIN = "retain"
TREATMENTS = ("missing", "ignore", "breaching", "notBreaching")
# The User Guide's tables ("Configuring how CloudWatch alarms treat missing data", and "Avoiding
# premature transitions to alarm state"): 5 datapoints of the evaluation range, oldest first
# (0 within the threshold, X breaching, - missing), and the state for each TreatMissingData.
USER_GUIDE_EXAMPLES = [
    # 3 out of 3
    ("0 - X - X", 3, (OK, OK, OK, OK)),
    ("0 - - - -", 3, (OK, OK, OK, OK)),
    ("- - - - -", 3, (INSUFFICIENT_DATA, RETAIN, ALARM, OK)),
    ("0 X X - X", 3, (ALARM, ALARM, ALARM, ALARM)),
    ("- - X - -", 3, (ALARM, RETAIN, ALARM, OK)),
    ("- - - - X", 3, (INSUFFICIENT_DATA, RETAIN, ALARM, OK)),
    ("- - - X -", 3, (INSUFFICIENT_DATA, RETAIN, ALARM, OK)),
    # 2 out of 3
    ("0 - X - X", 2, (ALARM, ALARM, ALARM, ALARM)),
    ("0 0 X 0 X", 2, (ALARM, ALARM, ALARM, ALARM)),
    ("0 - X - -", 2, (OK, OK, ALARM, OK)),
    ("- - - - 0", 2, (OK, OK, ALARM, OK)),
    ("- - - X -", 2, (ALARM, RETAIN, ALARM, OK)),
]


def values(pattern: str) -> list[float | None]:
    """Datapoints of a table row against GreaterThanThreshold 1.0."""
    return [{"0": 0.0, "X": 2.0, "-": None}[mark] for mark in pattern.split()]


@pytest.mark.parametrize("pattern, datapoints_to_alarm, states", USER_GUIDE_EXAMPLES)
@pytest.mark.parametrize("current", [OK, ALARM])
def test_decisions_match_the_user_guide_examples(pattern, datapoints_to_alarm, states, current):
    for treatment, expected in zip(TREATMENTS, states):
        rule = AlarmRule("GreaterThanThreshold", 1.0, 3, datapoints_to_alarm, treatment)
        assert len(values(pattern)) == rule.evaluation_range
        decided = decide(rule, values(pattern), current).state
        assert decided == (current if expected == RETAIN else expected), (pattern, treatment)


@pytest.mark.parametrize("comparison, breaching, within", [
    ("GreaterThanOrEqualToThreshold", 5.0, 4.9),
    ("GreaterThanThreshold", 5.1, 5.0),
    ("LessThanThreshold", 4.9, 5.0),
    ("LessThanOrEqualToThreshold", 5.0, 5.1),
])
def test_each_comparison_operator_against_the_threshold(comparison, breaching, within):
    rule = AlarmRule(comparison, 5.0, 1, 1)
    assert decide(rule, [None, None, breaching], OK).state == ALARM
    assert decide(rule, [None, None, within], ALARM).state == OK


def test_older_real_datapoints_stand_in_for_missing_recent_ones():
    rule = AlarmRule("GreaterThanThreshold", 1.0, 2, 2, "notBreaching")
    # Two real datapoints in the range are enough, however old: missing data plays no part.
    assert decide(rule, [2.0, 2.0, None, None], OK) == Decision(ALARM, (0, 1))
    # Of more, the most recent two are evaluated.
    assert decide(rule, [2.0, 2.0, 0.0, None], ALARM) == Decision(OK, (1, 2))


def test_state_reasons_are_worded_as_cloudwatch_words_them():
    minute = datetime(2015, 6, 3, 17, 43)
    rule = AlarmRule("GreaterThanThreshold", 0.0, 1, 1)
    points = [None, None, Datapoint(minute, 1234.0, 1.0)]
    assert state_reason(rule, decide(rule, [None, None, 1234.0], OK), points, INSUFFICIENT_DATA) == (
        "Threshold Crossed: 1 out of the last 1 datapoints [1234.0 (03/06/15 17:43:00)] was greater than the "
        "threshold (0.0) (minimum 1 datapoint for INSUFFICIENT_DATA -> ALARM transition).")

    quiet = AlarmRule("GreaterThanThreshold", 0.0, 2, 1, "notBreaching")
    assert state_reason(quiet, decide(quiet, [None] * 4, ALARM), [None] * 4, ALARM) == (
        "Threshold Crossed: no datapoints were received for 2 periods and 2 missing datapoints were treated "
        "as [NonBreaching].")
    unknown = AlarmRule("GreaterThanThreshold", 0.0, 2, 1)
    assert state_reason(unknown, decide(unknown, [None] * 4, OK), [None] * 4, OK) == (
        "Insufficient Data: 4 datapoints were unknown.")


# --- datapoints -----------------------------------------------------------------------------

def metric_alarm(**settings):
    """The attributes of moto's Alarm that its datapoints are taken by."""
    return SimpleNamespace(**{"namespace": "N", "metric_name": "Loss", "dimensions": [], "unit": None, "period": 60,
                              "statistic": "Maximum", "extended_statistic": None, **settings})


def test_periods_end_where_the_current_minute_began():
    starts = period_starts(datetime(2025, 2, 2, 12, 6, 35), 300, 3)
    assert starts == [datetime(2025, 2, 2, 11, 51), datetime(2025, 2, 2, 11, 56), datetime(2025, 2, 2, 12, 1)]


def test_each_period_gets_the_statistic_of_exactly_the_alarms_metric():
    from moto.cloudwatch.models import Dimension

    starts = [datetime(2025, 1, 1, 12, 0), datetime(2025, 1, 1, 12, 1), datetime(2025, 1, 1, 12, 2)]
    run = [{"Name": "Run", "Value": "r1"}]

    def datum(second, value, dimensions=run, unit="Seconds"):
        return MetricDatum("N", "Loss", value, dimensions, starts[0] + timedelta(seconds=second), unit)

    data = [datum(5, 1.0), datum(30, 4.0), datum(59, 3.0),            # first minute
            datum(70, 9.0, dimensions=[*run, {"Name": "Node", "Value": "i-1"}]),   # another metric
            datum(75, 9.0, unit="Count"),                              # another unit
            MetricAggregatedDatum("N", "Loss", 1.0, 6.0, 4.0, 12.0, run, starts[2], "Seconds"),
            datum(-1, 9.0), datum(180, 9.0)]                           # outside the range
    alarm = dict(dimensions=[Dimension("Run", "r1")], unit="Seconds")

    maximum = period_datapoints(metric_alarm(**alarm), data, starts)
    assert [point and (point.value, point.sample_count) for point in maximum] == [(4.0, 3), None, (6.0, 4.0)]
    assert maximum[0].timestamp == starts[0]
    average = period_datapoints(metric_alarm(**alarm, statistic="Average"), data, starts)
    assert [point and point.value for point in average] == [8.0 / 3, None, 3.0]
    median = period_datapoints(metric_alarm(**alarm, statistic=None, extended_statistic="p50"), data, starts)
    assert [point and point.value for point in median] == [3.0, None, None]  # a statistic set has no values
    any_unit = period_datapoints(metric_alarm(dimensions=[Dimension("Run", "r1")]), data, starts)
    assert [point and point.value for point in any_unit] == [4.0, 9.0, 6.0]


# --- alarms in a running local cloud ---------------------------------------------------------

ALARMS = "alarms-test-"
"""Every alarm and stack this module makes is named with this prefix."""


@pytest.fixture(scope="module")
def cloud():
    """A local cloud for this module, its time scaled 50x down (a nominal minute is 1.2 s).
    moto's state outlives it, and a later cloud in this process would evaluate this module's
    alarms and send its events to the deployed stack's functions: the alarms and the stack's
    EventBridge rules are deleted at the end."""
    from localcloud import LocalCloud

    with LocalCloud(time_scale=0.02) as running:
        yield running
        cloudwatch, events = running.client("cloudwatch"), running.client("events")
        alarms = cloudwatch.describe_alarms(AlarmNamePrefix=ALARMS)["MetricAlarms"]
        if alarms:
            cloudwatch.delete_alarms(AlarmNames=[alarm["AlarmName"] for alarm in alarms])
        remove_rules(events, ALARMS)


def topic_with_queue(cloud, topic_arn=None):
    """An SNS topic (a new one unless given) with a new SQS queue subscribed; (topic ARN, queue URL)."""
    sns, sqs = cloud.client("sns"), cloud.client("sqs")
    topic_arn = topic_arn or sns.create_topic(Name=unique(ALARMS))["TopicArn"]
    queue_url = sqs.create_queue(QueueName=unique(ALARMS))["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    sns.subscribe(TopicArn=topic_arn, Protocol="sqs", Endpoint=queue_arn)
    return topic_arn, queue_url


def notifications(cloud, queue_url):
    """The SNS notifications in the queue now, as (Subject, parsed Message), oldest first."""
    sqs = cloud.client("sqs")
    received = sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=0).get("Messages", [])
    for message in received:
        sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
    envelopes = [json.loads(message["Body"]) for message in received]
    return [(envelope["Subject"], json.loads(envelope["Message"])) for envelope in envelopes]


def put_value(cloud, namespace, value, minutes_ago):
    """A datapoint `minutes_ago` whole minutes before this one (1: the newest an evaluation sees)."""
    cloud.client("cloudwatch").put_metric_data(Namespace=namespace, MetricData=[{
        "MetricName": "Errors", "Value": value,
        "Timestamp": datetime.now(timezone.utc) - timedelta(minutes=minutes_ago)}])


def put_alarm(cloud, namespace, **settings):
    name = unique(ALARMS)
    cloud.client("cloudwatch").put_metric_alarm(**{
        "AlarmName": name, "Namespace": namespace, "MetricName": "Errors", "Statistic": "Maximum",
        "Period": 60, "EvaluationPeriods": 1, "Threshold": 10.0, "ComparisonOperator": "GreaterThanThreshold",
        **settings})
    return name


def described(cloud, name):
    return cloud.client("cloudwatch").describe_alarms(AlarmNames=[name])["MetricAlarms"][0]


def test_an_alarm_goes_to_alarm_and_back_to_ok_and_notifies_its_topic(cloud):
    topic, queue = topic_with_queue(cloud)
    namespace = unique("alarms")
    name = put_alarm(cloud, namespace, AlarmDescription="errors above 10", AlarmActions=[topic], OKActions=[topic])
    assert (described(cloud, name)["StateValue"], described(cloud, name)["StateReason"]) == (
        INSUFFICIENT_DATA, "Unchecked: Initial alarm creation")

    put_value(cloud, namespace, 15.0, minutes_ago=2)
    evaluate_alarms()
    alarm = described(cloud, name)
    assert alarm["StateValue"] == ALARM
    assert alarm["StateReason"].startswith("Threshold Crossed: 1 out of the last 1 datapoints [15.0 (")
    assert [point["value"] for point in json.loads(alarm["StateReasonData"])["evaluatedDatapoints"]] == [15.0]
    [(subject, message)] = notifications(cloud, queue)
    assert subject == f'ALARM: "{name}" in US East (N. Virginia)'
    assert {key: message[key] for key in ("AlarmName", "AlarmDescription", "AWSAccountId", "NewStateValue",
                                          "OldStateValue", "NewStateReason", "Region")} == {
        "AlarmName": name, "AlarmDescription": "errors above 10", "AWSAccountId": cloud.account_id,
        "NewStateValue": ALARM, "OldStateValue": INSUFFICIENT_DATA, "NewStateReason": alarm["StateReason"],
        "Region": "US East (N. Virginia)"}
    assert datetime.strptime(message["StateChangeTime"], "%Y-%m-%dT%H:%M:%S.%f%z") == alarm["StateUpdatedTimestamp"]
    assert message["Trigger"] == {
        "MetricName": "Errors", "Namespace": namespace, "StatisticType": "Statistic", "Statistic": "MAXIMUM",
        "Unit": None, "Dimensions": [], "Period": 60, "EvaluationPeriods": 1,
        "ComparisonOperator": "GreaterThanThreshold", "Threshold": 10.0, "TreatMissingData": "missing",
        "EvaluateLowSampleCountPercentile": ""}

    evaluate_alarms()  # no change, no notification
    put_value(cloud, namespace, 5.0, minutes_ago=1)  # newer, within the threshold
    evaluate_alarms()
    assert described(cloud, name)["StateValue"] == OK
    [(subject, message)] = notifications(cloud, queue)
    assert subject.startswith(f'OK: "{name}"')
    assert (message["OldStateValue"], message["NewStateValue"]) == (ALARM, OK)
    assert "[5.0 (" in message["NewStateReason"] and "was not greater than the threshold" in message["NewStateReason"]


def test_missing_data_as_not_breaching_is_ok_and_as_missing_is_insufficient(cloud):
    topic, queue = topic_with_queue(cloud)
    namespace = unique("alarms")
    quiet = put_alarm(cloud, namespace, TreatMissingData="notBreaching", OKActions=[topic])
    unknown = put_alarm(cloud, namespace, InsufficientDataActions=[topic])
    evaluate_alarms()
    assert described(cloud, quiet)["StateValue"] == OK
    assert described(cloud, quiet)["StateReason"] == ("Threshold Crossed: no datapoints were received for 1 period "
                                                      "and 1 missing datapoint was treated as [NonBreaching].")
    assert described(cloud, unknown)["StateValue"] == INSUFFICIENT_DATA  # as it was: no notification
    assert [message["AlarmName"] for _, message in notifications(cloud, queue)] == [quiet]


def test_alarms_are_evaluated_every_scaled_minute(cloud):
    namespace = unique("alarms")
    name = put_alarm(cloud, namespace, EvaluationPeriods=2, DatapointsToAlarm=1)
    put_value(cloud, namespace, 11.0, minutes_ago=1)
    # time_scale 0.02: a nominal minute is 1.2 s.
    cloud.wait_until(lambda: described(cloud, name)["StateValue"] == ALARM, "the alarm's own evaluation")


def test_putting_an_alarm_again_keeps_its_state_and_disabled_actions_do_not_run(cloud):
    topic, queue = topic_with_queue(cloud)
    namespace = unique("alarms")
    name = put_alarm(cloud, namespace, AlarmActions=[topic], ActionsEnabled=False)
    put_value(cloud, namespace, 11.0, minutes_ago=1)
    evaluate_alarms()
    assert described(cloud, name)["StateValue"] == ALARM
    assert notifications(cloud, queue) == []

    put_alarm_again = dict(AlarmName=name, Namespace=namespace, MetricName="Errors", Statistic="Maximum", Period=60,
                           EvaluationPeriods=1, Threshold=10.5, ComparisonOperator="GreaterThanThreshold")
    cloud.client("cloudwatch").put_metric_alarm(**put_alarm_again)
    assert (described(cloud, name)["StateValue"], described(cloud, name)["Threshold"]) == (ALARM, 10.5)


def test_set_alarm_state_runs_the_new_states_actions(cloud):
    topic, queue = topic_with_queue(cloud)
    name = put_alarm(cloud, unique("alarms"), AlarmActions=[topic], OKActions=[topic])
    cloud.client("cloudwatch").set_alarm_state(AlarmName=name, StateValue=ALARM, StateReason="testing the topic")
    [(subject, message)] = notifications(cloud, queue)
    assert subject.startswith("ALARM: ") and message["NewStateReason"] == "testing the topic"


def test_metric_math_alarms_are_left_as_they_are(cloud):
    namespace = unique("alarms")
    name = unique(ALARMS)
    cloud.client("cloudwatch").put_metric_alarm(
        AlarmName=name, EvaluationPeriods=1, Threshold=10.0, ComparisonOperator="GreaterThanThreshold",
        TreatMissingData="notBreaching", Metrics=[{"Id": "errors", "ReturnData": True, "MetricStat": {
            "Metric": {"Namespace": namespace, "MetricName": "Errors"}, "Period": 60, "Stat": "Maximum"}}])
    evaluate_alarms()
    assert described(cloud, name)["StateValue"] == INSUFFICIENT_DATA


@pytest.mark.slow
def test_the_projects_no_progress_alarm_notifies_its_topic(cloud):
    """template.yaml's NoProgressAlarm, deployed, on the SecondsSinceProgress the reaper publishes."""
    from localcloud.deploy import DeployRequest, deploy, load_template

    template = REPO / "template.yaml"
    stack_name = unique(ALARMS)
    stack = deploy(DeployRequest(template, cloud.endpoint, stack_name=stack_name))
    _, queue = topic_with_queue(cloud, stack.outputs["AlarmTopic"])
    name = stack.resources["NoProgressAlarm"].physical_id
    threshold = float(load_template(template)["Parameters"]["NoProgressAlarmSeconds"]["Default"])
    assert described(cloud, name)["Threshold"] == threshold
    cloud.client("cloudwatch").put_metric_data(Namespace="Trainfleet", MetricData=[{
        "MetricName": "SecondsSinceProgress", "Dimensions": [{"Name": "StackName", "Value": stack_name}],
        "Value": threshold + 60, "Unit": "Seconds", "Timestamp": datetime.now(timezone.utc) - timedelta(minutes=1)}])
    evaluate_alarms()

    assert described(cloud, name)["StateValue"] == ALARM
    # The alarm may have gone OK (no live run) before the queue was subscribed, or after.
    [(subject, message)] = [sent for sent in notifications(cloud, queue) if sent[1]["NewStateValue"] == ALARM]
    assert subject == f'ALARM: "{name}" in US East (N. Virginia)'
    assert message["AlarmName"] == name
    assert f"[{threshold + 60!r} (" in message["NewStateReason"]
    assert message["Trigger"]["Dimensions"] == [{"value": stack_name, "name": "StackName"}]
