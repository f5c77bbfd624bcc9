"""Startup time of the local cloud and the overhead of one Lambda task state.

    .venv/bin/python bench/localcloud.py [--tasks 20] [--repeats 3] [--runtime python3.12]

Startup: LocalCloud() to a served request, first in the process (imports moto) and again.
Task overhead: one execution of N Lambda Task states (an identity handler) against one of N
Pass states, side by side in one run; the difference per state is what a Lambda task costs over
the interpreter's own per-state work. The function runs on the local cloud's own Python (in a
thread, with its own modules) unless --runtime names another, installed one (in a warm process
of that interpreter). Last line: task_overhead_ms=<x>.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
import uuid
import zipfile
from pathlib import Path

# Run as a script, this file's own folder comes first on sys.path and its name would shadow
# the package it measures.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

HANDLER_SOURCE = "def handler(event, context):\n    return event\n"


def chain(states: list[dict]) -> dict:
    names = [f"S{index}" for index in range(len(states))]
    body = {}
    for index, (name, state) in enumerate(zip(names, states)):
        body[name] = {**state, **({"Next": names[index + 1]} if index + 1 < len(names) else {"End": True})}
    return {"StartAt": names[0], "States": body}


def run_once(sfn, machine_arn: str) -> float:
    started = time.perf_counter()
    execution = sfn.start_execution(stateMachineArn=machine_arn, name=uuid.uuid4().hex,
                                    input=json.dumps({"x": 1}))["executionArn"]
    while (described := sfn.describe_execution(executionArn=execution))["status"] == "RUNNING":
        time.sleep(0.002)
    if described["status"] != "SUCCEEDED":
        raise RuntimeError(f"bench execution failed: {described}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20, help="states per execution")
    parser.add_argument("--repeats", type=int, default=3, help="executions of each kind")
    parser.add_argument("--runtime", default=None, help="the function's Runtime (default: the local cloud's own)")
    args = parser.parse_args()

    started = time.perf_counter()
    from localcloud import LocalCloud
    from localcloud.lambda_runtimes import HOST_RUNTIME

    cloud = LocalCloud().start()
    cloud.client("sts").get_caller_identity()
    cold_s = time.perf_counter() - started
    cloud.stop()
    started = time.perf_counter()
    cloud = LocalCloud().start()
    cloud.client("sts").get_caller_identity()
    warm_s = time.perf_counter() - started
    print(f"startup_first_s={cold_s:.3f}  (imports moto and the glue)")
    print(f"startup_again_s={warm_s:.3f}")

    try:
        role = cloud.client("iam").create_role(
            RoleName=f"bench-{uuid.uuid4().hex[:6]}", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
        package = io.BytesIO()
        with zipfile.ZipFile(package, "w") as archive:
            archive.writestr("bench_localcloud_handler.py", HANDLER_SOURCE)
        function_arn = cloud.client("lambda").create_function(
            FunctionName=f"bench-{uuid.uuid4().hex[:6]}", Runtime=args.runtime or HOST_RUNTIME, Role=role,
            Handler="bench_localcloud_handler.handler", Code={"ZipFile": package.getvalue()},
        )["FunctionArn"]
        sfn = cloud.client("stepfunctions")
        machines = {
            kind: sfn.create_state_machine(name=f"bench-{kind}-{uuid.uuid4().hex[:6]}", roleArn=role,
                                           definition=json.dumps(chain([state] * args.tasks)))["stateMachineArn"]
            for kind, state in {"pass": {"Type": "Pass"},
                                "lambda": {"Type": "Task", "Resource": function_arn}}.items()}
        run_once(sfn, machines["lambda"])  # first invocation imports the handler
        seconds = {kind: [] for kind in machines}
        for _ in range(args.repeats):
            for kind, machine in machines.items():
                seconds[kind].append(run_once(sfn, machine))
        per_state_ms = {kind: statistics.median(values) / args.tasks * 1000
                        for kind, values in seconds.items()}
        invoke = cloud.client("lambda")
        started = time.perf_counter()
        for _ in range(args.tasks):
            invoke.invoke(FunctionName=function_arn, Payload=b"{}")
        invoke_ms = (time.perf_counter() - started) / args.tasks * 1000
    finally:
        cloud.stop()

    print(f"pass_state_ms={per_state_ms['pass']:.2f}")
    print(f"lambda_task_state_ms={per_state_ms['lambda']:.2f}")
    print(f"invoke_over_http_ms={invoke_ms:.2f}")
    print(f"task_overhead_ms={per_state_ms['lambda'] - per_state_ms['pass']:.2f}")


if __name__ == "__main__":
    main()
