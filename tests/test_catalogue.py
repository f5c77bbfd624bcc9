"""The catalogue against EC2's own DescribeInstanceTypes data (the copy moto ships)."""

import pytest
from moto.ec2.models.instance_types import INSTANCE_TYPES

from trainfleet.core.catalogue import (CATALOGUE, NCCL_ERROR_HANDLING, NCCL_WATCHDOG_PAUSE_S, UnknownInstanceType,
                                       instance_facts, nccl_environment)

ISSUE_TYPES = ["p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge", "trn1.32xlarge"]


def test_every_type_the_project_promises_is_there_with_cpu_types_for_local_runs():
    assert set(ISSUE_TYPES) < set(CATALOGUE)
    assert any(facts.accelerator == "none" for facts in CATALOGUE.values())


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_hardware_facts_match_describe_instance_types(name):
    facts, ec2 = CATALOGUE[name], INSTANCE_TYPES[name]
    network = ec2["NetworkInfo"]
    assert facts.vcpus == ec2["VCpuInfo"]["DefaultVCpus"]
    assert facts.network_cards == len(network["NetworkCards"])
    assert facts.efa_supported == network["EfaSupported"]
    if facts.efa_supported:
        assert facts.efa_interface_count == network["EfaInfo"]["MaximumEfaInterfaces"]
        assert facts.efa_bandwidth_gbps == sum(card["PeakBandwidthInGbps"] for card in network["NetworkCards"])
    if "GpuInfo" in ec2:
        (gpu,) = ec2["GpuInfo"]["Gpus"]
        assert (facts.accelerator, facts.accelerator_count) == (gpu["Name"], gpu["Count"])
        # CUDA's total: the data sheet's, less up to 2 % the driver and ECC keep.
        assert 0.98 * gpu["MemoryInfo"]["SizeInMiB"] / 1024 <= facts.accelerator_memory_gib \
            < gpu["MemoryInfo"]["SizeInMiB"] / 1024
        assert facts.ranks_per_node == gpu["Count"]
    elif "NeuronInfo" in ec2:
        (device,) = ec2["NeuronInfo"]["NeuronDevices"]
        assert (facts.accelerator, facts.accelerator_count) == (device["Name"], device["Count"])
        assert facts.accelerator_memory_gib == device["MemoryInfo"]["SizeInMiB"] // 1024
        assert facts.ranks_per_node == device["Count"] * device["CoreInfo"]["Count"]
    else:
        assert facts.accelerator_count == 0
        assert facts.ranks_per_node == ec2["VCpuInfo"]["DefaultCores"]


def test_prices_and_floors_are_sane():
    for facts in CATALOGUE.values():
        assert 0 < facts.on_demand_usd_per_hour < 200
        # The floor must stay below what the EFA line rate could carry (Gbit/s -> GB/s).
        if facts.efa_supported:
            assert facts.busbw_floor_gbytes_per_s < facts.efa_bandwidth_gbps / 8
    assert CATALOGUE["p5.48xlarge"].on_demand_usd_per_hour > CATALOGUE["p4d.24xlarge"].on_demand_usd_per_hour


def test_unknown_type_names_itself_and_the_choices():
    with pytest.raises(UnknownInstanceType, match="'p9.96xlarge' is not in the catalogue; supported: c5.2xlarge"):
        instance_facts("p9.96xlarge")


# --- what NCCL needs to reach the other nodes over EFA ---

DLAMI_PLUGIN_DIRS = ["/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib", "/opt/amazon/efa/lib", "/opt/amazon/efa/lib64"]


@pytest.mark.parametrize("name", ["p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge"])
def test_a_gpu_type_with_efa_sends_nccl_over_efa_with_device_rdma(name):
    env = nccl_environment(CATALOGUE[name], {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"})
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"  # RDMA read on Nitro v4 and later: GPU memory straight to the wire
    assert env["FI_EFA_FORK_SAFE"] == "1"
    # The plugin's and libfabric's folders come first; what the node had stays, after them.
    assert env["LD_LIBRARY_PATH"].split(":") == [*DLAMI_PLUGIN_DIRS, "/usr/local/cuda/lib64"]


def test_training_ranks_log_nccl_warnings_and_the_preflight_probe_every_info_line():
    """At INFO each of 4,096 ranks logs its rings, trees and channels; the probe reads the network
    NCCL chose from those lines, so it alone keeps them, of every subsystem."""
    facts, inherited = CATALOGUE["p5.48xlarge"], {"LD_LIBRARY_PATH": "/usr/local/cuda/lib64"}
    training = nccl_environment(facts, inherited)
    assert (training["NCCL_DEBUG"], training["NCCL_DEBUG_SUBSYS"]) == ("WARN", "INIT,NET")
    probe = nccl_environment(facts, inherited, probe=True)
    assert probe["NCCL_DEBUG"] == "INFO" and "NCCL_DEBUG_SUBSYS" not in probe
    # Only the log differs: the probe proves the network in the environment the ranks train in.
    assert {k: v for k, v in probe.items() if not k.startswith("NCCL_DEBUG")} == \
        {k: v for k, v in training.items() if not k.startswith("NCCL_DEBUG")}


@pytest.mark.parametrize("name", ["c5.large", "c5.xlarge", "c5.2xlarge", "trn1.32xlarge"])
def test_types_whose_collectives_do_not_go_through_nccl_over_efa_get_its_error_handling_alone(name):
    assert nccl_environment(CATALOGUE[name], {"LD_LIBRARY_PATH": "/usr/lib"}) == NCCL_ERROR_HANDLING


@pytest.mark.parametrize("name", sorted(CATALOGUE))
@pytest.mark.parametrize("probe", [False, True])
def test_every_rank_aborts_a_failed_collective_and_lives_on_to_be_repaired(name, probe):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2: the watchdog aborts the failed group's communicators and
    leaves the process (1, torchrun's, and 3, ProcessGroupNCCL's default, end it with SIGABRT);
    its pause before the abort, 4 x the dump timeout, is 4 s instead of a minute; no dump on
    timeout, whose heartbeat monitor would end the process 8 minutes after a peer's failure."""
    env = nccl_environment(CATALOGUE[name], {}, probe=probe)
    assert (env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], env["TORCH_NCCL_DUMP_ON_TIMEOUT"]) == ("2", "0")
    assert 4 * int(env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) / 1000 == NCCL_WATCHDOG_PAUSE_S == 4.0


def test_no_empty_library_path_entry_when_the_node_had_none():
    # An empty entry in LD_LIBRARY_PATH means the working directory: never add one.
    for inherited in ({}, {"LD_LIBRARY_PATH": ""}, {"LD_LIBRARY_PATH": "/opt/amazon/efa/lib:"}):
        assert nccl_environment(CATALOGUE["p5.48xlarge"], inherited)["LD_LIBRARY_PATH"].split(":") == DLAMI_PLUGIN_DIRS


def test_memory_per_rank_is_one_gpu_or_one_neuroncore():
    assert instance_facts("p4d.24xlarge").memory_per_rank_gib == 39.39  # what CUDA reports of an A100 40 GB
    assert instance_facts("p5.48xlarge").memory_per_rank_gib == 79.18
    assert instance_facts("trn1.32xlarge").memory_per_rank_gib == 16  # 32 GiB chips, two cores each
    assert instance_facts("c5.large").memory_per_rank_gib == 0
