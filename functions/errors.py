"""The errors the state machine's Retry and Catch name.

A Lambda error reaches Step Functions under its exception class name, and SendTaskFailure
sends its `error` string; statemachine/training_run.asl.json matches on both. A test checks
that every ErrorEquals name there is one of these classes (or one AWS defines).
"""

from __future__ import annotations

import json
from typing import Any

from trainfleet.contracts import FailureClass

__all__ = ["InvalidRunSpec", "RunInterrupted", "RecoveryGaveUp"]


class InvalidRunSpec(ValueError):
    """The execution input is not a valid RunSpec; the message has one `field: problem` line
    per problem. Nothing has been allocated when this is raised."""


class RecoveryGaveUp(RuntimeError):
    """Recover decided to stop (restart budget spent, crash loop, unrecoverable failure)."""


class RunInterrupted(Exception):
    """A failure the run may recover from: the event handler fails the AwaitNodes or Train
    task token with this name, and its cause (JSON) says what happened, so Recover can
    classify it without another lookup."""

    def __init__(self, failure_class: FailureClass, reason: str, instance_ids: list[str],
                 attempt: int):
        super().__init__(reason)
        self.failure_class = failure_class
        self.reason = reason
        self.instance_ids = instance_ids
        self.attempt = attempt

    def cause(self) -> str:
        """The SendTaskFailure cause: what Recover reads back with `from_cause`."""
        return json.dumps({"failure_class": self.failure_class.value, "reason": self.reason,
                           "instance_ids": self.instance_ids, "attempt": self.attempt})

    @classmethod
    def from_cause(cls, cause: str) -> RunInterrupted:
        fields: dict[str, Any] = json.loads(cause)
        return cls(FailureClass(fields["failure_class"]), fields["reason"],
                   list(fields["instance_ids"]), int(fields["attempt"]))
