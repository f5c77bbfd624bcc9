"""Helpers shared by the local-cloud tests: deploy test handlers, run and await executions."""

from __future__ import annotations

import io
import json
import sys
import uuid
import zipfile
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
HANDLERS_FILE = TESTS / "localcloud_handlers.py"
HANDLERS_MODULE = "localcloud_test_handlers"


def run_scenario(script: str, *args: str) -> dict[str, Any]:
    """Run tests/<script> in a process of its own (a local cloud must import the deployed copy
    of `functions`, not this process's) and return the JSON summary it prints last; waited for
    while it narrates (localcloud.waiting), never for a fixed time. The scenario's own watch of
    its run stalls first (it then prints the instances' consoles); this wait, a minute later,
    catches a scenario stuck outside that watch."""
    from localcloud.waiting import STALL_S, run_captured

    completed = run_captured([sys.executable, str(TESTS / script), *args], what=f"{script} {' '.join(args)}",
                             stall_s=STALL_S + 60, cwd=TESTS.parent)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-8000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def forget_functions() -> None:
    """Drop every module of the `functions` package this process imported, so that the next
    import (a test's, or a local cloud's of its deployed copy) executes it afresh. sys.modules is
    copied first: the local cloud's threads may be importing meanwhile."""
    for name in [name for name in list(sys.modules) if name == "functions" or name.startswith("functions.")]:
        sys.modules.pop(name, None)


def remove_rules(events, name_prefix: str) -> None:
    """Delete the EventBridge rules (and their targets) whose names start with `name_prefix`, on
    every bus: a schedule left behind would go on firing into the next local cloud of the process."""
    for bus in events.list_event_buses()["EventBuses"]:
        for rule in events.list_rules(EventBusName=bus["Name"], NamePrefix=name_prefix)["Rules"]:
            targets = events.list_targets_by_rule(Rule=rule["Name"], EventBusName=bus["Name"])["Targets"]
            if targets:
                events.remove_targets(Rule=rule["Name"], EventBusName=bus["Name"],
                                      Ids=[target["Id"] for target in targets])
            events.delete_rule(Name=rule["Name"], EventBusName=bus["Name"])


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def table_from_template(dynamodb, logical_id: str) -> str:
    """A new table with the key schema and indexes template.yaml gives `logical_id`; its name."""
    from trainfleet.operator.validate import load_template

    properties = load_template((TESTS.parent / "template.yaml").read_text())["Resources"][logical_id]["Properties"]
    name = unique(logical_id.lower())
    dynamodb.create_table(TableName=name, BillingMode="PAY_PER_REQUEST", KeySchema=properties["KeySchema"],
                          AttributeDefinitions=properties["AttributeDefinitions"],
                          **{key: properties[key] for key in ("GlobalSecondaryIndexes",) if key in properties})
    return name


def node_network_from_template(cloud, folder: Path) -> tuple[list[str], list[str]]:
    """The nodes' network as template.yaml makes it (its StackNetwork resources deployed alone,
    IAM left as it is): its subnets, one a zone, and its security group."""
    from localcloud.deploy import DeployRequest, deploy, load_template

    template = load_template(TESTS.parent / "template.yaml")
    network = {key: template[key] for key in ("AWSTemplateFormatVersion", "Parameters", "Rules", "Conditions")}
    network["Resources"] = {logical_id: resource for logical_id, resource in template["Resources"].items()
                            if resource.get("Condition") == "StackNetwork"}
    network["Outputs"] = {name: template["Outputs"][name] for name in ("NodeSubnetIds", "NodeSecurityGroupIds")}
    path = folder / "network.json"
    path.write_text(json.dumps(network))
    outputs = deploy(DeployRequest(template=path, endpoint=cloud.endpoint, stack_name=unique("network"),
                                   enforce_iam=False)).outputs
    return outputs["NodeSubnetIds"].split(","), outputs["NodeSecurityGroupIds"].split(",")


