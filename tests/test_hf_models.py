"""Hugging Face's stock classes both ways, for both families (trainer/hf.py, hf_import.py, export.py),
against transformers itself (pinned in the dev extra), with models and tokenizers made here:

- a checkpoint trained at pp=2 x tp=2, exported, loads with AutoModelForCausalLM and AutoTokenizer
  (no remote code) and gives the trainer's own logits within 1e-4 (fp32);
- a model transformers makes (random weights; llama with grouped-query attention and Llama 3's
  rotary scaling, GPT-2 with its tied head and gelu_new), imported and exported, comes back
  bit-identical;
- a run started from an imported checkpoint reports as its first loss the one transformers
  computes on the same batch;
- transformers' greedy generation is `trainfleet sample --greedy`'s;
- an import from S3, and the refusals, naming the field, with nothing written.
"""

import json
import os
import stat
import warnings
from pathlib import Path

import boto3
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import free_port, spawn_ranks
from trainer import tokenizer as tokenizers
from trainer.checkpoint import Checkpointer
from trainer.config import load_config
from trainer.export import export, exported_tokenizer, load_exported
from trainer.hf_import import ImportRefused, import_checkpoint
from trainer.sample import generate_ids
from trainer.train import build, environment

pytestmark = pytest.mark.slow
warnings.filterwarnings("ignore", module="transformers")

MODELS = {
    "gpt": ["--model.n_layers=2", "--model.d_model=32", "--model.n_heads=2"],  # exact GELU: "gelu" for transformers
    # The tests' Llama (two query heads per key/value head, Llama 3's rotary scaling), in 32 positions.
    "llama": ["--config", str(Path(__file__).parents[1] / "trainer" / "configs" / "llama-tiny.toml"),
              "--model.n_layers=2", "--model.rope_original_seq_len=16", "--parallel.pp=1"],
}
STEPS = 4


def trainer_args(folder: Path, family: str, *overrides: str) -> list[str]:
    return [*MODELS[family], "--model.seq_len=32", "--model.vocab_size=258", "--training.batch_size=4",
            "--parallel.microbatches=2", f"--training.steps={STEPS}", "--optim.warmup_steps=1", "--training.threads=1",
            "--training.device=cpu", f"--data.shards={folder.parent / 'shards'}",
            "--data.corpus=stdlib", "--data.corpus_bytes=20000", f"--training.metrics_file={folder / 'metrics.jsonl'}",
            f"--checkpoint.uri={folder / 'checkpoints'}", f"--checkpoint.interval={STEPS}", *overrides]


