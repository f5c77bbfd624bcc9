"""The DataPrep state machine on the local cloud (template.yaml deployed once for the module, each
test preparing into a destination of its own): a Distributed Map over many objects, one function per
item, one item's function timing out after its work and retried, gives the bytes `trainfleet data
prepare` gives on this machine; `trainfleet data prepare --on-stack`, as a person runs it, stops on
a malformed record naming its file and line once every other item is done, and run again with
--skip-bad does that item alone and says what it skipped; past the tolerated failures the Map Run
fails as Step Functions fails it."""

import json
import os
import re
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from localcloud.glue.stepfunctions_map import exceeds_tolerance
from localcloud.waiting import run_captured, until
from test_data_prepare import documents, jsonl
from trainer import tokenizer
from trainer.data import corpus_documents
from trainfleet.operator.data_command import prepare_here

REPO = Path(__file__).resolve().parents[1]
OBJECTS = 12
ITEMS = 24
"""Objects of the malformed-record tests, an item each: one failing is 4.2 %, within the template's
ToleratedFailurePercentage of 5; two of 25 are 8 %, past it."""
BAD_OBJECT, BAD_LINE = 7, 3


@pytest.mark.parametrize("failed, total, count, percentage, given, fails", [
    (0, 10, 0, 0.0, (False, False), False),
    (1, 10, 0, 0.0, (False, False), True),     # neither named: no failure tolerated
    (1, 10, 0, 5.0, (False, True), True),      # 10 % > 5 %
    (1, 30, 0, 5.0, (False, True), False),     # 3.3 % <= 5 %
    (2, 30, 1, 50.0, (True, True), True),      # past either threshold
    (1, 30, 1, 0.0, (True, False), False),
])
def test_the_tolerated_failure_thresholds_apply_as_named(failed, total, count, percentage, given, fails):
    assert exceeds_tolerance(failed, total, count, percentage, given) == fails


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The deployed template and a BPE tokenizer trained here, in the stack's bucket."""
    from localcloud import LocalCloud
    from localcloud.deploy import DeployRequest, deploy

    bpe = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    bpe.write_text(tokenizer.train_bpe(corpus_documents(300_000), vocab_size=500))
    stack_name = f"prep-{uuid.uuid4().hex[:6]}"
    with LocalCloud(time_scale=0.02) as cloud:
        outputs = deploy(DeployRequest(template=REPO / "template.yaml", endpoint=cloud.endpoint,
                                       stack_name=stack_name)).outputs
        bucket = outputs["CheckpointBucketName"]
        cloud.client("s3").put_object(Bucket=bucket, Key="data/tok/tokenizer.json", Body=bpe.read_bytes())
        yield SimpleNamespace(cloud=cloud, outputs=outputs, bucket=bucket, name=stack_name, bpe=bpe,
                              s3=cloud.client("s3"), sfn=cloud.client("stepfunctions"),
                              tokenizer=f"s3://{bucket}/data/tok/tokenizer.json")


def upload(stack, folder: Path, prefix: str) -> str:
    """Every file of `folder` under data/<prefix>/ in the stack's bucket; the prefix's URI."""
    for path in sorted(folder.iterdir()):
        stack.s3.put_object(Bucket=stack.bucket, Key=f"data/{prefix}/{path.name}", Body=path.read_bytes())
    return f"s3://{stack.bucket}/data/{prefix}/"


def keys(stack, prefix: str) -> list[str]:
    listed = stack.s3.list_objects_v2(Bucket=stack.bucket, Prefix=prefix)
    return [entry["Key"] for entry in listed.get("Contents", [])]


def read_json(stack, key: str):
    return json.loads(stack.s3.get_object(Bucket=stack.bucket, Key=key)["Body"].read())


def tokenise_invocations(stack) -> int:
    return sum(count for name, count in stack.cloud.lambda_invocations.items() if "DataTokenise" in name)


