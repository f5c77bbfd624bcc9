"""CloudWatch glue: metric alarms are evaluated, and act on their changes of state, as on AWS.

moto 5.2.5 stores what PutMetricAlarm is given and never evaluates it: an alarm keeps its first
state for ever (moto's is OK, AWS's INSUFFICIENT_DATA) and its actions never run. Now, after
the CloudWatch User Guide (evaluating an alarm, "M out of N", "Configuring how CloudWatch
alarms treat missing data", avoiding premature transitions to ALARM) and the API Reference:

- PutMetricAlarm creates an alarm in INSUFFICIENT_DATA ("Unchecked: Initial alarm creation");
  putting an existing alarm again replaces its configuration and keeps its state (moto started
  it over).
- While a LocalCloud runs, every metric alarm is evaluated once a nominal minute (scaled, like
  every nominal duration here: CloudWatch evaluates about once a minute), and at once by
  `evaluate_alarms()`. Periods are real time, as the metric data's timestamps are: the newest
  ends where the current minute began (CloudWatch's notifications list datapoints of whole
  minutes, the newest ending at the minute of the evaluation), and the evaluation range is
  EvaluationPeriods + 2 periods (`AlarmRule.evaluation_range`).
- A period's datapoint is the alarm's Statistic (moto's own `Statistics`, over single values
  and statistic sets) or ExtendedStatistic pNN (nearest rank over the single values) of the
  data put (PutMetricData, functions' EMF lines) with exactly the alarm's namespace, metric
  name and dimensions, and its Unit when it names one; a period without such data is missing.
- The new state is `decide()`'s, a pure function of the datapoints, the current state and the
  alarm's ComparisonOperator, Threshold, EvaluationPeriods, DatapointsToAlarm (default:
  EvaluationPeriods) and TreatMissingData (default: missing). It gives what every row of the
  User Guide's tables of examples gives.
- A change is recorded through SetAlarmState (StateValue; StateReason and StateReasonData
  worded as CloudWatch words them; StateUpdatedTimestamp). SetAlarmState, the API call too,
  now runs the new state's actions when the alarm's ActionsEnabled, as on AWS: an SNS
  topic gets the notification CloudWatch publishes (Subject `ALARM: "name" in US East (N.
  Virginia)`, the alarm's JSON document as Message), which moto's SNS delivers to the topic's
  subscriptions (SQS queues among them). Other actions (Auto Scaling, EC2, Systems Manager,
  Lambda) are logged and not run.

Not evaluated (a warning says so when such an alarm is put; its state changes only through
SetAlarmState): metric math alarms (Metrics), and with them the anomaly detection band
comparisons; composite alarms; extended statistics other than pNN. Nor is
EvaluateLowSampleCountPercentile applied: a percentile is evaluated however few its samples.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import operator
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

import botocore.session
from moto.cloudwatch.exceptions import ResourceNotFound
from moto.cloudwatch.models import Alarm, CloudWatchBackend, MetricDatum, MetricDatumBase, Statistics
from moto.core.utils import utcnow
from moto.sns.exceptions import SNSNotFoundError

from localcloud.glue import active_cloud

if TYPE_CHECKING:
    from localcloud.parts import Workers

log = logging.getLogger(__name__)

OK, ALARM, INSUFFICIENT_DATA = "OK", "ALARM", "INSUFFICIENT_DATA"

EVALUATION_INTERVAL_S = 60.0
"""Nominal seconds between two evaluations of every alarm."""


class Comparison(NamedTuple):
    """A ComparisonOperator."""

    holds: Callable[[float, float], bool]
    """(datapoint, threshold) -> whether the datapoint breaches."""
    words: str
    """As a state reason says it: "... was greater than the threshold (1.0)"."""


COMPARISONS = {
    "GreaterThanOrEqualToThreshold": Comparison(operator.ge, "greater than or equal to"),
    "GreaterThanThreshold": Comparison(operator.gt, "greater than"),
    "LessThanThreshold": Comparison(operator.lt, "less than"),
    "LessThanOrEqualToThreshold": Comparison(operator.le, "less than or equal to"),
}
"""The static-threshold operators; the anomaly band ones need a metric math alarm."""


# --- the decision (pure) -------------------------------------------------------------------

@dataclass(frozen=True)
class AlarmRule:
    """What deciding an alarm's state needs of its configuration."""

    comparison_operator: str
    """A key of COMPARISONS."""
    threshold: float
    evaluation_periods: int
    """N: how many datapoints are evaluated."""
    datapoints_to_alarm: int
    """M: how many of them must breach for ALARM."""
    treat_missing_data: str = "missing"
    """missing, notBreaching, breaching or ignore."""

    @property
    def evaluation_range(self) -> int:
        """Periods fetched for an evaluation: more than N, in case some are missing. The User
        Guide's examples fetch 5 for 3 and AWS gives no rule for other alarms: N + 2 here."""
        return self.evaluation_periods + 2

    def breaches(self, value: float) -> bool:
        return COMPARISONS[self.comparison_operator].holds(value, self.threshold)

    @classmethod
    def of(cls, alarm: Alarm) -> AlarmRule:
        return cls(alarm.comparison_operator, float(alarm.threshold), int(alarm.evaluation_periods),
                   int(alarm.datapoints_to_alarm or alarm.evaluation_periods),
                   alarm.treat_missing_data or "missing")


