"""Fault injection and request counting at the local cloud's endpoint and in its glue."""

import json
import sys
import threading
from dataclasses import replace

import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from localcloud.fleet import python_module
from localcloud_helpers import (create_state_machine, deploy_function, event_sink, process_state,
                                receive, records, run_execution, start_fake_node, unique)


def test_every_request_over_http_is_counted_by_service_and_action(local_cloud):
    bucket, table = unique("count"), unique("count")
    s3, dynamodb = local_cloud.client("s3"), local_cloud.client("dynamodb")
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="a/b.txt", Body=b"x")
    s3.copy_object(Bucket=bucket, Key="c.txt", CopySource={"Bucket": bucket, "Key": "a/b.txt"})
    s3.get_object(Bucket=bucket, Key="c.txt")
    s3.get_object(Bucket=bucket, Key="a/b.txt")
    s3.list_objects_v2(Bucket=bucket)
    dynamodb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                          KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
                          AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}])
    dynamodb.put_item(TableName=table, Item={"k": {"S": "1"}})
    local_cloud.client("ec2").describe_instances()
    local_cloud.client("events").put_events(Entries=[{"Source": "test", "DetailType": "x", "Detail": "{}"}])
    local_cloud.client("stepfunctions").list_state_machines()

    counted = local_cloud.requests
    assert counted[("s3", "CreateBucket")] == 1 and counted[("s3", "PutObject")] == 1
    assert counted[("s3", "CopyObject")] == 1 and counted[("s3", "GetObject")] == 2
    assert counted[("s3", "ListObjectsV2")] == 1
    assert counted[("dynamodb", "CreateTable")] == 1 and counted[("dynamodb", "PutItem")] == 1
    assert counted[("ec2", "DescribeInstances")] == 1
    assert counted[("events", "PutEvents")] == 1
    assert counted[("states", "ListStateMachines")] == 1


def test_state_transitions_and_lambda_invocations_are_counted(local_cloud, tmp_path):
    echo = deploy_function(local_cloud, "echo", tmp_path / "echo.jsonl")
    machine = create_state_machine(local_cloud, {"StartAt": "First", "States": {
        "First": {"Type": "Pass", "Next": "Call"},
        "Call": {"Type": "Task", "Resource": "arn:aws:states:::lambda:invoke",
                 "Parameters": {"FunctionName": echo, "Payload": {}}, "Next": "Done"},
        "Done": {"Type": "Succeed"}}})
    invokes_before = local_cloud.requests[("lambda", "Invoke")]

    assert run_execution(local_cloud, machine, {})["status"] == "SUCCEEDED"
    local_cloud.client("lambda").invoke(FunctionName=echo, Payload=b"{}")

    assert local_cloud.state_transitions[machine.split(":")[-1]] == 3
    assert local_cloud.lambda_invocations[echo.split(":")[-1]] == 2 == len(records(tmp_path / "echo.jsonl"))
    # The state machine's Lambda task calls Invoke over HTTP, as Step Functions calls Lambda.
    assert local_cloud.requests[("lambda", "Invoke")] - invokes_before == 2
    assert local_cloud.requests[("states", "StartExecution")] == 1


def test_lambda_invocations_by_an_eventbridge_rule_are_counted_though_not_requests(local_cloud, tmp_path):
    echo = deploy_function(local_cloud, "echo", tmp_path / "echo.jsonl")
    events, rule = local_cloud.client("events"), unique("rule")
    events.put_rule(Name=rule, EventPattern=json.dumps({"source": ["counting"]}))
    events.put_targets(Rule=rule, Targets=[{"Id": "echo", "Arn": echo}])
    invokes_before = local_cloud.requests[("lambda", "Invoke")]

    events.put_events(Entries=[{"Source": "counting", "DetailType": "x", "Detail": "{}"}])

    local_cloud.wait_until(lambda: records(tmp_path / "echo.jsonl"), "the rule's target to run")
    assert local_cloud.lambda_invocations[echo.split(":")[-1]] == 1
    assert local_cloud.requests[("lambda", "Invoke")] == invokes_before


