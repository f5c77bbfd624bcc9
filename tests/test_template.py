"""template.yaml: real AWS sample events match exactly their rules, EC2 mutations are
tag-scoped, the bucket is locked down, and the independent judges pass."""

import json
import sys
from pathlib import Path

import pytest
from moto.events.models import EventPattern

from localcloud.waiting import run_captured
from trainfleet.adapters.ec2_fleet import TAG_STACK
from trainfleet.operator.validate import (
    ValidationSetup,
    load_template,
    statelint_command,
    substituted_definitions,
    validate,
)

REPO = Path(__file__).resolve().parent.parent
AWS_EVENTS = REPO / "events" / "aws"
STACK = "trainfleet-test"

# Each sample (copied in shape from the AWS documentation) and the one rule it must reach.
SAMPLE_RULES = {
    "ec2-instance-state-change-terminated.json": "InstanceStateChange",
    "ec2-spot-instance-interruption-warning.json": "SpotInterruptionWarning",
    "ec2-instance-rebalance-recommendation.json": "RebalanceRecommendation",
    "aws-health-ec2-instance-retirement.json": "HealthEvent",
    "states-execution-status-change-aborted.json": "ExecutionEnded",
}
STATE_MACHINE_ARN = f"arn:aws:states:us-east-1:123456789012:stateMachine:{STACK}-training-run"


@pytest.fixture(scope="module")
def template() -> dict:
    return load_template((REPO / "template.yaml").read_text())


