"""torchrun (torch.distributed.run) as the node runs it: `python -m node.torchrun ARGS`, the
same arguments, the same launcher, with two changes.

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
still there: the order the agent wrote says how many of the launched world are gone.
"""

import os
import sys
from pathlib import Path

from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.run import main

from trainer.repair_order import REPAIR_ORDER_ENV, read_order

torch_exit_barrier = SimpleElasticAgent._exit_barrier


def caller_name(depth: int = 2) -> str:
    """What `dynamic_rendezvous.get_method_name(depth)` returns: the name of the function `depth`
    frames above this call (1: the caller)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def exit_barrier(agent: SimpleElasticAgent) -> None:
    """torch's exit barrier, counting only the launched world's nodes that are still there."""
    order = read_order(Path(os.environ[REPAIR_ORDER_ENV])) if REPAIR_ORDER_ENV in os.environ else None
    if order is not None:
        agent._worker_group.group_world_size -= order.launch_nodes_gone  # noqa: SLF001 (the barrier's count)
    torch_exit_barrier(agent)


if __name__ == "__main__":
    dynamic_rendezvous.get_method_name = caller_name
    SimpleElasticAgent._exit_barrier = exit_barrier
    main()
