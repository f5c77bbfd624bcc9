"""Preflight checks against the catalogue, with the node's probes replaced by plain functions."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from localcloud.waiting import run_captured
from trainer.health import (NCCL_MINIMUM, TORCH_MINIMUM, ProbeError, Probes, check_nccl_network_log, parse_fi_info,
                            parse_nccl_log, preflight, system_probes)
from trainfleet.catalogue import InstanceFacts, instance_facts
from trainfleet.contracts import HealthCheckResult

REPO = Path(__file__).resolve().parent.parent
NCCL_LOGS = Path(__file__).parent / "data" / "nccl"

# `fi_info -p efa -t FI_EP_RDM` on a node with two EFA devices (libfabric's output layout).
FI_INFO_TWO_DEVICES = """provider: efa
    fabric: efa
    domain: rdmap16s27-rdm
    version: 120.10
    type: FI_EP_RDM
    protocol: FI_PROTO_EFA
provider: efa
    fabric: efa
    domain: rdmap32s27-rdm
    version: 120.10
    type: FI_EP_RDM
    protocol: FI_PROTO_EFA
provider: efa
    fabric: efa
    domain: rdmap16s27-dgrm
    version: 120.10
    type: FI_EP_DGRAM
    protocol: FI_PROTO_EFA
"""


def nccl_log(name: str) -> str:
    return (NCCL_LOGS / name).read_text()


def probes(gpus: int = 0, efa: list[str] | Exception = (), gloo: bool = True, torch: str = "2.13.0+cu128",
           nccl: tuple[int, int, int] | None = (2, 27, 3), log: str | Exception = "efa-libfabric.log",
           nccl_runs: list[InstanceFacts] | None = None) -> Probes:
    def efa_devices() -> list[str]:
        if isinstance(efa, Exception):
            raise efa
        return list(efa)

    def nccl_network_log(facts: InstanceFacts) -> str:
        if nccl_runs is not None:
            nccl_runs.append(facts)
        if isinstance(log, Exception):
            raise log
        return nccl_log(log)

    return Probes(cuda_device_count=lambda: gpus, efa_devices=efa_devices, gloo_allreduce_ok=lambda: gloo,
                  torch_version=lambda: torch, nccl_version=lambda: nccl, nccl_network_log=nccl_network_log)


def by_name(checks: list[HealthCheckResult]) -> dict[str, HealthCheckResult]:
    return {check.name: check for check in checks}


def test_fi_info_devices_are_the_distinct_rdm_domains():
    assert parse_fi_info(FI_INFO_TWO_DEVICES) == ["rdmap16s27-rdm", "rdmap32s27-rdm"]
    assert parse_fi_info("") == []


def test_a_cpu_node_skips_what_it_lacks_and_says_why():
    nccl_runs = []
    checks = by_name(preflight(instance_facts("c5.large"), probes(gpus=1, nccl=None, nccl_runs=nccl_runs)))
    assert checks["gloo_allreduce"].passed and checks["torch_version"].passed
    for name in ("accelerator_count", "efa_devices", "nccl_version", "nccl_network", "allreduce_busbw"):
        assert checks[name].skipped and not checks[name].passed and not checks[name].failed
    assert "c5.large" in checks["accelerator_count"].detail and "EFA" in checks["efa_devices"].detail
    assert "gloo" in checks["nccl_network"].detail and "gloo" in checks["nccl_version"].detail
    assert nccl_runs == [], "no NCCL probe on a type that trains with gloo"


def test_a_healthy_p4d_passes_with_the_catalogue_counts():
    devices = [f"rdmap{i}s0-rdm" for i in range(4)]
    checks = by_name(preflight(instance_facts("p4d.24xlarge"), probes(gpus=8, efa=devices)))
    assert checks["accelerator_count"].passed and checks["accelerator_count"].measured == 8
    assert checks["efa_devices"].passed and checks["efa_devices"].expected == 4
    assert not any(check.failed for check in checks.values())


@pytest.mark.parametrize("node, failing", [
    (dict(gpus=7, efa=[f"d{i}-rdm" for i in range(4)]), "accelerator_count"),
    (dict(gpus=8, efa=["d0-rdm", "d1-rdm", "d2-rdm"]), "efa_devices"),
    (dict(gpus=8, efa=ProbeError("fi_info is not installed")), "efa_devices"),
    (dict(gpus=8, efa=subprocess.TimeoutExpired("fi_info", 30)), "efa_devices"),
    (dict(gpus=8, efa=[f"d{i}-rdm" for i in range(4)], gloo=False), "gloo_allreduce"),
    (dict(gpus=8, efa=[f"d{i}-rdm" for i in range(4)], log="socket-no-plugin.log"), "nccl_network"),
    (dict(gpus=8, efa=[f"d{i}-rdm" for i in range(4)], torch="2.12.1+cu128"), "torch_version"),
    (dict(gpus=8, efa=[f"d{i}-rdm" for i in range(4)], nccl=(2, 16, 5)), "nccl_version"),
])
def test_a_node_short_of_what_its_type_promises_fails_the_check_that_saw_it(node, failing):
    checks = by_name(preflight(instance_facts("p4d.24xlarge"), probes(**node)))
    assert [name for name, check in checks.items() if check.failed] == [failing]
    assert checks[failing].detail


def test_an_efa_probe_that_cannot_look_fails_rather_than_skips():
    check = by_name(preflight(instance_facts("p5.48xlarge"), probes(gpus=8, efa=ProbeError("no fi_info"))))["efa_devices"]
    assert check.failed and not check.skipped and "no fi_info" in check.detail


# --- NCCL over EFA ---

@pytest.mark.parametrize("log, plugin", [("efa-libfabric.log", "aws-ofi-nccl 1.16.2"),
                                         ("efa-aws-libfabric.log", "aws-ofi-nccl 1.7.3-aws")])
def test_nccl_on_the_ofi_plugin_with_the_efa_provider_passes(log, plugin):
    check = check_nccl_network_log(nccl_log(log))
    assert check.passed, check.detail
    assert plugin in check.detail and "efa" in check.detail


def test_a_socket_fallback_without_the_plugin_fails_naming_both():
    check = check_nccl_network_log(nccl_log("socket-no-plugin.log"))
    assert check.failed
    assert "Socket" in check.detail and "TCP" in check.detail
    assert "aws-ofi-nccl plugin was not loaded" in check.detail
    assert "No plugin found (libnccl-net.so)" in check.detail  # NCCL's own words on why


@pytest.mark.parametrize("why", [
    "NET/Plugin : No plugin found (libnccl-net.so), using internal implementation",  # NCCL 2.18 and before
    "NET/Plugin : Plugin load returned 2 : libnccl-net.so: cannot open shared object file",  # there, not loadable
])
def test_every_wording_of_no_plugin_is_named(why):
    log = (f"h:1:1 [0] NCCL INFO {why}\n"
           "h:1:1 [0] NCCL INFO NET/Socket : Using [0]eno2:192.168.1.105<0>\n"
           "h:1:1 [0] NCCL INFO Using network Socket\n")
    check = check_nccl_network_log(log)
    assert check.failed and why.rstrip(".") in check.detail


def test_a_socket_fallback_with_the_plugin_loaded_but_no_efa_device_fails_saying_so():
    check = check_nccl_network_log(nccl_log("socket-plugin-without-efa.log"))
    assert check.failed
    assert "Socket" in check.detail and "aws-ofi-nccl 1.16.2 loaded" in check.detail
    assert "No eligible providers were found" in check.detail


def test_the_plugin_on_another_libfabric_provider_fails_naming_it():
    log = ("h:1:2 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.16.2\n"
           "h:1:2 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is 10.0.0.0/16 (found 1 nics)\n"
           "h:1:2 [0] NCCL INFO Using network Libfabric\n")
    check = check_nccl_network_log(log)
    assert check.failed and "provider tcp" in check.detail and "efa" in check.detail


def test_a_log_without_a_network_choice_fails_rather_than_passes():
    check = check_nccl_network_log("NCCL version 2.27.3+cuda12.9\n")
    assert check.failed and "no network" in check.detail


def test_the_parser_reads_the_plugin_the_provider_and_the_network():
    seen = parse_nccl_log(nccl_log("efa-libfabric.log"))
    assert (seen.plugin, seen.provider, seen.networks) == ("aws-ofi-nccl 1.16.2", "efa", ("Libfabric",))
    fallback = parse_nccl_log(nccl_log("socket-no-plugin.log"))
    assert (fallback.plugin, fallback.provider, fallback.networks) == (None, None, ("Socket",))


def test_an_efa_gpu_node_runs_the_nccl_probe_for_its_type():
    nccl_runs = []
    facts = instance_facts("p5.48xlarge")
    devices = [f"rdmap{i}s0-rdm" for i in range(32)]
    checks = by_name(preflight(facts, probes(gpus=8, efa=devices, nccl_runs=nccl_runs)))
    assert nccl_runs == [facts]
    assert checks["nccl_network"].passed


def test_an_nccl_probe_that_cannot_run_fails_the_node():
    node = probes(gpus=8, efa=[f"d{i}-rdm" for i in range(4)],
                  log=ProbeError("the NCCL probe exited with 1: CUDA error: no CUDA-capable device"))
    check = by_name(preflight(instance_facts("p4d.24xlarge"), node))["nccl_network"]
    assert check.failed and not check.skipped and "no CUDA-capable device" in check.detail


def test_the_nccl_probe_where_nccl_cannot_start_raises_with_its_output():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine can run NCCL: the probe would succeed")
    with pytest.raises(ProbeError, match="the NCCL probe exited with 1: Traceback") as raised:
        system_probes().nccl_network_log(instance_facts("p4d.24xlarge"))
    assert "init_process_group" in str(raised.value)


def test_trainium_skips_the_nccl_checks_saying_why():
    checks = by_name(preflight(instance_facts("trn1.32xlarge"), probes(efa=[f"d{i}-rdm" for i in range(8)])))
    assert checks["nccl_network"].skipped and "Neuron" in checks["nccl_network"].detail
    assert checks["nccl_version"].skipped


# --- versions ---

def test_the_torch_minimum_is_the_pin_in_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"torch=={TORCH_MINIMUM}" in project["optional-dependencies"]["trainer"]


@pytest.mark.parametrize("installed, passed", [("2.13.0", True), ("2.13.0+cpu", True), ("2.14.1+cu128", True),
                                               ("2.13.1a0+git1234abc", True), ("2.12.1+cu124", False),
                                               ("1.13.1", False)])
def test_torch_older_than_the_pin_fails_naming_both_versions(installed, passed):
    check = by_name(preflight(instance_facts("c5.large"), probes(torch=installed, nccl=None)))["torch_version"]
    assert check.passed is passed
    assert installed in check.detail and TORCH_MINIMUM in check.detail


def test_nccl_older_than_the_minimum_fails_naming_both_versions():
    check = by_name(preflight(instance_facts("p4d.24xlarge"), probes(gpus=8, nccl=(2, 16, 5))))["nccl_version"]
    minimum = ".".join(map(str, NCCL_MINIMUM))
    assert check.failed and "2.16.5" in check.detail and minimum in check.detail
    assert by_name(preflight(instance_facts("p4d.24xlarge"), probes(gpus=8, nccl=NCCL_MINIMUM)))["nccl_version"].passed


def test_a_gpu_node_whose_torch_has_no_nccl_fails():
    check = by_name(preflight(instance_facts("p5.48xlarge"), probes(gpus=8, nccl=None)))["nccl_version"]
    assert check.failed and "without NCCL" in check.detail


def test_a_skipped_check_cannot_claim_to_have_passed():
    with pytest.raises(ValidationError, match="accelerator_count: a skipped check cannot have passed"):
        HealthCheckResult(name="accelerator_count", passed=True, skipped=True)


def test_the_command_prints_the_checks_of_this_machine():
    done = run_captured([sys.executable, "-m", "trainer.health", "--instance-type", "c5.large"], what="preflight")
    assert done.returncode == 0, done.stderr
    checks = by_name([HealthCheckResult.model_validate(item) for item in json.loads(done.stdout)])
    assert checks["gloo_allreduce"].passed and checks["efa_devices"].skipped
    assert checks["torch_version"].passed and checks["nccl_network"].skipped


def test_an_unknown_instance_type_is_named():
    done = run_captured([sys.executable, "-m", "trainer.health", "--instance-type", "p9.huge"], what="preflight")
    assert done.returncode == 2 and "'p9.huge' is not in the catalogue" in done.stderr