def handlers_zip() -> bytes:
    return zip_of({f"{HANDLERS_MODULE}.py": HANDLERS_FILE.read_text()})


def zip_of(files: dict[str, str]) -> bytes:
    """A deployment package (or layer) holding `files` (path in the zip -> text)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return buffer.getvalue()


def create_function(cloud, files: dict[str, str], handler: str = "app.lambda_handler",
                    runtime: str = "python3.11", **settings: Any) -> str:
    """A function whose package holds `files`; its ARN."""
    return cloud.client("lambda").create_function(
        FunctionName=unique("fn"), Runtime=runtime, Role=lambda_role(cloud), Handler=handler,
        Code={"ZipFile": zip_of(files)}, **settings)["FunctionArn"]


def lambda_role(cloud) -> str:
    iam = cloud.client("iam")
    try:
        return iam.get_role(RoleName="localcloud-tests")["Role"]["Arn"]
    except iam.exceptions.NoSuchEntityException:
        return iam.create_role(RoleName="localcloud-tests",
                               AssumeRolePolicyDocument=json.dumps({"Version": "2012-10-17"}))["Role"]["Arn"]


def deploy_function(cloud, handler: str, record_file: Path | None = None,
                    timeout: int = 10, **variables: str) -> str:
    """Create a function running `handler` from localcloud_handlers; returns its ARN."""
    if record_file is not None:
        variables["RECORD_FILE"] = str(record_file)
    response = cloud.client("lambda").create_function(
        FunctionName=unique(handler.replace("_", "-")), Runtime="python3.11",
        Role=lambda_role(cloud), Handler=f"{HANDLERS_MODULE}.{handler}",
        Code={"ZipFile": handlers_zip()}, Timeout=timeout,
        Environment={"Variables": variables})
    return response["FunctionArn"]


def records(record_file: Path) -> list[dict[str, Any]]:
    if not record_file.exists():
        return []
    return [json.loads(line) for line in record_file.read_text().splitlines()]


def create_state_machine(cloud, definition: dict[str, Any]) -> str:
    return cloud.client("stepfunctions").create_state_machine(
        name=unique("sm"), definition=json.dumps(definition),
        roleArn=lambda_role(cloud))["stateMachineArn"]


def wait_for_execution(cloud, execution_arn: str) -> dict[str, Any]:
    """The execution once it ended, waited for while its history grows (localcloud.waiting)."""
    from localcloud.stack import execution_history
    from localcloud.waiting import until

    sfn = cloud.client("stepfunctions")

    def ended() -> dict[str, Any] | None:
        described = sfn.describe_execution(executionArn=execution_arn)
        return described if described["status"] != "RUNNING" else None
    return until(ended, lambda: len(execution_history(sfn, execution_arn)), what=f"execution {execution_arn}",
                 poll_s=0.05)


def run_execution(cloud, state_machine_arn: str, payload: Any) -> dict[str, Any]:
    execution_arn = cloud.client("stepfunctions").start_execution(
        stateMachineArn=state_machine_arn, name=unique("run"), input=json.dumps(payload))["executionArn"]
    return wait_for_execution(cloud, execution_arn)


def history(cloud, execution_arn: str) -> list[dict[str, Any]]:
    from localcloud.stack import execution_history

    return execution_history(cloud.client("stepfunctions"), execution_arn)


def event_sink(cloud, pattern: dict[str, Any], bus: str = "default", **target: Any) -> str:
    """An EventBridge rule on `bus` sending matches to a new SQS queue; its URL."""
    sqs, events = cloud.client("sqs"), cloud.client("events")
    name = unique("sink")
    queue_url = sqs.create_queue(QueueName=name)["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name=name, EventPattern=json.dumps(pattern), EventBusName=bus)
    events.put_targets(Rule=name, EventBusName=bus, Targets=[{"Id": "sink", "Arn": queue_arn, **target}])
    return queue_url


def receive(cloud, queue_url: str, count: int) -> list[Any]:
    """Exactly `count` JSON messages from the queue (fails on fewer, once no new one came for
    the local cloud's EVENT_WAIT_S)."""
    from localcloud.cloud import EVENT_WAIT_S
    from localcloud.waiting import until

    sqs = cloud.client("sqs")
    bodies: list[Any] = []

    def all_received() -> bool:
        for message in sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10,
                                           WaitTimeSeconds=0).get("Messages", []):
            bodies.append(json.loads(message["Body"]))
            sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
        return len(bodies) >= count
    until(all_received, lambda: len(bodies), what=f"{count} messages (got {bodies})", stall_s=EVENT_WAIT_S,
          poll_s=0.05)
    return bodies


