"""The trainer config: file formats, precedence, and a clear error for every layout that cannot run."""

import sys
from pathlib import Path

import pytest

from localcloud.waiting import run_captured
from trainer.config import ConfigError, JobConfig, check_world_size, load_config
from trainer.parallel_dims import SCHEDULES
from trainer.train import main

REPO = Path(__file__).resolve().parents[1]


def test_defaults_are_valid():
    assert JobConfig().validate().parallel.schedule in SCHEDULES


def test_every_shipped_config_loads():
    for path in (REPO / "trainer" / "configs").glob("*.toml"):
        load_config(["--config", str(path)])


@pytest.mark.parametrize("suffix, text", [
    (".toml", '[model]\nn_layers = 6\n[parallel]\nlayers_per_stage = [2, 4]\npp = 2\n[checkpoint]\nresume = 1200\nuri = "/tmp/ck"\n'),
    (".yaml", "model:\n  n_layers: 6\nparallel:\n  layers_per_stage: [2, 4]\n  pp: 2\ncheckpoint:\n  resume: 1200\n  uri: /tmp/ck\n"),
])
def test_file_overrides_defaults_and_command_line_overrides_file(tmp_path, suffix, text):
    path = tmp_path / f"job{suffix}"
    path.write_text(text)
    from_file = load_config(["--config", str(path)])
    assert (from_file.model.n_layers, from_file.parallel.layers_per_stage) == (6, [2, 4])
    assert from_file.checkpoint.resume == "1200"
    assert from_file.model.d_model == JobConfig().model.d_model

    both = load_config(["--config", str(path), "--model.n_layers=8", "--parallel.layers_per_stage", "3,5",
                        "--checkpoint.async_save=false", "--optim.lr", "1e-4"])
    assert (both.model.n_layers, both.parallel.layers_per_stage) == (8, [3, 5])
    assert both.checkpoint.async_save is False and both.optim.lr == 1e-4