@dataclass(frozen=True)
class Decision:
    """An evaluation's outcome."""

    state: str
    """OK, ALARM or INSUFFICIENT_DATA; the current state where it is retained."""
    evaluated: tuple[int, ...] = ()
    """Positions in the evaluation range of the real datapoints the state rests on."""
    filled: int = 0
    """Missing datapoints evaluated as TreatMissingData says (breaching, notBreaching)."""

    def newest_first(self, datapoints: Sequence[Any]) -> list[Any]:
        """The evaluated ones of the evaluation range's `datapoints`, newest first."""
        return [datapoints[i] for i in reversed(self.evaluated)]


def decide(rule: AlarmRule, values: Sequence[float | None], state: str) -> Decision:
    """The alarm's state after an evaluation of `values`, its evaluation range's datapoints
    (oldest first, None where a period has none), while it is in `state`."""
    real = [i for i, value in enumerate(values) if value is not None]
    breaching = [i for i in real if rule.breaches(values[i])]
    needed = rule.datapoints_to_alarm
    if len(real) >= rule.evaluation_periods:  # enough real data: missing data plays no part
        recent = real[-rule.evaluation_periods:]
        return Decision(ALARM if len(set(recent) & set(breaching)) >= needed else OK, tuple(recent))
    # Fewer real datapoints than N: every one of them is evaluated, with as few missing ones as
    # make up N, counted as TreatMissingData says.
    filled = rule.evaluation_periods - len(real)
    if rule.treat_missing_data == "breaching":
        return Decision(ALARM if len(breaching) + filled >= needed else OK, tuple(real), filled)
    if rule.treat_missing_data == "notBreaching":
        return Decision(ALARM if len(breaching) >= needed else OK, tuple(real), filled)
    # missing and ignore: only real datapoints count.
    if len(breaching) >= needed:
        return Decision(ALARM, tuple(real))
    if len(breaching) < len(real):
        return Decision(OK, tuple(real))
    if rule.treat_missing_data == "ignore":
        return Decision(state)
    # No datapoint, or too few, all breaching: ALARM only once the oldest of them is at least M
    # periods old, so that one breaching datapoint followed by a good one raises no false alarm.
    if real and len(values) - real[0] >= needed:
        return Decision(ALARM, tuple(real))
    return Decision(INSUFFICIENT_DATA)


class Datapoint(NamedTuple):
    """One period's statistic."""

    timestamp: datetime
    """Start of the period, naive UTC as moto keeps metric timestamps."""
    value: float
    sample_count: float


