"""The contracts: the example RunSpec, bad input naming its field, state diagrams, event shapes."""

import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from localcloud.waiting import run_captured
from trainer import schedules
from trainfleet.core import events, node_access, records, runspec, shapes

EXAMPLE = json.loads((Path(__file__).parents[1] / "events" / "example-run.json").read_text())


def spec_with(**changes) -> dict:
    """The example RunSpec with dotted-path changes, e.g. {"capacity.kind": "spot"}."""
    doc = copy.deepcopy(EXAMPLE)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = doc
        for key in parents:
            target = target[key]
        if value is _DELETE:
            del target[leaf]
        else:
            target[leaf] = value
    return doc


_DELETE = object()


def test_example_run_spec_is_valid_and_round_trips():
    spec = runspec.RunSpec.model_validate(EXAMPLE)
    assert spec.facts.accelerator_count == 8
    assert runspec.RunSpec.model_validate_json(spec.model_dump_json()) == spec
    # Sections the control plane does not type reach the trainer untouched.
    assert spec.trainer.model_dump(mode="json")["optim"] == EXAMPLE["trainer"]["optim"]
    assert spec.trainer.model.model_dump()["d_model"] == 2048


def test_a_run_spec_leaves_its_checkpoints_and_network_to_the_stack():
    asked = []

    def network(instance_type: str) -> runspec.NodeNetwork:
        asked.append(instance_type)
        return runspec.NodeNetwork(["subnet-0a1b2c3d4e5f60718"], ["sg-0123456789abcdef0"])

    bare = spec_with(**{"checkpoint.s3_uri": _DELETE, "capacity.subnet_ids": _DELETE,
                        "capacity.security_group_ids": _DELETE})
    spec = runspec.RunSpec.model_validate(runspec.with_stack_defaults(bare, "stack-bucket", network))
    assert spec.checkpoint.s3_uri == "s3://stack-bucket/runs/gpt-1b-p5-demo/checkpoints"
    assert (spec.capacity.subnet_ids, spec.capacity.security_group_ids) == (["subnet-0a1b2c3d4e5f60718"],
                                                                           ["sg-0123456789abcdef0"])
    assert asked == [EXAMPLE["instance_type"]], "the stack's subnets in the zones that offer the run's type"
    assert spec.checkpoint.interval_steps == EXAMPLE["checkpoint"]["interval_steps"], "what is given stays"
    assert not [problem for problem in node_access.node_access_problems(spec, "stack-bucket")
                if problem.startswith("checkpoint")]
    asked.clear()
    assert runspec.with_stack_defaults(EXAMPLE, "stack-bucket", network) == EXAMPLE and not asked, (
        "a RunSpec that names them keeps its own, and the network is not looked up")
    half = runspec.with_stack_defaults(spec_with(**{"capacity.security_group_ids": _DELETE}), "stack-bucket", network)
    with pytest.raises(ValidationError, match="capacity.security_group_ids"):
        runspec.RunSpec.model_validate(half)  # subnets of the user's own: so are their groups
    assert runspec.with_stack_defaults(["not", "a", "spec"], "stack-bucket", network) == ["not", "a", "spec"]


def test_short_hang_timeouts_are_accepted_where_the_read_rate_allows():
    spec = runspec.RunSpec.model_validate(spec_with(**{"recovery.hang_timeout_seconds": 5,
                                                       "recovery.startup_timeout_seconds": 15,
                                                       "trainer.parallel.timeout_s": 10}))
    assert (spec.recovery.hang_timeout_seconds, spec.recovery.startup_timeout_seconds) == (5, 15)
    defaults = runspec.RecoveryPolicy()
    assert (defaults.hang_timeout_seconds, defaults.startup_timeout_seconds) == (600, 1800)
    big = {"node_count": 256, "spare_count": 0, "trainer.parallel.dp": 512, "trainer.training.batch_size": 4096}
    assert runspec.RunSpec.model_validate(spec_with(**big, **{"recovery.hang_timeout_seconds": 35})).node_count == 256


def test_the_timeouts_grow_from_hang_detection_to_the_collectives_to_the_repair_wait():
    """The defaults: a hang declared at 600 s, collectives failing at 900 s (the trainer's), the
    repair order awaited for 1800 s (the start-up timeout, which the agent makes the repair wait)."""
    spec = runspec.RunSpec.model_validate(spec_with())
    assert (spec.recovery.hang_timeout_seconds, spec.trainer.parallel.collective_timeout_s,
            spec.recovery.startup_timeout_seconds) == (600, 900, 1800)