def _train_rank(rank: int, port: int, folder: str, family: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer.train import main

    assert main(trainer_args(Path(folder), family, "--parallel.pp=2", "--parallel.tp=2")) == 0


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A folder per family whose checkpoints/ a pp=2 x tp=2 world trained and committed."""
    root = tmp_path_factory.mktemp("trained")
    folders = {}
    for family in MODELS:
        folders[family] = root / family
        spawn_ranks(_train_rank, (free_port(), str(folders[family]), family), nprocs=4)
    return folders


def a_batch() -> torch.Tensor:
    text = "def export(location, to):\n    return written  # the model, out of its checkpoint\n"
    return torch.tensor(tokenizers.load("bytes").encode(text)[:32]).view(2, 16)


def resumed_model(folder: Path, family: str) -> torch.nn.Module:
    """The trainer's own model, in one process, resumed from the folder's newest commit."""
    cfg = load_config(trainer_args(folder, family, "--checkpoint.resume=latest"))
    run = build(cfg, environment(cfg, torch.device("cpu")))
    assert Checkpointer(cfg.checkpoint).resume(run.state) == STEPS
    (model,) = run.pipeline.model_parts
    return model.eval()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_an_export_loads_in_transformers_with_the_trainers_logits(family, trained, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    written = export(str(trained[family] / "checkpoints"), tmp_path / "model", dtype=torch.float32)
    expected_class = {"llama": "LlamaForCausalLM", "gpt": "GPT2LMHeadModel"}[family]
    assert written.architecture == expected_class
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == [expected_class] and config["trainfleet"]["saved_layout"]["tp"] == 2
    for file in (tmp_path / "model").iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file.name

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", local_files_only=True).eval()
    assert type(model).__name__ == expected_class
    inputs = a_batch()
    with torch.no_grad():
        theirs = model(inputs).logits
        ours = resumed_model(trained[family], family)(inputs)
    assert (theirs - ours).abs().max().item() <= 1e-4

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model", local_files_only=True)
    text = "déjà vu, twice\n"
    assert tokenizer(text)["input_ids"] == tokenizers.load("bytes").encode(text)
    assert tokenizer.eos_token_id == 256 == model.generation_config.eos_token_id


def test_greedy_generation_in_transformers_is_trainfleet_sample_greedy(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainfleet.cli import main

    prompt, new = "def main(", 20
    for family in sorted(MODELS):
        folder = tmp_path / family
        export(str(trained[family] / "checkpoints"), folder, dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                 pad_token_id=tokenizer.eos_token_id)
        theirs = out[0, ids.shape[1]:].tolist()
        theirs = theirs[:theirs.index(256)] if 256 in theirs else theirs
        ours = generate_ids(load_exported(folder), tokenizers.load("bytes").encode(prompt), new_tokens=new,
                            vocab_size=257, eos_id=256)
        assert ours == theirs, family
        assert main(["sample", "--from", str(trained[family] / "checkpoints"), "--prompt", prompt, "--greedy",
                     "--tokens", str(new)]) == 0
        assert capsys.readouterr().out == prompt + tokenizer.decode(theirs) + "\n", family


def hf_llama(folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A LlamaForCausalLM made by transformers (random weights, two query heads per key/value head,
    Llama 3's rotary scaling) with a tokenizer trained here, saved as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 16})
    LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
    text = tokenizers.train_bpe(["def main():\n    return 0\n" * 20, "import os, sys\n" * 20], 300)
    PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(text),
                            bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>").save_pretrained(folder)
    return folder


def hf_gpt2(folder: Path) -> Path:
    """A GPT2LMHeadModel made by transformers: random weights, its head tied, gelu_new."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(2)
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=32)).save_pretrained(folder)
    return folder


LLAMA_RUN = ["--model.architecture=llama", "--model.n_layers=2", "--model.d_model=64", "--model.n_heads=8",
             "--model.n_kv_heads=2", "--model.ffn_hidden=160", "--model.vocab_size=300", "--model.seq_len=32",
             "--model.rope_theta=500000", "--model.rope_scaling_factor=8", "--model.rope_original_seq_len=16"]
GPT2_RUN = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--model.vocab_size=300",
            "--model.seq_len=32", "--model.activation=gelu_tanh", "--model.tie_embeddings=true"]


def stock_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors |= load_file(file)
    return tensors


