"""What the nodes may touch in S3: Validate refuses a RunSpec naming a URI the node role does not
grant, before anything is allocated; the example RunSpec stays inside it."""

import json
from pathlib import Path

import pytest

from trainfleet.core.runspec import RunSpec

REPO = Path(__file__).resolve().parent.parent
BUCKET = "stack-checkpointbucket-abc"


def example(**changes) -> dict:
    document = json.loads((REPO / "events" / "example-run.json").read_text().replace("my-training-bucket", BUCKET))
    for dotted, value in changes.items():
        section, field = dotted.split(".")
        document[section][field] = value
    return document


def parse(document: dict) -> RunSpec:
    from functions.validate import parse_run_spec

    return parse_run_spec(document, BUCKET)


def test_the_example_run_spec_names_only_what_the_nodes_may_read_and_write():
    assert parse(example()).run_name == "gpt-1b-p5-demo"


@pytest.mark.parametrize("uri", [
    f"s3://{BUCKET}/checkpoints/gpt",          # the stack's bucket, outside runs/
    f"s3://{BUCKET}/data/gpt",                 # readable by the nodes, not writable
    f"s3://{BUCKET}/runsx/gpt",                # a prefix that only starts like runs/
    "s3://another-bucket/runs/gpt",            # another bucket
])
def test_a_checkpoint_uri_the_nodes_cannot_write_is_refused_naming_the_field(uri):
    from functions.errors import InvalidRunSpec

    with pytest.raises(InvalidRunSpec, match=rf"^checkpoint\.s3_uri: the nodes write checkpoints only under "
                                             rf"s3://{BUCKET}/runs/ .*\(got '{uri}'\)$"):
        parse(example(**{"checkpoint.s3_uri": uri}))


@pytest.mark.parametrize("shards", [f"s3://{BUCKET}/tokens/v1", "s3://my-corpus/data/v1"])
def test_data_shards_the_nodes_cannot_read_are_refused_naming_the_field(shards):
    from functions.errors import InvalidRunSpec

    document = example()
    document["trainer"]["data"]["shards"] = shards
    with pytest.raises(InvalidRunSpec, match=r"^trainer\.data\.shards: the nodes read only under "
                                             rf"s3://{BUCKET}/runs/, s3://{BUCKET}/data/, s3://{BUCKET}/models/, "
                                             rf"s3://{BUCKET}/artifacts/"):
        parse(document)


def test_shards_in_a_readable_prefix_or_on_local_disk_are_accepted():
    for shards in (f"s3://{BUCKET}/data/tokens", f"s3://{BUCKET}/runs/gpt-1b-p5-demo/tokens", "runs/data/stdlib-bytes"):
        document = example()
        document["trainer"]["data"]["shards"] = shards
        assert parse(document).trainer.model_extra["data"]["shards"] == shards


def test_shards_in_another_runs_folder_are_refused_naming_the_field():
    """Under runs/ a run's nodes read their own folder alone (the node role is the run's)."""
    from functions.errors import InvalidRunSpec

    document = example()
    document["trainer"]["data"]["shards"] = f"s3://{BUCKET}/runs/gpt/tokens"
    with pytest.raises(InvalidRunSpec, match=r"^trainer\.data\.shards: under runs/ a run's nodes read their own "
                                             rf"run's folder alone, s3://{BUCKET}/runs/gpt-1b-p5-demo/ "):
        parse(document)


def test_an_imported_model_the_nodes_cannot_read_is_refused_naming_the_field():
    """training.init_from: where `trainfleet checkpoint import` put a model for runs to start from."""
    from functions.errors import InvalidRunSpec

    for readable in (f"s3://{BUCKET}/models/llama3-8b", f"s3://{BUCKET}/runs/gpt-1b-p5-demo/imported"):
        document = example()
        document["trainer"]["training"]["init_from"] = readable
        assert parse(document).trainer.training.model_extra["init_from"] == readable
    for unreadable, problem in ((f"s3://{BUCKET}/imports/llama", "the nodes read only under"),
                                (f"s3://{BUCKET}/runs/another/checkpoints", "under runs/ a run's nodes read")):
        document = example()
        document["trainer"]["training"]["init_from"] = unreadable
        with pytest.raises(InvalidRunSpec, match=rf"^trainer\.training\.init_from: {problem}"):
            parse(document)