@pytest.mark.parametrize("changes, field, words", [
    ({"run_name": "Bad_Name"}, "run_name", "lower-case"),
    ({"instance_type": "p9.96xlarge"}, "instance_type", "not in the catalogue"),
    ({"node_count": 0}, "node_count", "greater than or equal to 1"),
    ({"min_nodes": 5}, "(input)", "min_nodes=5 exceeds node_count=4"),
    ({"capacity.subnet_ids": []}, "capacity.subnet_ids", "at least 1"),
    ({"capacity.subnet_ids": ["subnet-nothex"]}, "capacity.subnet_ids", "'subnet-nothex' is not a subnet"),
    ({"capacity.security_group_ids": ["sg-0123456789abcdef0", "sg-0123456789abcdef0"]},
     "capacity.security_group_ids", "must not repeat"),
    ({"capacity.kind": "capacity-block"}, "capacity", "needs capacity.reservation_id"),
    ({"capacity.reservation_id": "cr-0123456789abcdef0"}, "capacity", "only used with"),
    ({"capacity.kind": "capacity-reservation", "capacity.reservation_id": "r-1"}, "capacity", "not a cr-"),
    ({"capacity.kind": "reserved"}, "capacity.kind", "on-demand"),
    ({"image_id": "ubuntu"}, "image_id", "neither an ami"),
    ({"checkpoint.s3_uri": "/tmp/ckpt"}, "checkpoint.s3_uri", "s3://BUCKET/PREFIX"),
    ({"checkpoint.keep_last": 1}, "checkpoint.keep_last", "greater than or equal to 2"),
    ({"recovery.backoff_max_seconds": 1}, "recovery", "below recovery.backoff_base_seconds"),
    ({"recovery.max_restart": 3}, "recovery.max_restart", "Extra inputs"),
    ({"recovery.hang_timeout_seconds": 4}, "recovery.hang_timeout_seconds", "greater than or equal to 5"),
    ({"recovery.hang_timeout_seconds": 600, "recovery.startup_timeout_seconds": 300}, "recovery",
     "recovery.startup_timeout_seconds=300 is below recovery.hang_timeout_seconds=600"),
    ({"trainer.parallel.timeout_s": 300}, "(input)",
     "trainer.parallel.timeout_s=300 must lie between recovery.hang_timeout_seconds=600 and "
     "recovery.startup_timeout_seconds=1800: a silent world is declared hung (naming the node that fell silent "
     "first) before its collectives time out"),
    ({"trainer.parallel.timeout_s": 1800}, "(input)", "must lie between"),
    ({"recovery.startup_timeout_seconds": 900}, "(input)",
     "trainer.parallel.timeout_s=900 must lie between recovery.hang_timeout_seconds=600 and "
     "recovery.startup_timeout_seconds=900"),
    ({"recovery.boot_timeout_seconds": 300, "recovery.late_worker_seconds": 600}, "recovery",
     "recovery.late_worker_seconds=600 exceeds recovery.boot_timeout_seconds=300"),
    # 4 workers and a spare may look every 0.6 s (a 5 s hang timeout); 256 nodes may not.
    ({"node_count": 256, "spare_count": 0, "trainer.parallel.dp": 512, "trainer.training.batch_size": 4096,
      "recovery.hang_timeout_seconds": 30}, "(input)",
     "recovery.hang_timeout_seconds=30 is too short for 256 nodes (node_count + spare_count): their agents would "
     "read the run record 41 times a second to tell a silent one in time, at most 34 are allowed; give at least 35 s"),
    ({"trainer.parallel.dp": 4}, "(input)", "32"),
    ({"trainer.parallel.schedule": "zigzag"}, "trainer.parallel.schedule", "unknown"),
    ({"trainer.parallel.tp": 3}, "(input)", "tp=3 must divide the 8 ranks per"),
    ({"trainer.parallel.tp": 2}, "(input)", "pp x dp x tp = 4 x 8 x 2 = 64 ranks"),
    ({"trainer.parallel.pp": 32, "trainer.parallel.dp": 1}, "trainer", "model.n_layers=24"),
    ({"trainer.training.batch_size": 500}, "trainer", "divisible by parallel.dp=8"),
    ({"trainer.parallel.microbatches": 5}, "trainer", "parallel.microbatches=5"),
    ({"trainer.checkpoint": {"uri": "s3://b/x"}}, "trainer", "RunSpec.checkpoint"),
    ({"trainer.model": _DELETE}, "trainer.model", "Field required"),
    ({"trainer.optim.learning_rate": 0.1}, "trainer", "trainer.optim.learning_rate is not a field"),
    ({"trainer.modle": {}}, "trainer", "trainer.modle is not a section"),
    ({"tags": {"trainfleet:run": "x"}}, "tags", "reserved"),
    # The launch template enables instance metadata tags, whose keys EC2 limits further.
    ({"tags": {"team": "x", "cost center": "ml"}}, "tags", "tag key 'cost center'"),
    ({"tags": {"team/owner": "x"}}, "tags", "tag key 'team/owner'"),
    ({"tags": {"_index": "x"}}, "tags", "tag key '_index'"),
    ({"tags": {"team": "x" * 257}}, "tags", "tag 'team': values take at most 256 characters"),
    ({"cost_ceiling_usd": 0}, "cost_ceiling_usd", "greater than 0"),
])
def test_bad_run_spec_names_the_field(changes, field, words):
    with pytest.raises(ValidationError) as caught:
        runspec.RunSpec.model_validate(spec_with(**changes))
    message = shapes.validation_message(caught.value)
    assert message.startswith(f"{field}: "), message
    assert words in message, message