def run_on_stack(stack, document: dict) -> dict:
    """Start DataPrep with `document` as its input; its execution once it has ended."""
    sfn = stack.sfn
    arn = sfn.start_execution(stateMachineArn=stack.outputs["DataPrepStateMachineArn"],
                              input=json.dumps(document))["executionArn"]
    destination = document["destination"].removeprefix(f"s3://{stack.bucket}/")
    return until(lambda: (found := sfn.describe_execution(executionArn=arn))["status"] != "RUNNING" and found,
                 lambda: (len(keys(stack, f"{destination}/.prepare/")), stack.cloud.activity()),
                 what="the DataPrep execution")


def map_run_export(stack, destination: str) -> dict[str, list[dict]]:
    """The children of the destination's one Map Run, by status, as its ResultWriter exported them."""
    (manifest,) = [key for key in keys(stack, f"{destination}/.prepare/map-runs/") if key.endswith("manifest.json")]
    files = read_json(stack, manifest)["ResultFiles"]
    return {status: [child for file in files[status] for child in read_json(stack, file["Key"])]
            for status in ("SUCCEEDED", "FAILED")}


@pytest.fixture(scope="module")
def inputs_with_a_bad_record(tmp_path_factory) -> Path:
    """ITEMS small JSON Lines objects; line BAD_LINE of object BAD_OBJECT is cut short (not JSON)."""
    folder = tmp_path_factory.mktemp("raw-bad")
    docs = documents(120_000)
    for number in range(ITEMS):
        lines = jsonl(docs[number::ITEMS]).split(b"\n")
        if number == BAD_OBJECT:
            lines.insert(BAD_LINE - 1, b'{"text": "cut short')
        (folder / f"part-{number:03d}.jsonl").write_bytes(b"\n".join(lines))
    return folder


@pytest.mark.slow
def test_the_distributed_map_prepares_many_objects_with_one_item_retried(stack, tmp_path):
    docs = documents(600_000)
    raw = tmp_path / "raw"
    raw.mkdir()
    for number in range(OBJECTS):
        (raw / f"part-{number:03d}.jsonl").write_bytes(jsonl(docs[number::OBJECTS]))
    here = prepare_here([str(raw)], str(stack.bpe), str(tmp_path / "here"), item_bytes=40_000, workers=2)

    inputs = upload(stack, raw, "raw")
    invoked_before = tokenise_invocations(stack)
    stack.cloud.time_out_invocations("DataTokenise", 1)  # the first item's function: its work done, then a timeout
    status = run_on_stack(stack, {"inputs": [inputs], "tokenizer": stack.tokenizer,
                                  "destination": f"s3://{stack.bucket}/data/web", "item_bytes": 40_000,
                                  "max_concurrency": 3})
    assert status["status"] == "SUCCEEDED", status
    assert read_json(stack, "data/web/index.json") == here.index  # the same shards, byte for byte (sha256s)
    children = map_run_export(stack, "data/web")
    assert children["FAILED"] == [] and {child["Status"] for child in children["SUCCEEDED"]} == {"SUCCEEDED"}
    numbers = sorted(json.loads(child["Input"])["item"]["number"] for child in children["SUCCEEDED"])
    items = len(json.loads((tmp_path / "here" / ".prepare" / "plan.json").read_text())["items"])
    assert numbers == list(range(items))
    assert tokenise_invocations(stack) - invoked_before == items + 1  # every item once, and the one timed out again
    assert len(here.index["shards"]) >= OBJECTS
    result = json.loads(status["output"])
    assert (result["tokens"], result["documents"], result["shards"]) == (
        here.index["tokens"], here.index["documents"], len(here.index["shards"]))


