"""Which checkpoints exist: the commit protocol, readable without torch.

A checkpoint of step N at a location (`uri`: a local directory or `s3://bucket/prefix`) is

    <uri>/step-00000000N/.metadata                  DCP's metadata (rank 0)
    <uri>/step-00000000N/commit.json                the commit marker, written last
    <uri>/shards-<s>/step-00000000N/__<rank>_0.distcp   each rank's shard, s = rank % 16 in hex

S3 scales request rates per key prefix (about 3,500 PUT and 5,500 GET per second each), by
splitting a bucket's key range where the load is. The shards of every save land under the same
16 `shards-<s>/` prefixes, so the splits S3 makes for one checkpoint serve all later ones
(a prefix per step folder would start every checkpoint cold on one range): 56,000 PUT and
88,000 GET per second once split, for thousands of ranks' multipart parts and ranged reads.

When every rank has finished, rank 0 writes `commit.json` last, with a conditional write so
that it is never overwritten. The marker is the manifest: step, why it was saved, parallel
layout, every file's name (relative to the location) and size, the trainer config hash and the
commit time. A step without a marker, or whose files do not match its manifest, does not exist
for resume.

Only boto3 and the standard library are imported here, so the control plane (a Lambda) can find
the resume point with `latest_committed(uri)`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Protocol

__all__ = [
    "MARKER_NAME",
    "REQUEST_FILE_ENV",
    "CheckpointInvalid",
    "CommitConflict",
    "Manifest",
    "SaveReason",
    "StoredFile",
    "Store",
    "open_store",
    "step_dir_name",
    "shard_folder",
    "step_folders",
    "step_files",
    "delete_step",
    "config_hash",
    "check_files",
    "saved_steps",
    "is_committed",
    "committed_steps",
    "read_manifest",
    "verified_manifest",
    "latest_committed",
    "retention_victims",
    "prune",
    "resume_target",
    "resume_point",
    "save_reason",
    "SaveRequests",
]

log = logging.getLogger(__name__)

MARKER_NAME = "commit.json"
REQUEST_FILE_ENV = "TRAINFLEET_CHECKPOINT_REQUEST_FILE"
"""Environment variable naming the file whose creation asks the trainer for a checkpoint now."""
FORMAT_VERSION = 2
"""2: shards under the shard prefixes, file names relative to the location. Version 1 (every file
in the step folder) is refused: its shards are not where a reader of this layout looks."""
_STEP_DIR_PREFIX = "step-"
SHARD_SPREAD = 16
"""Key prefixes the ranks' shards are spread over (see the module docstring)."""
_SHARD_FOLDERS = tuple(f"shards-{spread:x}" for spread in range(SHARD_SPREAD))


class CheckpointInvalid(Exception):
    """A step folder that has a marker but cannot be trusted (names the step and the file)."""


class CommitConflict(Exception):
    """The marker already exists: a checkpoint is committed once and never overwritten."""


def step_dir_name(step: int) -> str:
    """`step-000001200`: zero padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"{_STEP_DIR_PREFIX}{step:09d}"


def shard_folder(rank: int) -> str:
    """The key prefix a rank's shards go under, e.g. `shards-3`."""
    return _SHARD_FOLDERS[rank % SHARD_SPREAD]


def step_folders(step: int) -> list[str]:
    """Every folder that may hold files of a step: its own and its part of each shard prefix."""
    step_dir = step_dir_name(step)
    return [step_dir] + [f"{shards}/{step_dir}" for shards in _SHARD_FOLDERS]


def marker_step(key: str) -> int | None:
    """The step whose commit marker `key` (an object key or path ending in
    `.../step-00000000N/commit.json`) is; None for any other file."""
    folder, _, name = key.rpartition("/")
    return _parse_step_dir(folder.rpartition("/")[2]) if name == MARKER_NAME else None


def _parse_step_dir(name: str) -> int | None:
    digits = name.removeprefix(_STEP_DIR_PREFIX)
    if name.startswith(_STEP_DIR_PREFIX) and digits.isdigit():
        return int(digits)
    return None


UNHASHED_SECTIONS = frozenset({"parallel", "checkpoint", "fleet_check", "scaling_check"})
"""Config sections a checkpoint does not depend on: the layout (checkpoints reshard), where they
go, and the checks of the world (its network, its first steps' speed)."""


