"""Preflight checks against the catalogue, with the node's probes replaced by plain functions."""

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from localcloud.waiting import run_captured
from node.gpu_health import (GEMM_FLOOR_FRACTION, REPLACE_NODE_XIDS, check_clocks, check_ecc_errors, check_gemm,
                             check_kernel_xids, check_nvlink_allreduce, check_nvlink_links, check_pcie_link,
                             check_remapped_rows, measure_allreduce_busbw, measure_gemm_tflops, parse_kernel_xids,
                             parse_nvidia_smi_query, parse_nvlink_status)
from node.health import (GPU_DEVICE_CHECKS, NCCL_MINIMUM, TORCH_MINIMUM, ProbeError, Probes, parse_fi_info, preflight,
                         system_probes)
from node.nccl_log import check_nccl_network_log, parse_nccl_log
from trainfleet.core.catalogue import InstanceFacts, instance_facts
from trainfleet.core.events import HealthCheckResult

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).parent / "data"
NCCL_LOGS = DATA / "nccl"
NVIDIA_SMI = DATA / "nvidia-smi"
KERNEL_LOGS = DATA / "kernel-log"

# Recorded outputs (tests/data/nvidia-smi/README.md says where each comes from).
H100_QUERY = (NVIDIA_SMI / "h100-8gpu-535.183.01-q.txt").read_text()
"""8x H100 80GB HBM3, driver 535.183.01, as recorded: GPU 00000000:75:00.0 has a power brake and a
software thermal slowdown active, the seven others are healthy (six of them idle)."""
H100_QUERY_ALL_POWER_BRAKE = (NVIDIA_SMI / "h100-8gpu-535.161.08-q.txt").read_text()
"""8x H100 80GB HBM3, driver 535.161.08, as recorded: every GPU under a hardware power brake."""
A100_NVLINK = (NVIDIA_SMI / "a100-8gpu-nvlink-s.txt").read_text()
"""`nvidia-smi nvlink -s` of 8x A100-SXM4-80GB, as recorded: 12 links of each GPU at 25 GB/s."""
BRAKED_GPU = "00000000:75:00.0"


def edited(recording: str, heading: str, old: str, new: str) -> str:
    """`recording` with the first `old` after the line `heading` (a GPU's) replaced by `new`: the
    minimal edit that turns a real output into a failing one."""
    start = recording.index(heading + "\n")
    at = recording.index(old, start)
    return recording[:at] + new + recording[at + len(old):]


def healthy_h100_query() -> str:
    """The 535.183.01 recording with GPU 75:00.0's two active slowdowns set to "Not Active"."""
    query = edited(H100_QUERY, f"GPU {BRAKED_GPU}", "HW Power Brake Slowdown       : Active",
                   "HW Power Brake Slowdown       : Not Active")
    return edited(query, f"GPU {BRAKED_GPU}", "SW Thermal Slowdown               : Active",
                  "SW Thermal Slowdown               : Not Active")

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


def answer(value):
    """A probe that returns `value`, or raises it when it is an exception."""
    def probe(*_):
        if isinstance(value, Exception):
            raise value
        return value
    return probe


def probes(gpus: int = 0, efa: list[str] | Exception = (), gloo: bool = True, torch: str = "2.13.0+cu128",
           nccl: tuple[int, int, int] | None = (2, 27, 3), log: str | Exception = "efa-libfabric.log",
           nccl_runs: list[InstanceFacts] | None = None, query: str | Exception | None = None,
           nvlink: str | Exception = A100_NVLINK, kernel_log: str | Exception = "",
           gemm: dict[int, float] | Exception | None = None, busbw: float | Exception = 200.0) -> Probes:
    """A node whose probes answer as given; by default a healthy p4d's GPU devices (an H100's
    nvidia-smi -q: its gen5 links are more than p4d's gen4 asks)."""
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
                  torch_version=lambda: torch, nccl_version=lambda: nccl, nccl_network_log=nccl_network_log,
                  nvidia_smi_query=answer(healthy_h100_query() if query is None else query),
                  nvlink_status=answer(nvlink), kernel_log=answer(kernel_log),
                  gemm_tflops=answer({index: 280.0 for index in range(8)} if gemm is None else gemm),
                  nvlink_allreduce_busbw=answer(busbw))


def by_name(checks: list[HealthCheckResult]) -> dict[str, HealthCheckResult]:
    return {check.name: check for check in checks}


