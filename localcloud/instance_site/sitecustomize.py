"""What the local cloud does to an instance's network, as its trainer feels it.

The local fleet puts this folder on the PYTHONPATH of every instance, so Python imports this
module at the start of each of the instance's processes. Instances talk over loopback, where
no link is slower than another; `LocalFleet.slow_network` writes a delay into the file named by
LOCALCLOUD_NETWORK_DELAY_FILE, and from then on every torch.distributed transfer of the
instance's processes (point-to-point and collective) waits that long before it starts: a node
whose network is slow, as netem's delay would make it, while its agent's calls to the control
plane go on as before. The variable and the file are read at each transfer (a warm image's
processes imported torch before they were an instance's); without them nothing waits.
"""

import functools
import importlib.abc
import importlib.util
import os
import sys
import time

DELAY_FILE_VARIABLE = "LOCALCLOUD_NETWORK_DELAY_FILE"
TRANSFERS = ("send", "recv", "isend", "irecv", "all_reduce", "all_gather", "all_gather_object", "broadcast",
             "broadcast_object_list", "reduce_scatter_tensor", "all_gather_into_tensor", "barrier")


def delay_s() -> float:
    delay_file = os.environ.get(DELAY_FILE_VARIABLE)
    if not delay_file:
        return 0.0
    try:
        with open(delay_file) as delay:
            return float(delay.read() or 0)
    except (OSError, ValueError):
        return 0.0


def delayed(transfer):
    @functools.wraps(transfer)
    def wait_then_transfer(*args, **kwargs):
        wait = delay_s()
        if wait:
            time.sleep(wait)
        return transfer(*args, **kwargs)
    return wait_then_transfer


class SlowNetworkFinder(importlib.abc.MetaPathFinder):
    """Wraps the transfers of torch.distributed's c10d module as it is imported, before
    torch.distributed re-exports them: every caller, and torch's own checks of which function
    an operation names (P2POp's), see the same wrapped function."""

    MODULE = "torch.distributed.distributed_c10d"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            for name in TRANSFERS:
                if hasattr(module, name):
                    setattr(module, name, delayed(getattr(module, name)))

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, SlowNetworkFinder())
