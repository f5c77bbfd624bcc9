"""torchrun (torch.distributed.run) as the node runs it: `python -m node.torchrun ARGS`, the
same arguments, the same launcher, with three changes.

torch's c10d rendezvous names the method behind each of its events with `get_method_name`, which
calls `inspect.stack()` twice. That resolves the source file of every frame on the stack, and for
a frame without one (runpy's `<frozen runpy>`, under every `python -m`) `inspect.getmodule` walks
all of `sys.modules` (over 2,000 entries once torch is imported). It runs on each rendezvous sync
(once a second while a node waits for its peers, a survivor for its replacement) and each
keep-alive (every 5 s while training), whether or not anything records the event: on the local
cloud's chaos cells, a fifth of all the CPU they used. `caller_name` gives the same name from the
frame itself.

When its workers are done, torchrun waits (for up to 300 s) at an exit barrier until every node's
torchrun of its rendezvous checked in: the rendezvous store lives in node rank 0's torchrun, and
it must not go while another node's torchrun still reads it. In a world repaired in place
(trainer/repair.py) the lost nodes' torchrun never checks in (their replacements run their own),
so every survivor waited out the 300 s after the last step. `exit_barrier` waits for the nodes
still there: the order the agent wrote says how many of the launched world are gone. The order
can come while a node already waits there: a world that trained its last step while the control
plane repaired it (a Spot notice near the end: the world trains on until the leaving node is
terminated) reached the barrier before its agent wrote the order, and waited out the 300 s for
the node that had left. So the barrier reads the order again every EXIT_BARRIER_LOOK_S.

The workers' own store (the rendezvous store is not shared with them: node.trainer_process) listens
on a port node rank 0's torchrun picks. torch picks it by binding port 0 and closing the socket, so
the port goes back to the kernel's ephemeral range, and any process's outgoing connection may be
given it before rank 0 binds it (EADDRINUSE, and the attempt fails). `trainer.local_ports` draws it
below that range instead, where the kernel hands out no port.
"""

import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

from torch.distributed import DistError, DistStoreError
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID, SimpleElasticAgent
from torch.distributed.elastic.rendezvous import api as rendezvous_api
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.utils.store import _LAST_MEMBER_CHECKIN, _NUM_MEMBERS
from torch.distributed.run import main

from trainer.local_ports import free_port
from trainer.repair_order import REPAIR_ORDER_ENV, read_order

log = logging.getLogger(__name__)

EXIT_BARRIER_LOOK_S = 2.0
"""How often a node waiting at the exit barrier reads the repair order again (each wait that
ends unanswered logs two lines of c10d's)."""


def caller_name(depth: int = 2) -> str:
    """What `dynamic_rendezvous.get_method_name(depth)` returns: the name of the function `depth`
    frames above this call (1: the caller)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def nodes_gone() -> int:
    """How many of the launched world's nodes the repair order says are gone (0 without one)."""
    order = read_order(Path(os.environ[REPAIR_ORDER_ENV])) if REPAIR_ORDER_ENV in os.environ else None
    return order.launch_nodes_gone if order is not None else 0


def exit_barrier(agent: SimpleElasticAgent) -> None:
    """torch's exit barrier (each node's torchrun adds itself to a count in the rendezvous store,
    and the one that makes it whole sets the key the others wait on), counting only the launched
    world's nodes still there, as the order says now. Like torch's, it gives up after the agent's
    exit barrier timeout with the error logged, and torchrun exits as it would have."""
    store, world = agent._store, agent._worker_group.group_world_size  # noqa: SLF001 (what torch's barrier reads)
    members, last = _TERMINAL_STATE_SYNC_ID + _NUM_MEMBERS, _TERMINAL_STATE_SYNC_ID + _LAST_MEMBER_CHECKIN
    started = time.monotonic()
    agent._in_exit_barrier = True  # noqa: SLF001 (torch's health check: the workers' silence is no hang now)
    try:
        checked_in = store.add(members, 1)
        while checked_in < world - nodes_gone():
            try:
                store.wait([last], timedelta(seconds=EXIT_BARRIER_LOOK_S))
                return
            except DistStoreError:  # not made whole within the look: read the order again
                if time.monotonic() - started > agent._exit_barrier_timeout:  # noqa: SLF001
                    raise
            checked_in = store.add(members, 0)
        store.set(last, "<val_ignored>")
    except DistError:
        log.exception("Error waiting on exit barrier. Elapsed: %.0f seconds", time.monotonic() - started)
    finally:
        agent._in_exit_barrier = False  # noqa: SLF001


if __name__ == "__main__":
    dynamic_rendezvous.get_method_name = caller_name
    SimpleElasticAgent._exit_barrier = exit_barrier
    rendezvous_api.get_free_port = free_port
    main()
