"""Sharded, asynchronous, atomically committed checkpoints of the training state.

Every rank writes its own shards of `state.state_dict()` with torch.distributed.checkpoint (DCP)
under `<uri>/shards-<s>/step-00000000N/` (DCP's metadata in `<uri>/step-00000000N/`; the layout
is trainer/checkpoint_catalog.py's), keyed by the full model's parameter names, so that a
checkpoint loads into any other pp x dp split. When every rank has finished, rank 0 writes the
commit marker; only then does the checkpoint exist for resume.

Training is blocked only while the state is copied to CPU memory (and that copy overlaps the next
forward and backward: the wait is at the next optimizer step). The upload and the commit run in
the background; at most one save is in flight; a failed save raises CheckpointError on every rank
at the next `maybe_save` or at `close`.

    checkpointer = Checkpointer(cfg.checkpoint, layout={"pp": 4, "dp": 2})
    start = checkpointer.resume(state) or 0
    for step in range(start + 1, total_steps + 1):
        ...train one step; its all-reduce also sums checkpointer.vote() over the ranks: votes...
        checkpointer.maybe_save(step, state, final=step == total_steps, agreed=votes)
    checkpointer.close()

Whether a save is due is decided alike on every rank: each rank votes (its last save failed, it
was asked to save) and the votes are summed over the world. A training loop rides them on the
all-reduce it runs every step anyway (trainer/train.py); `maybe_save` without `agreed` sums them
itself over a gloo group of its own. DCP's collectives run on another gloo group (an
asynchronous save plans in a background thread, which needs a CPU backend). Both groups are
created at their first use, never up front: each connects every rank to every other, 4,095
sockets per rank in a world of 4,096.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from s3torchconnector import S3ClientConfig, S3ReaderConstructor
from s3torchconnector.dcp import S3PrefixStrategyBase, S3StorageReader, S3StorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim.optimizer import register_optimizer_step_pre_hook

from trainer import checkpoint_catalog as catalog
from trainer.world_failure import current_world, raise_if_failed

__all__ = ["Checkpointer", "CheckpointError", "ComputeOrderedStager", "host_stager", "storage_writer", "storage_reader"]

log = logging.getLogger(__name__)

_DCP_METADATA_FILE = ".metadata"
# DCP reports a failure on any rank as CheckpointException, which derives from BaseException.
_SAVE_FAILURES = (Exception, CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed or loaded."""


S3_PART_BYTES = 64 * 2**20
"""Multipart part size of the shard uploads. S3 takes at most 10,000 parts per upload and a rank
streams its shard without knowing its length, so the part size bounds the largest shard: 64 MiB
allows 671 GB (the connector's 8 MiB default: 84 GB, less than the 250 GB each of 8 ranks writes
of a 178B model's 2 TB of state). It also cuts the requests of a 2 TB save from 262,144 PUTs to
32,768, against S3's 3,500 PUT/s per prefix. Cost: the client buffers parts in flight in host
memory (a few parts of 64 MiB per rank)."""


def _s3_client_config() -> S3ClientConfig:
    # Path-style addressing is what S3-compatible endpoints (MinIO, moto) serve; virtual-hosted
    # style is AWS's default and needs DNS for every bucket.
    return S3ClientConfig(part_size=S3_PART_BYTES, force_path_style=bool(os.environ.get("AWS_ENDPOINT_URL")))


def _region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def _shard_prefix(step_dir: str, rank: int) -> str:
    """Where DCP puts a rank's shard files of a step, relative to the location."""
    return f"{catalog.shard_folder(rank)}/{step_dir}/__{rank}_"


class _StepLayout:
    """A DCP writer or reader rooted at the checkpoint location, for one step of the catalogue's
    layout: the step's metadata in its step folder, each rank's shard under its shard prefix.

    Rooted at the location, DCP would put `.metadata` at the root; `_get_metadata_path` is where
    both FileSystemWriter and FileSystemReader look it up, so the step folder is named there.
    """

    step_dir: str

    def _get_metadata_path(self, rank: int | None = None) -> os.PathLike:
        return self.fs.concat_path(self.path, f"{self.step_dir}/{_DCP_METADATA_FILE}")


