"""The memory plan's pure functions, and `trainfleet plan` (no torch here: the module must not need it)."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from trainfleet import cli
from trainfleet.core import memory_plan as mp

REPO = Path(__file__).resolve().parent.parent
J1 = mp.ModelShape(n_layers=76, d_model=13824, n_heads=96, vocab_size=256000, seq_len=2048)
J1_CONFIG = str(REPO / "trainer" / "configs" / "jurassic-1-jumbo.toml")
SMALL = mp.ModelShape(n_layers=8, d_model=256, n_heads=4, vocab_size=512, seq_len=128)


def test_the_module_imports_without_torch():
    code = ("import sys; import trainfleet.core.memory_plan, functions.validate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_jurassic_1_jumbo_has_its_published_size_with_an_untied_head():
    # 12 d^2 per layer + biases and norms, two embeddings of vocab rows and the position table.
    blocks = 76 * (12 * 13824 ** 2 + 13 * 13824)
    assert mp.parameter_count(J1) == blocks + 2 * 256000 * 13824 + 2048 * 13824 + 2 * 13824
    tied = replace(J1, tie_embeddings=True)
    assert round(mp.parameter_count(tied) / 1e9) == 178  # J1 as published ties them


def test_activation_bytes_per_layer_follow_the_derivation():
    u = 2 * SMALL.seq_len * SMALL.d_model  # microbatch of 2
    assert mp.activation_bytes(SMALL, 2, 1, "none", mixed_precision=False) == 64 * u  # 16 fp32 tensors of u
    assert mp.activation_bytes(SMALL, 2, 1, "none", mixed_precision=True) == 36 * u
    assert mp.activation_bytes(SMALL, 2, 1, "selective", mixed_precision=True) == 22 * u
    assert mp.activation_bytes(SMALL, 2, 1, "full", mixed_precision=True) == 2 * u
    # Sequence parallel splits all but the two gathered matmul inputs (2 bytes x u each).
    assert mp.activation_bytes(SMALL, 2, 4, "none", mixed_precision=True) == 4 * u + 32 * u // 4
    assert mp.activation_bytes(SMALL, 2, 4, "full", mixed_precision=True) == 2 * u // 4
    with pytest.raises(ValueError, match="activation_checkpoint 'some'"):
        mp.activation_bytes(SMALL, 2, 1, "some", mixed_precision=True)


@pytest.mark.parametrize("schedule, rank, expected", [
    ("gpipe", 0, 16), ("gpipe", 3, 16), ("1f1b", 0, 4), ("1f1b", 3, 1), ("looped-bfs", 0, 32),
    ("interleaved-1f1b", 0, 11), ("interleaved-1f1b", 3, 5), ("zbv-zero-bubble", 0, 8), ("dualpipev", 2, 9),
])
def test_microbatches_in_flight_by_schedule(schedule, rank, expected):
    stages_per_rank = 1 if schedule in ("gpipe", "1f1b") else 2
    assert mp.in_flight(schedule, 4, stages_per_rank, 16, rank) == expected
    assert mp.in_flight(schedule, 1, stages_per_rank, 16, 0) == 1  # no pipeline: one after another


def _workload(shape=SMALL, mixed_precision=True, **layout) -> mp.Workload:
    return mp.Workload(shape, mp.Layout(**{"batch_size": 64, "microbatches": 8, **layout}), mixed_precision)


def test_fsdp_shards_parameters_gradients_and_both_moments_over_dp_shard():
    whole = mp.rank_memory(_workload(dp=1), 0).components
    sharded = mp.rank_memory(_workload(dp=4), 0).components
    for name in ("parameters", "gradients"):
        assert sharded[name] == pytest.approx(whole[name] / 4, abs=16)
    assert whole["optimizer"] == 2 * whole["parameters"]
    replicated = mp.rank_memory(_workload(dp=4, dp_shard=2), 0).components
    assert replicated["parameters"] == pytest.approx(whole["parameters"] / 2, abs=16)


def test_a_pipeline_keeps_the_stage_gathered_in_bf16_and_its_gradients_unsharded_in_fp32():
    for reshard in ("auto", "always"):  # PipelineStage does not reshard after a backward, whatever is asked
        piped = mp.rank_memory(_workload(pp=2, dp=4, reshard_after_forward=reshard), 0)
        local_params = piped.components["parameters"] * 4 // mp.FP32  # the shard x dp_shard
        assert piped.components["gathered parameters"] == pytest.approx(local_params * mp.BF16, rel=1e-3)
        assert piped.components["unsharded gradients"] == pytest.approx(local_params * mp.FP32, rel=1e-3)
    # Without a pipeline, resharding after forward keeps only the blocks at work gathered.
    flat = mp.rank_memory(_workload(dp=8), 0).components
    assert flat["gathered parameters"] < mp.rank_memory(_workload(dp=8, reshard_after_forward="never"),
                                                        0).components["gathered parameters"]


def test_without_a_pipeline_each_microbatch_reduce_scatters_its_gradients():
    """One unit's unsharded gradient at a time, never the part's: 4 bytes a parameter would be
    +25 GiB on a 7B model's GPU."""
    accumulating = mp.rank_memory(_workload(shape=J1, tp=8, dp=8, batch_size=64, microbatches=8,
                                            activation_checkpoint="full"), 0)
    local = accumulating.components["parameters"] * 8 // mp.FP32
    assert accumulating.components["unsharded gradients"] < local * mp.FP32 / 20
    assert accumulating.components["gradients"] == accumulating.components["parameters"]
    # With replicas, a sharded partial sum waits for the last microbatch's all-reduce.
    hybrid = mp.rank_memory(_workload(shape=J1, tp=8, dp=8, dp_shard=4, batch_size=64, microbatches=8,
                                      activation_checkpoint="full"), 0)
    assert hybrid.components["gradients"] == 2 * hybrid.components["parameters"]