def state_reason(rule: AlarmRule, decision: Decision, datapoints: Sequence[Datapoint | None],
                 old_state: str) -> str:
    """StateReason of a change to `decision.state`, worded as CloudWatch words it."""
    if decision.state == INSUFFICIENT_DATA:
        unknown = sum(point is None for point in datapoints)
        return f"Insufficient Data: {_count(unknown, 'datapoint')} {_was(unknown)} unknown."
    alarming = decision.state == ALARM
    fills_breach = rule.treat_missing_data == "breaching"
    treated = (f"{_count(decision.filled, 'missing datapoint')} {_was(decision.filled)} treated as "
               f"[{'Breaching' if fills_breach else 'NonBreaching'}]")
    if not decision.evaluated:
        received = f"no datapoints were received for {_count(decision.filled, 'period')}"
        return f"Threshold Crossed: {received} and {treated}."
    shown = [point for point in decision.newest_first(datapoints) if rule.breaches(point.value) == alarming]
    count = len(shown) + (decision.filled if fills_breach == alarming else 0)
    listed = ", ".join(f"{point.value!r} ({point.timestamp:%d/%m/%y %H:%M:%S})" for point in shown)
    words = ("" if alarming else "not ") + COMPARISONS[rule.comparison_operator].words
    minimum = rule.datapoints_to_alarm if alarming else rule.evaluation_periods - rule.datapoints_to_alarm + 1
    reason = (f"Threshold Crossed: {count} out of the last {rule.evaluation_periods} datapoints [{listed}] "
              f"{_was(count)} {words} the threshold ({rule.threshold!r}) "
              f"(minimum {_count(minimum, 'datapoint')} for {old_state} -> {decision.state} transition).")
    return f"{reason} {treated}." if decision.filled else reason


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _was(number: int) -> str:
    return "was" if number == 1 else "were"


# --- datapoints from moto's metric data ----------------------------------------------------

_PERCENTILE = re.compile(r"p(\d+(?:\.\d+)?)")


def percentile(extended_statistic: str) -> float | None:
    """The percentile of a pNN statistic ("p99.9" -> 99.9); None for the other extended ones."""
    match = _PERCENTILE.fullmatch(extended_statistic)
    return float(match.group(1)) if match and float(match.group(1)) <= 100 else None


def period_starts(now: datetime, period_s: int, count: int) -> list[datetime]:
    """Starts of the `count` periods before the minute `now` is in, oldest first."""
    end = now.replace(second=0, microsecond=0)
    return [end - (count - i) * timedelta(seconds=period_s) for i in range(count)]


def period_datapoints(alarm: Alarm, metric_data: Sequence[MetricDatumBase],
                      starts: list[datetime]) -> list[Datapoint | None]:
    """The alarm's datapoint of each period that starts at `starts` (None where none)."""
    period = timedelta(seconds=alarm.period)
    first, end = starts[0], starts[-1] + period
    dimensions = {(dimension.name, dimension.value) for dimension in alarm.dimensions}
    in_periods: list[list[MetricDatumBase]] = [[] for _ in starts]
    for datum in metric_data:
        if (datum.name == alarm.metric_name and first <= datum.timestamp < end
                and datum.namespace == alarm.namespace and alarm.unit in (None, datum.unit)
                and len(datum.dimensions) == len(dimensions)
                and all((dimension.name, dimension.value) in dimensions for dimension in datum.dimensions)):
            in_periods[int((datum.timestamp - first) / period)].append(datum)
    return [_datapoint(alarm, start, data) if data else None for start, data in zip(starts, in_periods)]


def _datapoint(alarm: Alarm, start: datetime, data: list[MetricDatumBase]) -> Datapoint | None:
    statistics = Statistics([alarm.statistic], start)  # its sample count comes with any statistic
    statistics.metric_data = data
    if alarm.extended_statistic:
        values = sorted(datum.value for datum in data if isinstance(datum, MetricDatum))
        if not values:  # statistic sets carry no values to take a percentile of
            return None
        rank = math.ceil(percentile(alarm.extended_statistic) / 100 * len(values))
        value = values[max(rank, 1) - 1]
    else:
        value = statistics.get_statistics_for_type(alarm.statistic)
    return None if value is None else Datapoint(start, float(value), statistics.calc_sample_count())