def _trainer_config(pp, dp, schedule, microbatches, stages_per_rank, n_layers, batch_size, tie=False, dp_shard=0):
    return {"model": {"n_layers": n_layers, "tie_embeddings": tie},
            "parallel": {"pp": pp, "dp": dp, "schedule": schedule, "microbatches": microbatches,
                         "stages_per_rank": stages_per_rank, "dp_shard": dp_shard},
            "training": {"batch_size": batch_size}}


def _accepted(trainer_config: dict) -> bool:
    try:
        runspec.TrainerConfig.model_validate(trainer_config)
    except ValidationError:
        return False
    return True


LAYOUT_CASES = [dict(pp=pp, dp=dp, schedule=schedule, microbatches=mb, stages_per_rank=spr,
                     n_layers=layers, batch_size=batch, tie=tie, dp_shard=shard)
                for pp, dp, schedule, mb, spr, layers, batch, tie, shard in itertools.product(
                    (1, 2, 3, 4), (1, 2, 3), sorted(schedules.SCHEDULES), (1, 2, 4, 6), (0, 1, 2),
                    (4, 8), (12, 16), (False, True), (0, 2))]

# The trainer imports torch: ask it in a child process so this process stays torch-free.
TRAINER_SIDE = """
import dataclasses, json, sys
from trainer.config import ConfigError, JobConfig, _apply
verdicts = []
for case in json.load(sys.stdin):
    config = JobConfig()
    _apply(config, {"model": {"n_layers": case["n_layers"], "tie_embeddings": case["tie"]},
                    "parallel": {k: case[k] for k in ("pp", "dp", "schedule", "microbatches", "stages_per_rank",
                                                      "dp_shard")},
                    "training": {"batch_size": case["batch_size"]}}, "test")
    try:
        config.validate()
        verdicts.append(True)
    except ConfigError:
        verdicts.append(False)
fields = {f.name: sorted(g.name for g in dataclasses.fields(f.default_factory()))
          for f in dataclasses.fields(JobConfig)}
print(json.dumps({"verdicts": verdicts, "fields": fields}))
"""


@pytest.fixture(scope="module")
def trainer_side() -> dict:
    done = subprocess.run([sys.executable, "-c", TRAINER_SIDE], input=json.dumps(LAYOUT_CASES),
                          capture_output=True, text=True, check=True)  # it exits when its input ends
    return json.loads(done.stdout)


def test_layout_rules_agree_with_the_trainer(trainer_side):
    """The torch-free mirror refuses exactly the layouts trainer/config.py refuses."""
    verdicts = [_accepted(_trainer_config(**case)) for case in LAYOUT_CASES]
    disagreements = [case for case, ours, theirs in zip(LAYOUT_CASES, verdicts, trainer_side["verdicts"])
                     if ours != theirs]
    assert not disagreements, disagreements[:5]
    assert 0 < sum(verdicts) < len(verdicts)  # the grid holds both kinds


