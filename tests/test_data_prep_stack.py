"""The DataPrep state machine on the local cloud (template.yaml deployed): a Distributed Map over
many objects, one function per item, one item's function timing out after its work and retried,
gives the bytes `trainfleet data prepare` gives on this machine; and the local Distributed Map
fails its Map Run past the tolerated failures, as Step Functions does."""

import json
import uuid

import pytest

from localcloud.glue.stepfunctions_map import exceeds_tolerance
from localcloud.waiting import until
from test_data_prepare import documents, files, jsonl
from trainer import tokenizer
from trainer.data import corpus_documents
from trainfleet.operator.data_command import prepare_here

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]
OBJECTS = 12


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


@pytest.mark.slow
def test_the_distributed_map_prepares_many_objects_with_one_item_retried(tmp_path):
    from localcloud import LocalCloud
    from localcloud.deploy import DeployRequest, deploy

    docs = documents(600_000)
    raw = tmp_path / "raw"
    raw.mkdir()
    for number in range(OBJECTS):
        (raw / f"part-{number:03d}.jsonl").write_bytes(jsonl(docs[number::OBJECTS]))
    bpe = tmp_path / "tokenizer.json"
    bpe.write_text(tokenizer.train_bpe(corpus_documents(300_000), vocab_size=500))
    here = prepare_here([str(raw)], str(bpe), str(tmp_path / "here"), item_bytes=40_000, workers=2)

    with LocalCloud(time_scale=0.02) as cloud:
        outputs = deploy(DeployRequest(template=REPO / "template.yaml", endpoint=cloud.endpoint,
                                       stack_name=f"prep-{uuid.uuid4().hex[:6]}")).outputs
        s3, sfn = cloud.client("s3"), cloud.client("stepfunctions")
        bucket = outputs["CheckpointBucketName"]
        for path in sorted(raw.iterdir()):
            s3.put_object(Bucket=bucket, Key=f"data/raw/{path.name}", Body=path.read_bytes())
        s3.put_object(Bucket=bucket, Key="data/tok/tokenizer.json", Body=bpe.read_bytes())
        cloud.time_out_invocations("DataTokenise", 1)  # the first item's function: its work done, then a timeout
        execution = sfn.start_execution(stateMachineArn=outputs["DataPrepStateMachineArn"], input=json.dumps({
            "inputs": [f"s3://{bucket}/data/raw/"], "tokenizer": f"s3://{bucket}/data/tok/tokenizer.json",
            "destination": f"s3://{bucket}/data/web", "item_bytes": 40_000, "max_concurrency": 3}))["executionArn"]

        def parts() -> int:
            return s3.list_objects_v2(Bucket=bucket, Prefix="data/web/.prepare/part-").get("KeyCount", 0)

        status = until(lambda: (s := sfn.describe_execution(executionArn=execution))["status"] != "RUNNING" and s,
                       parts, what="the DataPrep execution")
        assert status["status"] == "SUCCEEDED", status
        invocations = {name: count for name, count in cloud.lambda_invocations.items() if "DataTokenise" in name}
        stored = json.loads(s3.get_object(Bucket=bucket, Key="data/web/index.json")["Body"].read())
        assert stored == here.index  # the same shards, byte for byte (each shard's sha256 is in the index)
        (manifest,) = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="data/web/.prepare/map-runs/")[
            "Contents"] if o["Key"].endswith("manifest.json")]
        written = json.loads(s3.get_object(Bucket=bucket, Key=manifest)["Body"].read())["ResultFiles"]
        (succeeded,) = written["SUCCEEDED"]
        children = json.loads(s3.get_object(Bucket=bucket, Key=succeeded["Key"])["Body"].read())
        assert written["FAILED"] == [] and {child["Status"] for child in children} == {"SUCCEEDED"}
        assert sorted(json.loads(child["Input"])["item"]["number"] for child in children) == list(range(len(children)))

    items = len(here.index["shards"])
    (tokenise_function,) = invocations
    assert invocations[tokenise_function] == len(json.loads((tmp_path / "here" / ".prepare" / "plan.json").read_text())[
        "items"]) + 1  # every item once, and the one that timed out again
    assert items >= OBJECTS
    result = json.loads(status["output"])
    assert (result["tokens"], result["documents"], result["shards"]) == (
        here.index["tokens"], here.index["documents"], items)
