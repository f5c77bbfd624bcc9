"""The errors the handlers raise for the state machine's Retry and Catch to match.

A Lambda error reaches Step Functions under its exception class name;
statemachine/training_run.asl.json matches on these. (Failures the event handler reports
through SendTaskFailure use trainfleet.core.records.FAILURE_ERROR.)
"""

__all__ = ["InvalidRunSpec", "RecoveryGaveUp", "CapacityUnavailable", "TransientError", "ReapIncomplete",
           "NodeNotRecordedYet"]


class InvalidRunSpec(ValueError):
    """The execution input is not a valid RunSpec; the message has one `field: problem` line
    per problem. Nothing has been allocated when this is raised."""


class RecoveryGaveUp(RuntimeError):
    """Recover decided to stop (restart budget spent, crash loop, unrecoverable failure); the
    message is the decision's reason."""


class CapacityUnavailable(RuntimeError):
    """No subnet could launch the instances needed now (InsufficientInstanceCapacity and
    kin); the state machine retries with backoff. Allocate's message lists each zone's errors;
    Recover's is a FailureReport (JSON) of the attempt that came up short, for the Recover
    that catches it."""


class TransientError(RuntimeError):
    """An AWS call was throttled, answered 5xx or timed out, or the endpoint could not be
    reached, and the client's own retries did not outlast it; the state machine retries the
    task with backoff instead of ending the run. The message names the call's error."""


class ReapIncomplete(RuntimeError):
    """The reaper could not tear down some runs this time (the message names each and why);
    it tore down the others, and its next sweep tries these again."""


class NodeNotRecordedYet(RuntimeError):
    """An AWS event names an instance this stack launched whose node record is not visible yet
    (Allocate or Recover records it just after the launch): the invocation fails, so Lambda
    tries the event again later instead of dropping it as another account's instance."""
