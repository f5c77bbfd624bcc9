"""EMF extraction: what CloudWatch makes of a function's embedded-metric log lines."""

import json

from localcloud.emf import metric_data


def emf(**root):
    return json.dumps({"_aws": {"Timestamp": 1_700_000_000_000, "CloudWatchMetrics": [{
        "Namespace": "trainfleet", "Dimensions": [["RunName"], ["RunName", "Node"]],
        "Metrics": [{"Name": "Loss", "Unit": "None"}, {"Name": "StepTime", "Unit": "Seconds"}]}]},
        **root})


def test_each_dimension_set_gets_every_metric_with_a_value():
    [(namespace, entries)] = metric_data(emf(RunName="r1", Node="i-1", Loss=2.0, StepTime=[0.5, 0.7]))

    assert namespace == "trainfleet"
    assert [(entry["MetricName"], [d["Name"] for d in entry["Dimensions"]], entry["Values"])
            for entry in entries] == [("Loss", ["RunName"], [2.0]), ("StepTime", ["RunName"], [0.5, 0.7]),
                                      ("Loss", ["RunName", "Node"], [2.0]),
                                      ("StepTime", ["RunName", "Node"], [0.5, 0.7])]
    assert entries[1]["Unit"] == "Seconds"
    assert entries[0]["Timestamp"].timestamp() == 1_700_000_000


def test_lines_that_are_not_valid_emf_give_nothing():
    assert metric_data("step 7 done") == []
    assert metric_data(json.dumps({"level": "INFO", "message": "hi"})) == []
    assert metric_data(emf(Loss=2.0)) == []                      # dimension value missing
    assert metric_data(emf(RunName="r1", Node="i-1", Loss="high", StepTime=None)) == []
