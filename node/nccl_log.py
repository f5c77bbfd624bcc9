"""What NCCL's log (NCCL_DEBUG=INFO) says about the network NCCL chose, and the preflight check
that holds it to EFA (node/health.py runs NCCL and reads its log with these)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainfleet.core.events import HealthCheckResult

OFI_NETWORKS = ("Libfabric", "AWS Libfabric")
"""The names aws-ofi-nccl registers with NCCL: "AWS Libfabric" before 1.13, "Libfabric" since."""


@dataclass(frozen=True)
class NcclLog:
    """What an NCCL_DEBUG=INFO log says about the network NCCL chose."""

    networks: tuple[str, ...]
    """Each distinct network NCCL used, in order ("Using network X", one per communicator)."""
    plugin: str | None
    """The aws-ofi-nccl plugin that started ("NET/OFI Initializing aws-ofi-nccl 1.16.2"), if any."""
    provider: str | None
    """The libfabric provider the plugin selected ("efa"), if it got that far."""
    why_no_plugin: str | None
    """NCCL's own line on why it loaded no network plugin (libnccl-net.so not found, not loadable)."""
    plugin_notes: tuple[str, ...]
    """The plugin's lines after its start that say what went wrong (no provider, a failed init)."""


# Message texts as NCCL and aws-ofi-nccl print them, after "NCCL INFO " or "NCCL WARN ".
_USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
_PLUGIN_START = re.compile(r"NET/OFI (?:Initializing|Using) (aws-ofi-nccl \S+)")
# "Selected Provider is efa (found 4 nics)" before aws-ofi-nccl 1.15, "Selected provider is efa,
# fabric is efa (found 1 nics)" since.
_PROVIDER = re.compile(r"NET/OFI Selected provider is ([\w.-]+)", re.IGNORECASE)
# "NET/Plugin : No plugin found (libnccl-net.so), using internal implementation" (NCCL 2.18 and
# before), "NET/Plugin: No plugin found (libnccl-net.so)" (2.19 on), "... Could not find: ..." and
# "... Plugin load returned 2 : <dlerror>" when it is there but cannot be loaded.
_NO_PLUGIN = re.compile(r"NET/Plugin ?: ?(?:No plugin found|Could not find|Plugin load returned).*")
_PLUGIN_TROUBLE = re.compile(r"NET/OFI (?:No eligible providers.*|.*(?:[Ff]ailed|[Cc]ouldn't|[Uu]nable).*)"
                             r"|Failed to initialize NET plugin .*")


def parse_nccl_log(log: str) -> NcclLog:
    """The network facts of an NCCL_DEBUG=INFO log; lines of anything else are ignored."""
    networks: list[str] = []
    plugin = provider = why_no_plugin = None
    notes: list[str] = []
    for line in log.splitlines():
        if found := _USING_NETWORK.search(line):
            if found[1] not in networks:
                networks.append(found[1])
        elif found := _PLUGIN_START.search(line):
            plugin = plugin or found[1]
        elif found := _PROVIDER.search(line):
            provider = provider or found[1]
        elif found := _NO_PLUGIN.search(line):
            why_no_plugin = why_no_plugin or found[0].rstrip(".")
        elif found := _PLUGIN_TROUBLE.search(line):
            notes.append(found[0].rstrip("."))
    return NcclLog(networks=tuple(networks), plugin=plugin, provider=provider, why_no_plugin=why_no_plugin,
                   plugin_notes=tuple(notes))


def check_nccl_network_log(log: str) -> HealthCheckResult:
    """Passed only when NCCL used the aws-ofi-nccl plugin and nothing else, on the efa provider."""
    seen = parse_nccl_log(log)

    def result(passed: bool, detail: str) -> HealthCheckResult:
        return HealthCheckResult(name="nccl_network", passed=passed, detail=detail)

    if not seen.networks:
        return result(False, "NCCL logged no network choice (no 'Using network' line): it did not start, "
                             "or NCCL_DEBUG=INFO did not reach it")
    others = [network for network in seen.networks if network not in OFI_NETWORKS]
    if others:
        slow = " (TCP sockets: cross-node collectives an order of magnitude slower)" if "Socket" in others else ""
        if seen.plugin is None:
            why = (f"the aws-ofi-nccl plugin was not loaded ({seen.why_no_plugin or 'no NET/OFI line in the log'}; "
                   "is its folder on LD_LIBRARY_PATH?)")
        else:
            why = (f"{seen.plugin} loaded but NCCL did not use it"
                   + (f": {'; '.join(seen.plugin_notes)}" if seen.plugin_notes else ""))
        return result(False, f"NCCL uses network {', '.join(others)}{slow}, not EFA: {why}")
    if seen.provider != "efa":
        return result(False, f"NCCL uses {seen.plugin or 'the aws-ofi-nccl plugin'} on libfabric provider "
                             f"{seen.provider or '(none logged)'}, not efa")
    return result(True, f"NCCL uses {seen.plugin or 'the aws-ofi-nccl plugin'} (network "
                        f"{seen.networks[0]}) on libfabric provider efa")