# --- control-plane faults ----------------------------------------------------------------

def _call_of(cloud, service):
    """One cheap read of each service, by a client made with `config`."""
    return {
        "dynamodb": ("dynamodb", lambda client: client.list_tables()),
        "s3": ("s3", lambda client: client.list_buckets()),
        "events": ("events", lambda client: client.list_rules()),
        "lambda": ("lambda", lambda client: client.list_functions()),
        "ec2": ("ec2", lambda client: client.describe_instances()),
        "states": ("stepfunctions", lambda client: client.list_state_machines()),
    }[service]


EXPECTED_ERRORS = {
    ("dynamodb", "throttle"): ("ProvisionedThroughputExceededException", 400),
    ("s3", "throttle"): ("SlowDown", 503),
    ("events", "throttle"): ("ThrottlingException", 400),
    ("lambda", "throttle"): ("TooManyRequestsException", 429),
    ("ec2", "throttle"): ("RequestLimitExceeded", 503),
    ("states", "throttle"): ("ThrottlingException", 400),
    ("dynamodb", "error"): ("InternalServerError", 500),
    ("s3", "error"): ("InternalError", 500),
    ("events", "error"): ("InternalException", 500),
    ("lambda", "error"): ("ServiceException", 500),
    ("ec2", "error"): ("InternalError", 500),
    ("states", "error"): ("InternalFailure", 500),
}


@pytest.mark.parametrize("service, answer", sorted(EXPECTED_ERRORS))
@pytest.mark.parametrize("mode", ["standard", "legacy"])
def test_a_failing_service_answers_its_documented_error_and_botocore_retries_it(local_cloud, service, answer, mode):
    client_name, call = _call_of(local_cloud, service)
    once = local_cloud.client(client_name, config=Config(retries={"max_attempts": 1, "mode": mode}))
    retrying = local_cloud.client(client_name, config=Config(retries={"max_attempts": 10, "mode": mode}))
    call(once)  # both clients made and working before the fault

    local_cloud.fail_requests(service, 60.0, answer)
    with pytest.raises(ClientError) as refused:
        call(once)
    refused_so_far = local_cloud.failed_requests[(service, answer)]
    # The outage ends once the retrying client has been refused twice: it must have retried.
    ender = threading.Thread(target=lambda: (
        local_cloud.wait_until(lambda: local_cloud.failed_requests[(service, answer)] >= refused_so_far + 2, "two refused attempts"),
        local_cloud.stop_failing_requests(service)))
    ender.start()
    call(retrying)
    ender.join()

    code, status = EXPECTED_ERRORS[(service, answer)]
    assert refused.value.response["Error"]["Code"] == code
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert refused.value.response["ResponseMetadata"]["MaxAttemptsReached"]


def test_request_faults_name_what_is_known_and_can_end_early(local_cloud):
    with pytest.raises(ValueError, match="service must be one of"):
        local_cloud.fail_requests("sqs", 1.0)
    with pytest.raises(ValueError, match="answer must be one of"):
        local_cloud.fail_requests("s3", 1.0, answer="slow")
    local_cloud.fail_requests("s3", 60.0, answer="error")
    local_cloud.stop_failing_requests("s3")
    local_cloud.client("s3").list_buckets()


@pytest.mark.parametrize("answer, error", [("throttle", "Lambda.TooManyRequestsException"),
                                           ("error", "Lambda.ServiceException")])
def test_a_state_machine_task_sees_the_lambda_outage_as_step_functions_reports_it(local_cloud, tmp_path, answer, error):
    echo = deploy_function(local_cloud, "echo", tmp_path / "echo.jsonl")
    machine = create_state_machine(local_cloud, {"StartAt": "Call", "States": {
        "Call": {"Type": "Task", "Resource": "arn:aws:states:::lambda:invoke",
                 "Parameters": {"FunctionName": echo, "Payload": {}}, "End": True}}})
    local_cloud.fail_requests("lambda", 30.0, answer)

    done = run_execution(local_cloud, machine, {})

    assert done["status"] == "FAILED" and done["error"] == error, done
    assert not records(tmp_path / "echo.jsonl")