@pytest.mark.parametrize("overrides, named", [
    (["--parallel.schedule=pipedream"], "parallel.schedule='pipedream' is unknown"),
    (["--parallel.pp=4", "--model.n_layers=3"], "model.n_layers=3"),
    (["--parallel.pp=2", "--parallel.schedule=interleaved-1f1b", "--model.n_layers=3"], "4 pipeline stages"),
    (["--training.batch_size=16", "--parallel.microbatches=3"], "parallel.microbatches=3 must divide"),
    (["--training.batch_size=16", "--parallel.dp=3"], "training.batch_size=16 must be divisible by parallel.dp=3"),
    (["--parallel.pp=2", "--parallel.microbatches=1"], "schedule '1f1b' needs parallel.microbatches >= number"),
    (["--parallel.pp=2", "--parallel.schedule=dualpipev", "--parallel.microbatches=2"], "'dualpipev' needs"),
    (["--parallel.pp=2", "--parallel.schedule=zbv-zero-bubble", "--parallel.stages_per_rank=3"], "a V"),
    (["--parallel.pp=2", "--parallel.schedule=gpipe", "--parallel.stages_per_rank=2"], "exactly one stage"),
    (["--parallel.pp=2", "--parallel.layers_per_stage=4,3"], "parallel.layers_per_stage=[4, 3]"),
    (["--parallel.pp=2", "--model.tie_embeddings=true"], "model.tie_embeddings"),
    (["--model.n_heads=5"], "model.n_heads=5 must divide"),
    (["--model.vocab_size=100"], "model.vocab_size=100"),
    (["--model.n_layers=0"], "model.n_layers must be >= 1"),
    (["--model.n_layers=two"], "model.n_layers='two' is not a valid int"),
    (["--checkpoint.async_save=maybe"], "checkpoint.async_save='maybe' is not a valid bool"),
    (["--checkpoint.resume=yesterday", "--checkpoint.uri=/tmp/ck"], "checkpoint.resume='yesterday'"),
    (["--checkpoint.resume=latest"], "needs checkpoint.uri"),
    (["--checkpoint.keep_last=1"], "checkpoint.keep_last=1"),
    (["--checkpoint.interval=0"], "checkpoint.interval"),
    (["--checkpoint.uri=s3://"], "names no bucket"),
    (["--optim.warmup_steps=500", "--training.steps=100"], "optim.warmup_steps=500"),
    (["--optim.warmup_steps=50", "--optim.decay_steps=50"], "optim.decay_steps=50 must be 0"),
    (["--training.device=tpu"], "training.device='tpu'"),
    (["--parallel.tp=3"], "parallel.tp=3 must divide model.n_heads=4"),
    (["--parallel.tp=2", "--model.vocab_size=258", "--model.tie_embeddings=true"], "model.tie_embeddings=true needs parallel.tp=1"),
    (["--parallel.dp=4", "--parallel.dp_shard=3"], "parallel.dp_shard=3 must divide parallel.dp=4"),
    (["--parallel.reshard_after_forward=sometimes"], "parallel.reshard_after_forward='sometimes'"),
    (["--training.activation_checkpoint=some"], "training.activation_checkpoint='some'"),
    (["--checkpoint.timeout_s=0"], "checkpoint.timeout_s must be > 0"),
    (["--parallel.repair_file=/tmp/order.json"], "parallel.repair_file needs checkpoint.memory_interval > 0"),
    (["--model.architecture=mamba"], "model.architecture='mamba' must be one of gpt, llama"),
    (["--model.n_kv_heads=2"], "model.n_kv_heads=2 applies to the llama family only"),
    (["--model.architecture=llama", "--model.activation=gelu_tanh"], "model.activation='gelu_tanh' applies to the gpt"),
    (["--model.architecture=llama", "--model.n_kv_heads=3"], "model.n_kv_heads=3 must divide model.n_heads=4"),
    (["--model.architecture=llama", "--model.d_model=20"], "must be even: rotary embeddings"),
    (["--model.architecture=llama", "--model.n_heads=8", "--model.n_kv_heads=2", "--parallel.tp=4",
      "--model.vocab_size=260"], "parallel.tp=4 must divide the model's 2 key/value heads (model.n_kv_heads)"),
    (["--model.architecture=llama", "--model.rope_scaling_factor=0.5"], "model.rope_scaling_factor=0.5 (0: none)"),
    (["--model.activation=relu"], "model.activation='relu' must be one of gelu, gelu_tanh"),
    (["--training.init_from=s3://bucket/models/x"], "training.init_from needs checkpoint.uri"),
    (["--checkpoint.memory_interval=1", "--checkpoint.memory_dir=/dev/shm/x"], "checkpoint.memory_interval needs "
                                                                                  "checkpoint.uri"),
    (["--parallel.repair_file=/tmp/order.json", "--checkpoint.memory_interval=1", "--parallel.timeout_s=600",
      "--parallel.repair_wait_s=600"], "parallel.repair_wait_s=600 must exceed parallel.timeout_s=600: a rank that "
                                       "left a failed world waits for the repair order longer"),
    (["--model.width=3"], "unknown field model.width"),
    (["--modle.n_layers=3"], "unknown config section 'modle'"),
    (["stray"], "unexpected argument 'stray'"),
    (["--config", "/no/such/file.toml"], "does not exist"),
])
def test_bad_config_names_the_problem(overrides, named):
    with pytest.raises(ConfigError) as error:
        load_config(overrides)
    assert named in str(error.value)


def test_world_size_must_match_the_layout():
    check_world_size(load_config(["--parallel.pp=2", "--parallel.dp=2"]), 4)
    with pytest.raises(ConfigError, match=r"world size 3 != parallel.pp x dp x tp = 2 x 2 x 1 = 4"):
        check_world_size(load_config(["--parallel.pp=2", "--parallel.dp=2"]), 3)
    check_world_size(load_config(["--parallel.pp=2", "--parallel.tp=2", "--model.vocab_size=258"]), 4)


def test_bad_launch_fails_before_any_process_group(monkeypatch, capsys):
    # torchrun sets these; a process group would block waiting for the other 3 ranks.
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main(["--parallel.pp=2", "--parallel.dp=2"]) == 2
    assert "world size 3 != parallel.pp x dp x tp" in capsys.readouterr().err


def test_bad_config_from_the_command_line_exits_with_the_message():
    result = run_captured([sys.executable, "-m", "trainer.train", "--parallel.schedule=nope"], what="the trainer",
                          cwd=REPO)
    assert result.returncode == 2
    assert "config error: parallel.schedule='nope' is unknown" in result.stderr