def test_the_peak_is_one_moment_of_the_step():
    # One microbatch: the gradients grow only as the activations are freed, so the peak holds one or the other.
    single = mp.rank_memory(_workload(mixed_precision=False, microbatches=1), 0)
    assert single.peak == "activations" and single.components["gradients"] == 0
    # Several microbatches: the first's gradients are alive while the next holds its activations.
    several = mp.rank_memory(_workload(mixed_precision=False, microbatches=8), 0)
    assert several.peak == "activations" and several.components["gradients"] == several.components["parameters"]
    # A model of parameters and little else peaks when its gradients are complete.
    wide = mp.ModelShape(n_layers=2, d_model=2048, n_heads=16, vocab_size=50304, seq_len=8)
    heavy = mp.rank_memory(_workload(shape=wide, mixed_precision=False, microbatches=1), 0)
    assert heavy.peak == "gradients" and heavy.components["gradients"] == heavy.components["parameters"]
    assert mp.grads_alive_at_activation_peak(held=4, stages_here=1, microbatches=8)       # 1F1B past its warm-up
    assert not mp.grads_alive_at_activation_peak(held=8, stages_here=1, microbatches=8)   # GPipe


def test_cpu_runs_are_fp32_without_copies_or_allowance():
    memory = mp.rank_memory(_workload(mixed_precision=False), 0)
    assert memory.components["gathered parameters"] == memory.components["unsharded gradients"] == 0
    assert memory.allowance == 0


def test_the_gpu_allowance_counts_the_context_each_nccl_communicator_and_fragmentation():
    on_h100 = mp.rank_memory(_workload(pp=2, dp=4), 0)  # the world, pp and dp_shard: three communicators
    assert mp.Layout(pp=2, dp=4).communicators == 3 and mp.Layout().communicators == 1
    assert mp.Layout(pp=2, dp=4, dp_shard=2, tp=8).communicators == 5
    assert on_h100.allowance == (mp.CUDA_CONTEXT_BYTES + 3 * mp.NCCL_COMMUNICATOR_BYTES["H100"]
                                 + int(mp.FRAGMENTATION_FRACTION * on_h100.tensors))
    on_a100 = mp.rank_memory(replace(_workload(pp=2, dp=4), accelerator="A100"), 0)
    assert on_a100.tensors == on_h100.tensors and on_a100.allowance < on_h100.allowance


def test_the_fullest_rank_decides():
    w = _workload(pp=4, dp=2, schedule="1f1b")
    ranks = [mp.rank_memory(w, r) for r in range(4)]
    assert mp.fullest_rank(w).total == max(r.total for r in ranks)
    assert ranks[0].components["activations"] > ranks[3].components["activations"]  # 1F1B's warm-up
    assert ranks[3].components["logits"] > 0 == ranks[0].components["logits"]


def test_checkpointing_and_more_stages_cut_memory():
    totals = [mp.fullest_rank(_workload(shape=J1, pp=8, tp=8, dp=8, batch_size=1536, microbatches=192,
                                        activation_checkpoint=mode)).total for mode in ("none", "selective", "full")]
    assert totals[0] > totals[1] > totals[2]
    assert mp.fullest_rank(_workload(shape=J1, pp=16, tp=8, dp=4, batch_size=1536, microbatches=384)).total < \
        mp.fullest_rank(_workload(shape=J1, pp=8, tp=8, dp=8, batch_size=1536, microbatches=192)).total