# --- process faults ----------------------------------------------------------------------

@pytest.fixture(params=["execd", "run in place"])
def fake_node(local_cloud, request):
    """A running instance with an agent, torchrun and two ranks: (id, {role: pids}); each process
    a new interpreter, or each run in place in a warm image's processes (localcloud/in_place.py)."""
    if request.param == "run in place":
        local_cloud.fleet.use_warm_image(["json"])
    instance_id, pids = start_fake_node(local_cloud)
    yield instance_id, pids
    local_cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    local_cloud.fleet.wait_for_state(instance_id, "terminated")


def test_python_module_is_the_interpreters_own_not_an_argument():
    assert python_module(["/venv/bin/python3", "-u", "-m", "trainer.worker", "--config", "c"]) == "trainer.worker"
    assert python_module(["python", "-X", "dev", "-m", "node.agent"]) == "node.agent"
    assert python_module(["python", "-m", "torch.distributed.run", "-m", "trainer.worker"]) == "torch.distributed.run"
    assert python_module(["python", "-c", "code", "-m", "trainer.worker"]) is None
    assert python_module(["python", "script.py", "-m", "trainer.worker"]) is None
    assert python_module(["/bin/sh", "-m", "trainer.worker"]) is None


def test_hang_process_stops_one_rank_or_the_agent_alone_and_resume_continues_it(local_cloud, fake_node):
    instance_id, pids = fake_node
    everyone = [pid for group in pids.values() for pid in group]

    assert local_cloud.fleet.hang_process(instance_id, "trainer") == pids["trainer"][0]
    local_cloud.wait_until(lambda: process_state(pids["trainer"][0]) == "T", "the rank to stop")
    assert [pid for pid in everyone if process_state(pid) == "T"] == [pids["trainer"][0]]
    local_cloud.fleet.resume(instance_id)
    local_cloud.wait_until(lambda: process_state(pids["trainer"][0]) != "T", "the rank to go on")

    assert local_cloud.fleet.hang_process(instance_id, "agent") == pids["agent"][0]
    local_cloud.wait_until(lambda: process_state(pids["agent"][0]) == "T", "the agent to stop")
    assert [pid for pid in everyone if process_state(pid) == "T"] == pids["agent"]
    assert local_cloud.fleet.get(instance_id).state == "running"
    local_cloud.fleet.resume(instance_id)
    local_cloud.wait_until(lambda: process_state(pids["agent"][0]) != "T", "the agent to go on")


def test_crash_process_kills_one_rank_and_the_instance_lives_on(local_cloud, fake_node):
    instance_id, pids = fake_node

    assert local_cloud.fleet.crash_process(instance_id, "trainer") == pids["trainer"][0]

    local_cloud.wait_until(lambda: process_state(pids["trainer"][0]) in {"Z", "X"}, "the rank to die")
    assert process_state(pids["trainer"][1]) not in {"Z", "X", "T"}
    assert process_state(pids["agent"][0]) not in {"Z", "X", "T"}
    assert local_cloud.fleet.get(instance_id).state == "running"
    # The next rank is the trainer process now.
    assert local_cloud.fleet.process_of(instance_id, "trainer") == pids["trainer"][1]


@pytest.mark.parametrize("end", ["terminate", "kill"])
def test_an_instance_ends_with_every_process_it_ran_a_frozen_one_in_a_session_of_its_own_too(local_cloud, end):
    """The miniature node's torchrun and ranks run in sessions of their own, as torchrun's ranks
    do; frozen (a hung host), they cannot act on SIGTERM. On EC2 nothing of an instance outlives it."""
    instance_id, pids = start_fake_node(local_cloud)
    everyone = [pid for group in pids.values() for pid in group]
    local_cloud.fleet.hang(instance_id)
    local_cloud.wait_until(lambda: all(process_state(pid) == "T" for pid in everyone), "the node to freeze")
    if end == "kill":
        local_cloud.fleet.kill(instance_id)
    else:
        local_cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    local_cloud.fleet.wait_for_state(instance_id, "terminated")
    local_cloud.wait_until(lambda: all(process_state(pid) in {"Z", "X"} for pid in everyone),
                           "every process of the instance to end")


