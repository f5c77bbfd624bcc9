"""The Checkpointer in one process with the real trainer's state: resume, requests, errors, async copy."""

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.filesystem import _StorageInfo

from checkpoint_fixtures import bucket, run_uri, s3  # noqa: F401 (fixtures)
from trainer import checkpoint, checkpoint_catalog as catalog
from trainer.checkpoint import (CheckpointError, Checkpointer, ComputeOrderedStager, manifest_files, storage_reader,
                                storage_writer)
from trainer.config import load_config
from trainer.train import build, environment, train_step
from trainer.train import train as trainer_train


@pytest.fixture
def config(tmp_path):
    return load_config([
        "--model.n_layers=2", "--model.d_model=16", "--model.n_heads=2", "--model.seq_len=16",
        "--training.batch_size=4", "--parallel.microbatches=1", "--training.steps=12",
        "--optim.warmup_steps=2", "--training.device=cpu", f"--training.metrics_file={tmp_path}/metrics.jsonl",
        f"--data.shards={tmp_path}/shards", "--data.corpus=stdlib", "--data.corpus_bytes=20000",
        "--checkpoint.interval=4", "--checkpoint.keep_last=2",
    ])


def new_run(config):
    return build(config, environment(config, torch.device("cpu")))


def settings(config, uri: str, **changes):
    return replace(config.checkpoint, uri=uri, **changes)


def train(run, checkpointer, until: int) -> dict[int, float]:
    losses = {}
    while run.state.step < until:
        metrics = train_step(run)
        losses[metrics["step"]] = metrics["loss"]
        checkpointer.maybe_save(run.state.step, run.state)
    return losses


@pytest.fixture(params=["s3", "local"])
def uri(request, tmp_path):
    return request.getfixturevalue("run_uri") if request.param == "s3" else str(tmp_path / "checkpoints")


def test_resume_from_a_step_continues_bit_for_bit(config, uri):
    first = Checkpointer(settings(config, uri), request_signal=None)
    straight = train(new_run(config), first, 12)
    first.close()
    assert catalog.committed_steps(catalog.open_store(uri)) == [12, 8]  # keep_last=2 pruned step 4

    again = Checkpointer(settings(config, uri, resume="8"), request_signal=None)
    run = new_run(config)
    assert again.resume(run.state) == 8
    assert catalog.saved_steps(catalog.open_store(uri)) == [8]  # 12 was of the abandoned timeline
    resumed = train(run, again, 12)
    again.close()

    assert resumed == {step: straight[step] for step in range(9, 13)}
    assert catalog.latest_committed(uri).step == 12


def test_a_run_resumed_from_another_reads_its_steps_and_saves_prunes_and_cleans_only_its_own(config, uri, tmp_path):
    """resume_uri: another run's checkpoints (a run that gave up), read and never changed; the new
    run goes on as one run would have, in its own place."""
    uninterrupted = train(new_run(config), Checkpointer(settings(config, str(tmp_path / "straight")),
                                                        request_signal=None), 20)
    first = Checkpointer(settings(config, uri), request_signal=None)
    train(new_run(config), first, 12)
    first.close()
    old = catalog.open_store(uri)
    old_files = {step: catalog.step_files(old, step) for step in catalog.saved_steps(old)}
    own_uri = uri.replace("test-run", "resumed-run") if uri.startswith("s3://") else uri + "-resumed"
    own = catalog.open_store(own_uri)
    # An earlier attempt of the new run that saved, uncommitted, past the step it resumes from.
    own.create(f"{catalog.shard_folder(0)}/{catalog.step_dir_name(13)}", "__0_0.distcp", b"half")

    resumed = Checkpointer(settings(config, own_uri, resume="latest", resume_uri=uri), request_signal=None)
    run = new_run(config)
    assert resumed.resume(run.state) == 12
    assert catalog.saved_steps(own) == []  # its abandoned save went
    losses = train(run, resumed, 20)
    resumed.close()
    assert losses == {step: uninterrupted[step] for step in range(13, 21)}
    assert catalog.committed_steps(own) == [20, 16]  # keep_last=2, in its own place
    assert {step: catalog.step_files(old, step) for step in catalog.saved_steps(old)} == old_files


def test_resume_uri_needs_a_resume_and_another_place():
    from trainer.config import ConfigError

    with pytest.raises(ConfigError, match="checkpoint.resume_uri needs checkpoint.resume"):
        load_config(["--checkpoint.uri=/tmp/a", "--checkpoint.resume_uri=/tmp/b"])
    with pytest.raises(ConfigError, match="checkpoint.resume_uri is checkpoint.uri"):
        load_config(["--checkpoint.uri=/tmp/a", "--checkpoint.resume=latest", "--checkpoint.resume_uri=/tmp/a/"])


