"""`trainfleet data prepare --on-stack`: start the stack's DataPrep state machine and follow it.

The execution input is what the console would be given (functions/data_prep.py PlanInput); this
command waits while the items' parts appear under the destination, then reads the index.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from trainer import prepare
from trainer.prepare import Preparation, PrepareError
from trainer.shards import ShardStore

POLL_S = 5.0


def prepare_on_stack(args: argparse.Namespace):
    from trainfleet.operator.data_command import Prepared  # here: that module imports this one where asked

    started = time.monotonic()
    sfn = boto3.client("stepfunctions")
    machine = _state_machine(args.stack)
    document = {"inputs": args.inputs, "tokenizer": args.tokenizer, "destination": args.to,
                "text_field": args.text_field, "item_bytes": args.item_mib * 2**20, "skip_bad": args.skip_bad}
    try:
        arn = sfn.start_execution(stateMachineArn=machine, name=f"prepare-{uuid.uuid4().hex[:12]}",
                                  input=json.dumps(document))["executionArn"]
    except (ClientError, BotoCoreError) as error:
        raise PrepareError(f"cannot start the preparation on stack {args.stack}: {error}") from None
    print(f"started {arn}", flush=True)
    store, seen = ShardStore(args.to), -1
    while (execution := sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
        done = len(store.names(prepare.PART_PREFIX))
        if done != seen:
            print(f"  {done} items done", flush=True)
            seen = done
        time.sleep(POLL_S)
    if execution["status"] != "SUCCEEDED":
        failures = [json.loads(store.read(name))["error"] for name in store.names(".prepare/failed-")]
        cause = failures[0] if failures else f"{execution.get('error')}: {execution.get('cause')}"
        raise PrepareError(f"the preparation {execution['status'].lower()}: {cause} (run it again to go on)")
    preparation = Preparation.resume(args.to)
    return Prepared(preparation.index(), time.monotonic() - started, 0, tuple(preparation.bad_examples()))


def _state_machine(stack: str) -> str:
    try:
        outputs = boto3.client("cloudformation").describe_stacks(StackName=stack)["Stacks"][0].get("Outputs", [])
    except (ClientError, BotoCoreError) as error:
        raise PrepareError(f"no stack {stack!r}: {error} (deploy it, or name it with --stack)") from None
    found = {output["OutputKey"]: output["OutputValue"] for output in outputs}.get("DataPrepStateMachineArn")
    if found is None:
        raise PrepareError(f"stack {stack!r} has no DataPrep state machine (output DataPrepStateMachineArn): "
                           "deploy this version of template.yaml")
    return found
