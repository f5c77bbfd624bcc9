"""How often node agents heartbeat and look at the control plane, from a run's node count and
hang timeout: the rules RunSpec validation (contracts), the agent and Recover (lifecycle.liveness)
must agree on, so they live below both.

A hang is declared when the Train task's heartbeat stops for the hang timeout, and Recover then
asks which worker went silent. Two paces follow from that:

- the heartbeat: rank 0's agent beats HEARTBEATS_PER_HANG times per hang timeout (at most every
  HEARTBEAT_EVERY_S), so a healthy run misses a few beats (a slow step just after one, a throttled
  call) before Step Functions gives up on it;
- the looks: an agent looks (and writes its liveness record) every POLL_MIN_S-POLL_MAX_S seconds,
  drawn, slower in runs above FULL_RATE_NODES nodes, and faster where SILENT_LOOKS looks would not
  fit in the hang timeout less one heartbeat: a hang may be declared that long after the node
  froze (its last beat up to one pace before), and by then its agent must count as silent.

Every look is one read of the run record, so a run's agents read it nodes / (mean look interval)
times a second: at most READ_RATE_BOUND (FULL_RATE_NODES / 7.5 s) however large the run. A hang
timeout short enough to push a large run past that is refused (hang_timeout_problem).

Unless its trainer steps, every agent looks at the full rate whatever the run's size: between
attempts (it boots, waits for its first attempt, or its attempt ended), and while its trainer
starts, winds down or has stalled (no step for STALL_STEPS steps, at least STALL_MIN_S: a lost
peer blocks the world's collectives until the control plane moves the run on). What it waits for
then (the run's next attempt, its launch spec) is read at its next look, and a paced look of a
2,048-node run is 80 s, a recovery's lost minutes on every GPU. That is nodes / 7.5 reads a
second for the minutes of a start-up or a recovery (2,048 nodes: 273, about 550 RCU of the run
partition's 3,000 for a run record under 16 KB), while training keeps the bound. A world repaired
in place waits on no look: Recover confirms its survivors and the spares stepping in, and their
agents read the launch spec from S3 every LAUNCH_SPEC_POLL_S.

A world that trains keeps a cadence, and each agent knows its own trainer's: a world silent for
HANG_STEPS of its recent median step time (never less than the run's stall floor) has hung, and
the agent says so at once (hung_after) rather than waiting out the hang timeout, which must stay
long enough for a start-up, a large checkpoint's save and NCCL's own collective timeout. At a
failure every three hours on 16,384 GPUs, a 600 s timeout alone would spend more than the whole
loss a 0.99 goodput allows per failure. The cadence is trusted only after CADENCE_STEPS_KNOWN
steps of an attempt: its start-up (imports, the rendezvous, NCCL set-up, a checkpoint load) and
first steps (the allocator's first growth, compilation) are judged by the startup timeout.
"""

import statistics
from collections.abc import Collection
from datetime import timedelta
from itertools import count

POLL_MIN_S = 5.0
"""Least time between two looks of one agent at the control plane (with a long hang timeout)."""
POLL_MAX_S = 10.0
"""Most time between two looks, in runs up to FULL_RATE_NODES nodes (with a long hang timeout)."""
FULL_RATE_NODES = 256
"""Above this many nodes every agent looks proportionally less often: the run's read rate stays
bounded."""
SILENT_LOOKS = 3
"""Looks an agent may miss before it counts as silent."""
READ_RATE_BOUND = FULL_RATE_NODES / ((POLL_MIN_S + POLL_MAX_S) / 2)
"""Most reads of the run record a second by one run's agents (about 34)."""
HEARTBEAT_EVERY_S = 5.0
"""Least time between two SendTaskHeartbeat calls with a long hang timeout (a step may take
milliseconds)."""
HEARTBEATS_PER_HANG = 4
"""Heartbeats per hang timeout when it is short: a healthy run never times out on a late one."""
HANG_TIMEOUT_MIN_S = 5
"""Shortest hang timeout a RunSpec may ask for."""
STALL_STEPS = 3
"""Steps' time without a step after which a trainer counts as stalled."""
STALL_MIN_S = 10.0
"""Least time without a step for a trainer to count as stalled (a checkpoint save blocks a step)."""
HANG_STEPS = 5
"""Median step times of silence after which a world that was stepping has hung."""
CADENCE_STEPS_KNOWN = 3
"""Steps of an attempt timed before its cadence is trusted."""
LAUNCH_SPEC_POLL_S = 1.0
"""How often the agents a world repaired in place waits for (its survivors', its joining nodes')
and the idle agents of a training run (its READY spares) read the launch spec from S3, rather
than at their next look: a repair waits on no look. One GET of one object: 2,048 nodes make 2,048
a second for the seconds a repair takes, within the 5,500 S3 serves on a prefix; a training
run's spares (2 %: 41 of 2,048) make 41 a second while it trains."""
CADENCE_WINDOW = 20
"""The most recent step times whose median is the cadence: one slow step (a save, a fetch) in it
moves the median little."""