def unevaluated_because(alarm: Alarm) -> str | None:
    """Why the alarm is not evaluated here, or None if it is."""
    if alarm.rule is not None:
        return "it is a composite alarm"
    if alarm.metric_data_queries:
        return "it is a metric math alarm (Metrics)"
    if not (alarm.metric_name and alarm.period and (alarm.statistic or alarm.extended_statistic)):
        return "it lacks a MetricName, a Period or a statistic (CloudWatch refuses such an alarm)"
    if alarm.comparison_operator not in COMPARISONS:
        return f"its ComparisonOperator is {alarm.comparison_operator}"
    if alarm.extended_statistic and percentile(alarm.extended_statistic) is None:
        return f"its ExtendedStatistic is {alarm.extended_statistic}"
    return None


# --- evaluation ----------------------------------------------------------------------------

_evaluating = threading.Lock()
"""One evaluation at a time, so that a change of state (and its actions) happens once."""


def evaluate_alarms() -> None:
    """Evaluate every metric alarm now, as CloudWatch does each minute (`evaluate_every_minute`
    calls it while a LocalCloud runs; a test can call it to evaluate at once)."""
    from moto.cloudwatch.models import cloudwatch_backends

    with _evaluating:
        now = utcnow()
        for account in list(cloudwatch_backends.values()):
            for backend in list(account.values()):
                alarms = [alarm for alarm in list(backend.alarms.values())
                          if unevaluated_because(alarm) is None]
                metric_data = list(backend.metric_data) if alarms else []
                for alarm in alarms:
                    _evaluate(backend, alarm, metric_data, now)


def _evaluate(backend: CloudWatchBackend, alarm: Alarm, metric_data: list[MetricDatumBase],
              now: datetime) -> None:
    rule = AlarmRule.of(alarm)
    starts = period_starts(now, alarm.period, rule.evaluation_range)
    datapoints = period_datapoints(alarm, metric_data, starts)
    values = [None if point is None else point.value for point in datapoints]
    decision = decide(rule, values, alarm.state_value)
    if decision.state == alarm.state_value:
        return
    reason_data = {
        "version": "1.0", "queryDate": _aws_time(now), "startDate": _aws_time(starts[0]),
        "statistic": alarm.statistic or alarm.extended_statistic, "period": alarm.period,
        "recentDatapoints": [value for value in values if value is not None],
        "threshold": rule.threshold,
        "evaluatedDatapoints": [{"timestamp": _aws_time(point.timestamp), "sampleCount": point.sample_count,
                                 "value": point.value} for point in decision.newest_first(datapoints)],
    }
    try:
        backend.set_alarm_state(alarm.name, state_reason(rule, decision, datapoints, alarm.state_value),
                                json.dumps(reason_data), decision.state)
    except ResourceNotFound:  # deleted while this evaluation ran
        pass


def evaluate_every_minute(cloud: Workers) -> None:
    """Evaluate every alarm once a nominal minute for as long as `cloud` is the running one."""
    def tick() -> None:
        if active_cloud() is not cloud:
            return
        cloud.submit_later("evaluate CloudWatch alarms", EVALUATION_INTERVAL_S, tick)
        evaluate_alarms()

    cloud.submit_later("evaluate CloudWatch alarms", EVALUATION_INTERVAL_S, tick)


# --- actions -------------------------------------------------------------------------------

_ACTIONS_OF_STATE = {OK: "ok_actions", ALARM: "alarm_actions", INSUFFICIENT_DATA: "insufficient_data_actions"}


@functools.cache
def region_description(region: str) -> str:
    """A region as alarm notifications name it ("US East (N. Virginia)"), from botocore's data."""
    for partition in botocore.session.get_session().get_data("endpoints")["partitions"]:
        if region in partition["regions"]:
            return partition["regions"][region]["description"]
    return region