def test_fi_info_devices_are_the_distinct_rdm_domains():
    assert parse_fi_info(FI_INFO_TWO_DEVICES) == ["rdmap16s27-rdm", "rdmap32s27-rdm"]
    assert parse_fi_info("") == []


def test_a_cpu_node_skips_what_it_lacks_and_says_why():
    nccl_runs = []
    checks = by_name(preflight(instance_facts("c5.large"), probes(gpus=1, nccl=None, nccl_runs=nccl_runs)))
    assert checks["gloo_allreduce"].passed and checks["torch_version"].passed
    for name in ("accelerator_count", "efa_devices", "nccl_version", "nccl_network", "allreduce_busbw",
                 *GPU_DEVICE_CHECKS):
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
    (dict(gpus=8, efa=[f"d{i}-rdm" for i in range(4)], torch="2.10.1+cu128"), "torch_version"),
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
    with pytest.raises(ProbeError, match="the NCCL probe exited with 1: ") as raised:
        system_probes().nccl_network_log(instance_facts("p4d.24xlarge"))
    # The end of its output: the error and the call that raised it.
    assert "init_process_group" in str(raised.value) and "ValueError: device_id cuda:0" in str(raised.value)


def test_trainium_skips_the_nccl_checks_saying_why():
    checks = by_name(preflight(instance_facts("trn1.32xlarge"), probes(efa=[f"d{i}-rdm" for i in range(8)])))
    assert checks["nccl_network"].skipped and "Neuron" in checks["nccl_network"].detail
    assert checks["nccl_version"].skipped


# --- versions ---

def test_the_torch_minimum_is_the_oldest_torch_ci_tests():
    assert f"TORCH_OLDEST := {TORCH_MINIMUM}\n" in (REPO / "Makefile").read_text()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = next(r for r in project["optional-dependencies"]["trainer"] if r.startswith("torch=="))
    assert tuple(map(int, pinned.removeprefix("torch==").split("."))) >= tuple(map(int, TORCH_MINIMUM.split(".")))


