"""A port on this machine for a server a process is about to start (a process group's store, a
local endpoint): the tests', the benches' and the trainer demo's one way to choose it.

A port found free by binding port 0 comes from the kernel's ephemeral range, and is handed back to
that range when the probe closes: before the server binds it, any process's outgoing connection
may be given it (EADDRINUSE, seen whenever the machine is busy with the suite's other workers).
Ports below the ephemeral range are never handed out by the kernel, so a port drawn there at
random and found free stays free unless another process draws the same one in that moment.
"""

import random
import socket

__all__ = ["free_port"]

DRAWN = range(20_000, 29_400)
"""Above the registered services' usual ports, below torchrun's rendezvous port 29400 (and the
local instances' 500 from it, trainfleet.core.records.RENDEZVOUS_PORTS)."""
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(EPHEMERAL_RANGE) as limits:
            return int(limits.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` that nothing listens on, outside the kernel's ephemeral range."""
    candidates = [port for port in DRAWN if port < _ephemeral_start()]
    for port in random.SystemRandom().sample(candidates, len(candidates)):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} among the {len(candidates)} drawn from, below the ephemeral range")