def test_a_process_fault_names_the_instance_without_such_a_process(local_cloud):
    local_cloud.fleet.boot = lambda instance: [sys.executable, "-c", "import time; time.sleep(60)"]
    ec2 = local_cloud.client("ec2")

    def launch() -> str:
        return ec2.run_instances(ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1,
                                 MaxCount=1)["Instances"][0]["InstanceId"]

    booting = local_cloud.config
    local_cloud.config = replace(booting, boot_seconds=3600.0)  # pending for as long as the test looks
    instance_id = launch()
    local_cloud.config = booting
    with pytest.raises(RuntimeError, match=f"instance {instance_id} \\(pending\\) has no running processes"):
        local_cloud.fleet.hang_process(instance_id, "trainer")
    ec2.terminate_instances(InstanceIds=[instance_id])
    instance_id = launch()
    local_cloud.fleet.wait_for_state(instance_id, "running")
    with pytest.raises(RuntimeError, match=f"instance {instance_id} has no trainer process"):
        local_cloud.fleet.crash_process(instance_id, "trainer")
    with pytest.raises(ValueError, match="role must be one of"):
        local_cloud.fleet.hang_process(instance_id, "torchrun")
    local_cloud.client("ec2").terminate_instances(InstanceIds=[instance_id])
    local_cloud.fleet.wait_for_state(instance_id, "terminated")


# --- Lambda invocation faults ------------------------------------------------------------

def test_a_timed_out_invocation_ran_its_handler_and_reports_sandbox_timedout(local_cloud, tmp_path):
    echo = deploy_function(local_cloud, "echo", tmp_path / "echo.jsonl", timeout=7)
    local_cloud.time_out_invocations("echo-", count=1)
    client = local_cloud.client("lambda")

    timed_out = client.invoke(FunctionName=echo, Payload=b'{"n": 1}')
    answered = client.invoke(FunctionName=echo, Payload=b'{"n": 2}')

    error = json.loads(timed_out["Payload"].read())
    assert timed_out["FunctionError"] == "Unhandled"
    assert error["errorType"] == "Sandbox.Timedout"
    assert error["errorMessage"].endswith("Task timed out after 7.00 seconds")
    assert "FunctionError" not in answered and json.loads(answered["Payload"].read()) == {"n": 2}
    assert [entry["event"] for entry in records(tmp_path / "echo.jsonl")] == [{"n": 1}, {"n": 2}]


@pytest.mark.parametrize("integration", ["lambda:invoke", "function arn"])
def test_a_state_machine_sees_a_timed_out_function_as_lambda_unknown(local_cloud, tmp_path, integration):
    echo = deploy_function(local_cloud, "echo", tmp_path / "echo.jsonl")
    task = ({"Resource": "arn:aws:states:::lambda:invoke", "Parameters": {"FunctionName": echo, "Payload": {}}}
            if integration == "lambda:invoke" else {"Resource": echo})
    machine = create_state_machine(local_cloud, {"StartAt": "Call", "States": {
        "Call": {"Type": "Task", **task, "End": True}}})
    retried = create_state_machine(local_cloud, {"StartAt": "Call", "States": {
        "Call": {"Type": "Task", **task, "End": True,
                 "Retry": [{"ErrorEquals": ["Lambda.Unknown"], "IntervalSeconds": 1, "MaxAttempts": 1}]}}})
    local_cloud.time_out_invocations(echo.split(":")[-1], count=2)

    failed = run_execution(local_cloud, machine, {})
    succeeded = run_execution(local_cloud, retried, {})

    assert failed["status"] == "FAILED" and failed["error"] == "Lambda.Unknown", failed
    assert json.loads(failed["cause"])["errorType"] == "Sandbox.Timedout"
    assert succeeded["status"] == "SUCCEEDED", succeeded
    assert len(records(tmp_path / "echo.jsonl")) == 3, "each timed-out invocation ran the handler"