class _StepWriterMetadata:
    """The metadata `dcp.save` returns names where each item went, which the commit's manifest
    reads. torch before 2.13 records that in FileSystemWriter.finish on a copy of the metadata
    (S3StorageWriter's too), so the one returned had none: it is recorded on the original here."""

    def finish(self, metadata: Metadata, results: list[Any]) -> None:
        super().finish(metadata, results)
        metadata.storage_data = {result.index: result.storage_data for per_rank in results for result in per_rank}


class _ShardPrefixes(S3PrefixStrategyBase):
    """The connector's seam for where each rank's shard goes (it calls it with the rank)."""

    def __init__(self, step_dir: str):
        super().__init__()
        self.step_dir = step_dir

    def generate_prefix(self, rank: int) -> str:
        return _shard_prefix(self.step_dir, rank)


class _S3StepWriter(_StepWriterMetadata, _StepLayout, S3StorageWriter):
    def __init__(self, location: str, step_dir: str):
        super().__init__(_region(), location, s3client_config=_s3_client_config(),
                         prefix_strategy=_ShardPrefixes(step_dir))
        self.step_dir = step_dir


class _S3StepReader(_StepLayout, S3StorageReader):
    def __init__(self, location: str, step_dir: str):
        super().__init__(_region(), location, s3client_config=_s3_client_config(),
                         reader_constructor=S3ReaderConstructor.dcp_optimized())
        self.step_dir = step_dir


class _LocalStepWriter(_StepWriterMetadata, _StepLayout, dcp.FileSystemWriter):
    def __init__(self, location: str, step_dir: str):
        super().__init__(location, sync_files=True)
        self.step_dir = step_dir

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(_shard_prefix(self.step_dir, rank)))
                for rank, plan in enumerate(plans)]

    def write_data(self, plan: Any, planner: Any) -> Future:
        Path(self.path, plan.storage_data.prefix).parent.mkdir(parents=True, exist_ok=True)
        return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[Any]) -> None:
        Path(self.path, self.step_dir).mkdir(parents=True, exist_ok=True)
        super().finish(metadata, results)


class _LocalStepReader(_StepLayout, dcp.FileSystemReader):
    def __init__(self, location: str, step_dir: str):
        super().__init__(location)
        self.step_dir = step_dir


def storage_writer(location: str, step_dir: str) -> dcp.StorageWriter:
    """The DCP writer of one step at a checkpoint location: s3torchconnector's on S3, the stock
    one on a filesystem, both writing the catalogue's layout."""
    if location.startswith("s3://"):
        return _S3StepWriter(location, step_dir)
    return _LocalStepWriter(location, step_dir)


def storage_reader(location: str, step_dir: str) -> dcp.StorageReader:
    """The DCP reader of one step (see `storage_writer`). On S3 it is s3torchconnector's
    DCP-optimized reader: each rank fetches only the byte ranges of the items it loads, in
    offset order, coalescing neighbours, instead of streaming whole shard files."""
    if location.startswith("s3://"):
        return _S3StepReader(location, step_dir)
    return _LocalStepReader(location, step_dir)


def _model_difference(saved: Mapping[str, Any], ours: Mapping[str, Any]) -> str | None:
    """The first model field whose value differs between a checkpoint's model section and the
    run's, as a sentence; None when they agree on every field both name."""
    for name in sorted(set(saved) & set(ours)):
        if saved[name] != ours[name]:
            return f"model.{name} is {saved[name]!r} there, {ours[name]!r} in the run's config"
    return None


def manifest_files(
    metadata: Metadata, step_dir: str, present: Mapping[str, catalog.StoredFile], where: str
) -> tuple[catalog.StoredFile, ...]:
    """The files a DCP checkpoint consists of, as stored; CheckpointError if one is short or absent.

    The DCP metadata says which file holds each item and at which offset and length, so a file
    shorter than its last item is caught here, before the checkpoint is committed. Names are
    relative to the checkpoint location, like the metadata's.
    """
    needed_bytes = {f"{step_dir}/{_DCP_METADATA_FILE}": 1}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed_bytes[info.relative_path] = max(needed_bytes.get(info.relative_path, 0), end)
    files = []
    for name, needed in sorted(needed_bytes.items()):
        stored = present.get(name)
        if stored is None or stored.size < needed:
            found = "missing" if stored is None else f"{stored.size} bytes"
            raise CheckpointError(f"{where}: file {name} should hold {needed} bytes, found {found}")
        files.append(stored)
    return tuple(files)


