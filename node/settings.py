"""The node agent's settings: what the user data gives it, and the paces it keeps."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from trainfleet.core.runspec import HOST_MEMORY_DIR

LOOK_S = 0.5
"""How often the agent looks at what is on the node: the trainer's files."""
METADATA_LOOK_S = 5.0
"""How often the agent asks the metadata service for a Spot notice: every 5 s, as AWS recommends
(the notice comes two minutes ahead). TRAINFLEET_METADATA_LOOK_S sets another pace: the local
cloud's notices are as much shorter as its time is scaled."""
UNREACHABLE_LIMIT_S = 900.0
"""No AWS service answered for this long, and the node's trainer silent as long (the node is cut
off), or the stack's resources gone as long: nothing can tell the agent its run is over, so it
ends its instance rather than leave it running unwatched."""


class AgentError(RuntimeError):
    """The agent cannot go on (a missing setting, an unreachable metadata service)."""


@dataclass(frozen=True)
class AgentSettings:
    """What the user data gives the agent."""

    run_name: str
    """The run this instance belongs to (TRAINFLEET_RUN_NAME)."""
    run_table: str
    """DynamoDB table of run and node records (TRAINFLEET_RUN_TABLE)."""
    liveness_table: str
    """DynamoDB table the agent writes its liveness record to (TRAINFLEET_LIVENESS_TABLE)."""
    bucket: str
    """The stack's bucket: launch specs and checkpoints (TRAINFLEET_BUCKET)."""
    event_bus: str
    """The agents' EventBridge bus (TRAINFLEET_EVENT_BUS)."""
    workdir: Path
    """Where attempts keep their config, output and metrics (the working directory)."""
    lifetime_s: float | None
    """Exit after this many seconds (TRAINFLEET_AGENT_LIFETIME_S); None = run until terminated.
    Local runs set it so that no agent outlives its test or demo."""
    shutdown_command: tuple[str, ...] = ()
    """How the agent ends its instance when the run is over (TRAINFLEET_SHUTDOWN_COMMAND, e.g.
    "systemctl poweroff"); empty: the agent exits, which ends a local instance."""
    standin_step_s: float | None = None
    """Seconds a step of the stand-in trainer takes (TRAINFLEET_STANDIN_STEP_S); set, the agent
    runs node/standin.py instead of torchrun and a stand-in preflight: no torch on the node,
    the same signals to the control plane. None: the real trainer."""
    metadata_look_s: float = METADATA_LOOK_S
    """Seconds between two looks for a Spot notice (TRAINFLEET_METADATA_LOOK_S)."""
    unreachable_limit_s: float = UNREACHABLE_LIMIT_S
    """How long the control plane may be out of reach, with the trainer silent as long, before
    the agent ends its instance (TRAINFLEET_UNREACHABLE_LIMIT_S; bench/outage.py sets it lower)."""
    log_group: str | None = None
    """The CloudWatch Logs group the node's log goes to (TRAINFLEET_NODE_LOG_GROUP,
    node/node_log.py); None: the console alone."""
    host_memory_dir: Path = Path(HOST_MEMORY_DIR)
    """The node's host-memory folder, under the node's filesystem root (TRAINFLEET_ROOT, unset on
    EC2: a local instance's own folder): the trainer keeps its in-memory checkpoints under
    RUN_NAME in it (trainer/memory_checkpoint.py)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | os._Environ = os.environ, workdir: Path | None = None) -> AgentSettings:
        names = {"run_name": "TRAINFLEET_RUN_NAME", "run_table": "TRAINFLEET_RUN_TABLE",
                 "liveness_table": "TRAINFLEET_LIVENESS_TABLE", "bucket": "TRAINFLEET_BUCKET",
                 "event_bus": "TRAINFLEET_EVENT_BUS"}
        missing = [variable for variable in names.values() if not env.get(variable)]
        if missing:
            raise AgentError(f"missing environment variable(s): {', '.join(missing)}")
        return cls(**{field: env[variable] for field, variable in names.items()},
                   workdir=workdir or Path.cwd(), lifetime_s=_seconds(env, "TRAINFLEET_AGENT_LIFETIME_S"),
                   shutdown_command=tuple(shlex.split(env.get("TRAINFLEET_SHUTDOWN_COMMAND", ""))),
                   standin_step_s=_seconds(env, "TRAINFLEET_STANDIN_STEP_S"),
                   metadata_look_s=_seconds(env, "TRAINFLEET_METADATA_LOOK_S") or METADATA_LOOK_S,
                   unreachable_limit_s=_seconds(env, "TRAINFLEET_UNREACHABLE_LIMIT_S") or UNREACHABLE_LIMIT_S,
                   log_group=env.get("TRAINFLEET_NODE_LOG_GROUP") or None,
                   host_memory_dir=Path(env.get("TRAINFLEET_ROOT") or "/", HOST_MEMORY_DIR.lstrip("/")))


def _seconds(env: dict[str, str] | os._Environ, variable: str) -> float | None:
    """A positive number of seconds from the environment, None when unset."""
    raw = env.get(variable)
    try:
        seconds = float(raw) if raw else None
    except ValueError:
        seconds = -1.0
    if seconds is not None and seconds <= 0:
        raise AgentError(f"{variable} must be a positive number of seconds, got {raw!r}")
    return seconds
