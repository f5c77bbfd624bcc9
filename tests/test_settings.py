"""Typed settings: read from the environment the template gives every function."""

from pathlib import Path

import pytest

from localcloud.deploy import load_template
from trainfleet.core.settings import MissingSetting, Settings

ENV = {"TRAINFLEET_RUN_TABLE": "runs", "TRAINFLEET_LIVENESS_TABLE": "liveness", "TRAINFLEET_BUCKET": "bucket", "TRAINFLEET_EVENT_BUS": "agents",
       "TRAINFLEET_NODE_POLICY_ARN": "arn:aws:iam::123456789012:policy/node",
       "TRAINFLEET_STACK": "trainfleet", "TRAINFLEET_NODE_SUBNETS": "subnet-0a,subnet-0b",
       "TRAINFLEET_NODE_SECURITY_GROUPS": "sg-0a"}


def test_settings_come_from_the_environment():
    settings = Settings.from_environ({**ENV, "POWERTOOLS_METRICS_NAMESPACE": "Custom"})
    assert (settings.run_table, settings.stack_name, settings.metrics_namespace) == ("runs", "trainfleet", "Custom")
    assert Settings.from_environ(ENV).metrics_namespace == "Trainfleet"
    assert Settings.from_environ(ENV).node_subnet_ids == ("subnet-0a", "subnet-0b")


@pytest.mark.parametrize("variable", sorted(ENV))
def test_a_missing_setting_is_named(variable):
    with pytest.raises(MissingSetting, match=f"{variable} .* is not set"):
        Settings.from_environ({**ENV, variable: " "})


def test_the_template_sets_every_variable_the_settings_read():
    template = load_template(Path(__file__).parents[1] / "template.yaml")
    variables = template["Globals"]["Function"]["Environment"]["Variables"]
    assert set(ENV) <= set(variables)