def test_invocation_timeouts_are_checked(local_cloud):
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        local_cloud.time_out_invocations("echo", count=0)
    with pytest.raises(ValueError, match="must not be empty"):
        local_cloud.time_out_invocations("")


# --- EventBridge delivery faults ---------------------------------------------------------

def put(cloud, *detail_types: str) -> list[str]:
    """Put one event per detail type in one PutEvents call; their ids."""
    entries = cloud.client("events").put_events(Entries=[
        {"Source": "faults", "DetailType": detail_type, "Detail": json.dumps({"n": n})}
        for n, detail_type in enumerate(detail_types)])["Entries"]
    return [entry["EventId"] for entry in entries]


def test_a_duplicated_event_reaches_each_target_twice(local_cloud):
    queue = event_sink(local_cloud, {"source": ["faults"]})
    local_cloud.duplicate_events(detail_types=["Twice"], count=1)

    twice, once, again = put(local_cloud, "Twice", "Once", "Twice")

    delivered = [message["id"] for message in receive(local_cloud, queue, 4)]
    assert sorted(delivered) == sorted([twice, twice, once, again])


def test_a_delayed_event_arrives_after_those_put_later(local_cloud):
    queue = event_sink(local_cloud, {"source": ["faults"]})
    local_cloud.delay_events(50.0, detail_types=["Late"])  # 1 s at the fixture's time scale

    # One PutEvents call: the on-time event is delivered as it returns, and the late one's second
    # counts from the same moment (a second call could come more than a second later on a busy machine).
    late, on_time = put(local_cloud, "Late", "OnTime")

    assert [message["id"] for message in receive(local_cloud, queue, 2)] == [on_time, late]


def test_held_events_are_released_newest_first(local_cloud):
    queue = event_sink(local_cloud, {"source": ["faults"]})
    local_cloud.reorder_events(25.0, detail_types=["Step"], count=3)

    ids = put(local_cloud, "Step", "Step", "Step")

    assert [message["id"] for message in receive(local_cloud, queue, 3)] == ids[::-1]


def test_event_faults_are_checked(local_cloud):
    with pytest.raises(ValueError, match="count must be an integer >= 1"):
        local_cloud.duplicate_events(count=0)
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        local_cloud.delay_events(-1.0)
    with pytest.raises(ValueError, match="detail_types must be a list"):
        local_cloud.reorder_events(1.0, detail_types="Step")


