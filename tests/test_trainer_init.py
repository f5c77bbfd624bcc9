"""The weights' initial values: drawn by position, so a shard is drawn alone and every layout
starts from the single-process model; not drawn at all where a restore follows."""

import pytest
import torch

from trainer import model
from trainer.config import load_config
from trainer.model import INIT_BLOCK, INIT_STD, initial_values
from trainer.pipeline_parallel import Pipeline, build_pipeline
from trainer.train import environment, train

LLAMA = ["--model.architecture=llama", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.multiple_of=16"]
"""The llama family, grouped-query attention and a SwiGLU MLP by Llama's rule."""


@pytest.mark.parametrize("shape, offset, size", [
    ((300, 100), (100, 30), (120, 50)),       # a block of rows and columns (FSDP over tensor parallel)
    ((70_000, 3), (65_000, 1), (5_000, 2)),   # rows across a block's edge, a column split
    ((3, INIT_BLOCK + 7), (1, 5), (2, INIT_BLOCK)),  # rows longer than a block
    ((200_000,), (131_070,), (10,)),          # one dimension, across two blocks
])
def test_a_shard_is_the_same_region_of_the_whole_value(shape, offset, size):
    whole = initial_values("layers.0.mlp.fc.weight", torch.Size(shape), 7, 4)
    shard = initial_values("layers.0.mlp.fc.weight", torch.Size(shape), 7, 4, region=(offset, size))
    assert torch.equal(shard, whole[tuple(slice(o, o + n) for o, n in zip(offset, size))])


def test_values_are_normal_scaled_per_name_and_differ_by_name_and_seed(monkeypatch):
    monkeypatch.setattr(model, "INIT_CHUNK", 1000)  # drawn in many chunks: the same values
    fc = initial_values("layers.0.mlp.fc.weight", torch.Size((512, 256)), 0, 4)
    assert torch.equal(fc, initial_values("layers.0.mlp.fc.weight", torch.Size((512, 256)), 0, 4,
                                          region=((0, 0), (512, 256))))
    proj = initial_values("layers.0.mlp.proj.weight", torch.Size((512, 256)), 0, 4)
    assert fc.std().item() == pytest.approx(0.02, rel=0.02) and abs(fc.mean().item()) < 1e-3
    assert proj.std().item() == pytest.approx(0.02 / 8 ** 0.5, rel=0.02)  # GPT-2's residual scaling
    assert not torch.equal(fc, initial_values("layers.1.mlp.fc.weight", torch.Size((512, 256)), 0, 4))
    assert not torch.equal(fc, initial_values("layers.0.mlp.fc.weight", torch.Size((512, 256)), 1, 4))
    assert torch.equal(initial_values("layers.0.attn_norm.weight", torch.Size((8,)), 0, 4), torch.ones(8))
    assert torch.equal(initial_values("layers.0.attn.q.bias", torch.Size((8,)), 0, 4), torch.zeros(8))


def test_the_llama_family_starts_by_the_rules_of_its_parameters_names():
    """Built on the meta device and filled where its shards are, as GPT is: RMSNorm's weights
    ones, every matrix normal, the output projections (attention's and SwiGLU's down, both
    `proj`) scaled by depth; no parameter left as to_empty's memory."""
    cfg = load_config([*LLAMA, "--model.n_layers=4", "--model.d_model=64", "--model.vocab_size=512"])
    (part,) = build_pipeline(cfg, torch.device("cpu")).model_parts
    params = dict(part.named_parameters())
    assert {name for name in params if name.startswith("layers.0.")} == {
        f"layers.0.{name}.weight" for name in ("attn_norm", "attn.q", "attn.k", "attn.v", "attn.proj", "mlp_norm",
                                               "mlp.gate", "mlp.up", "mlp.proj")}
    assert params["layers.0.attn.k.weight"].shape == (32, 64)  # two key/value heads of 16
    for name, param in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        std = INIT_STD / 8 ** 0.5 if name.endswith("proj.weight") else INIT_STD
        assert param.std().item() == pytest.approx(std, rel=0.1) and abs(param.mean().item()) < std / 10, name
        assert torch.equal(param, initial_values(name, param.shape, cfg.training.seed, 4)), name


@pytest.mark.parametrize("family", [[], LLAMA], ids=["gpt", "llama"])
def test_a_run_that_resumes_draws_no_initial_values(tmp_path, monkeypatch, family):
    drawn = []
    fill = Pipeline.initialise
    monkeypatch.setattr(Pipeline, "initialise", lambda self, seed, n_layers: drawn.append(1) or fill(self, seed,
                                                                                                     n_layers))
    args = ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=2", "--model.seq_len=16",
            "--training.batch_size=4", "--parallel.microbatches=2", "--optim.warmup_steps=1",
            f"--data.shards={tmp_path}/shards", "--data.corpus=stdlib", "--data.corpus_bytes=20000",
            f"--training.metrics_file={tmp_path}/metrics.jsonl", f"--checkpoint.uri={tmp_path}/checkpoints",
            "--checkpoint.interval=2", "--checkpoint.async_save=false", *family]
    first = load_config([*args, "--training.steps=2", "--checkpoint.resume=none"])
    train(first, environment(first, torch.device("cpu")))
    assert drawn == [1]  # a fresh start draws them
    resumed = load_config([*args, "--training.steps=3", "--checkpoint.resume=latest"])
    assert [m["step"] for m in train(resumed, environment(resumed, torch.device("cpu")))] == [3]
    assert drawn == [1], "resumed from step 2: nothing drawn"