def test_the_planner_prefers_fewest_nodes_then_least_recompute_then_smallest_tp():
    w = _workload(shape=J1, batch_size=1536)
    found = mp.smallest_fleet(w, ranks_per_node=8, memory_gib=80, max_nodes=64)
    assert found is not None and mp.fits(found.workload, 80)
    assert mp.best_fit(w, found.nodes - 1, 8, 80) is None  # one node fewer: nothing fits
    # On the same fleet, every layout before the chosen one does not fit, in the stated order.
    order = list(mp.plan_layouts(w, found.nodes, 8))
    keys = [(mp.ACTIVATION_CHECKPOINT_MODES.index(c.workload.layout.activation_checkpoint), c.workload.layout.tp,
             c.workload.layout.pp) for c in order]
    assert keys == sorted(keys)
    chosen = order.index(found)
    assert all(c.memory.total > 80 * mp.GIB for c in order[:chosen])
    # A small model fits on one node with no recompute and no tensor parallel.
    small = mp.smallest_fleet(_workload(), 8, 80, 4)
    assert (small.nodes, small.workload.layout.activation_checkpoint, small.workload.layout.tp) == (1, "none", 1)


def test_fixed_fields_are_kept():
    w = _workload(shape=J1, batch_size=1536, tp=4, activation_checkpoint="full")
    for candidate in mp.plan_layouts(w, 32, 8, frozenset({"tp", "activation_checkpoint"})):
        assert (candidate.workload.layout.tp, candidate.workload.layout.activation_checkpoint) == (4, "full")


def test_memory_problem_gives_the_figures_and_a_proposal():
    w = _workload(shape=J1, pp=2, tp=8, batch_size=16, microbatches=16)
    problem = mp.memory_problem(w, "p4d.24xlarge", 8, 40)
    assert problem.startswith("the layout needs ")
    for name in mp.COMPONENTS:
        assert name in problem
    assert "smallest fleet that fits: 16 x p4d.24xlarge" in problem
    assert mp.memory_problem(_workload(), "p5.48xlarge", 8, 80) is None


def test_the_checkpoints_take_four_copies_of_a_nodes_share_in_its_tmpfs_and_two_staged_in_its_processes():
    """The in-memory copies' staged state and the S3 saves' (pinned on a GPU node) stay from one
    copy or save to the next; a copy streams from file to file and holds no buffer of its size."""
    w = _workload(shape=J1, pp=8, dp=1, tp=8, batch_size=64, microbatches=32, activation_checkpoint="full")
    share = max(mp.state_bytes(w, r) for r in range(8)) * 8
    assert mp.state_bytes(w, 0) == sum(mp.rank_memory(w, 0).components[c] for c in ("parameters", "optimizer"))
    assert mp.host_memory_per_node(w, 8) == (4 * share, 2 * share)
    # J1 on 8 p4de: 72 GiB of its 79 GiB GPUs, but 1,026 GiB of copies against a 576 GiB tmpfs.
    assert mp.fits(w, 79.35)
    problem = mp.host_memory_problem(w, "p4de.24xlarge", 8, 1152)
    assert problem.startswith("the in-memory checkpoints need 1025.5 GiB of a node's tmpfs (/dev/shm: 576 GiB")
    assert "set checkpoint.memory_interval_steps to 0" in problem
    # Twice the nodes halve each one's share.
    assert mp.host_memory_problem(replace(w, layout=replace(w.layout, dp=2)), "p4de.24xlarge", 8, 1152) is None


# --- trainfleet plan ---------------------------------------------------------------------------