@pytest.mark.parametrize("family, dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt", torch.float32)])
def test_a_model_made_by_transformers_comes_back_bit_identical(family, dtype, tmp_path):
    source = hf_llama(tmp_path / "hf", dtype) if family == "llama" else hf_gpt2(tmp_path / "hf")
    run = load_config(LLAMA_RUN if family == "llama" else GPT2_RUN).model
    imported = import_checkpoint(str(source), str(tmp_path / "imported"), run, group_bytes=100_000)
    assert imported.step == 0 and imported.parameters == sum(t.numel() for t in stock_tensors(source).values())
    assert len(list((tmp_path / "imported").glob("shards-*/step-000000000"))) > 4, "written a group at a time"
    written = export(str(tmp_path / "imported"), tmp_path / "out", dtype=dtype)
    assert written.step == 0
    before, after = stock_tensors(source), stock_tensors(tmp_path / "out")
    assert set(before) == set(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    theirs, ours = (json.loads((folder / "config.json").read_text()) for folder in (source, tmp_path / "out"))
    shared = {"llama": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "vocab_size"),
              "gpt": ("n_embd", "n_layer", "n_head", "n_positions", "vocab_size", "layer_norm_epsilon")}[family]
    assert {key: ours[key] for key in shared} == {key: theirs[key] for key in shared}
    if family == "llama":  # its tokenizer came along: the import kept it, the export wrote it
        assert (tmp_path / "out" / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()


def _run_rank(rank: int, port: int, world: int, args: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    from trainer.train import main

    assert main(args) == 0


@pytest.mark.parametrize("family, layout", [("llama", []), ("gpt", []), ("llama", ["--parallel.tp=2"])],
                         ids=["llama", "gpt", "llama tp=2"])
def test_a_run_from_an_imported_checkpoint_reports_the_loss_transformers_computes(family, layout, tmp_path):
    from transformers import AutoModelForCausalLM

    source = hf_llama(tmp_path / "hf") if family == "llama" else hf_gpt2(tmp_path / "hf")
    args = [*(LLAMA_RUN if family == "llama" else GPT2_RUN), "--training.steps=2", "--optim.warmup_steps=1",
            "--training.batch_size=4", "--parallel.microbatches=1", "--training.device=cpu", "--training.threads=1",
            f"--data.shards={tmp_path / 'shards'}", "--data.corpus=stdlib", "--data.corpus_bytes=20000",
            f"--training.metrics_file={tmp_path / 'metrics.jsonl'}", f"--checkpoint.uri={tmp_path / 'run'}",
            f"--training.init_from={tmp_path / 'imported'}", *layout]
    cfg = load_config(args)
    import_checkpoint(str(source), str(tmp_path / "imported"), cfg.model)
    one = load_config([*args, "--parallel.tp=1"])
    batch = build(one, environment(one, torch.device("cpu"))).state.loader.next_batch()
    inputs, targets = (t.contiguous() for t in batch)
    model = AutoModelForCausalLM.from_pretrained(source, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(input_ids=inputs, labels=targets, shift_labels=targets).loss.item()
        assert theirs == pytest.approx(F.cross_entropy(model(inputs).logits.flatten(0, 1), targets.flatten()).item())
    world = cfg.parallel.tp
    spawn_ranks(_run_rank, (free_port(), world, args), nprocs=world)
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["step"], first["loss"]) == (1, pytest.approx(theirs, rel=1e-5))


def test_an_import_from_s3_and_its_export(moto_endpoint, tmp_path):
    source = hf_llama(tmp_path / "hf")
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="models")
    for file in source.iterdir():
        s3.upload_file(str(file), "models", f"hf/llama/{file.name}")
    imported = import_checkpoint("s3://models/hf/llama", "s3://models/runs/a/checkpoints", load_config(LLAMA_RUN).model)
    assert imported.tokenizer == "s3://models/runs/a/checkpoints/tokenizer/tokenizer.json"
    assert imported.bytes_read == sum(t.numel() * t.element_size() for t in stock_tensors(source).values())
    export("s3://models/runs/a/checkpoints", tmp_path / "out", dtype=torch.float32)
    before, after = stock_tensors(source), stock_tensors(tmp_path / "out")
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    assert exported_tokenizer(tmp_path / "out").encode("import os") == tokenizers.load(
        str(source / "tokenizer.json")).encode("import os")


@pytest.mark.parametrize("change, field", [
    ("--model.n_kv_heads=4", "model.n_kv_heads=4"),
    ("--model.rope_scaling_factor=0", "model.rope_scaling_factor=0.0"),
    ("--model.ffn_hidden=128", "model.ffn_hidden=128"),
])
def test_an_import_unlike_the_runs_model_is_refused_naming_the_field(change, field, tmp_path, capsys):
    from trainfleet.cli import main

    source = hf_llama(tmp_path / "hf")
    with pytest.raises(ImportRefused, match=field):
        import_checkpoint(str(source), str(tmp_path / "imported"), load_config([*LLAMA_RUN, change]).model)
    config = tmp_path / "run.toml"
    fields = dict(arg.removeprefix("--model.").split("=") for arg in [*LLAMA_RUN, change])
    config.write_text("[model]\n" + "".join(f"{name} = {json.dumps(_typed(value))}\n"
                                            for name, value in fields.items()))
    capsys.readouterr()
    assert main(["checkpoint", "import", str(source), "--to", str(tmp_path / "imported"), "--config", str(config)]) == 1
    error = capsys.readouterr().err
    assert error.startswith("trainfleet checkpoint import: ") and field in error and error.count("\n") == 1
    assert not (tmp_path / "imported").exists()


def _typed(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value, value)


def test_an_import_refuses_a_missing_tensor_and_a_location_in_use(tmp_path):
    source = hf_llama(tmp_path / "hf")
    run = load_config(LLAMA_RUN).model
    import_checkpoint(str(source), str(tmp_path / "imported"), run)
    with pytest.raises(ImportRefused, match="holds checkpoints already"):
        import_checkpoint(str(source), str(tmp_path / "imported"), run)
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    from safetensors.torch import save_file

    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ImportRefused, match="holds no model.layers.1.mlp.up_proj.weight"):
        import_checkpoint(str(source), str(tmp_path / "other"), run)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("family", sorted(MODELS))