def test_trainer_field_names_match_the_trainers_config(trainer_side):
    fields = dict(trainer_side["fields"])
    for section in runspec.FILLED_SECTIONS:  # filled from the RunSpec's own sections
        assert fields.pop(section)
    assert {section: sorted(names) for section, names in runspec.TRAINER_FIELDS.items()} == fields


def test_contracts_import_neither_torch_nor_boto3():
    script = ("import sys, trainfleet.core.runspec, trainfleet.core.records, trainfleet.core.events, "
              "trainfleet.core.node_access; print(sorted({'torch', 'boto3'} & set(sys.modules)))")
    done = run_captured([sys.executable, "-c", script], what="importing the contracts")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_run_transitions_follow_the_diagram():
    records.check_run_transition(records.RunState.TRAINING, records.RunState.RECOVERING)
    for state in records.RunState:
        if not state.is_final and state is not records.RunState.TEARING_DOWN:
            records.check_run_transition(state, records.RunState.TEARING_DOWN)
    with pytest.raises(records.InvalidTransition, match="SUCCEEDED -> TRAINING"):
        records.check_run_transition(records.RunState.SUCCEEDED, records.RunState.TRAINING)
    with pytest.raises(records.InvalidTransition, match="REQUESTED -> TRAINING"):
        records.check_run_transition(records.RunState.REQUESTED, records.RunState.TRAINING)


def test_node_transitions_follow_the_diagram():
    records.check_node_transition(records.NodeState.LAUNCHED, records.NodeState.REGISTERED)
    records.check_node_transition(records.NodeState.READY, records.NodeState.TERMINATED)
    with pytest.raises(records.InvalidTransition, match="TERMINATED -> READY"):
        records.check_node_transition(records.NodeState.TERMINATED, records.NodeState.READY)
    with pytest.raises(records.InvalidTransition, match="UNHEALTHY -> READY"):
        records.check_node_transition(records.NodeState.UNHEALTHY, records.NodeState.READY)


def test_parallel_plan_and_launch_spec_check_their_numbers():
    plan = records.ParallelPlan(nodes=2, ranks_per_node=8, pp=4, dp=4)
    assert plan.world_size == 16
    with pytest.raises(ValidationError, match="does not fill"):
        records.ParallelPlan(nodes=2, ranks_per_node=8, pp=4, dp=3)
    assert records.ParallelPlan(nodes=2, ranks_per_node=8, pp=2, dp=2, tp=4).world_size == 16
    base = dict(run_name="r", attempt=1, plan=plan, rendezvous_host="10.0.0.1", rendezvous_id="r-1",
                trainer_config={}, hang_timeout_seconds=600, startup_timeout_seconds=1800, stall_floor_seconds=30)
    records.LaunchSpec(node_ranks={"i-1": 0, "i-2": 1}, **base)
    with pytest.raises(ValidationError, match="node_ranks must number"):
        records.LaunchSpec(node_ranks={"i-1": 0, "i-2": 2}, **base)


# The AWS sample events the rules are checked against (events/aws/, shapes from the EC2 and
# Health user guides), one per detail model.
AWS_SAMPLES = {model: json.loads((Path(__file__).parents[1] / "events" / "aws" / name).read_text())
               for model, name in {
                   events.Ec2InstanceStateChange: "ec2-instance-state-change-terminated.json",
                   events.Ec2SpotInterruptionWarning: "ec2-spot-instance-interruption-warning.json",
                   events.Ec2RebalanceRecommendation: "ec2-instance-rebalance-recommendation.json",
                   events.HealthEvent: "aws-health-ec2-instance-retirement.json"}.items()}


@pytest.mark.parametrize("model", list(AWS_SAMPLES), ids=lambda m: m.__name__)
def test_aws_sample_events_parse(model):
    event = events.parse_event(AWS_SAMPLES[model])
    assert isinstance(event.detail, model)
    assert event.detail.model_extra is not None  # unknown AWS fields are kept, not refused
    if model is events.HealthEvent:
        assert event.detail.instance_ids == ["i-1234567890abcdef0"]
    else:
        assert event.detail.instance_id.startswith("i-")


