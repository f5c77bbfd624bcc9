"""torchrun (torch.distributed.run) as the node runs it: `python -m node.torchrun ARGS`, the
same arguments, the same launcher, with one change.

torch's c10d rendezvous names the method behind each of its events with `get_method_name`, which
calls `inspect.stack()` twice. That resolves the source file of every frame on the stack, and for
a frame without one (runpy's `<frozen runpy>`, under every `python -m`) `inspect.getmodule` walks
all of `sys.modules` (over 2,000 entries once torch is imported). It runs on each rendezvous sync
(once a second while a node waits for its peers, a survivor for its replacement) and each
keep-alive (every 5 s while training), whether or not anything records the event: on the local
cloud's chaos cells, a fifth of all the CPU they used. `caller_name` gives the same name from the
frame itself.
"""

import sys

from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.run import main


def caller_name(depth: int = 2) -> str:
    """What `dynamic_rendezvous.get_method_name(depth)` returns: the name of the function `depth`
    frames above this call (1: the caller)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


if __name__ == "__main__":
    dynamic_rendezvous.get_method_name = caller_name
    main()