def test_generation_with_the_kv_cache_is_generation_without_it(family, tmp_path):
    """Past a context of 16 positions, twice over: the cache begins again from the last half."""
    cfg = load_config([*trainer_args(tmp_path, family), "--model.seq_len=16"])
    torch.manual_seed(0)
    model = build(cfg, environment(cfg, torch.device("cpu"))).pipeline.model_parts[0].eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)  # far from uniform: each step's likeliest token is clear
    prompt, window, expected = [5, 17, 99, 3, 42], [5, 17, 99, 3, 42], []
    with torch.no_grad():
        for _ in range(30):
            logits = model(torch.tensor([window]))[0, -1]
            token = int(logits[:257].argmax())
            expected.append(token)
            window = (window + [token])[-16 // 2:] if len(window) == 16 else window + [token]
    assert generate_ids(model, prompt, new_tokens=30, vocab_size=257, eos_id=None) == expected


def test_the_cli_imports_with_the_runs_runspec_as_its_config(tmp_path, capsys):
    from trainfleet.cli import main

    source = hf_llama(tmp_path / "hf")
    model = {arg.removeprefix("--model.").split("=")[0]: _typed(arg.split("=")[1]) for arg in LLAMA_RUN}
    (tmp_path / "run.json").write_text(json.dumps({"run_name": "llama", "trainer": {"model": model}}))
    capsys.readouterr()
    assert main(["checkpoint", "import", str(source), "--to", str(tmp_path / "imported"),
                 "--config", str(tmp_path / "run.json")]) == 0
    out = capsys.readouterr().out
    assert "as committed step 0" in out and f"{tmp_path / 'imported'}/tokenizer/tokenizer.json" in out
    listing = main(["checkpoint", "list", str(tmp_path / "imported")])
    assert listing == 0 and "resume=latest takes step 0" in capsys.readouterr().out


@pytest.mark.parametrize("change, named", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"head_dim": 16}, "head_dim=16 is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ({"architectures": ["MistralForCausalLM"]}, "holds none of LlamaForCausalLM, GPT2LMHeadModel"),
])
def test_a_config_the_trainer_cannot_hold_is_refused_naming_its_field(change, named, tmp_path):
    source = hf_llama(tmp_path / "hf")
    config = json.loads((source / "config.json").read_text()) | change
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ImportRefused, match=named):
        import_checkpoint(str(source), str(tmp_path / "imported"), load_config(LLAMA_RUN).model)
    assert not (tmp_path / "imported").exists()
