"""The commit protocol without torch: markers, verification, discovery, retention."""

import json
import sys

import pytest

from checkpoint_fixtures import bucket, run_uri, s3  # noqa: F401 (fixtures)

from localcloud.waiting import run_captured
from trainer import checkpoint_catalog as catalog
from trainer.checkpoint_catalog import CheckpointInvalid, CommitConflict, Manifest, StoredFile


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return catalog.open_store(str(tmp_path / "checkpoints"))
    run_uri = request.getfixturevalue("run_uri")
    return catalog.open_store(run_uri)


def shard_dir(rank: int, step: int) -> str:
    return f"{catalog.shard_folder(rank)}/{catalog.step_dir_name(step)}"


def save_fake_checkpoint(store, step: int, shard: bytes = b"x" * 100, commit: bool = True) -> None:
    """Two ranks' shards and DCP's metadata where the trainer puts them, and optionally the marker."""
    step_dir = catalog.step_dir_name(step)
    for rank in (0, 1):
        store.create(shard_dir(rank, step), f"__{rank}_0.distcp", shard)
    store.create(step_dir, ".metadata", b"meta")
    if commit:
        files = tuple(catalog.step_files(store, step).values())
        store.create(step_dir, catalog.MARKER_NAME, Manifest(step=step, layout={"pp": 2}, files=files).to_json())


def test_marker_is_written_once_and_never_overwritten(store):
    save_fake_checkpoint(store, 7)
    original = store.read(catalog.step_dir_name(7), catalog.MARKER_NAME)

    with pytest.raises(CommitConflict, match="commit.json already exists"):
        store.create(catalog.step_dir_name(7), catalog.MARKER_NAME, b"{}")

    assert store.read(catalog.step_dir_name(7), catalog.MARKER_NAME) == original


def test_latest_is_the_newest_committed_and_whole_checkpoint(store):
    assert catalog.latest_committed(store) is None
    save_fake_checkpoint(store, 100)
    save_fake_checkpoint(store, 200)
    save_fake_checkpoint(store, 300, commit=False)  # a save in flight, or one that died

    latest = catalog.latest_committed(store)

    assert latest.step == 200
    assert latest.layout == {"pp": 2}
    assert {f.name for f in latest.files} == {
        "shards-0/step-000000200/__0_0.distcp", "shards-1/step-000000200/__1_0.distcp", "step-000000200/.metadata"}


def test_shards_of_every_save_go_under_the_same_sixteen_prefixes():
    assert [catalog.shard_folder(rank) for rank in (0, 1, 15, 16, 17, 1023)] == [
        "shards-0", "shards-1", "shards-f", "shards-0", "shards-1", "shards-f"]
    assert catalog.step_folders(12)[:3] == ["step-000000012", "shards-0/step-000000012", "shards-1/step-000000012"]
    assert len(catalog.step_folders(12)) == 17


def test_a_truncated_shard_is_refused_by_name_and_discovery_falls_back(store, caplog):
    save_fake_checkpoint(store, 100)
    save_fake_checkpoint(store, 200, commit=False)
    store.delete_folder(shard_dir(1, 200))
    store.create(shard_dir(1, 200), "__1_0.distcp", b"x" * 60)
    files = (StoredFile("shards-0/step-000000200/__0_0.distcp", 100),
             StoredFile("shards-1/step-000000200/__1_0.distcp", 100), StoredFile("step-000000200/.metadata", 4))
    store.create(catalog.step_dir_name(200), catalog.MARKER_NAME, Manifest(step=200, layout={}, files=files).to_json())

    truncated = r"step-000000200: file shards-1/step-000000200/__1_0.distcp has 60 bytes, manifest says 100"
    with pytest.raises(CheckpointInvalid, match=truncated):
        catalog.verified_manifest(store, 200)
    assert catalog.latest_committed(store).step == 100
    assert "__1_0.distcp has 60 bytes" in caplog.text