@pytest.mark.slow
def test_prepare_on_stack_names_a_bad_record_then_skips_it_when_told(stack, inputs_with_a_bad_record, tmp_path):
    """`trainfleet data prepare --on-stack` from the command line, pointed at the local cloud by the
    environment alone: the malformed record's item fails (its function records why, the Map Run
    tolerates it and exports it as failed, every other item is done), WriteIndex names the file and
    line and the execution fails with it, and so does the command, in one line. Run again with
    --skip-bad it tokenises that item alone and says what it skipped; the shards are those a
    preparation here with --skip-bad writes."""
    inputs = upload(stack, inputs_with_a_bad_record, "raw-bad")
    bad_uri = f"{inputs}part-{BAD_OBJECT:03d}.jsonl"
    command = [sys.executable, "-m", "trainfleet.cli", "data", "prepare", inputs, "--tokenizer", stack.tokenizer,
               "--to", f"s3://{stack.bucket}/data/bad", "--on-stack", "--stack", stack.name]
    env = {**os.environ, **stack.cloud.env()}

    invoked_before = tokenise_invocations(stack)
    stopped = run_captured(command, what="trainfleet data prepare --on-stack", env=env, cwd=tmp_path)
    assert stopped.returncode == 1, stopped
    assert re.fullmatch(rf"trainfleet data prepare: the preparation failed: {re.escape(bad_uri)}:{BAD_LINE}: "
                        r"not JSON: Unterminated string .+ \(run it again to go on\)\n", stopped.stderr), stopped.stderr
    assert tokenise_invocations(stack) - invoked_before == ITEMS  # a malformed record is not retried

    recorded = read_json(stack, f"data/bad/.prepare/failed-{BAD_OBJECT:05d}.json")
    assert recorded["error"].startswith(f"{bad_uri}:{BAD_LINE}: not JSON")
    assert len(keys(stack, "data/bad/.prepare/part-")) == ITEMS - 1
    children = map_run_export(stack, "data/bad")
    (failed,) = children["FAILED"]
    assert (failed["Error"], json.loads(failed["Input"])["item"]["number"]) == ("BadRecord", BAD_OBJECT)
    assert len(children["SUCCEEDED"]) == ITEMS - 1  # the Map Run succeeded: 1 of 24 is within 5 %
    (execution,) = stack.sfn.list_executions(stateMachineArn=stack.outputs["DataPrepStateMachineArn"],
                                             statusFilter="FAILED")["executions"]
    history = stack.sfn.get_execution_history(executionArn=execution["executionArn"], reverseOrder=True)["events"]
    details = next(event["executionFailedEventDetails"] for event in history if event["type"] == "ExecutionFailed")
    assert details["error"] == "PrepareError"  # WriteIndex's
    cause = json.loads(details["cause"])["errorMessage"]
    assert cause.startswith(f"1 of {ITEMS} items are not done (first: item {BAD_OBJECT}, {bad_uri})")
    assert f"{bad_uri}:{BAD_LINE}: not JSON" in cause

    invoked_before = tokenise_invocations(stack)
    finished = run_captured([*command, "--skip-bad"], what="trainfleet data prepare --on-stack --skip-bad", env=env,
                            cwd=tmp_path)
    assert finished.returncode == 0, finished
    assert tokenise_invocations(stack) - invoked_before == 1  # the item left, alone
    here = prepare_here([str(inputs_with_a_bad_record)], str(stack.bpe), str(tmp_path / "here"), skip_bad=True,
                        workers=1)
    index = read_json(stack, "data/bad/index.json")
    assert index == here.index and index["bad_records"] == 1
    assert f"skipped 1 malformed records, among them:\n  {bad_uri}:{BAD_LINE}: not JSON" in finished.stdout


@pytest.mark.slow
def test_past_the_tolerated_failures_the_map_run_fails(stack, inputs_with_a_bad_record, tmp_path):
    """Two items of 25 failing for good (8 %) fail the Map Run with States.ExceedToleratedFailureThreshold,
    and no index is written."""
    inputs = upload(stack, inputs_with_a_bad_record, "raw-bad")
    (tmp_path / "more").mkdir()
    (tmp_path / "more" / "extra.jsonl").write_bytes(b'{"text": "fine"}\n[1, 2]\n')  # line 2: not an object
    more = upload(stack, tmp_path / "more", "raw-more")
    status = run_on_stack(stack, {"inputs": [inputs, more], "tokenizer": stack.tokenizer,
                                  "destination": f"s3://{stack.bucket}/data/past"})
    assert (status["status"], status["error"]) == ("FAILED", "States.ExceedToleratedFailureThreshold"), status
    assert not keys(stack, "data/past/index.json")
    assert len(keys(stack, "data/past/.prepare/failed-")) == 2