def _plan(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_accepts_a_layout_that_fits(capsys):
    code, out, _ = _plan(capsys, "--model", J1_CONFIG, "--instance-type",
                         "p5.48xlarge", "--nodes", "64")
    assert code == 0
    assert "layout (as configured): pp=8 dp=8 tp=8" in out and "fits:" in out and "GiB" in out
    assert "not yet measured on a GPU" in out, "what the figures rest on, where they are read"


def test_plan_refuses_a_layout_that_does_not_fit_and_proposes_the_smallest_fleet(capsys):
    code, out, _ = _plan(capsys, "--model", J1_CONFIG, "--instance-type", "p4d.24xlarge", "--nodes", "64",
                         "--activation-checkpoint", "none", "--tp", "8", "--pp", "8", "--schedule", "1f1b")
    assert code == 1
    assert "DOES NOT FIT" in out and "activations" in out
    assert "smallest fleet that fits:" in out and "activation_checkpoint=none" in out


GPT_70B_CONFIG = str(REPO / "trainer" / "configs" / "gpt-70b.toml")


def test_plan_predicts_the_configured_layout_and_ranks_it_with_the_fastest(capsys):
    code, out, _ = _plan(capsys, "--model", GPT_70B_CONFIG, "--instance-type", "p5.48xlarge", "--nodes", "16")
    assert code == 0
    configured, ranking = out.split("fastest layouts that fit on 16 x p5.48xlarge")
    assert "layout (as configured): pp=4 dp=8 tp=4" in configured and "fits:" in configured
    assert "predicted step on 16 x p5.48xlarge (8 x H100 SXM5 80GB, 3,200 Gb/s a node):" in configured
    assert "tokens/s" in configured and "MFU" in configured and "pipeline bubble" in configured
    # The shipped config is the planner's pick: first of the three, with each one's terms.
    places = [line for line in ranking.splitlines() if line[:2] in ("1.", "2.", "3.")]
    assert len(places) == 3 and places[0].startswith("1. pp=4 dp=8 tp=4")
    assert ranking.count("  step ") == 3 and ranking.count("  compute ") == 3


def test_plan_predicts_a_layout_given_in_full_as_given(capsys):
    code, out, _ = _plan(capsys, "--model", GPT_70B_CONFIG, "--instance-type", "p5.48xlarge", "--nodes", "16",
                         "--pp", "1", "--tp", "8", "--dp", "16", "--dp-shard", "16", "--microbatches", "64",
                         "--activation-checkpoint", "none", "--schedule", "1f1b")
    assert code == 0
    assert "layout (as given): pp=1 dp=16 tp=8 dp_shard=16 schedule=1f1b microbatches=64" in out
    assert "FSDP gathers" in out and "FSDP reductions" in out and "fastest layouts" not in out


def test_plan_ranks_the_fastest_layouts_keeping_what_is_given(capsys):
    code, out, _ = _plan(capsys, "--model", J1_CONFIG, "--instance-type", "p5.48xlarge", "--nodes", "16",
                         "--tp", "8")
    assert code == 0 and "fastest layouts that fit on 16 x p5.48xlarge" in out
    places = [line for line in out.splitlines() if line[:2] in ("1.", "2.", "3.")]
    assert len(places) == 3 and all(" tp=8 " in line for line in places)
    assert "the fastest, on its fullest GPU:" in out and "device memory" in out


def test_plan_on_a_type_the_step_time_model_does_not_describe_plans_by_memory(capsys):
    code, out, _ = _plan(capsys, "--model", str(REPO / "trainer" / "configs" / "gpt-7b.toml"), "--instance-type",
                         "trn1.32xlarge", "--nodes", "4")
    assert "the step-time model describes no accelerator of trn1.32xlarge" in out
    assert "layout (planned)" in out and "predicted step" not in out


def test_plan_on_a_cpu_type_says_it_does_not_check(capsys):
    code, out, _ = _plan(capsys, "--model", str(REPO / "trainer" / "configs" / "small.toml"),
                         "--instance-type", "c5.xlarge", "--nodes", "1")
    assert code == 0 and "not checked" in out


@pytest.mark.parametrize("args, message", [
    (["--model", "trainer/configs/small.toml", "--instance-type", "p9.huge", "--nodes", "1"],
     "trainfleet plan: instance type 'p9.huge' is not in the catalogue"),
    (["--model", "README.md", "--instance-type", "p5.48xlarge", "--nodes", "1"],
     "trainfleet plan: config file README.md must end in .toml, .yaml or .yml"),
    (["--model", "nowhere.toml", "--instance-type", "p5.48xlarge", "--nodes", "1"],
     "trainfleet plan: config file nowhere.toml does not exist"),
])
def test_plan_bad_input_is_one_line(capsys, monkeypatch, args, message):
    monkeypatch.chdir(REPO)
    code, out, err = _plan(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "argument --nodes: must be >= 1, got 0"),
    (["--nodes", "1", "--schedule", "fast"], "argument --schedule: invalid choice: 'fast'"),
])
def test_plan_bad_arguments_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--model", J1_CONFIG, "--instance-type", "p5.48xlarge", *args])
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("name, nodes, billions, hidden", [
    ("llama3-8b", 4, 8.03, 14336), ("llama3-70b", 16, 70.55, 28672), ("llama3-405b", 128, 405.85, 53248)])
def test_the_llama_3_configs_have_their_published_shapes_and_fit_their_fleets(capsys, name, nodes, billions, hidden):
    from trainer.config import load_config

    model = load_config(["--config", str(REPO / "trainer" / "configs" / f"{name}.toml")]).model
    shape = mp.ModelShape.of(model)
    assert (shape.architecture, shape.n_kv_heads, shape.hidden, shape.vocab_size) == ("llama", 8, hidden, 128256)
    assert round(mp.parameter_count(shape) / 1e9, 2) == billions
    code, out, _ = _plan(capsys, "--model", str(REPO / "trainer" / "configs" / f"{name}.toml"),
                         "--instance-type", "p5.48xlarge", "--nodes", str(nodes))
    assert code == 0 and "layout (as configured)" in out and "sharing 8 key/value heads" in out
