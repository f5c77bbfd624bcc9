"""The training loop in one process: LR schedule, non-finite loss, the state dict's names, the CLI."""

import collections
import copy
import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import OptimConfig, load_config
from trainer.model import GPT
from trainer.progress import PROGRESS_FILE_ENV, progress_file, read_progress
from trainer.train import NonFiniteLossError, build, environment, lr_factor, main, train_step


def tiny_args(tmp_path) -> list[str]:
    return ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=2", "--model.seq_len=16",
            "--training.batch_size=4", "--parallel.microbatches=2", "--training.steps=4", "--optim.warmup_steps=2",
            f"--data.shards={tmp_path}/shards", "--data.corpus=stdlib", "--data.corpus_bytes=20000",
            f"--training.metrics_file={tmp_path}/metrics.jsonl"]


def tiny(tmp_path):
    return load_config(tiny_args(tmp_path))


def test_lr_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    cfg = OptimConfig(warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_factor(s, cfg, 12) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(8, cfg, 12) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(12, cfg, 12) == pytest.approx(0.1)
    assert all(lr_factor(s, cfg, 12) >= lr_factor(s + 1, cfg, 12) for s in range(4, 12))


def test_a_decay_shorter_than_the_run_holds_the_floor_after_it():
    cfg = OptimConfig(warmup_steps=2, decay_steps=6, min_lr_ratio=0.1)
    assert lr_factor(1, cfg, 10) == 1.0
    assert lr_factor(4, cfg, 10) == pytest.approx(0.1 + 0.9 * 0.5)
    assert [lr_factor(s, cfg, 10) for s in range(6, 11)] == pytest.approx([0.1] * 5)


CONFIGS = Path(__file__).resolve().parent.parent / "trainer" / "configs"
PUBLISHED_SCHEDULES = {
    # GPT-3 175B's (Brown et al. 2020, table 2.1, appendix B), which J1-Jumbo's white paper matches
    # in peak rate and batch: warmup over 375 M tokens, cosine to 10 % over 260 B tokens of 300 B.
    "jurassic-1-jumbo.toml": {"peak": 0.6e-4, "warmup_tokens": 375e6, "decay_tokens": 260e9, "run_tokens": 300e9},
    # Llama 2 (Touvron et al. 2023, section 2.2, table 1): 2,000 warmup steps of 4 M tokens,
    # cosine to 10 % at the end of 2 T tokens.
    "gpt-7b.toml": {"peak": 3.0e-4, "warmup_tokens": 2000 * 4 * 2**20, "decay_tokens": 2e12, "run_tokens": 2e12},
    "gpt-70b.toml": {"peak": 1.5e-4, "warmup_tokens": 2000 * 4 * 2**20, "decay_tokens": 2e12, "run_tokens": 2e12},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_SCHEDULES))
def test_a_large_configs_learning_rate_follows_its_published_schedule(name):
    """The learning rate the config gives each step, read at the token counts the papers state."""
    published = PUBLISHED_SCHEDULES[name]
    cfg = load_config(["--config", str(CONFIGS / name)])
    tokens_per_step = cfg.training.batch_size * cfg.model.seq_len

    def lr_after(tokens: float) -> float:  # the rate of the step that begins after `tokens`
        return cfg.optim.lr * lr_factor(round(tokens / tokens_per_step), cfg.optim, cfg.training.steps)

    peak, warmup, decay = published["peak"], published["warmup_tokens"], published["decay_tokens"]
    warmup_increment = peak * tokens_per_step / warmup  # what one step of warmup adds
    assert cfg.training.steps * tokens_per_step == pytest.approx(published["run_tokens"], rel=1e-4)
    assert lr_after(0) == pytest.approx(warmup_increment, rel=0.01)  # linear from 0
    assert lr_after(warmup / 2) == pytest.approx(peak / 2, abs=2 * warmup_increment)  # to a step
    assert lr_after(warmup) == pytest.approx(peak, rel=1e-3)
    assert lr_after((warmup + decay) / 2) == pytest.approx(peak * 0.55, rel=1e-3)  # the cosine's midpoint
    assert lr_after(decay) == pytest.approx(peak * 0.1, rel=1e-3)
    assert lr_after(published["run_tokens"]) == pytest.approx(peak * 0.1, rel=1e-3)


def test_non_finite_loss_stops_with_a_clear_error(tmp_path):
    cfg = tiny(tmp_path)
    run = build(cfg, environment(cfg, torch.device("cpu")))
    train_step(run)
    before = run.pipeline.model_parts[0].layers["1"].mlp.fc.weight.detach().clone()
    with torch.no_grad():
        run.pipeline.model_parts[0].layers["0"].mlp.fc.weight[0, 0] = math.nan
    with pytest.raises(NonFiniteLossError, match=r"step 2: loss is nan"):
        train_step(run)
    assert torch.equal(run.pipeline.model_parts[0].layers["1"].mlp.fc.weight, before)  # no update applied