def _resolve_stack_name(node):
    if node == {"Ref": "AWS::StackName"}:
        return STACK
    if node == {"Ref": "TrainingRunStateMachine"}:
        return STATE_MACHINE_ARN
    if isinstance(node, dict):
        return {key: _resolve_stack_name(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolve_stack_name(value) for value in node]
    return node


@pytest.fixture(scope="module")
def rules(template) -> dict[str, EventPattern]:
    """Every EventBridge rule, by name: the functions' rules by event name, the others by
    logical id."""
    resources = template["Resources"]
    events = {name: event for resource in resources.values() if resource["Type"] == "AWS::Serverless::Function"
              for name, event in resource["Properties"].get("Events", {}).items()}
    patterns = {name: event["Properties"]["Pattern"] for name, event in events.items()
                if event["Type"] == "EventBridgeRule"}
    patterns |= {name: resource["Properties"]["EventPattern"] for name, resource in resources.items()
                 if resource["Type"] == "AWS::Events::Rule"}
    return {name: EventPattern.load(json.dumps(_resolve_stack_name(pattern))) for name, pattern in patterns.items()}


def _matching(rules: dict[str, EventPattern], event: dict) -> list[str]:
    return sorted(name for name, pattern in rules.items() if pattern.matches_event(event))


@pytest.mark.parametrize("sample, rule", sorted(SAMPLE_RULES.items()))
def test_aws_sample_event_matches_exactly_its_rule(rules, sample, rule):
    event = json.loads((AWS_EVENTS / sample).read_text())
    assert _matching(rules, event) == [rule]


def test_every_sample_event_file_is_checked():
    assert sorted(path.name for path in AWS_EVENTS.glob("*.json")) == sorted(SAMPLE_RULES)


def test_events_that_do_not_concern_a_run_match_no_rule(rules):
    running = json.loads((AWS_EVENTS / "ec2-instance-state-change-terminated.json").read_text())
    running["detail"]["state"] = "running"
    rds_health = json.loads((AWS_EVENTS / "aws-health-ec2-instance-retirement.json").read_text())
    rds_health["detail"]["service"] = "RDS"
    notice = json.loads((AWS_EVENTS / "aws-health-ec2-instance-retirement.json").read_text())
    notice["detail"]["eventTypeCategory"] = "accountNotification"
    succeeded = json.loads((AWS_EVENTS / "states-execution-status-change-aborted.json").read_text())
    succeeded["detail"]["status"] = "SUCCEEDED"  # Teardown ran
    another_machine = json.loads((AWS_EVENTS / "states-execution-status-change-aborted.json").read_text())
    another_machine["detail"]["stateMachineArn"] += "-of-another-stack"
    for event in (running, rds_health, notice, succeeded, another_machine):
        assert _matching(rules, event) == [], event["detail"]


def test_every_agent_event_type_reaches_the_agents_queue_on_the_stacks_own_bus(template, rules):
    from trainfleet.core.events import DETAIL_MODELS, EVENT_SOURCE, NodeReady, put_events_entry

    resources = template["Resources"]
    rule = resources["AgentEventRule"]["Properties"]
    assert rule["EventBusName"] == {"Ref": "AgentEventBus"}
    assert [target["Arn"] for target in rule["Targets"]] == [{"Fn::GetAtt": ["AgentEventQueue", "Arn"]}]
    source = resources["AgentEventsFunction"]["Properties"]["Events"]["AgentEvents"]
    assert source["Type"] == "SQS" and source["Properties"]["Queue"] == {"Fn::GetAtt": ["AgentEventQueue", "Arn"]}
    detail = NodeReady(run_name="demo", attempt=0, instance_id="i-0123456789abcdef0")
    entry = put_events_entry(detail, "trainfleet-test-agents",
                             "arn:aws:ec2:us-east-1:123456789012:instance/i-0123456789abcdef0")
    for source, detail_type in DETAIL_MODELS:
        if source != EVENT_SOURCE:
            continue
        event = {"version": "0", "id": "5f4e3d2c-0000-4000-8000-000000000001",
                 "source": entry["Source"], "detail-type": detail_type.value,
                 "account": "123456789012", "time": "2026-01-01T00:00:00Z",
                 "region": "us-east-1", "resources": entry["Resources"],
                 "detail": json.loads(entry["Detail"])}
        assert _matching(rules, event) == ["AgentEventRule"], detail_type


def test_an_agents_report_outlives_an_outage_the_state_machine_waits_out(template):
    """A record that fails (the run table down) comes back each visibility timeout; five receives
    sent an hour-long outage's reports, a lost node's TrainerFailed among them, to the
    undelivered events after 27 minutes."""
    asl = json.loads((REPO / "statemachine" / "training_run.asl.json").read_text())
    outage = next(rule for rule in asl["States"]["Recover"]["Retry"] if rule["ErrorEquals"] == ["TransientError"])
    waited_s = sum(min(outage["IntervalSeconds"] * outage["BackoffRate"] ** attempt, outage["MaxDelaySeconds"])
                   for attempt in range(outage["MaxAttempts"])) / 2  # full jitter: half on average
    queue = template["Resources"]["AgentEventQueue"]["Properties"]
    kept_s = queue["VisibilityTimeout"] * queue["RedrivePolicy"]["maxReceiveCount"]
    assert kept_s >= waited_s and kept_s <= queue["MessageRetentionPeriod"]


def _statements(template) -> list[tuple[str, dict]]:
    found = []
    for name, resource in template["Resources"].items():
        properties = resource.get("Properties", {})
        for policy in properties.get("Policies", []):
            if isinstance(policy, dict) and "Statement" in policy:
                found += [(name, statement) for statement in policy["Statement"]]
            if isinstance(policy, dict) and "PolicyDocument" in policy:
                found += [(name, statement) for statement in policy["PolicyDocument"]["Statement"]]
    return found


def test_ec2_mutations_are_limited_to_this_stacks_resources(template):
    destructive = {"ec2:TerminateInstances", "ec2:DeleteLaunchTemplate", "ec2:DeletePlacementGroup",
                   "ec2:StopInstances", "ec2:RebootInstances"}
    for name, statement in _statements(template):
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        if destructive & set(actions):
            condition = statement.get("Condition", {}).get("StringEquals", {})
            assert condition.get(f"aws:ResourceTag/{TAG_STACK}") == {"Ref": "AWS::StackName"}, name
        if "ec2:CreateTags" in actions:
            assert "ec2:CreateAction" in statement["Condition"]["StringEquals"], name
        assert "*" not in actions and "ec2:*" not in actions, name


def test_new_instances_must_carry_this_stacks_tag(template):
    for name, statement in _statements(template):
        resources = statement.get("Resource", [])
        resources = resources if isinstance(resources, list) else [resources]
        creates_instances = "ec2:CreateFleet" in statement.get("Action", []) and any(
            "instance/*" in json.dumps(resource) for resource in resources)
        if creates_instances:
            condition = statement["Condition"]["StringEquals"]
            assert condition[f"aws:RequestTag/{TAG_STACK}"] == {"Ref": "AWS::StackName"}, name


def test_checkpoint_bucket_blocks_public_access_requires_tls_and_encrypts(template):
    resources = template["Resources"]
    bucket = resources["CheckpointBucket"]["Properties"]
    assert all(bucket["PublicAccessBlockConfiguration"].values())
    assert len(bucket["PublicAccessBlockConfiguration"]) == 4
    assert bucket["BucketEncryption"]["ServerSideEncryptionConfiguration"][0][
        "ServerSideEncryptionByDefault"]["SSEAlgorithm"] in ("aws:kms", "AES256")
    (deny,) = resources["CheckpointBucketPolicy"]["Properties"]["PolicyDocument"]["Statement"]
    assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_every_function_handler_is_a_module_in_functions(template):
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::Serverless::Function":
            module, _, function = resource["Properties"]["Handler"].rpartition(".")
            assert (REPO / (module.replace(".", "/") + ".py")).exists(), name
            assert function == "handler", name


def test_every_built_function_imports_its_handler_without_torch(template, tmp_path):
    """What `sam build` packs into a function (the Makefile's build-%Function, the same for every
    function) holds every module its handler imports; the layer brings the dependencies, and
    nothing on the way may need torch, which Lambda does not have."""
    built = run_captured(["make", "-s", "build-ValidateFunction", f"ARTIFACTS_DIR={tmp_path}"], what="the build",
                         cwd=REPO)
    assert built.returncode == 0, built.stderr
    modules = sorted(resource["Properties"]["Handler"].rpartition(".")[0]
                     for resource in template["Resources"].values()
                     if resource["Type"] == "AWS::Serverless::Function")
    # The project's editable install would supply any module the build lacks: every module of
    # ours that the handlers load must come from the build.
    script = "\n".join([
        "import importlib, json, sys",
        "sys.modules['torch'] = None  # any import of torch now fails",
        f"sys.path.insert(0, {str(tmp_path)!r})",
        f"for name in {modules!r}: importlib.import_module(name)",
        "ours = {'functions', 'trainfleet', 'trainer'}",
        "print(json.dumps({name: module.__file__ for name, module in sys.modules.items()",
        "                  if name.split('.')[0] in ours and getattr(module, '__file__', None)}))",
    ])
    done = run_captured([sys.executable, "-c", script], what="importing the built functions", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    assert set(modules) <= set(loaded)
    assert {name: path for name, path in loaded.items() if not path.startswith(str(tmp_path))} == {}


def test_a_placeholder_without_substitution_is_named(tmp_path):
    (tmp_path / "machine.asl.json").write_text('{"Comment": "${Missing} ${Known}"}')
    (tmp_path / "template.yaml").write_text(
        "Resources:\n  Machine:\n    Type: AWS::Serverless::StateMachine\n    Properties:\n"
        "      DefinitionUri: machine.asl.json\n      DefinitionSubstitutions:\n        Known: x\n")
    with pytest.raises(ValueError, match=r"placeholders without a substitution: \['Missing'\]"):
        substituted_definitions(tmp_path / "template.yaml")


def test_missing_tools_are_named(tmp_path, capsys):
    assert validate(ValidationSetup(tools_venv=tmp_path / "absent")) == 1
    assert "make sam-tools" in capsys.readouterr().err


def test_sam_validate_lint_and_statelint_pass(capsys):
    """The judges themselves (make test installs them in .venv-sam first)."""
    status = validate()
    output = capsys.readouterr().out
    assert status == 0, output
    assert "is a valid SAM Template" in output


def _statelint(definition: dict, tmp_path: Path) -> str:
    """statelint's problems with `definition`, as `trainfleet validate` runs it ("" when none)."""
    import subprocess

    asl = tmp_path / "machine.asl.json"
    asl.write_text(json.dumps(definition))
    linted = subprocess.run(statelint_command(ValidationSetup(), asl), capture_output=True, text=True, timeout=300)
    assert linted.returncode in (0, 1), linted.stderr  # 1: problems found, listed
    return linted.stdout.strip()


def test_statelint_knows_the_readers_input_type_as_step_functions_documents_it(tmp_path):
    """statelint 3.1.0 refuses ReaderConfig.InputType, which Step Functions documents for reading a
    file in S3; validate teaches it the field and its values, and every other check still fails."""
    definition = json.loads(substituted_definitions(REPO / "template.yaml")["DataPrepStateMachine"])
    assert _statelint(definition, tmp_path) == ""
    reader = definition["States"]["Tokenise"]["ItemReader"]

    reader["ReaderConfig"] = {"InputType": "XML"}
    assert _statelint(definition, tmp_path) == (
        'One error:\n State Machine.States.Tokenise.ItemReader.ReaderConfig.InputType is "XML", not one of the '
        'allowed values ["CSV", "JSON", "JSONL", "PARQUET", "MANIFEST"]')

    reader["ReaderConfig"] = {"InputType": "JSON", "InputTypes": "JSON"}
    assert _statelint(definition, tmp_path) == (
        'One error:\n Field "InputTypes" not allowed in State Machine.States.Tokenise.ItemReader.ReaderConfig')

    reader["ReaderConfig"] = {"InputType": "JSON"}
    definition["States"]["Plan"]["Next"] = "NoSuchState"
    assert "NoSuchState" in _statelint(definition, tmp_path)


def test_the_reaper_runs_on_ended_executions_and_on_a_schedule(template):
    events = template["Resources"]["ReaperFunction"]["Properties"]["Events"]
    assert events["ExecutionEnded"]["Properties"]["Pattern"]["detail"]["status"] == ["ABORTED", "TIMED_OUT", "FAILED"]
    assert events["Sweep"]["Type"] == "Schedule"
    assert events["Sweep"]["Properties"]["Schedule"].startswith("rate(")


def test_dashboard_body_is_json_and_charts_the_metrics_the_code_emits(template):
    import re

    from trainfleet.adapters.metrics import checkpoint_metrics, lost_time_metrics, progress_metrics
    from trainfleet.core.events import CheckpointCommitted, TrainingProgress
    from trainfleet.core.records import GoodputLedger, RunRecord
    from trainfleet.core.runspec import RunSpec

    body = template["Resources"]["Dashboard"]["Properties"]["DashboardBody"]["Fn::Sub"]
    # A substitution is a string inside quotes, a number (a parameter) outside them.
    widgets = json.loads(re.sub(r"\$\{[^}]+\}", "x", re.sub(r"(?<=: )\$\{[^}]+\}", "0", body)))["widgets"]
    charted = json.dumps(widgets)
    progress = progress_metrics(TrainingProgress(run_name="r", attempt=0, step=1, loss=2.0,
                                                 tokens_per_second=1.0, step_seconds=1.0), "Trainfleet")
    stall = checkpoint_metrics(CheckpointCommitted(run_name="r", attempt=0, step=1, uri="s3://b/k"),
                               "Trainfleet")
    for name in ("Loss", "TokensPerSecond", "StepTime", "CheckpointStall"):
        assert name in progress or name in stall, name
        assert f'MetricName=\\"{name}\\"' in charted, name
    # Lost time by cause: the search names the dimension set the Report function's lines carry.
    run = RunRecord(run_name="r", spec=RunSpec.model_validate_json((REPO / "events" / "example-run.json").read_text()),
                    ledger=GoodputLedger(lost_seconds=1, lost_by_cause={"startup": 1}))
    (lost,) = lost_time_metrics(run, "Trainfleet")
    dimensions = ",".join(lost["_aws"]["CloudWatchMetrics"][0]["Dimensions"][0])
    assert f"SEARCH('{{Trainfleet,{dimensions}}} MetricName=\\\"LostTime\\\"'" in charted
    # Detection latency and each run's seconds since its last step, with the dimensions Recover's
    # and the reaper's lines carry; the alarm watches the stack's maximum.
    from datetime import datetime, timedelta, timezone

    from trainfleet.adapters.metrics import detection_metrics, stall_metrics
    from trainfleet.core.records import FailureClass, FailureRecord

    now = datetime.now(timezone.utc)
    detected = detection_metrics("r", FailureRecord(failure_class=FailureClass.HANG, resume_step=None, at=now,
                                                    onset_at=now - timedelta(seconds=5)), "Trainfleet")
    stall = stall_metrics(run.model_copy(update={"created_at": now}), "st", now, "Trainfleet")
    for document, name in ((detected, "DetectionLatency"), (stall, "SecondsSinceProgress")):
        sets = document["_aws"]["CloudWatchMetrics"][0]["Dimensions"]
        assert f"SEARCH('{{Trainfleet,{','.join(sets[0])}}} MetricName=\\\"{name}\\\"'" in charted, name
    alarm = template["Resources"]["NoProgressAlarm"]["Properties"]
    assert (alarm["MetricName"], [d["Name"] for d in alarm["Dimensions"]]) == ("SecondsSinceProgress", ["StackName"])
    assert [["StackName"]] == [dims for dims in stall["_aws"]["CloudWatchMetrics"][0]["Dimensions"]
                               if dims == ["StackName"]]
