"""S3 checkpoint catalogue for the control plane: the resume point, by the trainer's own protocol.

The commit protocol (step-NNNNNNNNN/ folders, commit.json written last, files checked against it)
is defined once, in trainer/checkpoint_catalog.py, which imports only boto3 and the standard
library; this module turns its answers into the contracts' CheckpointRef.

    latest_checkpoint(s3, "s3://bucket/runs/r1/checkpoints") -> CheckpointRef | None
    resume_checkpoint(s3, spec) -> CheckpointRef | None      the run's own newest, else the newest
                                                             of the run it resumes (spec.resume_from)
    verify_checkpoint(s3, uri, step) -> CheckpointRef        (CheckpointInvalid if not whole)
"""

from datetime import datetime
from typing import Any

from trainer.checkpoint_catalog import (CheckpointInvalid, Manifest, latest_committed, open_store,
                                        step_dir_name, verified_manifest)
from trainfleet.core.records import CheckpointRef
from trainfleet.core.runspec import RunSpec

__all__ = ["latest_checkpoint", "resume_checkpoint", "verify_checkpoint", "CheckpointInvalid"]


def _ref(uri: str, manifest: Manifest) -> CheckpointRef:
    return CheckpointRef(step=manifest.step, uri=f"{uri.rstrip('/')}/{step_dir_name(manifest.step)}",
                         committed_at=datetime.fromisoformat(manifest.committed_at))


def latest_checkpoint(s3: Any, checkpoint_uri: str) -> CheckpointRef | None:
    """The newest committed, whole checkpoint under `checkpoint_uri`, or None (start fresh)."""
    manifest = latest_committed(checkpoint_uri, s3)
    return _ref(checkpoint_uri, manifest) if manifest else None


def resume_checkpoint(s3: Any, spec: RunSpec) -> CheckpointRef | None:
    """Where the run's next attempt resumes: its own newest committed checkpoint; before it has
    one, the newest of the run it resumes (RunSpec.resume_from); None: from scratch."""
    own = latest_checkpoint(s3, spec.checkpoint.s3_uri)
    if own is not None or spec.resume_from_uri is None:
        return own
    return latest_checkpoint(s3, spec.resume_from_uri)


def verify_checkpoint(s3: Any, checkpoint_uri: str, step: int) -> CheckpointRef:
    """Check an agent's CheckpointCommitted claim against S3 before the run records it."""
    return _ref(checkpoint_uri, verified_manifest(open_store(checkpoint_uri, s3), step))