def config_hash(config: Mapping[str, Any]) -> str:
    """A stable fingerprint of a config's sections that shape the training state (canonical
    JSON, SHA-256), recorded in the manifest."""
    hashed = {section: fields for section, fields in config.items() if section not in UNHASHED_SECTIONS}
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class SaveReason(StrEnum):
    """Why the trainer saved a checkpoint."""

    INTERVAL = "interval"
    """The step is a multiple of the checkpoint interval."""
    REQUESTED = "requested"
    """Asked for: the request file, the request signal or a forced save (a Spot notice)."""
    FINAL = "final"
    """The last step of the run."""
    IMPORTED = "imported"
    """A model brought in from elsewhere (`trainfleet checkpoint import`): step 0, the weights
    alone; a run resumed from it starts its optimizer, schedule and data afresh."""
    UNKNOWN = "unknown"
    """A marker written before the reason was recorded."""


@dataclass(frozen=True)
class StoredFile:
    """One object of a checkpoint as the store reports it."""

    name: str
    """Path relative to the location, e.g. `shards-1/step-000000010/__1_0.distcp`."""
    size: int
    """Size in bytes."""


@dataclass(frozen=True)
class Manifest:
    """The content of a commit marker."""

    step: int
    """Training step the checkpoint was taken after."""
    layout: dict[str, int]
    """Parallel layout of the saving run, e.g. {"pp": 4, "dp": 2}; informative, loads reshard."""
    files: tuple[StoredFile, ...]
    """Every object the checkpoint consists of; resume refuses the step if one differs."""
    config_hash: str = ""
    """Fingerprint of the trainer config that saved it (see `config_hash`)."""
    committed_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    """UTC time of the commit, ISO 8601."""
    format_version: int = FORMAT_VERSION
    """Version of this manifest format."""
    reason: SaveReason = SaveReason.UNKNOWN
    """Why it was saved; markers without it read as UNKNOWN."""
    model: dict[str, Any] = field(default_factory=dict)
    """The model section of the trainer config that saved it (trainer/config.py ModelConfig): the
    architecture an export names. Empty on markers written before it was kept."""
    tokenizer: str = ""
    """The tokenizer the model was trained or imported with (a trainer/tokenizer.py spec: bytes,
    or where its tokenizer.json is): what an export and sampling use. Empty: bytes."""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(raw)
            if doc["format_version"] != FORMAT_VERSION:
                raise ValueError(f"format_version {doc['format_version']!r} is not {FORMAT_VERSION}")
            return cls(
                step=int(doc["step"]),
                layout={str(k): int(v) for k, v in doc["layout"].items()},
                files=tuple(StoredFile(**entry) for entry in doc["files"]),
                config_hash=str(doc["config_hash"]),
                committed_at=str(doc["committed_at"]),
                format_version=FORMAT_VERSION,
                reason=SaveReason(doc.get("reason", SaveReason.UNKNOWN)),
                model=dict(doc.get("model", {})),
                tokenizer=str(doc.get("tokenizer", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointInvalid(f"{where}: unreadable commit marker: {exc!r}") from exc


class Store(Protocol):
    """The few operations the protocol needs from a checkpoint location."""

    uri: str

    def step_dirs(self, under: str = "") -> list[str]:
        """Names of the folders directly under the location, or under one of its folders (one
        listing, no recursion)."""

    def files(self, folder: str) -> dict[str, StoredFile]:
        """Every object under one folder, keyed by its name relative to the location."""

    def read(self, folder: str, name: str) -> bytes | None:
        """The object's bytes, or None when it does not exist."""

    def create(self, folder: str, name: str, data: bytes) -> None:
        """Write an object that must not exist yet; raise CommitConflict if it does."""

    def delete(self, folder: str, name: str) -> None:
        """Delete one object (nothing if it does not exist)."""

    def delete_folder(self, folder: str) -> None:
        """Delete every object under a folder."""

    def step_uri(self, step_dir: str) -> str:
        """The uri of a step folder (where its marker is)."""


class LocalStore:
    """A checkpoint location on a local (or network) filesystem."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.uri = str(self.root)

    def step_dirs(self, under: str = "") -> list[str]:
        folder = self.root / under
        if not folder.is_dir():
            return []
        return [entry.name for entry in folder.iterdir() if entry.is_dir()]

    def files(self, folder: str) -> dict[str, StoredFile]:
        names = (path.relative_to(self.root).as_posix() for path in (self.root / folder).rglob("*") if path.is_file())
        return {name: StoredFile(name, (self.root / name).stat().st_size) for name in names}

    def read(self, folder: str, name: str) -> bytes | None:
        try:
            return (self.root / folder / name).read_bytes()
        except FileNotFoundError:
            return None

    def create(self, folder: str, name: str, data: bytes) -> None:
        folder = self.root / folder
        folder.mkdir(parents=True, exist_ok=True)
        # Write aside, then hard-link into place: the link is atomic and fails if the name
        # exists, so readers see either no marker or a whole one, and never a replaced one.
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{name}.", delete=False) as tmp:
            tmp.write(data)
            tmp.flush()
            os.fchmod(tmp.fileno(), 0o644)
            os.fsync(tmp.fileno())
        try:
            os.link(tmp.name, folder / name)
        except FileExistsError as exc:
            raise CommitConflict(f"{folder / name} already exists") from exc
        finally:
            os.unlink(tmp.name)

    def delete(self, folder: str, name: str) -> None:
        (self.root / folder / name).unlink(missing_ok=True)

    def delete_folder(self, folder: str) -> None:
        try:
            shutil.rmtree(self.root / folder)
        except FileNotFoundError:
            pass

    def step_uri(self, step_dir: str) -> str:
        return str(self.root / step_dir)


TRAINER_S3_RETRIES = {"mode": "standard", "max_attempts": 10}
"""The trainer's own S3 calls (commit markers, listings, retention) ride out seconds of throttling
or 5xx answers as its shard uploads do (s3torchconnector's client tries ten times): with
botocore's default a marker write could fail a checkpoint, and with it the attempt, on a brief
S3 brownout."""


class S3Store:
    """A checkpoint location `s3://bucket/prefix` on any S3-compatible endpoint.

    The endpoint comes from boto3's own configuration (AWS_ENDPOINT_URL and friends).
    """

    def __init__(self, uri: str, client: Any = None):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"checkpoint uri {uri!r} names no bucket (expected s3://BUCKET/PREFIX)")
        self.uri = uri.rstrip("/")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client("s3", config=Config(retries=TRAINER_S3_RETRIES))
        self.client = client

    def _objects(self, prefix: str, **extra: Any) -> Iterable[dict[str, Any]]:
        """Pages of a ListObjectsV2 of `prefix`."""
        paginator = self.client.get_paginator("list_objects_v2")
        return paginator.paginate(Bucket=self.bucket, Prefix=prefix, **extra)

    def step_dirs(self, under: str = "") -> list[str]:
        listed = f"{self.prefix}{under}/" if under else self.prefix
        return [
            common["Prefix"][len(listed) :].rstrip("/")
            for page in self._objects(listed, Delimiter="/")
            for common in page.get("CommonPrefixes", [])
        ]

    def files(self, folder: str) -> dict[str, StoredFile]:
        found = {}
        for page in self._objects(f"{self.prefix}{folder}/"):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(self.prefix) :]
                found[name] = StoredFile(name, obj["Size"])
        return found

    def read(self, folder: str, name: str) -> bytes | None:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}{folder}/{name}")
        except self.client.exceptions.NoSuchKey:
            return None
        return response["Body"].read()

    def create(self, folder: str, name: str, data: bytes) -> None:
        key = f"{self.prefix}{folder}/{name}"
        try:
            # If-None-Match: * makes S3 refuse the write when the key exists (412).
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
        except self.client.exceptions.ClientError as exc:
            if exc.response["Error"]["Code"] in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise CommitConflict(f"s3://{self.bucket}/{key} already exists") from exc
            raise

    def delete(self, folder: str, name: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=f"{self.prefix}{folder}/{name}")

    def delete_folder(self, folder: str) -> None:
        keys = [obj["Key"] for page in self._objects(f"{self.prefix}{folder}/") for obj in page.get("Contents", [])]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": key} for key in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})

    def step_uri(self, step_dir: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{step_dir}"


def open_store(uri: str, s3_client: Any = None) -> Store:
    """The store behind a checkpoint uri: `s3://bucket/prefix` or a local directory."""
    if not uri:
        raise ValueError("checkpoint uri is empty")
    if uri.startswith("s3://"):
        return S3Store(uri, s3_client)
    if "://" in uri:
        raise ValueError(f"checkpoint uri {uri!r}: only s3:// and local paths are supported")
    return LocalStore(uri)


def check_files(manifest: Manifest, present: Mapping[str, StoredFile], where: str) -> None:
    """Raise CheckpointInvalid naming the first file that is missing or differs from the manifest."""
    for expected in manifest.files:
        found = present.get(expected.name)
        if found is None:
            raise CheckpointInvalid(f"{where}: file {expected.name} is missing")
        if found.size != expected.size:
            raise CheckpointInvalid(
                f"{where}: file {expected.name} has {found.size} bytes, manifest says {expected.size}"
            )


def _steps(folder_names: Iterable[str]) -> list[int]:
    """The steps among folder names, newest first, each once."""
    return sorted({step for step in map(_parse_step_dir, folder_names) if step is not None}, reverse=True)


def saved_steps(store: Store) -> list[int]:
    """Steps that have any file, committed or not, newest first.

    One listing of the location and one of each shard prefix, at once: a save that died before
    rank 0 wrote DCP's metadata left shards only.
    """
    return _steps(name for names in _each(store.step_dirs, ["", *_SHARD_FOLDERS]) for name in names)


def is_committed(store: Store, step: int) -> bool:
    """Whether the step folder holds a marker (its files are not checked)."""
    return bool(_markers(store, [step]))


def committed_steps(store: Store) -> list[int]:
    """Steps whose folder holds a marker, newest first (files not checked; markers are only ever
    in step folders, so one listing of the location finds the folders)."""
    return _markers(store, _steps(store.step_dirs()))


def _markers(store: Store, steps: list[int]) -> list[int]:
    """Those of `steps` whose folder holds a marker, in their order: told by listing each folder,
    no object read (a recovery reads no checkpoint object it does not load)."""
    listed = _files_in(store, map(step_dir_name, steps))
    return [step for step in steps if f"{step_dir_name(step)}/{MARKER_NAME}" in listed]


def step_files(store: Store, step: int) -> dict[str, StoredFile]:
    """Every file of a step, wherever the layout put it (one listing per folder of `step_folders`)."""
    return _files_in(store, step_folders(step))


def delete_step(store: Store, step: int) -> None:
    """Delete a step, its marker first so that it is never seen committed and half deleted."""
    store.delete(step_dir_name(step), MARKER_NAME)
    list(_each(store.delete_folder, step_folders(step)))


def _each(request: Callable[[str], Any], folders: list[str]) -> Iterable[Any]:
    """`request` for every folder, concurrently: each is a round trip to the store, the 17
    folders of a step would otherwise cost 17 in a row."""
    with ThreadPoolExecutor(max_workers=max(1, len(folders))) as pool:
        return list(pool.map(request, folders))


def _files_in(store: Store, folders: Iterable[str]) -> dict[str, StoredFile]:
    return {name: stored for files in _each(store.files, sorted(folders)) for name, stored in files.items()}


def read_manifest(store: Store, step: int) -> Manifest:
    """The manifest in a step's marker (its files not checked), else CheckpointInvalid."""
    step_dir = step_dir_name(step)
    where = f"{store.uri}/{step_dir}"
    raw = store.read(step_dir, MARKER_NAME)
    if raw is None:
        raise CheckpointInvalid(f"{where}: no commit marker (never committed, or deleted)")
    manifest = Manifest.from_json(raw, where)
    if manifest.step != step:
        raise CheckpointInvalid(f"{where}: marker is for step {manifest.step}")
    return manifest


def verified_manifest(store: Store, step: int) -> Manifest:
    """The manifest of a committed step whose files all match it, else CheckpointInvalid.

    Lists only the folders the manifest names files in (one per shard prefix the saving ranks used).
    """
    manifest = read_manifest(store, step)
    present = _files_in(store, {file.name.rpartition("/")[0] for file in manifest.files})
    check_files(manifest, present, f"{store.uri}/{step_dir_name(step)}")
    return manifest


def latest_committed(uri: str | Store, s3_client: Any = None) -> Manifest | None:
    """The newest checkpoint that is committed and whole, or None.

    Costs one delimited listing of the checkpoint prefix, then, for each step tried newest first,
    one marker read and one listing of each folder its manifest names. Refused checkpoints are logged with the reason.
    """
    store = uri if not isinstance(uri, str) else open_store(uri, s3_client)
    for step in committed_steps(store):
        try:
            return verified_manifest(store, step)
        except CheckpointInvalid as refused:
            log.warning("skipping checkpoint: %s", refused)
    return None


def retention_victims(
    committed: Mapping[int, bool], keep_last: int, protected: Iterable[int] = ()
) -> list[int]:
    """Step folders to delete, given {step: has a marker}.

    Committed steps beyond the `keep_last` newest go (0 keeps all), and so do uncommitted folders
    older than the newest commit: leftovers of a save that died, which nothing will finish.
    Nothing newer than the newest commit is touched (it may be a save in flight), nor `protected`.
    """
    newest_first = sorted((step for step, done in committed.items() if done), reverse=True)
    if not newest_first:
        return []
    kept = set(protected) | set(newest_first[:keep_last] if keep_last > 0 else newest_first)
    return sorted(step for step in committed if step < newest_first[0] and step not in kept)



def prune(store: Store, keep_last: int) -> None:
    """Apply retention to the location (retention_victims) after a commit."""
    saved = {step: is_committed(store, step) for step in saved_steps(store)}
    for step in retention_victims(saved, keep_last):
        log.info("retention: deleting %s/%s", store.uri, step_dir_name(step))
        delete_step(store, step)

# --- what a trainer decides with it (the real one and node/standin.py alike) -------------------

def resume_target(resume: str) -> str | int:
    """`"none"`, `"latest"`, or a step number, from the `resume` setting."""
    value = str(resume).strip()
    if value in ("none", "latest"):
        return value
    if value.isdigit():
        return int(value)
    raise ValueError(f"checkpoint resume={resume!r}: expected 'none', 'latest' or a step number")


def resume_point(store: Store, target: str | int, saves: Store | None = None) -> Manifest | None:
    """The checkpoint to resume from (None: start afresh), else CheckpointInvalid.

    "none" refuses a location that already holds a committed step; "latest" takes the newest
    committed checkpoint whose files match its manifest, skipping (and logging) broken ones; a
    step number takes that step or fails. Step folders newer than the one chosen belong to an
    abandoned timeline and are deleted from where the saves go (`saves`: `store` when None; another
    run's checkpoints are read, never changed), so that this run's saves never mix with them.
    """
    if target == "none":
        committed = committed_steps(store)
        if committed:
            raise CheckpointInvalid(f"checkpoint uri {store.uri} already holds committed step {committed[0]}; "
                                    "resume from it (resume=latest) or use an empty location")
        manifest = None
    elif target == "latest":
        manifest = latest_committed(store)
    else:
        try:
            manifest = verified_manifest(store, int(target))
        except CheckpointInvalid as exc:
            raise CheckpointInvalid(f"cannot resume from step {target}: {exc}") from exc
    forget_after(saves or store, manifest.step if manifest else None)
    return manifest


def forget_after(store: Store, step: int | None) -> None:
    """Delete the step folders newer than `step` (all of them for None): the world resumed at
    `step`, and they belong to an abandoned timeline that this run's saves must never mix with."""
    for saved in saved_steps(store):
        if step is None or saved > step:
            log.warning("deleting %s/%s: newer than the resume point", store.uri, step_dir_name(saved))
            delete_step(store, saved)


def commits_after(store: Store, step: int) -> list[int]:
    """Committed steps newer than `step`, newest first: whether a copy kept elsewhere at `step`
    is still the newest state."""
    return _markers(store, [saved for saved in saved_steps(store) if saved > step])


def save_reason(step: int, interval: int, *, requested: bool, final: bool) -> SaveReason | None:
    """Why `step` is saved, or None when it is not: asked for, the last step, or on the interval."""
    if requested:
        return SaveReason.REQUESTED
    if final:
        return SaveReason.FINAL
    if interval > 0 and step % interval == 0:
        return SaveReason.INTERVAL
    return None


class SaveRequests:
    """'Checkpoint now' requests: a signal, or a flag file that the node agent touches."""

    def __init__(self, request_file: str | os.PathLike | None, request_signal: int | None):
        self._file = Path(request_file) if request_file else None
        self._honoured_mtime = self._file_mtime()
        self._signalled = threading.Event()
        self._signal = request_signal
        self._previous_handler = None
        if request_signal is not None and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(request_signal, lambda *_: self._signalled.set())

    def _file_mtime(self) -> int | None:
        try:
            return self._file.stat().st_mtime_ns if self._file else None
        except FileNotFoundError:
            return None

    def pending(self) -> bool:
        """A signal arrived or the flag file was created or touched since the last save."""
        return self._signalled.is_set() or self._file_mtime() not in (None, self._honoured_mtime)

    def honoured(self) -> None:
        """The pending request is being served."""
        self._signalled.clear()
        self._honoured_mtime = self._file_mtime()

    def close(self) -> None:
        if self._previous_handler is not None:
            signal.signal(self._signal, self._previous_handler)