class ComputeOrderedStager(DefaultStager):
    """DCP's stager, with the copy ordered after the work already queued on the compute stream.

    On CUDA the copy to pinned memory runs on a side stream, which does not wait for the stream
    the training loop queued the optimizer step on: without an order, it could read parameters
    and Adam moments that the fused optimizer kernels are still writing. An event recorded on
    the caller's stream when the save starts marks the end of that step; the staging thread
    waits for it before it queues a copy, so the training loop itself never blocks on the GPU.
    """

    def __init__(self, options: StagingOptions, *, cuda: bool):
        super().__init__(options)
        self._cuda = cuda

    def stage(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
        step_queued = None
        if self._cuda:
            step_queued = torch.cuda.Event()
            step_queued.record()  # on the caller's current stream
        return super().stage(state_dict, step_queued=step_queued, **kwargs)

    def _stage(self, state_dict: dict[str, Any], step_queued: Any = None, **kwargs: Any) -> dict[str, Any]:
        if step_queued is not None:
            step_queued.synchronize()
        if not self._state_dict_stager._deepcopy_dispatch:
            # torch before 2.13 closes its state-dict stager after every copy, and a closed one
            # cannot copy again: the next save gets a new one (its pinned buffers are made anew).
            self._state_dict_stager = StateDictStager(pin_memory=self._config.use_pinned_memory,
                                                      share_memory=self._config.use_shared_memory)
        return super()._stage(state_dict, **kwargs)


def host_stager() -> ComputeOrderedStager:
    """A stager that copies a state dict to host memory (pinned on CUDA) on a thread of its own:
    `stage` returns a future of the copy."""
    cuda = torch.cuda.is_available()
    options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                             use_non_blocking_copy=cuda)
    return ComputeOrderedStager(options, cuda=cuda)