def test_the_last_step_is_always_saved_and_a_run_resumed_there_trains_nothing(config, uri, tmp_path, capsys):
    config = replace(config, training=replace(config.training, steps=6), checkpoint=settings(config, uri))
    env = environment(config, torch.device("cpu"))
    assert [metrics["step"] for metrics in trainer_train(config, env)] == list(range(1, 7))
    store = catalog.open_store(uri)
    assert [(step, catalog.read_manifest(store, step).reason) for step in catalog.committed_steps(store)] == [
        (6, catalog.SaveReason.FINAL), (4, catalog.SaveReason.INTERVAL)]  # 6 is off the interval of 4

    resumed = replace(config, checkpoint=settings(config, uri, resume="latest"))
    assert trainer_train(resumed, env) == []
    assert "nothing to train: resumed at step 6, training.steps is 6" in capsys.readouterr().out
    last_record = json.loads(Path(config.training.metrics_file).read_text().splitlines()[-1])
    assert last_record == {"step": 6, "finished": True, "time": pytest.approx(time.time(), abs=60)}
    assert catalog.committed_steps(store) == [6, 4]  # the resumed step is not saved again


def test_a_fresh_run_refuses_a_location_with_checkpoints(config, run_uri):
    first = Checkpointer(settings(config, run_uri), request_signal=None)
    train(new_run(config), first, 4)
    first.close()

    fresh = Checkpointer(settings(config, run_uri), request_signal=None)
    with pytest.raises(CheckpointError, match="already holds committed step 4"):
        fresh.resume(new_run(config).state)
    fresh.close()


def test_resuming_a_step_that_is_not_there_names_it(config, run_uri):
    checkpointer = Checkpointer(settings(config, run_uri, resume="7"), request_signal=None)
    with pytest.raises(CheckpointError, match=r"cannot resume from step 7: .*step-000000007: no commit marker"):
        checkpointer.resume(new_run(config).state)
    checkpointer.close()


def test_resume_latest_with_nothing_saved_starts_fresh(config, run_uri):
    checkpointer = Checkpointer(settings(config, run_uri, resume="latest"), request_signal=None)
    assert checkpointer.resume(new_run(config).state) is None
    checkpointer.close()


def test_a_bad_resume_value_is_named(config, run_uri):
    with pytest.raises(ValueError, match="resume='yesterday'"):
        Checkpointer(settings(config, run_uri, resume="yesterday"), request_signal=None)


def test_the_request_file_asks_for_a_committed_checkpoint(config, run_uri, tmp_path):
    flag = tmp_path / "checkpoint-now"
    checkpointer = Checkpointer(settings(config, run_uri, interval=100), request_file=flag, request_signal=None)
    run = new_run(config)
    train(run, checkpointer, 1)
    assert catalog.latest_committed(run_uri) is None

    flag.touch()
    train_step(run)
    assert checkpointer.maybe_save(2, run.state)
    committed = catalog.latest_committed(run_uri)  # committed before maybe_save returned
    assert (committed.step, committed.reason) == (2, catalog.SaveReason.REQUESTED)
    train_step(run)
    assert not checkpointer.maybe_save(3, run.state)  # that request was served

    os.utime(flag, ns=(time.time_ns() + 10**9,) * 2)  # the agent touches it again
    train_step(run)
    assert checkpointer.maybe_save(4, run.state)
    checkpointer.close()


def test_a_request_that_comes_while_the_requested_checkpoint_is_written_is_answered_by_it(config, run_uri, tmp_path,
                                                                                         monkeypatch):
    flag = tmp_path / "checkpoint-now"
    checkpointer = Checkpointer(settings(config, run_uri, interval=100), request_file=flag, request_signal=None)
    run = new_run(config)
    train(run, checkpointer, 1)
    flag.touch()
    wait_in_flight = checkpointer._wait_in_flight

    def another_path_asks_meanwhile():  # the run record reaches this node's agent during the save
        os.utime(flag, ns=(time.time_ns() + 10**9,) * 2)
        wait_in_flight()

    monkeypatch.setattr(checkpointer, "_wait_in_flight", another_path_asks_meanwhile)
    train_step(run)
    assert checkpointer.maybe_save(2, run.state)
    monkeypatch.undo()
    train_step(run)
    assert not checkpointer.maybe_save(3, run.state), "one departure, one checkpoint"
    checkpointer.close()


def test_sigusr1_asks_for_a_checkpoint_and_the_handler_is_restored(config, run_uri):
    before = signal.getsignal(signal.SIGUSR1)
    checkpointer = Checkpointer(settings(config, run_uri, interval=100))
    run = new_run(config)
    train_step(run)

    os.kill(os.getpid(), signal.SIGUSR1)

    assert checkpointer.maybe_save(1, run.state)
    assert catalog.latest_committed(run_uri).step == 1
    checkpointer.close()
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failed_save_raises_at_the_next_save(config, moto_endpoint, async_save):
    checkpointer = Checkpointer(settings(config, "s3://no-such-bucket/run", async_save=async_save),
                                request_signal=None)
    run = new_run(config)
    with pytest.raises(CheckpointError, match="checkpoint of step 4 failed"):
        train(run, checkpointer, 8)
    # Sync: at once. Async: at the first maybe_save after the upload failed, step 8 at the latest.
    assert run.state.step == 4 if not async_save else 4 < run.state.step <= 8
    checkpointer.close()