def test_a_missing_shard_is_refused_by_name(store):
    step_dir = catalog.step_dir_name(5)
    store.create(step_dir, ".metadata", b"meta")
    files = (StoredFile("shards-1/step-000000005/__1_0.distcp", 10), StoredFile("step-000000005/.metadata", 4))
    store.create(step_dir, catalog.MARKER_NAME, Manifest(step=5, layout={}, files=files).to_json())

    with pytest.raises(CheckpointInvalid, match="file shards-1/step-000000005/__1_0.distcp is missing"):
        catalog.verified_manifest(store, 5)
    assert catalog.latest_committed(store) is None


def test_the_marker_records_why_it_was_saved_and_older_markers_read_as_unknown():
    requested = Manifest(step=4, layout={}, files=(StoredFile("__0_0.distcp", 100),),
                         reason=catalog.SaveReason.REQUESTED)
    assert Manifest.from_json(requested.to_json(), "here") == requested

    older = json.loads(requested.to_json())
    del older["reason"]
    assert Manifest.from_json(json.dumps(older).encode(), "here").reason is catalog.SaveReason.UNKNOWN
    with pytest.raises(CheckpointInvalid, match="here: unreadable commit marker: .*'someday' is not a valid SaveReason"):
        Manifest.from_json(json.dumps({**older, "reason": "someday"}).encode(), "here")


def test_an_unreadable_marker_is_refused(store):
    store.create(catalog.step_dir_name(3), catalog.MARKER_NAME, b'{"step": 3}')

    unreadable = r"step-000000003: unreadable commit marker: KeyError\('format_version'\)"
    with pytest.raises(CheckpointInvalid, match=unreadable):
        catalog.verified_manifest(store, 3)


def test_deleting_a_step_removes_the_marker_and_every_file(store):
    save_fake_checkpoint(store, 1)
    save_fake_checkpoint(store, 2)

    catalog.delete_step(store, 1)

    assert catalog.saved_steps(store) == [2]
    assert catalog.step_files(store, 1) == {}
    assert len(catalog.step_files(store, 2)) == 4


def test_a_save_that_died_before_its_metadata_is_found_by_its_shards_alone(store):
    save_fake_checkpoint(store, 10)
    store.create(shard_dir(3, 12), "__3_0.distcp", b"x")  # rank 3 wrote, then the world died

    assert catalog.saved_steps(store) == [12, 10]
    assert catalog.committed_steps(store) == [10]
    catalog.delete_step(store, 12)
    assert catalog.saved_steps(store) == [10]


def test_a_marker_of_the_earlier_layout_is_refused_by_its_version(store):
    marker = json.loads(Manifest(step=4, layout={}, files=()).to_json())
    store.create(catalog.step_dir_name(4), catalog.MARKER_NAME, json.dumps({**marker, "format_version": 1}).encode())

    with pytest.raises(CheckpointInvalid, match="format_version 1 is not 2"):
        catalog.verified_manifest(store, 4)


@pytest.mark.parametrize(
    "committed, keep_last, protected, victims",
    [
        ({10: True, 20: True, 30: True}, 2, (), [10]),
        ({10: True, 20: True, 30: True}, 0, (), []),
        ({10: True, 20: True, 30: True}, 1, (10,), [20]),
        # A dead save below the newest commit goes; one above it may be in flight and stays.
        ({10: True, 15: False, 20: True, 25: False}, 2, (), [15]),
        ({10: False, 20: False}, 1, (), []),
    ],
)
def test_retention(committed, keep_last, protected, victims):
    assert catalog.retention_victims(committed, keep_last, protected) == victims


@pytest.mark.parametrize(
    "uri, message",
    [
        ("", "checkpoint uri is empty"),
        ("gs://bucket/x", "only s3:// and local paths"),
        ("s3:///prefix", "names no bucket"),
    ],
)
def test_bad_uris_are_named(uri, message):
    with pytest.raises(ValueError, match=message):
        catalog.open_store(uri)


def test_the_catalog_imports_no_torch():
    code = "import sys, trainer.checkpoint_catalog; print('torch' in sys.modules)"
    result = run_captured([sys.executable, "-c", code], what="importing the catalogue")
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def test_config_hash_is_stable_and_order_free():
    assert catalog.config_hash({"a": 1, "b": [2]}) == catalog.config_hash({"b": [2], "a": 1})
    assert catalog.config_hash({"a": 1}) != catalog.config_hash({"a": 2})
