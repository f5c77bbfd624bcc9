"""What the node agent's torchrun starts for each rank: trainer.train, bound to torchrun's life.

    torchrun ... -m trainer.worker --config FILE [--section.field=value ...]

torchrun starts every rank in a session of its own, so when a node's agent and torchrun are
killed outright (an instance lost in the local cloud, the OOM killer) the ranks would live on
without a world, holding memory and ports. The kernel is asked to SIGKILL this process when its
parent dies (PR_SET_PDEATHSIG, Linux); from then on it is exactly trainer.train.
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        sys.exit("torchrun exited before this rank started")


if __name__ == "__main__":
    die_with_parent()
    from trainer.train import main

    sys.exit(main())