def test_a_failed_save_raises_at_close(config, moto_endpoint):
    checkpointer = Checkpointer(settings(config, "s3://no-such-bucket/run"), request_signal=None)
    train(new_run(config), checkpointer, 4)
    with pytest.raises(CheckpointError, match="checkpoint of step 4 failed"):
        checkpointer.close()


def test_the_optimizer_step_waits_for_the_copy_being_saved(config, run_uri, monkeypatch):
    copy_may_start = threading.Event()
    real_stage = DefaultStager._stage

    def slow_stage(self, state_dict, **kwargs):
        copy_may_start.wait(timeout=60)
        return real_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow_stage)
    checkpointer = Checkpointer(settings(config, run_uri), request_signal=None)
    run = new_run(config)
    train(run, checkpointer, 3)
    train_step(run)
    at_save = {k: v.clone() for k, v in run.pipeline.model_parts[0].state_dict().items()}
    checkpointer.maybe_save(4, run.state)  # returns while the copy has not even started

    next_step = threading.Thread(target=train_step, args=(run,))
    next_step.start()
    next_step.join(timeout=1)
    assert next_step.is_alive(), "the optimizer stepped while the state was being copied"
    copy_may_start.set()
    next_step.join(timeout=60)
    checkpointer.close()

    loaded = new_run(config)
    reader = Checkpointer(settings(config, run_uri, resume="4"), request_signal=None)
    reader.resume(loaded.state)
    reader.close()
    for name, tensor in loaded.pipeline.model_parts[0].state_dict().items():
        assert torch.equal(tensor, at_save[name]), name


def test_a_short_shard_is_never_committed():
    shard = "shards-0/step-000000004/__0_0.distcp"
    metadata = Metadata(state_dict_metadata={}, storage_data={
        MetadataIndex("model.w"): _StorageInfo(shard, offset=0, length=100),
        MetadataIndex("model.b"): _StorageInfo(shard, offset=100, length=20),
    })
    stored = {"step-000000004/.metadata": catalog.StoredFile("step-000000004/.metadata", 9),
              shard: catalog.StoredFile(shard, 110)}

    with pytest.raises(CheckpointError, match=f"file {shard} should hold 120 bytes, found 110 bytes"):
        manifest_files(metadata, "step-000000004", stored, "s3://b/step-000000004")



def test_on_cuda_the_copy_waits_for_the_work_queued_on_the_compute_stream(monkeypatch):
    """torch.cuda.Event is stood in for (no GPU here): the stager must record an event on the
    caller's stream when a save starts (after the optimizer step was queued), and the staging
    thread must wait on it before it copies a tensor; otherwise the side stream could copy
    parameters and Adam moments that the fused optimizer is still writing."""
    calls = []

    class Event:
        def record(self, stream=None):
            calls.append(("record", threading.current_thread() is threading.main_thread()))

        def synchronize(self):
            calls.append(("wait", threading.current_thread() is threading.main_thread()))

    real_stage = DefaultStager._stage

    def copy(self, state_dict, **kwargs):
        calls.append(("copy", threading.current_thread() is threading.main_thread()))
        return real_stage(self, state_dict, **kwargs)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(DefaultStager, "_stage", copy)
    stager = ComputeOrderedStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                 use_async_staging=True, use_non_blocking_copy=False), cuda=True)
    weights = torch.arange(4.0)
    staged = stager.stage({"w": weights}).result()
    stager.close()

    # Recorded by the training loop's thread, waited on by the staging thread, then copied.
    assert calls == [("record", True), ("wait", False), ("copy", False)]
    assert torch.equal(staged["w"], weights)


def test_shards_go_under_the_shard_prefixes_and_the_metadata_beside_the_marker(config, run_uri, s3, bucket):
    checkpointer = Checkpointer(settings(config, run_uri), request_signal=None)
    run = new_run(config)
    train(run, checkpointer, 4)
    checkpointer.close()

    listed = s3.list_objects_v2(Bucket=bucket, Prefix="runs/test-run/checkpoints/")["Contents"]
    assert sorted(obj["Key"].removeprefix("runs/test-run/checkpoints/") for obj in listed) == [
        "shards-0/step-000000004/__0_0.distcp", "step-000000004/.metadata", "step-000000004/commit.json"]


def test_s3_parts_are_large_enough_for_a_shard_of_a_2_tb_state_on_one_node():
    """S3 takes at most 10,000 parts per multipart upload, and a rank streams its shard without
    knowing its length, so the part size bounds the largest shard a rank can write."""
    writer = storage_writer("s3://bucket/runs/r/checkpoints", "step-000000001")

    part_size = writer.fs._client.s3client_config.part_size
    assert part_size == checkpoint.S3_PART_BYTES
    assert part_size * 10_000 >= 2e12 / 8  # a 178B model's 2 TB of state saved by the 8 GPUs of one node


def test_s3_loads_fetch_byte_ranges_with_the_dcp_optimized_reader():
    from s3torchconnector.s3reader.constructor import DCPOptimizedConstructor

    reader = storage_reader("s3://bucket/runs/r/checkpoints", "step-000000001")

    assert isinstance(reader._reader_constructor, DCPOptimizedConstructor)
