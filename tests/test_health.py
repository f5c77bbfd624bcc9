"""Preflight checks against the catalogue, with the node's probes replaced by plain functions."""

import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from trainer.health import ProbeError, Probes, parse_fi_info, preflight
from trainfleet.catalogue import instance_facts
from trainfleet.contracts import HealthCheckResult

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


def probes(gpus: int = 0, efa: list[str] | Exception = (), gloo: bool = True) -> Probes:
    def efa_devices() -> list[str]:
        if isinstance(efa, Exception):
            raise efa
        return list(efa)

    return Probes(cuda_device_count=lambda: gpus, efa_devices=efa_devices, gloo_allreduce_ok=lambda: gloo)


def by_name(checks: list[HealthCheckResult]) -> dict[str, HealthCheckResult]:
    return {check.name: check for check in checks}


def test_fi_info_devices_are_the_distinct_rdm_domains():
    assert parse_fi_info(FI_INFO_TWO_DEVICES) == ["rdmap16s27-rdm", "rdmap32s27-rdm"]
    assert parse_fi_info("") == []


def test_a_cpu_node_skips_what_it_lacks_and_says_why():
    checks = by_name(preflight(instance_facts("c5.large"), probes(gpus=1)))
    assert checks["gloo_allreduce"].passed
    for name in ("accelerator_count", "efa_devices", "allreduce_busbw"):
        assert checks[name].skipped and not checks[name].passed and not checks[name].failed
    assert "c5.large" in checks["accelerator_count"].detail and "EFA" in checks["efa_devices"].detail


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
])
def test_a_node_short_of_what_its_type_promises_fails_the_check_that_saw_it(node, failing):
    checks = by_name(preflight(instance_facts("p4d.24xlarge"), probes(**node)))
    assert [name for name, check in checks.items() if check.failed] == [failing]
    assert checks[failing].detail


def test_an_efa_probe_that_cannot_look_fails_rather_than_skips():
    check = by_name(preflight(instance_facts("p5.48xlarge"), probes(gpus=8, efa=ProbeError("no fi_info"))))["efa_devices"]
    assert check.failed and not check.skipped and "no fi_info" in check.detail


def test_a_skipped_check_cannot_claim_to_have_passed():
    with pytest.raises(ValidationError, match="accelerator_count: a skipped check cannot have passed"):
        HealthCheckResult(name="accelerator_count", passed=True, skipped=True)


def test_the_command_prints_the_checks_of_this_machine():
    done = subprocess.run([sys.executable, "-m", "trainer.health", "--instance-type", "c5.large"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    checks = by_name([HealthCheckResult.model_validate(item) for item in json.loads(done.stdout)])
    assert checks["gloo_allreduce"].passed and checks["efa_devices"].skipped


def test_an_unknown_instance_type_is_named():
    done = subprocess.run([sys.executable, "-m", "trainer.health", "--instance-type", "p9.huge"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "'p9.huge' is not in the catalogue" in done.stderr