def test_train_state_is_keyed_by_the_full_models_names(tmp_path):
    cfg = tiny(tmp_path)
    run = build(cfg, environment(cfg, torch.device("cpu")))
    train_step(run)
    state = run.state.state_dict()
    full_names = set(dict(GPT(cfg.model).named_parameters()))
    assert set(state["model"]) == full_names
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in state["optimizer"] if k.startswith("state.")} == full_names
    assert state["step"] == 1 and state["sampler"] == {"sequences_drawn": 4, "seed": 0}


def test_loading_a_state_replays_the_same_step(tmp_path):
    cfg = tiny(tmp_path)
    run = build(cfg, environment(cfg, torch.device("cpu")))
    train_step(run)
    saved = copy.deepcopy(run.state.state_dict())
    expected = train_step(run)["loss"]
    run.state.load_state_dict(saved)
    assert run.state.step == 1
    assert train_step(run)["loss"] == expected


def test_cli_logs_each_step_and_writes_jsonl(tmp_path, capsys):
    assert main([*tiny_args(tmp_path), "--training.steps=3"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(lines) == 3 and "tok/s" in lines[0] and "s/step" in lines[0]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"loss", "tokens_per_s", "step_time_s", "lr", "grad_norm"} <= set(records[0])


def test_a_tied_head_reads_the_token_embedding(tmp_path):
    cfg = load_config([*tiny_args(tmp_path), "--model.tie_embeddings=true"])
    run = build(cfg, environment(cfg, torch.device("cpu")))
    (model,) = run.pipeline.model_parts
    assert model.head is None and "head.weight" not in run.state.state_dict()["model"]
    losses = [train_step(run)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] and model.tok_emb.weight.grad is not None


def test_local_rank_0_writes_the_nodes_progress_for_its_agent(tmp_path, monkeypatch):
    progress = tmp_path / "progress"
    monkeypatch.setenv(PROGRESS_FILE_ENV, str(progress))
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main([*tiny_args(tmp_path), "--training.steps=3"]) == 0
    assert read_progress(progress) == 3
    # A sign of life for each phase of the start-up (up, world formed, model built, joined at
    # step 0), each of the 2 microbatches of every step, and each step: the agent tells a slow
    # step from a silent one by them.
    assert progress.read_text().split() == ["3", str(4 + 3 * 2 + 3)]
    monkeypatch.setenv("LOCAL_RANK", "1")  # the other ranks of a node leave it to local rank 0
    assert progress_file() is None


def test_non_finite_gradient_norm_stops_before_the_update(tmp_path):
    cfg = tiny(tmp_path)
    run = build(cfg, environment(cfg, torch.device("cpu")))
    weight = run.pipeline.model_parts[0].layers["0"].mlp.fc.weight
    before = weight.detach().clone()
    weight.register_hook(lambda grad: grad * math.inf)  # the loss stays finite, the gradient does not
    with pytest.raises(NonFiniteLossError, match=r"step 1: loss is [0-9.]+, gradient norm is (inf|nan)"):
        train_step(run)
    assert torch.equal(weight.detach(), before)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def _ops_in_one_step(run) -> collections.Counter:
    inputs, targets = run.state.loader.next_batch()
    with _OpCounter() as counter:
        run.pipeline.forward_backward(inputs, targets)
    return counter.counts


LLAMA = ["--model.architecture=llama", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.multiple_of=16",
         "--model.rope_scaling_factor=8", "--model.rope_original_seq_len=8"]
"""The tiny model in the llama family: grouped-query attention, SwiGLU, Llama 3's rotary scaling."""


@pytest.mark.parametrize("family, matmul, activation", [([], "addmm", "gelu"), (LLAMA, "mm", "silu")],
                         ids=["gpt", "llama"])  # llama's matrices have no bias: mm, not addmm
def test_activation_checkpointing_recomputes_what_its_mode_says_and_trains_the_same(tmp_path, family, matmul,
                                                                                    activation):
    curves, ops = {}, {}
    for mode in ("none", "selective", "full"):
        cfg = load_config([*tiny_args(tmp_path), *family, f"--training.activation_checkpoint={mode}"])
        run = build(cfg, environment(cfg, torch.device("cpu")))
        ops[mode] = _ops_in_one_step(run)
        run = build(cfg, environment(cfg, torch.device("cpu")))
        curves[mode] = [value for m in (train_step(run) for _ in range(3)) for value in (m["loss"], m["grad_norm"])]
    # Selective keeps the matmul outputs and recomputes the elementwise work; full recomputes both.
    assert ops["selective"][matmul] == ops["none"][matmul] < ops["full"][matmul]
    assert ops["none"][activation] < ops["selective"][activation] == ops["full"][activation]
    for mode in ("selective", "full"):
        assert curves[mode] == pytest.approx(curves["none"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("family", [[], LLAMA], ids=["gpt", "llama"])
def test_compiled_blocks_train_the_same(tmp_path, family):
    histories = {}
    for compiled in (False, True):
        cfg = load_config([*tiny_args(tmp_path), *family, f"--training.compile={compiled}"])
        run = build(cfg, environment(cfg, torch.device("cpu")))
        histories[compiled] = [value for m in (train_step(run) for _ in range(2)) for value in (m["loss"], m["grad_norm"])]
    assert histories[True] == pytest.approx(histories[False], rel=1e-4)