def _aws_time(moment: datetime) -> str:
    """A naive UTC time as CloudWatch writes it in notifications: 2025-02-02T12:06:35.472+0000."""
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{moment.microsecond // 1000:03d}+0000"


def alarm_notification(backend: CloudWatchBackend, alarm: Alarm, old_state: str) -> dict[str, Any]:
    """The JSON document CloudWatch publishes to an alarm's SNS topics on a change of state."""
    statistic = ({"StatisticType": "ExtendedStatistic", "ExtendedStatistic": alarm.extended_statistic}
                 if alarm.extended_statistic else
                 {"StatisticType": "Statistic", "Statistic": (alarm.statistic or "").upper()})
    return {
        "AlarmName": alarm.name, "AlarmDescription": alarm.description, "AWSAccountId": backend.account_id,
        "AlarmConfigurationUpdatedTimestamp": _aws_time(alarm.configuration_updated_timestamp),
        "NewStateValue": alarm.state_value, "NewStateReason": alarm.state_reason,
        "StateChangeTime": _aws_time(alarm.state_updated_timestamp),
        "Region": region_description(backend.region_name), "AlarmArn": alarm.alarm_arn,
        "OldStateValue": old_state, "OKActions": alarm.ok_actions, "AlarmActions": alarm.alarm_actions,
        "InsufficientDataActions": alarm.insufficient_data_actions,
        "Trigger": {
            "MetricName": alarm.metric_name, "Namespace": alarm.namespace, **statistic, "Unit": alarm.unit,
            "Dimensions": [{"value": dimension.value, "name": dimension.name}
                           for dimension in alarm.dimensions],
            "Period": alarm.period, "EvaluationPeriods": alarm.evaluation_periods,
            "ComparisonOperator": alarm.comparison_operator, "Threshold": alarm.threshold,
            "TreatMissingData": alarm.treat_missing_data or "missing",
            "EvaluateLowSampleCountPercentile": alarm.evaluate_low_sample_count_percentile or "",
        },
    }


def _run_actions(backend: CloudWatchBackend, alarm: Alarm, old_state: str) -> None:
    from moto.sns.models import sns_backends

    for arn in getattr(alarm, _ACTIONS_OF_STATE[alarm.state_value]):
        parts = arn.split(":", 5)
        if len(parts) != 6 or parts[2] != "sns":
            log.warning("alarm %s went to %s: its action %s is not run here (only SNS topics are)",
                        alarm.name, alarm.state_value, arn)
            continue
        # SNS refuses a Subject over 100 characters; an alarm name may have 255.
        subject = f'{alarm.state_value}: "{alarm.name}" in {region_description(backend.region_name)}'[:100]
        message = json.dumps(alarm_notification(backend, alarm, old_state))
        try:
            sns_backends[parts[4]][parts[3]].publish(message, arn=arn, subject=subject)
        except SNSNotFoundError:  # CloudWatch does not check that an action exists either
            log.warning("alarm %s went to %s: its topic %s does not exist",
                        alarm.name, alarm.state_value, arn)


# --- patches -------------------------------------------------------------------------------

_moto_put_metric_alarm = CloudWatchBackend.put_metric_alarm
_moto_set_alarm_state = CloudWatchBackend.set_alarm_state


def _put_metric_alarm(self: CloudWatchBackend, name: str, *args: Any, **kwargs: Any) -> Alarm:
    previous = self.alarms.get(name)
    alarm = _moto_put_metric_alarm(self, name, *args, **kwargs)
    if active_cloud() is None:
        return alarm
    if previous is None:
        alarm.state_value = INSUFFICIENT_DATA  # moto's reason is already AWS's
    else:
        for kept in ("state_value", "state_reason", "state_reason_data", "state_updated_timestamp",
                     "history"):
            setattr(alarm, kept, getattr(previous, kept))
    why = unevaluated_because(alarm)
    if why is not None:
        log.warning("CloudWatch alarm %s is not evaluated here: %s", name, why)
    return alarm


def _set_alarm_state(self: CloudWatchBackend, alarm_name: str, reason: str, reason_data: str,
                     state_value: str) -> None:
    previous = self.alarms.get(alarm_name)
    old_state = previous.state_value if previous is not None else None
    _moto_set_alarm_state(self, alarm_name, reason, reason_data, state_value)
    alarm = self.alarms[alarm_name]
    if active_cloud() is not None and alarm.actions_enabled and state_value != old_state:
        _run_actions(self, alarm, old_state)


def apply() -> None:
    CloudWatchBackend.put_metric_alarm = _put_metric_alarm
    CloudWatchBackend.set_alarm_state = _set_alarm_state
