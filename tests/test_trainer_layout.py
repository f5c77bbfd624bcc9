"""Stage placement and the layer split (pure functions, checked against torch's own mapping), and which
FSDP units reshard after forward."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from conftest import spawn_ranks
from trainer.config import load_config
from trainer.model import GPT
from trainer.parallelize import _fully_shard
from trainer.parallel_dims import SCHEDULES, layer_ranges, split_layers, stage_ids
from trainer.pipeline_parallel import _layers_per_stage, v_schedule_problem


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("pp", [2, 4])
def test_each_stage_sits_where_the_schedule_expects_it(name, pp):
    spec = SCHEDULES[name]
    n_stages = pp * spec.stages_per_rank
    placed = {s: rank for rank in range(pp) for s in stage_ids(rank, pp, spec.stages_per_rank, spec.placement)}
    assert sorted(placed) == list(range(n_stages))
    if spec.placement != "single":
        assert placed == generate_stage_to_rank_mapping(pp, n_stages, style=spec.placement)


def test_all_seven_schedules_of_this_torch_are_offered():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble",
                              "zbv-zero-bubble", "dualpipev"}


def test_equal_layers_split_evenly():
    assert split_layers(100, 8, 0, 0, 4) == [2, 2, 2, 2]


def test_heavy_embedding_and_head_get_fewer_layers():
    # Embedding and head each weigh two layers: 2+L0 ~ L1 ~ L2 ~ L3+2 with 12 layers.
    assert split_layers(100, 12, 200, 200, 4) == [2, 4, 4, 2]


def test_every_stage_keeps_a_layer_even_when_the_ends_are_huge():
    assert split_layers(1, 4, 1000, 1000, 4) == [1, 1, 1, 1]


def test_split_balances_real_parameter_counts():
    cfg = load_config(["--model.n_layers=10", "--model.d_model=64", "--model.vocab_size=4096"])
    counts = _layers_per_stage(cfg.model, 2, [])
    stage_params = [sum(p.numel() for p in GPT(cfg.model, r, first=i == 0, last=i == 1).parameters())
                    for i, r in enumerate(layer_ranges(counts))]
    block = sum(p.numel() for p in GPT(cfg.model, range(1), first=False, last=False).parameters())
    assert abs(stage_params[0] - stage_params[1]) <= block
    assert sum(counts) == 10 and counts == [5, 5]


def test_layer_ranges_are_contiguous_global_indices():
    assert layer_ranges([3, 1, 2]) == [range(0, 3), range(3, 4), range(4, 6)]


def test_a_stage_keeps_the_full_models_parameter_names():
    cfg = load_config(["--model.n_layers=4", "--model.d_model=32", "--model.n_heads=2"]).model
    whole = set(dict(GPT(cfg).named_parameters()))
    parts = [GPT(cfg, range(0, 1), first=True, last=False), GPT(cfg, range(1, 3), first=False, last=False),
             GPT(cfg, range(3, 4), first=False, last=True)]
    names = [set(dict(p.named_parameters())) for p in parts]
    assert set.union(*names) == whole and sum(len(n) for n in names) == len(whole)
    assert "layers.2.mlp.fc.weight" in names[1] and "head.weight" in names[2] and "tok_emb.weight" in names[0]


def test_a_v_schedule_on_gloo_needs_a_torch_that_does_not_send_to_itself():
    refused = v_schedule_problem("2.11.0+cu130", "gloo", "v", "zbv-zero-bubble")
    assert "'zbv-zero-bubble' on gloo needs torch 2.13 or later" in refused and "2.11.0+cu130" in refused
    assert v_schedule_problem("2.13.0+cpu", "gloo", "v", "dualpipev") is None
    assert v_schedule_problem("2.11.0", "nccl", "v", "dualpipev") is None      # NCCL sends to itself
    assert v_schedule_problem("2.11.0", "gloo", "loop", "interleaved-1f1b") is None


def _resharding_after_forward(rank: int, reshard: str, results) -> None:
    """Which FSDP units of the whole model reshard after forward, in a one-rank world."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = load_config(["--model.n_layers=3", "--model.d_model=16", "--model.n_heads=2", "--model.seq_len=8",
                           "--training.device=cpu", f"--parallel.reshard_after_forward={reshard}"])
        mesh = init_device_mesh("cpu", (1, 1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        with torch.device("meta"):
            part = GPT(cfg.model)
        _fully_shard(part, cfg, mesh, torch.device("cpu"))
        units = {"block 0": part.layers["0"], "last block": part.layers["2"], "embeddings": part.tok_emb,
                 "head": part.head}
        results[reshard] = {name: module._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
                            for name, module in units.items()}
    finally:
        dist.destroy_process_group()


def test_without_a_pipeline_the_last_block_and_the_head_keep_their_gather_for_their_backward():
    """Their backward comes straight after their forward: resharding them would gather them again at once."""
    with torch_mp.Manager() as manager:
        results = manager.dict()
        for reshard in ("auto", "always"):
            spawn_ranks(_resharding_after_forward, (reshard, results), nprocs=1)
        results = dict(results)
    assert results["auto"] == {"block 0": True, "last block": False, "embeddings": True, "head": False}
    assert all(results["always"].values())