def _slowdown(nodes: int) -> float:
    return max(1.0, nodes / FULL_RATE_NODES)


def heartbeat_pace(hang_timeout_s: float) -> float:
    """Seconds between two heartbeats of the Train task."""
    return min(HEARTBEAT_EVERY_S, hang_timeout_s / HEARTBEATS_PER_HANG)


def longest_look(nodes: int, hang_timeout_s: float) -> float:
    """Most seconds between two looks of one agent of a run of `nodes` nodes."""
    fits = (hang_timeout_s - heartbeat_pace(hang_timeout_s)) / SILENT_LOOKS
    return min(POLL_MAX_S * _slowdown(nodes), fits)


def poll_interval(nodes: int, draw: float, hang_timeout_s: float, stepping: bool = True) -> float:
    """Seconds until an agent's next look; draw in [0, 1) from the caller. Drawn between half the
    longest look and the longest, so a fleet's looks spread out. `stepping`: the agent's trainer
    steps (False: the full rate, see above)."""
    if not 0 <= draw < 1:
        raise ValueError(f"draw must be in [0, 1), got {draw}")
    longest = longest_look(nodes if stepping else min(nodes, FULL_RATE_NODES), hang_timeout_s)
    return longest * (POLL_MIN_S + (POLL_MAX_S - POLL_MIN_S) * draw) / POLL_MAX_S


def stall_after(step_seconds: float | None) -> float:
    """Seconds without a step after which a trainer at steps of `step_seconds` (None: not known
    yet) has stalled."""
    return max(STALL_MIN_S, STALL_STEPS * (step_seconds or 0.0))


def stalled(seconds_since_step: float, step_seconds: float | None) -> bool:
    """Whether a trainer whose last step came `seconds_since_step` ago has stalled."""
    return seconds_since_step > stall_after(step_seconds)


def hung_after(step_seconds: Collection[float], floor_s: float) -> float | None:
    """Seconds without a sign of life after which a world whose recent steps took `step_seconds`
    (oldest first) has hung: HANG_STEPS times their median, at least `floor_s`. None while fewer
    than CADENCE_STEPS_KNOWN steps are timed: the cadence is not known yet."""
    if len(step_seconds) < CADENCE_STEPS_KNOWN:
        return None
    return max(floor_s, HANG_STEPS * statistics.median(list(step_seconds)[-CADENCE_WINDOW:]))


def looks_per_second(nodes: int, hang_timeout_s: float) -> float:
    """Mean looks a second of a run's agents together (each one read of the run record)."""
    return nodes / (longest_look(nodes, hang_timeout_s) * (POLL_MIN_S + POLL_MAX_S) / 2 / POLL_MAX_S)


def silent_after(nodes: int, hang_timeout_s: float) -> timedelta:
    """How long without a liveness report before an agent counts as silent: SILENT_LOOKS of its
    longest looks, which is never more than the hang timeout less one heartbeat."""
    return timedelta(seconds=SILENT_LOOKS * longest_look(nodes, hang_timeout_s))


def least_hang_timeout(nodes: int) -> int:
    """The shortest whole hang timeout at which a run of `nodes` nodes reads within READ_RATE_BOUND."""
    return next(seconds for seconds in count(HANG_TIMEOUT_MIN_S) if _within_bound(nodes, seconds))


def _within_bound(nodes: int, hang_timeout_s: float) -> bool:
    # Above FULL_RATE_NODES the rate is the bound itself: floating point must not refuse it.
    return looks_per_second(nodes, hang_timeout_s) <= READ_RATE_BOUND * (1 + 1e-9)


def hang_timeout_problem(nodes: int, hang_timeout_s: float) -> str | None:
    """Why a run of `nodes` nodes (workers and spares) cannot have this hang timeout, or None."""
    if _within_bound(nodes, hang_timeout_s):
        return None
    return (f"recovery.hang_timeout_seconds={hang_timeout_s:g} is too short for {nodes} nodes (node_count + "
            f"spare_count): their agents would read the run record {looks_per_second(nodes, hang_timeout_s):.0f} "
            f"times a second to tell a silent one in time, at most {READ_RATE_BOUND:.0f} are allowed; give at "
            f"least {least_hang_timeout(nodes)} s")