AGENT_SAMPLES = [
    events.NodeRegistered(run_name="r", attempt=0, instance_id="i-1", private_ip="10.0.0.5"),
    events.NodeReady(run_name="r", attempt=0, instance_id="i-1",
                checks=[events.HealthCheckResult(name="gpu_count", passed=True, measured=8, expected=8)]),
    events.NodeUnhealthy(run_name="r", attempt=0, instance_id="i-1", reason="efa_devices: 3 of 4"),
    events.CheckpointCommitted(run_name="r", attempt=2, step=1200, uri="s3://b/runs/r/step-000001200"),
    events.TrainerFailed(run_name="r", attempt=2, instance_id="i-1", kind=records.TrainerFailureKind.NAN_LOSS),
    events.TrainerHung(run_name="r", attempt=2, last_step=10, seconds_since_progress=930.0),
    events.TrainingCompleted(run_name="r", attempt=3, final_step=20000),
    events.TrainingProgress(run_name="r", attempt=3, step=100, loss=2.5, tokens_per_second=1e6, step_seconds=1.2),
]


@pytest.mark.parametrize("detail", AGENT_SAMPLES, ids=lambda d: type(d).__name__)
def test_agent_events_round_trip_through_put_events(detail):
    sender = "arn:aws:ec2:us-east-1:123456789012:instance/i-0123456789abcdef0"
    entry = events.put_events_entry(detail, event_bus_name="trainfleet", sender_arn=sender)
    assert entry["Source"] == f"trainfleet/{sender}" and entry["DetailType"] == type(detail).__name__
    # What a rule target receives: EventBridge's envelope around the entry.
    delivered = {"version": "0", "id": "e-1", "source": entry["Source"], "detail-type": entry["DetailType"],
                 "time": "2026-01-01T00:00:00Z", "resources": entry["Resources"],
                 "detail": json.loads(entry["Detail"])}
    parsed = events.parse_event(delivered)
    assert parsed.detail == detail and parsed.sender == "i-0123456789abcdef0"


@pytest.mark.parametrize("source, sender", [
    ("trainfleet/arn:aws:ec2:us-east-1:123456789012:instance/i-0abc", "i-0abc"),
    ("trainfleet/arn:aws-cn:ec2:cn-north-1:123456789012:instance/i-0abc", "i-0abc"),
    ("trainfleet", None),                                              # no sender named
    ("trainfleet/arn:aws:iam::123456789012:role/node", None),          # not an instance
    ("aws.ec2", None),
])
def test_an_event_s_sender_is_the_instance_its_source_names(source, sender):
    assert events.event_sender(source) == sender


def test_unknown_event_and_bad_detail_are_refused_with_the_field():
    with pytest.raises(ValidationError, match="no handler for source='aws.ec2' detail-type='EC2 Fleet Error'"):
        events.parse_event({**AWS_SAMPLES[events.Ec2RebalanceRecommendation], "detail-type": "EC2 Fleet Error"})
    bad = {**AWS_SAMPLES[events.Ec2InstanceStateChange], "detail": {"instance-id": "i-1", "state": "exploded"}}
    with pytest.raises(ValidationError, match="state"):
        events.parse_event(bad)
    with pytest.raises(ValidationError, match="kind"):
        events.TrainerFailed.model_validate({"run_name": "r", "attempt": 0, "kind": "meh"})


def test_the_ledger_keeps_lost_time_the_sum_of_its_causes_and_reads_older_records():
    assert records.GoodputLedger(lost_seconds=30, lost_by_cause={"startup": 10, "restart:HANG": 20}).lost_seconds == 30
    with pytest.raises(ValidationError, match="not the sum of lost_by_cause"):
        records.GoodputLedger(lost_seconds=31, lost_by_cause={"startup": 10, "restart:HANG": 20})
    with pytest.raises(ValidationError, match="negative time"):
        records.GoodputLedger(lost_seconds=0, lost_by_cause={"startup": 10, "redone:HANG": -10})
    # A record written before causes were kept is read with its loss under one cause.
    older = records.GoodputLedger.model_validate({"productive_seconds": 90, "lost_seconds": 10})
    assert (older.lost_by_cause, older.booked_until) == ({"unattributed": 10}, None)
    assert records.GoodputLedger().lost_by_cause == {}


def test_the_late_worker_deadline_defaults_within_the_boot_timeout():
    assert runspec.RecoveryPolicy().late_worker_deadline == runspec.LATE_WORKER_DEFAULT_S
    assert runspec.RecoveryPolicy(boot_timeout_seconds=120).late_worker_deadline == 120
    assert runspec.RecoveryPolicy(boot_timeout_seconds=900, late_worker_seconds=300).late_worker_deadline == 300