# A node as the agent runs it, in miniature: the agent (python -m node.agent) starts
# "torchrun" (here -c code, with torchrun's own `-m trainer.worker` arguments), which starts two
# ranks (python -u -m trainer.worker) in sessions of their own and reaps them.
FAKE_NODE = {
    "trainer/__init__.py": "",
    "node/__init__.py": "",
    "node/agent.py": (
        "import subprocess, sys, time\n"
        "TORCHRUN = ('import subprocess, sys, pathlib\\n'\n"
        "            'ranks = [subprocess.Popen([sys.executable, \"-u\", \"-m\", \"trainer.worker\", \"--config\", \"c\"],'\n"
        "            ' start_new_session=True) for _ in range(2)]\\n'\n"
        "            'pathlib.Path(\"ranks\").write_text(\" \".join(str(rank.pid) for rank in ranks))\\n'\n"
        "            '[rank.wait() for rank in ranks]\\n'\n"
        "            'import time; time.sleep(300)\\n')\n"
        "torchrun = subprocess.Popen([sys.executable, '-c', TORCHRUN, '-m', 'trainer.worker', '--config', 'c'],\n"
        "                            start_new_session=True)\n"
        "open('torchrun', 'w').write(str(torchrun.pid))\n"
        "time.sleep(300)\n"),
    # A rank says it runs once it is one: a rank run in place takes its name a moment after its
    # parent learnt its pid.
    "trainer/worker.py": "import os, pathlib, time\npathlib.Path(f'running-{os.getpid()}').touch()\ntime.sleep(300)\n",
}


def boot_fake_node(instance):
    for name, text in FAKE_NODE.items():
        path = instance.workdir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [sys.executable, "-m", "node.agent"]


def process_state(pid: int) -> str:
    """R, S, T (stopped), Z (ended, not reaped) ...; X once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def start_fake_node(cloud, tags: dict[str, str] | None = None) -> tuple[str, dict[str, list[int]]]:
    """An instance running the miniature node, once its ranks run: (id, {role: pids}) with roles
    agent, torchrun and trainer (the ranks, lowest pid first)."""
    cloud.fleet.boot = boot_fake_node
    request: dict[str, Any] = {"ImageId": "ami-12c6146b", "InstanceType": "t3.micro", "MinCount": 1, "MaxCount": 1}
    if tags:
        request["TagSpecifications"] = [{"ResourceType": "instance", "Tags": [
            {"Key": key, "Value": value} for key, value in tags.items()]}]
    instance_id = cloud.client("ec2").run_instances(**request)["Instances"][0]["InstanceId"]
    cloud.fleet.wait_for_state(instance_id, "running")
    workdir = cloud.fleet.get(instance_id).workdir

    def ranks() -> list[int]:
        listed = workdir / "ranks"
        return sorted(int(pid) for pid in listed.read_text().split()) if listed.exists() else []

    cloud.wait_until(lambda: ranks() and all((workdir / f"running-{pid}").exists() for pid in ranks()),
                     "the ranks to run")
    return instance_id, {"agent": [cloud.fleet.get(instance_id).process.pid],
                         "torchrun": [int((workdir / "torchrun").read_text())], "trainer": ranks()}
