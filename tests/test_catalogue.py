"""The catalogue against EC2's own DescribeInstanceTypes data (the copy moto ships)."""

import pytest
from moto.ec2.models.instance_types import INSTANCE_TYPES

from trainfleet.catalogue import CATALOGUE, UnknownInstanceType, instance_facts

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
        assert facts.accelerator_memory_gib == gpu["MemoryInfo"]["SizeInMiB"] // 1024
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


def test_memory_per_rank_is_one_gpu_or_one_neuroncore():
    assert instance_facts("p4d.24xlarge").memory_per_rank_gib == 40
    assert instance_facts("p5.48xlarge").memory_per_rank_gib == 80
    assert instance_facts("trn1.32xlarge").memory_per_rank_gib == 16  # 32 GiB chips, two cores each
    assert instance_facts("c5.large").memory_per_rank_gib == 0