@pytest.mark.parametrize("installed, passed", [("2.11.0", True), ("2.11.0+cu130", True), ("2.14.1+cu128", True),
                                               ("2.11.1a0+git1234abc", True), ("2.10.1+cu124", False),
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
    done = run_captured([sys.executable, "-m", "node.health", "--instance-type", "c5.large"], what="preflight")
    assert done.returncode == 0, done.stderr
    checks = by_name([HealthCheckResult.model_validate(item) for item in json.loads(done.stdout)])
    assert checks["gloo_allreduce"].passed and checks["efa_devices"].skipped
    assert checks["torch_version"].passed and checks["nccl_network"].skipped
    assert all(checks[name].skipped and "c5.large has no GPUs" in checks[name].detail for name in GPU_DEVICE_CHECKS)


def test_an_unknown_instance_type_is_named():
    done = run_captured([sys.executable, "-m", "node.health", "--instance-type", "p9.huge"], what="preflight")
    assert done.returncode == 2 and "'p9.huge' is not in the catalogue" in done.stderr


# --- GPU devices: nvidia-smi -q ---

def test_the_query_parser_reads_each_gpu_section_as_a_tree():
    gpus = parse_nvidia_smi_query(H100_QUERY)
    assert [gpu.bus_id for gpu in gpus][:3] == ["00000000:53:00.0", "00000000:64:00.0", BRAKED_GPU]
    assert len(gpus) == 8
    assert gpus[0].get("Remapped Rows", "Pending") == "No"
    assert gpus[0].get("PCI", "GPU Link Info", "Link Width", "Current") == "16x"
    assert gpus[0].get("Clocks Event Reasons", "HW Slowdown") == "Not Active"
    assert gpus[0].get("No Such Section", "Field") is None


def test_a_healthy_h100_node_passes_the_query_checks():
    query = healthy_h100_query()
    for check in (check_ecc_errors(query), check_remapped_rows(query), check_clocks(query),
                  check_pcie_link(instance_facts("p5.48xlarge"), query)):
        assert check.passed, check.detail
        assert "8 GPUs" in check.detail


def test_the_recorded_power_brake_fails_the_clocks_check_naming_the_gpu_and_reasons():
    check = check_clocks(H100_QUERY)
    assert check.failed
    assert check.detail == f"GPU {BRAKED_GPU}: HW Power Brake Slowdown, SW Thermal Slowdown active"
    assert check_ecc_errors(H100_QUERY).passed and check_remapped_rows(H100_QUERY).passed


def test_a_node_whose_every_gpu_is_power_braked_fails_naming_all_eight():
    check = check_clocks(H100_QUERY_ALL_POWER_BRAKE)
    assert check.failed and check.detail.count("HW Slowdown, HW Power Brake Slowdown active") == 8
    assert "GPU 00000000:19:00.0" in check.detail and "GPU 00000000:DB:00.0" in check.detail


def test_idle_and_power_cap_clock_reasons_are_normal():
    # Six GPUs of the recording are idle ("Idle : Active"); the SW power cap is a limit, not a fault.
    capped = edited(healthy_h100_query(), "GPU 00000000:53:00.0", "SW Power Cap                      : Not Active",
                    "SW Power Cap                      : Active")
    assert check_clocks(capped).passed


def test_an_older_driver_s_throttle_reasons_are_read_too():
    older = edited(H100_QUERY, f"GPU {BRAKED_GPU}", "Clocks Event Reasons\n", "Clocks Throttle Reasons\n")
    assert check_clocks(older).detail == check_clocks(H100_QUERY).detail


@pytest.mark.parametrize("old, new, said", [
    ("DRAM Uncorrectable            : 0", "DRAM Uncorrectable            : 2",
     "2 uncorrectable ECC errors since the driver loaded"),
    ("SRAM Uncorrectable SEC-DED    : 0", "SRAM Uncorrectable SEC-DED    : 1",
     "1 uncorrectable ECC errors since the driver loaded"),
    ("SRAM Threshold Exceeded       : No", "SRAM Threshold Exceeded       : Yes", "over NVIDIA's threshold"),
    ("ECC Mode\n        Current                           : Enabled",
     "ECC Mode\n        Current                           : Disabled", "ECC is disabled"),
])
def test_uncorrectable_ecc_errors_since_the_driver_loaded_fail_naming_the_gpu(old, new, said):
    check = check_ecc_errors(edited(healthy_h100_query(), "GPU 00000000:64:00.0", old, new))
    assert check.failed and check.detail.startswith("GPU 00000000:64:00.0: ") and said in check.detail


def test_lifetime_uncorrectable_errors_are_shown_not_judged():
    aggregate_dram = ("Aggregate\n            SRAM Correctable              : 0\n"
                      "            SRAM Uncorrectable Parity     : 0\n            SRAM Uncorrectable SEC-DED    : 0\n"
                      "            DRAM Correctable              : 0\n            DRAM Uncorrectable            : ")
    query = edited(healthy_h100_query(), "GPU 00000000:64:00.0", aggregate_dram + "0", aggregate_dram + "3")
    check = check_ecc_errors(query)
    assert check.passed and "lifetime uncorrectable errors (repaired by row remapping): 00000000:64:00.0 (3)" in check.detail


@pytest.mark.parametrize("old, new, said", [
    ("Uncorrectable Error               : 0\n        Pending                           : No",
     "Uncorrectable Error               : 1\n        Pending                           : Yes",
     "row remapping pending (1 rows remapped"),
    ("Remapping Failure Occurred        : No", "Remapping Failure Occurred        : Yes", "row remapping failed"),
])
def test_a_pending_or_failed_row_remapping_fails_naming_the_gpu(old, new, said):
    check = check_remapped_rows(edited(healthy_h100_query(), "GPU 00000000:97:00.0", old, new))
    assert check.failed and check.detail.startswith("GPU 00000000:97:00.0: ") and said in check.detail


@pytest.mark.parametrize("gpu, old, new, passed", [
    ("00000000:53:00.0", "Current                   : 16x", "Current                   : 8x", False),
    # an idle GPU's link at gen1 to save power, able to reach gen5: fine
    ("00000000:53:00.0", "Current                   : 5", "Current                   : 1", True),
    # idle, and its link cannot reach gen5
    ("00000000:53:00.0", "Max                       : 5\n                Current                   : 5",
     "Max                       : 3\n                Current                   : 3", False),
    # busy (GPU 75:00.0 is not idle) at gen3
    (BRAKED_GPU, "Current                   : 5", "Current                   : 3", False),
])
def test_the_pcie_link_is_held_to_the_type_s_lanes_and_generation(gpu, old, new, passed):
    check = check_pcie_link(instance_facts("p5.48xlarge"), edited(healthy_h100_query(), f"GPU {gpu}", old, new))
    assert check.passed is passed, check.detail
    if not passed:
        assert check.detail.startswith(f"GPU {gpu}: PCIe ") and "p5.48xlarge has gen5 x16" in check.detail


def test_an_output_without_gpus_fails_every_query_check():
    for check in (check_ecc_errors(""), check_remapped_rows(""), check_clocks(""),
                  check_pcie_link(instance_facts("p5.48xlarge"), "")):
        assert check.failed and "lists no GPU" in check.detail


# --- GPU devices: NVLink links ---

def test_the_nvlink_parser_reads_each_gpu_s_links():
    gpus = parse_nvlink_status(A100_NVLINK)
    assert sorted(gpus) == list(range(8)) and all(len(links) == 12 for links in gpus.values())
    assert gpus[7][11] == 25.0


def test_an_a100_node_with_all_links_up_passes_p4d_and_is_short_of_p5():
    assert check_nvlink_links(instance_facts("p4d.24xlarge"), A100_NVLINK).passed
    check = check_nvlink_links(instance_facts("p5.48xlarge"), A100_NVLINK)
    assert check.failed and "GPU 0: 12 of 18 NVLink links up" in check.detail and check.measured == 12


def test_an_inactive_link_fails_naming_the_gpu_and_link():
    # "<inactive>" is how nvidia-smi shows a link that is down.
    status = edited(A100_NVLINK, "GPU 3: NVIDIA A100-SXM4-80GB (UUID: GPU-6e4fbadc-10d9-a63a-8988-9a0d320ff1a0)",
                    "Link 7: 25 GB/s", "Link 7: <inactive>")
    check = check_nvlink_links(instance_facts("p4d.24xlarge"), status)
    assert check.failed and check.detail == "GPU 3: 11 of 12 NVLink links up (down: 7)"


# --- GPU devices: Xids in the kernel log ---

def test_the_xid_parser_keeps_each_gpu_and_code_once_with_its_first_message():
    events = parse_kernel_xids((KERNEL_LOGS / "xid-48-63-94-dbe.log").read_text())
    assert [(event.gpu, event.xid) for event in events] == [("0000:19:00", 48), ("0000:19:00", 63),
                                                            ("0000:19:00", 94)]
    assert "uncorrectable double bit error (DBE)" in events[0].message


@pytest.mark.parametrize("log, fatal, noted", [
    ("xid-48-63-94-dbe.log", "Xid 48 (double-bit ECC error) on GPU 0000:19:00",
     ["Xid 63 (row remapping recorded) on 0000:19:00", "Xid 94 (contained memory error) on 0000:19:00"]),
    ("xid-119-gsp-timeout.log", "Xid 119 (GSP RPC timeout) on GPU 0000:9b:00", []),
])
def test_an_xid_that_needs_a_reset_fails_naming_it_and_its_gpu(log, fatal, noted):
    check = check_kernel_xids((KERNEL_LOGS / log).read_text())
    assert check.failed and check.detail.startswith("replace the node: " + fatal)
    assert all(note in check.detail for note in noted)


def test_application_xids_are_listed_but_pass():
    check = check_kernel_xids((KERNEL_LOGS / "xid-13-43-application-faults.log").read_text())
    assert check.passed
    assert "Xid 13 (graphics engine exception) on 0000:38:00" in check.detail and "Xid 43" in check.detail


def test_a_kernel_log_without_xids_passes():
    check = check_kernel_xids("[    2.1] nvidia-nvlink: Nvlink Core is being initialized\n")
    assert check.passed and check.detail == "no Xid in the kernel log"


def test_the_xids_that_replace_a_node_include_the_catalogue_s_resets():
    # 63 (remapping recorded) and 94 (contained) are IGNORE / RESTART_APP in NVIDIA's catalogue.
    assert {48, 64, 74, 79, 95, 119, 120} <= set(REPLACE_NODE_XIDS) and not {13, 31, 43, 63, 94} & set(REPLACE_NODE_XIDS)


# --- GPU devices: measurements ---

def test_gemm_rates_over_the_floor_pass_and_a_slow_gpu_is_named():
    facts = instance_facts("p4d.24xlarge")
    floor = GEMM_FLOOR_FRACTION * facts.bf16_dense_tflops
    rates = {index: 270.0 for index in range(8)}
    assert check_gemm(facts, rates).passed and check_gemm(facts, rates).expected == floor
    check = check_gemm(facts, {**rates, 5: floor - 1})
    assert check.failed and check.detail.startswith(f"GPU 5 reaches {floor - 1:.0f} TFLOPS")
    assert check.measured == floor - 1


def test_a_gemm_that_measured_fewer_gpus_than_the_type_has_fails():
    check = check_gemm(instance_facts("p5.48xlarge"), {index: 700.0 for index in range(7)})
    assert check.failed and "7 GPUs measured, p5.48xlarge has 8" in check.detail


@pytest.mark.parametrize("busbw, passed", [(360.0, True), (120.0, False)])
def test_the_nvlink_all_reduce_is_held_to_the_type_s_floor(busbw, passed):
    check = check_nvlink_allreduce(instance_facts("p5.48xlarge"), busbw)
    assert check.passed is passed and check.expected == instance_facts("p5.48xlarge").nvlink_busbw_floor_gbytes_per_s


def test_the_gemm_measurement_runs_here_on_cpu():
    torch = pytest.importorskip("torch")
    assert measure_gemm_tflops(torch.device("cpu"), torch.float32, 64, 3) > 0


def test_the_all_reduce_measurement_spawns_one_process_per_rank():
    pytest.importorskip("torch")
    assert measure_allreduce_busbw(2, "gloo", 1 << 20, 3) > 0


# --- GPU devices in preflight ---

def test_a_healthy_gpu_node_passes_every_device_check():
    checks = by_name(preflight(instance_facts("p4d.24xlarge"), probes(gpus=8, efa=[f"d{i}-rdm" for i in range(4)])))
    assert all(checks[name].passed for name in GPU_DEVICE_CHECKS), [checks[name] for name in GPU_DEVICE_CHECKS]


@pytest.mark.parametrize("node, failing", [
    (dict(query=H100_QUERY), ["gpu_clocks"]),
    (dict(nvlink=A100_NVLINK.replace("Link 0: 25 GB/s", "Link 0: <inactive>", 1)), ["nvlink_links"]),
    (dict(kernel_log=(KERNEL_LOGS / "xid-119-gsp-timeout.log").read_text()), ["gpu_xid"]),
    (dict(gemm={**{index: 280.0 for index in range(8)}, 2: 90.0}), ["gpu_gemm"]),
    (dict(busbw=60.0), ["nvlink_allreduce_busbw"]),
    (dict(query=ProbeError("nvidia-smi is not installed (the NVIDIA driver is missing)")),
     ["ecc_errors", "remapped_rows", "gpu_clocks", "gpu_pcie"]),
    (dict(gemm=ProbeError("the GEMM probe exited with 1: CUDA error")), ["gpu_gemm"]),
])
def test_a_gpu_fault_fails_the_device_check_that_saw_it(node, failing):
    checks = by_name(preflight(instance_facts("p4d.24xlarge"),
                               probes(gpus=8, efa=[f"d{i}-rdm" for i in range(4)], **node)))
    assert [name for name, check in checks.items() if check.failed] == failing
    assert all(checks[name].detail for name in failing)


def test_a_kernel_log_that_cannot_be_read_skips_the_xid_check_saying_why():
    node = probes(gpus=8, efa=[f"d{i}-rdm" for i in range(4)],
                  kernel_log=ProbeError("dmesg exited with 1: dmesg: read kernel buffer failed: Operation not permitted"))
    check = by_name(preflight(instance_facts("p4d.24xlarge"), node))["gpu_xid"]
    assert check.skipped and not check.passed and "Operation not permitted" in check.detail


def test_trainium_skips_the_gpu_device_checks_saying_why():
    checks = by_name(preflight(instance_facts("trn1.32xlarge"), probes(efa=[f"d{i}-rdm" for i in range(8)])))
    assert all(checks[name].skipped and "Trainium" in checks[name].detail for name in GPU_DEVICE_CHECKS)


def test_without_nvidia_smi_the_system_probes_say_so():
    if shutil.which("nvidia-smi"):
        pytest.skip("nvidia-smi is installed here")
    with pytest.raises(ProbeError, match="nvidia-smi is not installed"):
        system_probes().nvidia_smi_query()