class Checkpointer:
    """Saves and restores a Stateful training state to one checkpoint location.

    Every rank constructs it with the same arguments and calls its methods alike, in the same
    order with respect to other process-group creation: the first resume that loads, the first
    save and the first `maybe_save` without `agreed` each create a gloo group of its own (see the
    module docstring).
    """

    def __init__(
        self,
        cfg: Any,
        *,
        layout: Mapping[str, int] | None = None,
        config_hash: str = "",
        model: Mapping[str, Any] | None = None,
        tokenizer: str = "",
        init_from: str = "",
        request_file: str | os.PathLike | None = None,
        request_signal: int | None = signal.SIGUSR1,
        timeout: timedelta = timedelta(minutes=10),
    ):
        """
        cfg: a CheckpointConfig (uri, interval, keep_last, resume, async_save).
        layout: the parallel layout recorded in the manifest, e.g. {"pp": 4, "dp": 2}.
        config_hash: fingerprint of the trainer config (checkpoint_catalog.config_hash); a resume
            from a checkpoint with another one is allowed and logged.
        model: the trainer config's model section, recorded in the manifest (what an export names).
        tokenizer: the trainer config's data.tokenizer, recorded in the manifest (what an export writes).
        init_from: a checkpoint location whose newest commit's weights `resume` loads when `cfg.uri`
            holds nothing to resume (the trainer config's training.init_from).
        request_file: a path whose creation or touch asks for a checkpoint now.
        request_signal: a signal that asks for a checkpoint now (None: none).
        timeout: how long a checkpoint collective waits for a peer before failing.
        """
        self.cfg = cfg
        self.store = catalog.open_store(cfg.uri)
        self.resume_store = catalog.open_store(cfg.resume_uri) if cfg.resume_uri else self.store
        """Where the resume point lies: the saves' own place, or another run's, which is only read."""
        self._resume_target = catalog.resume_target(cfg.resume)
        self.layout = dict(layout or {})
        self.config_hash = config_hash
        self.model = dict(model or {})
        self.tokenizer = tokenizer
        self.init_from = init_from
        self._distributed = dist.is_available() and dist.is_initialized()
        self._world = current_world()
        self.rank = dist.get_rank() if self._distributed else 0
        self._timeout = timeout
        self._dcp_process_group: dist.ProcessGroup | None = None
        self._vote_group: dist.ProcessGroup | None = None
        self._requests = catalog.SaveRequests(request_file, request_signal)
        self._stager = host_stager()
        self._staging: Future | None = None
        self._staging_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._in_flight: Future | None = None
        self._in_flight_step: int | None = None
        self._last_saved_step: int | None = None
        self.blocked_seconds = 0.0
        """Total time the training loop has waited on checkpointing (staging and previous saves)."""

    # ---- resume -------------------------------------------------------------------------------

    def resume(self, state: Stateful) -> int | None:
        """Load the checkpoint `cfg.resume` asks for into `state`; its step, or None if none.

        "latest" takes the newest committed checkpoint whose files match its manifest, skipping
        (and logging) broken ones; a step number takes that step or fails; under `cfg.resume_uri`
        where it names another run's checkpoints (a run resumed from another: its whole state).
        Step folders newer than the one loaded belong to an abandoned timeline and are deleted
        where this run saves, so that its saves never mix with them; another run's are never
        touched. With nothing to resume, the newest commit at `init_from` gives the weights. An
        imported step (and init_from's) loads the weights alone, through `state`'s
        model_state_dict and load_model_state_dict (trainer/train.py TrainState): everything else
        starts afresh.
        """
        decision = self._on_rank0_for_all(self._choose_resume_step)
        if decision is None:
            return None
        location, step, weights_only = decision
        step_dir = catalog.step_dir_name(step)
        reader = storage_reader(location, step_dir)
        if weights_only:
            state_dict = {"model": state.model_state_dict()}
            dcp.load(state_dict, storage_reader=reader, process_group=self._dcp_group())
            state.load_model_state_dict(state_dict["model"])
        else:
            state_dict = state.state_dict()
            dcp.load(state_dict, storage_reader=reader, process_group=self._dcp_group())
            state.load_state_dict(state_dict)
        if location == self.store.uri:
            self._last_saved_step = step
        log.info("resumed from checkpoint %s%s", catalog.open_store(location).step_uri(step_dir),
                 " (its weights)" if weights_only else "")
        return step

    def adopt(self, step: int) -> list[int]:
        """Take `step`, restored from elsewhere (host memory), as the resume point: the committed
        steps S3 holds newer than it, found by listing alone; when there are none, step folders
        newer than it are deleted as `resume` deletes them. When there are, `resume` takes the
        newest commit, whatever step `cfg.resume` named (the launch's, chosen before it)."""
        newer = self._on_rank0_for_all(lambda: catalog.commits_after(self.store, step))
        if newer:
            self._resume_target = "latest"
        elif self.rank == 0:
            catalog.forget_after(self.store, step)
        return newer

    def _choose_resume_step(self) -> tuple[str, int, bool] | None:
        """(location, step, whether its weights alone load), or None to start from scratch."""
        try:
            manifest = catalog.resume_point(self.resume_store, self._resume_target, saves=self.store)
            location, initial = self.resume_store.uri, False
            if manifest is None and self.init_from:
                manifest, location, initial = catalog.latest_committed(self.init_from), self.init_from, True
                if manifest is None:
                    raise CheckpointError(f"training.init_from={self.init_from}: no committed checkpoint there")
        except catalog.CheckpointInvalid as exc:
            raise CheckpointError(str(exc)) from exc
        if manifest is None:
            return None
        weights_only = initial or manifest.reason is catalog.SaveReason.IMPORTED
        if weights_only:
            problem = _model_difference(manifest.model, self.model)
            if problem:
                raise CheckpointError(f"{location} step {manifest.step} holds another model than the run's: {problem}")
        elif self.config_hash and manifest.config_hash != self.config_hash:
            log.warning("resuming step %d saved with another trainer config (hash %s, now %s)",
                        manifest.step, manifest.config_hash, self.config_hash)
        return location, manifest.step, weights_only

    def _on_rank0_for_all(self, decide: Callable[[], Any]) -> Any:
        """Run `decide` on rank 0 and give every rank its result, or its error as CheckpointError."""
        outcome: list[Any] = [None]
        error: Exception | None = None
        if self.rank == 0:
            try:
                outcome = [("ok", decide())]
            except Exception as exc:  # every rank must learn it, or the others would wait for ever
                message = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
                outcome, error = [("error", message)], exc
        if self._distributed:
            # On the default group: before training starts nothing else runs on it.
            dist.broadcast_object_list(outcome, src=0)
            raise_if_failed(self._world, "the checkpoint decision's broadcast")
        kind, value = outcome[0]
        if kind == "error":
            raise CheckpointError(value) from error
        return value

    # ---- save ---------------------------------------------------------------------------------

    def vote(self, force: bool = False) -> torch.Tensor:
        """This rank's say in the next `maybe_save`: [its last save failed, it was asked to save
        (or `force`)], as 0 or 1. Summed over all ranks, it is `maybe_save`'s `agreed`."""
        return torch.tensor([float(self._finished_with_error()), float(force or self._requests.pending())])

    def maybe_save(self, step: int, state: Stateful, force: bool = False, final: bool = False,
                   agreed: torch.Tensor | None = None) -> bool:
        """Save if `step` is on the interval, is the run's last (`final`), or if asked to; True if
        a save was started.

        Call it on every rank after every step. `agreed`: the ranks' votes (`vote`) summed over
        all ranks, by a collective the caller runs anyway (then `force` must be the same on every
        rank); without it this rank's vote, `force` included, is summed here. A save on request
        (force, signal, flag file) returns only once the checkpoint is committed: the node may be
        about to go away. The manifest records why it was saved (a request wins over the other
        reasons).
        """
        if agreed is None:
            agreed = self._agree(self.vote(force))
        any_failed, any_requested = (flag > 0 for flag in agreed.tolist())
        if any_failed:
            self._wait_in_flight()  # raises this rank's own error, if it has one
            raise CheckpointError(f"checkpoint of step {self._in_flight_step} failed on another rank")
        requested = any_requested or force
        reason = catalog.save_reason(step, self.cfg.interval, requested=requested, final=final)
        if reason is None or step == self._last_saved_step:
            return False
        started = time.perf_counter()
        self._wait_in_flight()
        self._wait_for_staging()
        self._requests.honoured()
        uploaded = self._start_upload(catalog.step_dir_name(step), state.state_dict())
        self._in_flight = self._committer.submit(self._commit_when_uploaded, step, reason, uploaded)
        if self.rank == 0:
            # Queued behind the commit on the same thread; the save counts as done without it.
            self._committer.submit(self._prune)
        self._in_flight_step = step
        self._last_saved_step = step
        self.blocked_seconds += time.perf_counter() - started
        if requested or not self.cfg.async_save:
            started = time.perf_counter()
            self._wait_in_flight()
            self.blocked_seconds += time.perf_counter() - started
        if requested:
            # A request that came while this checkpoint was being written (one departure reaches
            # the ranks along several paths) is answered by it, not by another save a step later.
            self._requests.honoured()
        return True

    def _start_upload(self, step_dir: str, state_dict: dict[str, Any]) -> Future:
        """Start writing the shards; a future of DCP's metadata, failed if anything went wrong."""
        uploaded: Future = Future()
        try:
            if self.cfg.async_save:
                response = dcp.async_save(state_dict, storage_writer=storage_writer(self.store.uri, step_dir),
                                          process_group=self._dcp_group(), async_stager=self._stager)
                self._staging = response.staging_completion
                return response.upload_completion
            uploaded.set_result(dcp.save(state_dict, storage_writer=storage_writer(self.store.uri, step_dir),
                                         process_group=self._dcp_group()))
        except _SAVE_FAILURES as exc:  # raised as CheckpointError by _wait_in_flight, like a failed upload
            uploaded.set_exception(exc)
        return uploaded

    def _commit_when_uploaded(self, step: int, reason: catalog.SaveReason, uploaded: Future) -> None:
        metadata: Metadata = uploaded.result()
        if self.rank != 0:
            return
        step_dir = catalog.step_dir_name(step)
        where = f"{self.store.uri}/{step_dir}"
        files = manifest_files(metadata, step_dir, catalog.step_files(self.store, step), where)
        manifest = catalog.Manifest(step=step, layout=self.layout, files=files, config_hash=self.config_hash,
                                    reason=reason, model=self.model, tokenizer=self.tokenizer)
        self.store.create(step_dir, catalog.MARKER_NAME, manifest.to_json())
        log.info("checkpoint committed: %s (%s, %d files, %d bytes)", where, reason, len(files),
                 sum(f.size for f in files))

    def _prune(self) -> None:
        """Apply retention; a failure is logged, not raised: the next commit prunes again."""
        try:
            catalog.prune(self.store, self.cfg.keep_last)
        except Exception:
            log.warning("retention failed in %s", self.store.uri, exc_info=True)

    def _agree(self, votes: torch.Tensor) -> torch.Tensor:
        """`votes` summed over all ranks."""
        if self._distributed:
            if self._vote_group is None:
                # Not the DCP group: a save's collectives may be running on that one in the background.
                self._vote_group = dist.new_group(backend="gloo", timeout=self._timeout)
            dist.all_reduce(votes, group=self._vote_group)
        return votes

    def _dcp_group(self) -> dist.ProcessGroup | None:
        """The group DCP's collectives run on: gloo, with the checkpoint's timeout (the save's last
        collective waits for the slowest rank's upload); created at the first load or save."""
        if self._distributed and self._dcp_process_group is None:
            self._dcp_process_group = dist.new_group(backend="gloo", timeout=self._timeout)
        return self._dcp_process_group

    def _finished_with_error(self) -> bool:
        return self._in_flight is not None and self._in_flight.done() and self._in_flight.exception() is not None

    def _wait_in_flight(self) -> None:
        """Block until the save in flight is committed; raise CheckpointError if it failed."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        try:
            in_flight.result()
        except _SAVE_FAILURES as exc:
            raise CheckpointError(f"checkpoint of step {self._in_flight_step} failed: {exc}") from exc

    def _wait_for_staging(self) -> None:
        """Block until the CPU copy of the state being saved is complete (or has failed)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            # A failed copy fails the upload future with the same error, which every rank raises
            # as CheckpointError at its next maybe_save; raising it here would stop one rank alone.
            futures.wait([staging])

    def _before_optimizer_step(self, *_: Any) -> None:
        # The optimizer step changes parameters and optimizer state in place, so the copy being
        # staged must be complete first; forward and backward ran while it was being made.
        if self._staging is not None:
            started = time.perf_counter()
            self._wait_for_staging()
            self.blocked_seconds += time.perf_counter() - started

    def save_done(self) -> bool:
        """Whether no save is in flight (the last one committed or failed)."""
        return self._in_flight is None or self._in_flight.done()

    def wait(self) -> None:
        """Block until the save in flight, if any, is committed; CheckpointError if it failed."""
        self._wait_for_staging()
        self._wait_in_flight()

    def close(self) -> None:
        """Wait for the save in flight and release resources; raises CheckpointError if it failed."""
        try:
            self.wait()
        finally:
            self._staging_hook.remove()
            self._requests.close()
            self._committer.shutdown(wait=True)
            self._stager.close()

    def abandon(self) -> None:
        """Stop without waiting: the world failed and is being repaired. What the threads started
        finishes on its own (a save whose upload is whole still commits; one the failure cut short
        fails on the dead groups). The staged state is released once a staging in progress ends
        (the stager closes off the repair's path): the next world's saves stage their own."""
        self._staging_hook.remove()
        self._requests.close()
        self._committer.shutdown(wait=False)
        self._staging = None
        threading.Thread(target=self._stager.close, name="checkpoint-release", daemon=True).start()
