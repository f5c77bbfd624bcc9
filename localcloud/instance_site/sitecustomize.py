"""What the local cloud does to an instance's network, as its processes feel it.

The local fleet puts this folder on the PYTHONPATH of every instance, so Python imports this
module at the start of each of the instance's processes. It does four things, each read from the
environment at the moment it acts (a warm image's processes imported torch before they were an
instance's); a process without the variables runs unchanged.

- A slow network. Instances talk over loopback, where no link is slower than another;
  `LocalFleet.slow_network` writes a delay into the file named by LOCALCLOUD_NETWORK_DELAY_FILE,
  and from then on every torch.distributed transfer of the instance's processes (point-to-point
  and collective) waits that long before it starts: a node whose network is slow, as netem's
  delay would make it, while its agent's calls to the control plane go on as before.
- Ports of its own. On EC2 each node has its own network stack, so two runs' rendezvous hosts
  may listen on the same port. Here every instance shares this machine's, and torch's TCPStore
  listens on every address: the second of two local runs whose attempts drew the same port (one
  in RENDEZVOUS_PORTS' 500) failed to host its rendezvous (EADDRINUSE, torchrun's "connection to
  the C10d store has failed") where EC2 would have run both. The c10d rendezvous store an
  instance hosts at its own address (LOCALCLOUD_PRIVATE_IP) listens on that address alone.
- Its own address. A host's packets carry its address; here every instance's processes share the
  machine's, so a TCP connection an instance's process opens to a loopback address is sent from
  the instance's (bound to it before connecting), and the local cloud knows which instance a
  request comes from (localcloud/glue/routes.py).
- Routes. A request the instance's network cannot carry is answered UNREACHABLE_HEADER by the
  local cloud; the AWS SDK (botocore's HTTP session) then fails it as a dropped packet fails it on
  EC2: a connect timeout (ConnectTimeoutError), after the client's connect timeout.
"""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import sys
import time

DELAY_FILE_VARIABLE = "LOCALCLOUD_NETWORK_DELAY_FILE"
ADDRESS_VARIABLE = "LOCALCLOUD_PRIVATE_IP"
TRANSFERS = ("send", "recv", "isend", "irecv", "all_reduce", "all_gather", "all_gather_object", "broadcast",
             "broadcast_object_list", "reduce_scatter_tensor", "all_gather_into_tensor", "barrier")
LISTEN_BACKLOG = 4096
UNREACHABLE_HEADER = "x-localcloud-unreachable"
"""localcloud.glue.routes.UNREACHABLE_HEADER (this module imports nothing of the local cloud)."""


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


def slow_transfers(module) -> None:
    for name in TRANSFERS:
        if hasattr(module, name):
            setattr(module, name, delayed(getattr(module, name)))


def listening_on_own_address(store_class):
    """`store_class` (TCPStore) whose server, hosted at the instance's own address, is handed a
    socket listening on that address alone (TCPStore's master_listen_fd) instead of binding all."""
    @functools.wraps(store_class)
    def store(host, port, *args, is_master=False, **kwargs):
        address = os.environ.get(ADDRESS_VARIABLE)
        if is_master and host == address and port and kwargs.get("master_listen_fd") is None:
            listener = socket.socket()
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((address, port))
                listener.listen(LISTEN_BACKLOG)
            except OSError:
                listener.close()  # taken on this address too: TCPStore fails as it would on EC2
            else:
                kwargs["master_listen_fd"] = listener.detach()
        return store_class(host, port, *args, is_master=is_master, **kwargs)
    return store


def own_ports(module) -> None:
    module.TCPStore = listening_on_own_address(module.TCPStore)


def from_own_address(connect):
    """`connect` of a socket that, being an instance's TCP socket to a loopback address not yet
    bound, is bound to the instance's address first."""
    @functools.wraps(connect)
    def connect_from_own_address(sock, address):
        own = os.environ.get(ADDRESS_VARIABLE)
        if (own and sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM and isinstance(address, tuple)
                and str(address[0]).startswith("127.") and sock.getsockname() == ("0.0.0.0", 0)):
            sock.bind((own, 0))
        return connect(sock, address)
    return connect_from_own_address


def unreachable_times_out(module):
    """botocore's HTTP session: an answer saying no route leads there becomes the connect timeout
    a dropped packet gives, after the session's connect timeout."""
    send = module.URLLib3Session.send

    @functools.wraps(send)
    def send_or_time_out(self, request):
        response = send(self, request)
        why = response.headers.get(UNREACHABLE_HEADER)
        if why is None:
            return response
        timeout = self._timeout
        time.sleep(getattr(timeout, "connect_timeout", timeout))
        from botocore.exceptions import ConnectTimeoutError
        raise ConnectTimeoutError(endpoint_url=request.url, error=f"no route from this instance: {why}")

    module.URLLib3Session.send = send_or_time_out


socket.socket.connect = from_own_address(socket.socket.connect)
socket.socket.connect_ex = from_own_address(socket.socket.connect_ex)


class InstanceNetworkFinder(importlib.abc.MetaPathFinder):
    """Changes modules as they are imported, before anything imports names from them: botocore's
    HTTP session; c10d's transfers (torch.distributed re-exports them, so every caller, and torch's
    own checks of which function an operation names (P2POp's), see the same wrapped function), and
    the store the c10d rendezvous backend creates."""

    CHANGES = {"torch.distributed.distributed_c10d": slow_transfers,
               "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend": own_ports,
               "botocore.httpsession": unreachable_times_out}

    def find_spec(self, fullname, path, target=None):
        change = self.CHANGES.get(fullname)
        if change is None:
            return None
        # Back in its own place, not first: a finder ahead of it (a later sitecustomize's, such as
        # the test world's NCCL rules) wraps a module after this one has changed it, whichever of
        # the modules is imported first (the AWS SDK's comes before torch's in a node's processes).
        place = sys.meta_path.index(self)
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(place, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            change(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, InstanceNetworkFinder())


def run_next_sitecustomize() -> None:
    """The sitecustomize that this one hides, if any: the first in a folder after this one's."""
    here = os.path.dirname(os.path.abspath(__file__))
    folders = [os.path.abspath(folder or os.getcwd()) for folder in sys.path]
    later = folders[folders.index(here) + 1:] if here in folders else []
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", later)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


run_next_sitecustomize()