def test_a_node_boot_rides_out_s3_throttling_longer_than_its_requests_retries(local_cloud, tmp_path):
    """S3 answering SlowDown past one try of the artifacts copy (its requests' own retries): the
    user data's step is tried again after a jittered wait, so the node boots; before, the node
    reported a failed boot, which ended a run of 512 nodes."""
    import os
    from pathlib import Path

    from localcloud.node_boot import publish_artifacts
    from localcloud.waiting import run_captured
    from trainfleet.adapters.ec2_fleet import BOOT_REQUEST_ATTEMPTS

    bucket = unique("artifacts")
    local_cloud.client("s3").create_bucket(Bucket=bucket)
    publish_artifacts(local_cloud.client("s3"), bucket)
    refusals = BOOT_REQUEST_ATTEMPTS + 1  # a whole try of the step refused, and one more request
    local_cloud.fail_requests("s3", 3600.0, "throttle")
    ender = threading.Thread(target=lambda: (
        local_cloud.wait_until(lambda: local_cloud.failed_requests[("s3", "throttle")] >= refusals,
                               f"{refusals} refused requests"),
        local_cloud.stop_failing_requests("s3")))
    ender.start()
    booted = run_captured(
        [sys.executable, "-m", "localcloud.node_boot", sys.executable, "-c", "print('agent started')"],
        what="the node boot", cwd=tmp_path,
        env={**os.environ, **local_cloud.env(), "TRAINFLEET_BUCKET": bucket, "TRAINFLEET_BOOT_RETRY_S": "0.1",
             "LOCALCLOUD_INSTANCE_ID": "i-0123456789abcdef0", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    ender.join()
    assert "agent started" in booted.stdout, booted.stdout + booted.stderr
    assert "node boot: try 1 of 5 failed" in booted.stdout and "in 1 tries" not in booted.stdout
    assert local_cloud.failed_requests[("s3", "throttle")] >= refusals


def test_a_starved_machine_runs_its_instances_their_share_of_the_time_never_none(local_cloud):
    """cpu_share 0.25: a busy instance gets about a quarter of the CPU time a busy instance
    started beside it at full share gets (a ratio measured side by side, whatever else loads this
    machine): slower, never stopped for good."""
    local_cloud.fleet.boot = lambda instance: [sys.executable, "-c", "while True: pass"]
    processes = {}
    for share in (0.25, 1.0):
        local_cloud.fleet.cpu_share = lambda instance, share=share: share
        instance_id = local_cloud.client("ec2").run_instances(
            ImageId="ami-12c6146b", InstanceType="t3.micro", MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
        local_cloud.fleet.wait_for_state(instance_id, "running")
        local_cloud.wait_until(lambda: local_cloud.fleet.get(instance_id).process is not None, "its process")
        processes[share] = local_cloud.fleet.get(instance_id).process.pid
    before = {share: process_cpu_s(pid) for share, pid in processes.items()}
    local_cloud.wait_until(lambda: process_cpu_s(processes[0.25]) - before[0.25] >= 0.3,
                           "the starved instance to use 0.3 s of CPU time")
    used = {share: process_cpu_s(pid) - before[share] for share, pid in processes.items()}
    assert used[0.25] / used[1.0] < 0.5, f"the starved instance used {used[0.25]:.2f} s, the other {used[1.0]:.2f} s"
    assert all(process_state(pid) != "X" for pid in processes.values())


def process_cpu_s(pid: int) -> float:
    import os
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_s3_answers_slow_down_past_a_prefixs_rate_and_serves_other_prefixes():
    """S3 serves at least 5,500 GET/HEAD and 3,500 PUT/DELETE a second per prefix, SlowDown beyond
    (glue/s3_rates.py). Rates as low as a test can exceed, over a window of ten real seconds
    (time_scale 10), so that no slow machine spreads the requests past it."""
    from botocore.config import Config
    from botocore.exceptions import ClientError

    from localcloud import LocalCloud

    with LocalCloud(time_scale=10.0, s3_prefix_rates=(6, 3)) as cloud:
        s3 = cloud.client("s3", config=Config(retries={"total_max_attempts": 1}))  # every answer seen
        bucket = unique("rates")
        s3.create_bucket(Bucket=bucket)
        for name in ("a", "b", "c"):
            s3.put_object(Bucket=bucket, Key=f"hot/{name}", Body=b"x")
        with pytest.raises(ClientError, match="SlowDown"):
            s3.put_object(Bucket=bucket, Key="hot/d", Body=b"x")  # a fourth write to hot/ in the window
        answers = []
        for _ in range(8):
            try:
                s3.get_object(Bucket=bucket, Key="hot/a")
                answers.append("served")
            except ClientError as error:
                answers.append(error.response["Error"]["Code"])
        assert answers == ["served"] * 6 + ["SlowDown"] * 2
        s3.put_object(Bucket=bucket, Key="other/a", Body=b"x")  # another prefix has its own rate
        assert s3.get_object(Bucket=bucket, Key="other/a")["Body"].read() == b"x"
        assert cloud.s3_rates.busiest[(f"{bucket}/hot/", "read")] == 6
        assert cloud.s3_rates.refused[(f"{bucket}/hot/", "read")] == 2
        assert cloud.failed_requests[("s3", "slowdown")] == 3
