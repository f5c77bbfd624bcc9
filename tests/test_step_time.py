"""The step-time model's parts (trainfleet/core/step_time.py, hardware.py): the architectures' shapes,
the kernels' and collectives' times, what each layout pays for, and the planner that ranks layouts.
Its predictions against published runs: tests/test_step_time_validation.py."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from trainfleet.core import memory_plan as mp
from trainfleet.core import step_time as st
from trainfleet.core.catalogue import CATALOGUE, CUDA_GPUS, instance_facts
from trainfleet.core.hardware import A100_80GB, DGX_A100_SUPERPOD, H100, UnmodelledInstanceType, ec2_cluster

REPO = Path(__file__).resolve().parent.parent
P5 = ec2_cluster(instance_facts("p5.48xlarge"))
P4D = ec2_cluster(instance_facts("p4d.24xlarge"))
GPT_70B = mp.ModelShape(n_layers=86, d_model=8192, n_heads=64, vocab_size=32000, seq_len=4096)
J1 = mp.ModelShape(n_layers=76, d_model=13824, n_heads=96, vocab_size=256000, seq_len=2048)


def _workload(shape=GPT_70B, **layout) -> mp.Workload:
    return mp.Workload(shape, mp.Layout(**{"batch_size": 1024, **layout}), accelerator="H100")


def test_the_modules_import_without_torch():
    code = ("import sys; import trainfleet.core.step_time, trainfleet.core.hardware; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_every_ec2_type_with_a_cuda_gpu_has_its_gpu_at_the_catalogues_peak():
    for facts in CATALOGUE.values():
        if facts.accelerator in CUDA_GPUS:
            cluster = ec2_cluster(facts)
            assert cluster.gpu.bf16_tflops == facts.bf16_dense_tflops
            assert (cluster.gpus_per_node, cluster.network_gbits_per_s) == (facts.accelerator_count,
                                                                            facts.efa_bandwidth_gbps)
        else:
            with pytest.raises(UnmodelledInstanceType, match=f"describes no accelerator of {facts.name}"):
                ec2_cluster(facts)
    assert ec2_cluster(instance_facts("p4de.24xlarge")).gpu is A100_80GB, "80 GB of HBM2e, faster than p4d's"
    assert DGX_A100_SUPERPOD.network_bytes_per_s == 8 * 200e9 / 8


def test_the_gpt_architecture_counts_the_memory_plans_parameters():
    arch = st.gpt_architecture(J1)
    assert arch.embedding_params + J1.n_layers * arch.block_params + arch.head_params == mp.parameter_count(J1)
    for tp in (1, 2, 8):
        assert arch.block_params_on_rank(tp) == mp._block_params(J1, tp)
        assert arch.embedding_params_on_rank(tp) == mp._embedding_params(J1, tp)
        assert arch.head_params_on_rank(tp) == mp._head_params(J1, tp)
    assert arch.layers_per_stage(8) == mp._layers_per_stage(mp.Workload(J1, mp.Layout(pp=8)))
    assert st.architecture(J1) == arch


def test_the_llama_architecture_has_llama_3_8bs_published_size():
    arch = st.llama_architecture(32, 4096, 32, 8, 14336, 128256, 8192)
    total = arch.embedding_params + 32 * arch.block_params + arch.head_params
    assert total == 8_030_261_248   # transformers' count for Meta-Llama-3-8B
    assert [mm.name for mm in arch.matmuls if mm.split == "row"] == ["attention output", "mlp output"]


def test_model_flops_are_six_a_weight_and_palms_attention_term():
    arch = st.gpt_architecture(GPT_70B)
    weights = GPT_70B.n_layers * 12 * 8192 ** 2 + 32000 * 8192
    assert st.model_flops_per_token(arch) == 6 * weights + 12 * 86 * 8192 * 4096


def test_a_large_gemm_runs_at_the_sustained_matmul_rate_a_small_one_is_quantized_or_memory_bound():
    rate = H100.bf16_tflops * 1e12 * H100.matmul_efficiency * st.SUSTAINED
    m = n = 128 * 132 * 2   # 2 x 132 tiles in each direction: whole waves either way
    assert st._gemm_seconds(H100, m, n, 8192) == pytest.approx(2 * m * n * 8192 / rate)
    # 12 x 11 tiles of 128 x 256 fill the 132 SMs once; a row of tiles more takes a second wave.
    one_wave = st._gemm_seconds(H100, 128 * 12, 256 * 11, 8192)
    assert st._gemm_seconds(H100, 128 * 13, 256 * 11, 8192) == pytest.approx(2 * one_wave, rel=0.01)
    # A thin contraction is bound by moving its operands, not by the tensor cores.
    thin = st._gemm_seconds(H100, 65536, 65536, 8)
    assert thin == pytest.approx(2 * (2 * 65536 * 8 + 65536 ** 2) / (H100.hbm_gbytes_per_s * 1e9
                                                                      * st.MEMORY_EFFICIENCY * st.SUSTAINED))


def test_a_ring_moves_n_minus_1_over_n_of_the_buffer_on_nvlink_or_the_nodes_share_of_its_network():
    gib = 2 ** 30
    within = st._ring_seconds(P5, gib, st._Group(8, 1))
    assert within == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + 7 / 8 * gib / 370e9)
    # One rank a node (tp=8 inside): each GPU's collective has an eighth of the node's cards.
    across = st._ring_seconds(P5, gib, st._Group(16, 8))
    assert across == pytest.approx(15 / 16 * gib / (400e9 * st.NETWORK_EFFICIENCY / 8), rel=0.01)
    # Eight ranks a node of one ring: it leaves the node once, at the node's whole bandwidth.
    assert st._ring_seconds(P5, gib, st._Group(128, 1)) < across / 4
    # An all-reduce is two passes; latency grows with the ring (NCCL's model), so tiny ones cost it alone.
    assert st._ring_seconds(P5, gib, st._Group(16, 8), all_reduce=True) == pytest.approx(2 * across, rel=0.01)
    tiny = st._ring_seconds(P5, 8, st._Group(1024, 1))
    assert tiny == pytest.approx((8.4 + (1023 - 127) * 3.4 + 127 * 9.6) * 1e-6, rel=1e-3)


def test_the_terms_add_up_to_the_step_and_mfu_counts_model_flops():
    w = _workload(pp=4, dp=8, tp=4, microbatches=128)
    step = st.predict(w, P5)
    assert step.seconds == pytest.approx(sum(step.terms.values()))
    assert set(step.terms) == set(st.TERMS)
    assert step.tokens_per_second == pytest.approx(1024 * 4096 / step.seconds)
    assert step.mfu == pytest.approx(st.model_flops_per_token(st.architecture(GPT_70B)) * 1024 * 4096
                                     / (step.seconds * 128 * 989e12))


def test_without_a_pipeline_every_microbatch_gathers_and_reduces_the_whole_model():
    """The shipped gpt-70b layout of 64 microbatches (issue 51): about 4.2 TB a rank a step over EFA."""
    few, many = (st.predict(_workload(dp=16, tp=8, microbatches=m), P5) for m in (16, 64))
    traffic = 64 * 8.73e9 * (2 + 2 + 4) * 15 / 16   # two gathers in bf16, a reduction in fp32
    assert traffic == pytest.approx(4.2e12, rel=0.05)
    floor = traffic / (400e9 * st.NETWORK_EFFICIENCY / 8)
    fsdp = many.terms["FSDP gathers"] + many.terms["FSDP reductions"]
    assert floor - many.terms["compute"] - many.terms["tensor parallel"] < fsdp < floor * 1.05
    assert few.terms["FSDP gathers"] + few.terms["FSDP reductions"] < fsdp / 3, "a quarter of the microbatches"


def test_a_pipeline_gathers_once_a_step_and_reduces_after_its_last_backward():
    flat = st.predict(_workload(dp=16, tp=8, microbatches=64), P5)
    piped = st.predict(_workload(pp=4, dp=8, tp=4, microbatches=128), P5)
    assert piped.terms["FSDP gathers"] < flat.terms["FSDP gathers"] / 20
    assert piped.terms["pipeline bubble"] > 0 and piped.terms["pipeline hand-offs"] > 0
    # Single-stage schedules gather each stage along the fill; runtime schedules only the first.
    j1 = mp.Workload(J1, mp.Layout(pp=8, dp=8, tp=8, microbatches=192, batch_size=1536,
                                   activation_checkpoint="selective"), accelerator="A100")
    one_f_one_b = st.predict(j1, P4D)
    zbv = st.predict(replace(j1, layout=replace(j1.layout, schedule="zbv-zero-bubble")), P4D)
    assert zbv.terms["FSDP gathers"] < one_f_one_b.terms["FSDP gathers"] / 8
    assert zbv.terms["pipeline bubble"] < one_f_one_b.terms["pipeline bubble"] / 4


def test_recomputation_costs_a_forward_when_full_and_little_when_selective():
    steps = {mode: st.predict(_workload(pp=4, dp=8, tp=4, microbatches=128, activation_checkpoint=mode), P5)
             for mode in mp.ACTIVATION_CHECKPOINT_MODES}
    assert steps["none"].terms["recompute"] == 0
    # Selective: the elementwise work, tensor parallel's gathers, the attention output projection.
    assert 0 < steps["selective"].terms["recompute"] < 0.25 * steps["full"].terms["recompute"]
    full = steps["full"].terms   # a forward again: a third of the compute and half the tensor parallel
    assert full["recompute"] == pytest.approx(full["compute"] / 3 + full["tensor parallel"] / 2, rel=0.1)


def test_replicas_all_reduce_and_shards_gather():
    sharded = st.predict(_workload(pp=4, dp=8, tp=4, microbatches=128), P5)
    hybrid = st.predict(_workload(pp=4, dp=8, tp=4, dp_shard=2, microbatches=128), P5)
    assert sharded.terms["HSDP all-reduce"] == 0 < hybrid.terms["HSDP all-reduce"]
    assert hybrid.terms["FSDP gathers"] < sharded.terms["FSDP gathers"], "a gather over 2 ranks, not 8"


def test_the_fastest_layouts_fit_and_no_faster_one_that_fits_was_passed_over():
    small = mp.ModelShape(n_layers=16, d_model=2048, n_heads=16, vocab_size=32000, seq_len=2048)
    w = mp.Workload(small, mp.Layout(batch_size=64), accelerator="A100")
    ranked, runnable = st.fastest_layouts(w, P4D, 2, 39.39, count=3)
    everything = sorted(((st.predict(trial, P4D).tokens_per_second, trial) for trial in st.layouts(w, 2, 8)),
                        key=lambda pair: -pair[0])
    fitting = [trial for _, trial in everything if mp.fits(trial, 39.39)]
    assert runnable == len(everything) and len(ranked) == 3
    assert [r.candidate.workload for r in ranked] == fitting[:3]
    speeds = [r.step.tokens_per_second for r in ranked]
    assert speeds == sorted(speeds, reverse=True)
    kept = st.fastest_layouts(w, P4D, 2, 39.39, frozenset({"tp", "activation_checkpoint"}))[0]
    assert all((r.candidate.workload.layout.tp, r.candidate.workload.layout.activation_checkpoint) == (1, "none")
               for r in kept)


def test_the_fastest_gpt_70b_on_16_p5_is_a_pipeline_far_faster_than_64_microbatches_without_one():
    """Issue 51's case: the layout shipped before, pp=1 with 64 microbatches, against the planner's."""
    before = st.predict(_workload(dp=16, tp=8, microbatches=64), P5)
    (best, *_), _ = st.fastest_layouts(_workload(), P5, 16, 79.18, count=1)
    assert best.candidate.workload.layout.pp > 1
    assert best.step.tokens_per_second > 2.5 * before.tokens_per_second
