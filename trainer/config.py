"""The trainer's one config object.

Precedence: command line > config file (TOML or YAML) > the defaults below.

    config = load_config(["--config", "trainer/configs/small.toml", "--parallel.pp=2", "--training.steps", "50"])

Every field has a docstring; `JobConfig.validate()` refuses combinations that cannot run, naming
the field, before any process group work. `check_world_size()` checks the launch against the layout.

No torch here (nor in what this imports): the control plane's Validate runs these same checks on
a RunSpec's trainer section (`config_from_sections`) before it allocates a fleet.
"""

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from trainer import tokenizer
from trainer.schedules import SCHEDULES, schedule_problem


class ConfigError(ValueError):
    """A config value or combination that cannot run; the message names the field."""


ARCHITECTURES = ("gpt", "llama")
GPT_ACTIVATIONS = ("gelu", "gelu_tanh")


@dataclass
class ModelConfig:
    architecture: str = "gpt"
    """The family: gpt (GPT-2's shape: learned positions, LayerNorm, a GELU MLP, biases) or llama
    (rotary positions, RMSNorm, a SwiGLU MLP, grouped-query attention, no biases)."""
    n_layers: int = 8
    """Transformer blocks."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention (query) heads; must divide d_model."""
    vocab_size: int = tokenizer.ByteTokenizer.vocab_size
    """Embedding rows; at least the tokenizer's vocabulary (257 for bytes + end of document), and at
    least the vocabulary the shards were tokenised with (their index says)."""
    seq_len: int = 128
    """Tokens per training sequence (the rows of gpt's position embedding, of llama's rotary table)."""
    tie_embeddings: bool = False
    """Use the token embedding as the output head. Needs the embedding and the head in one process (pp=1)."""
    norm_eps: float = 1e-5
    """The epsilon of every norm (gpt's LayerNorm, llama's RMSNorm)."""
    mlp_ratio: int = 4
    """gpt: hidden width of the MLP as a multiple of d_model."""
    activation: str = "gelu"
    """gpt: the MLP's activation, gelu (exact, erf) or gelu_tanh (its tanh approximation, GPT-2's gelu_new)."""
    n_kv_heads: int = 0
    """llama: key/value heads, each shared by n_heads / n_kv_heads query heads (grouped-query
    attention); 0 = n_heads."""
    ffn_hidden: int = 0
    """llama: hidden width of the SwiGLU MLP; 0 = Llama's rule: 2/3 of 4 d_model, times
    ffn_dim_multiplier, rounded up to a multiple of multiple_of (Llama 3 8B: 14,336)."""
    ffn_dim_multiplier: float = 1.0
    """llama: the rule's multiplier of the hidden width (Llama 3 8B and 70B: 1.3, 405B: 1.2)."""
    multiple_of: int = 256
    """llama: the rule rounds the hidden width up to a multiple of this (Llama 3: 1,024 for 8B, 4,096 above)."""
    rope_theta: float = 10000.0
    """llama: the rotary embedding's base (Llama 3: 500,000)."""
    rope_scaling_factor: float = 0.0
    """llama: Llama 3's (3.1's) frequency scaling of the rotary embedding: low frequencies divided by
    this, high ones kept, those between blended; 0 = none. Llama 3.1: 8."""
    rope_low_freq_factor: float = 1.0
    """llama: wavelengths above rope_original_seq_len / this are scaled whole (Llama 3.1: 1)."""
    rope_high_freq_factor: float = 4.0
    """llama: wavelengths below rope_original_seq_len / this are kept (Llama 3.1: 4)."""
    rope_original_seq_len: int = 8192
    """llama: the context the scaled frequencies were first trained at (Llama 3.1: 8,192)."""

    def resolved_kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def resolved_ffn_hidden(self) -> int:
        """The MLP's hidden width: gpt's mlp_ratio x d_model; llama's given width or Llama's rule."""
        if self.architecture != "llama":
            return self.mlp_ratio * self.d_model
        if self.ffn_hidden:
            return self.ffn_hidden
        hidden = int(self.ffn_dim_multiplier * int(2 * 4 * self.d_model / 3))
        return -(-hidden // self.multiple_of) * self.multiple_of


_FAMILY_FIELDS = {"gpt": ("mlp_ratio", "activation"),
                  "llama": ("n_kv_heads", "ffn_hidden", "ffn_dim_multiplier", "multiple_of", "rope_theta",
                            "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                            "rope_original_seq_len")}
"""The model fields one family reads and the other ignores: set away from their defaults for the
other family, they would be silently dropped, so they are refused."""


@dataclass
class ParallelConfig:
    pp: int = 1
    """Pipeline-parallel degree (ranks per pipeline)."""
    dp: int = 1
    """Data-parallel degree (ranks that see different data); world size must be pp * dp * tp."""
    dp_shard: int = 0
    """Of the dp ranks, how many share one copy of the parameters, gradients and optimizer state,
    each holding a shard (FSDP2); the model is replicated over dp / dp_shard such groups.
    0 = all of dp (ZeRO-3 over every data-parallel rank); 1 = full replicas, gradients averaged."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split every attention and MLP matrix, with sequence
    parallelism between them. Keep it within a node (NVLink): it talks twice per layer."""
    reshard_after_forward: str = "auto"
    """FSDP: free the gathered parameters after forward (always, ZeRO-3), keep them until backward
    (never, ZeRO-2: more memory, half the all-gathers), or auto: always without a pipeline, never
    with one (a stage runs forward once per microbatch and would gather again each time)."""
    schedule: str = "1f1b"
    """Pipeline schedule: one of trainer.schedules.SCHEDULES (gpipe, 1f1b, interleaved-1f1b, ...) that the installed
    torch offers."""
    microbatches: int = 4
    """Microbatches per step per replica; must divide the replica's batch."""
    stages_per_rank: int = 0
    """Stages (virtual stages) each pipeline rank holds; 0 = what the schedule needs (1 or 2)."""
    layers_per_stage: list[int] = field(default_factory=list)
    """Layers of each stage in order, overriding the split balanced by parameter count; empty = balanced."""
    timeout_s: float = 900.0
    """The collective timeout: how long a process group's operation waits on a peer before it fails
    (NCCL's watchdog aborts it; the 30-minute default otherwise). Longer than the control plane's
    hang detection (RunSpec recovery.hang_timeout_seconds, 600 s by default), which names the node
    that fell silent first: shorter, every rank's collectives would fail first and the hang would
    pass for a crash of all. Shorter than repair_wait_s."""
    repair_file: str = ""
    """Where the node agent writes the order to repair the world in place when a node is lost
    (trainer/repair.py). A rank whose step fails says so beside it (for the agent to report) and
    waits for the order. Empty: a failed step ends the process, and the control plane restarts
    the world."""
    repair_wait_s: float = 1800.0
    """The repair wait: how long a rank whose step failed waits for the repair order before it
    exits. The agent ends the trainer sooner when the control plane restarts the world instead; it
    sets this to the run's start-up timeout, the time the control plane gives a world to form.
    Longer than timeout_s: a peer may be held in one of the failed world's collectives that long
    before it comes to the repair."""

    def resolved_dp_shard(self) -> int:
        return self.dp_shard or self.dp

    def resolved_stages_per_rank(self) -> int:
        return self.stages_per_rank or SCHEDULES[self.schedule].stages_per_rank

    def n_stages(self) -> int:
        return self.pp * self.resolved_stages_per_rank() if self.pp > 1 else 1


@dataclass
class DataConfig:
    shards: str = "runs/data/stdlib-bytes"
    """Where the token shards live: a local directory or s3://bucket/prefix holding a shard set (its
    index.json), as `trainfleet data prepare` writes one. A location without one is refused, unless
    data.corpus names the corpus to build it from."""
    tokenizer: str = "bytes"
    """The tokenizer: bytes (every UTF-8 byte a token, plus an end of document; no file) or a Hugging Face
    tokenizer.json, a path or s3:// URI (trainer/tokenizer.py). The shards must have been tokenised with it."""
    cache_dir: str = "runs/data/cache"
    """Local directory that S3 shards' blocks are cached in (shared by the ranks of a node), and where shards that
    matched their index are stamped (size, mtime, inode) so that a restart does not hash them again."""
    cache_bytes: int = 64 * 2**30
    """Bound on the blocks of S3 shards cached in cache_dir; the least recently opened are deleted past it. Shard
    sets whose index has no block digests are fetched whole, outside this bound."""
    corpus: str = ""
    """The built-in corpus to build data.shards from when they hold no shard set: stdlib (the Python
    standard library's own source, in a fixed order), tokenised with data.tokenizer. Empty: none,
    data.shards must hold a prepared set."""
    corpus_bytes: int = 4_000_000
    """Bytes of text taken from the corpus."""
    shard_tokens: int = 1_000_000
    """Tokens per shard file when the shards are built from the corpus."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate of AdamW, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr * min_lr_ratio at decay_steps, and stays there."""
    warmup_steps: int = 10
    """Steps of linear warmup from 0 to lr."""
    decay_steps: int = 0
    """The step at which the cosine reaches its floor, counted from the first step (past
    warmup_steps); 0 = the last step. GPT-3 decayed over 260 B of its 300 B tokens."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices only (not to biases, norms or embeddings)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all stages) to this; 0 disables clipping."""


@dataclass
class TrainingConfig:
    steps: int = 100
    """Optimizer steps to train."""
    batch_size: int = 16
    """Sequences per step over all data-parallel replicas (the global batch)."""
    seed: int = 0
    """Seeds weight init, the data order and the RNGs; the same seed gives the same run at any pp x dp."""
    device: str = "auto"
    """cpu, cuda or auto (cuda when available). Compute is bf16 on CUDA, fp32 on CPU."""
    activation_checkpoint: str = "none"
    """Recompute activations in backward instead of keeping them: none, selective (the attention
    and MLP internals of each block; keeps the block inputs and the matmul outputs cheap to store)
    or full (everything but each block's input)."""
    init_from: str = ""
    """A checkpoint location (a folder or s3://bucket/prefix) whose newest committed step gives the
    model's initial weights when checkpoint.uri holds no step to resume: an imported model
    (`trainfleet checkpoint import`) or another run's. Its model section must be this run's; the
    optimizer, schedule and data start afresh. Needs checkpoint.uri. Empty: initialised by seed."""
    compile: bool = False
    """torch.compile each transformer block (CUDA; slow to start, faster per step)."""
    threads: int = 0
    """CPU threads per rank for intra-op work; 0 leaves torch's default."""
    metrics_file: str = "runs/metrics.jsonl"
    """One JSON line per step is appended here (written by global rank 0)."""


@dataclass
class CheckpointConfig:
    uri: str = ""
    """Where checkpoints go: a local directory or s3://bucket/prefix; empty = no checkpoints."""
    interval: int = 100
    """Steps between saves."""
    keep_last: int = 3
    """Committed checkpoints kept; older ones are deleted."""
    resume: str = "none"
    """none, latest, or a step number to resume from."""
    resume_uri: str = ""
    """Where the step `resume` names lies when not under `uri`: another run's checkpoints, read and
    never written, pruned or cleaned up; saves and retention stay under `uri`. Empty: `uri`."""
    async_save: bool = True
    """Save in the background so training is not stalled by storage."""
    timeout_s: float = 1800.0
    """How long a checkpoint collective waits for a peer: the save's last collective waits for the
    slowest rank's upload, far longer than a training collective may take."""
    memory_interval: int = 0
    """Steps between in-memory checkpoints: every rank's shard kept in its node's host memory and
    on a buddy node (trainer/memory_checkpoint.py); 0: none."""
    memory_dir: str = ""
    """The node's host-memory folder for them (/dev/shm on a node: it outlives the trainer's
    processes, not the instance); the node agent sets it."""
    memory_resume: bool = False
    """Resume from the newest step every shard has in some node's memory, S3 only when one lacks
    it: the control plane's choice after a failure (the launch spec's restore_from_memory)."""
    result_file: str = ""
    """Where global rank 0 writes where the resumed state came from (JSON); the node agent reports it."""


@dataclass
class FleetCheckConfig:
    enabled: bool = False
    """Measure the whole world's network before the first step (trainer/fleet_check.py); the
    control plane turns it on for worlds of more than one node (RunSpec.preflight)."""
    size_mib: float = 1024.0
    """The buffer each rank all-reduces and exchanges with its peers: 1 GiB, where NCCL's
    all-reduce reaches its bandwidth plateau on EFA (a smaller message is latency-bound at scale
    and falls far below the floor on a healthy world); CPU worlds set a few MiB."""
    iterations: int = 5
    """Timed repetitions of each measurement, after one untimed."""
    busbw_floor_gbytes_per_s: float = 0.0
    """The two-node floor (the catalogue's, or the RunSpec's): every node-to-node link must reach
    it, and the all-reduce the same scaled for the world's node count (fleet_check.allreduce_floor)."""
    result_file: str = ""
    """Where global rank 0 writes the result (JSON); the node agent reports it."""


@dataclass
class ScalingCheckConfig:
    enabled: bool = False
    """Judge the whole world's first steps against what its ranks compute alone
    (trainer/scaling_check.py); the control plane sets it from RunSpec.scaling_check."""
    warmup_steps: int = 2
    """Steps of each attempt left untimed first (shape inference, allocator, NCCL set-up)."""
    steps: int = 5
    """Steps timed after them."""
    efficiency_floor: float = 0.7
    """Step time a rank's compute alone predicts over the step time measured, below which the
    world does not train on."""
    slow_rank_factor: float = 1.25
    """A rank computing longer than this times the median of the others holding its stages is
    slow (a throttled GPU): a world below the floor has its node replaced rather than given up.
    Healthy peers doing the same work differ by a few percent."""
    result_file: str = ""
    """Where global rank 0 writes the result (JSON); the node agent reports it."""


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Pipeline, data and tensor parallel layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and token shards."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Steps, batch, seed, device, logging."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming the training state."""
    fleet_check: FleetCheckConfig = field(default_factory=FleetCheckConfig)
    """The fleet-wide network check at the start of every attempt."""
    scaling_check: ScalingCheckConfig = field(default_factory=ScalingCheckConfig)
    """The judgement of every attempt's first steps."""

    def validate(self) -> "JobConfig":
        """Raise ConfigError naming the first field that cannot work; return self."""
        for problem in _problems(self):
            raise ConfigError(problem)
        return self


CORPORA = ("stdlib",)
"""What data.corpus may name (trainer/data.py builds it)."""
# Integer fields where 0 means something (a seed, "torch's default", "what the schedule needs").
_ZERO_ALLOWED = {"seed", "threads", "stages_per_rank", "dp_shard", "n_kv_heads", "ffn_hidden"}
ACTIVATION_CHECKPOINT_MODES = ("none", "selective", "full")
RESHARD_AFTER_FORWARD = ("auto", "always", "never")


def _problems(c: JobConfig):
    """Yield one message per invalid value or combination, in the order a reader meets them."""
    m, p, t, o, k = c.model, c.parallel, c.training, c.optim, c.checkpoint
    for section in (m, p, c.data, t):
        for f in dataclasses.fields(section):
            value, lowest = getattr(section, f.name), 0 if f.name in _ZERO_ALLOWED else 1
            if f.type is int and value < lowest:
                yield f"{_name(section)}.{f.name} must be >= {lowest}, got {value}"
    f = c.fleet_check
    if f.size_mib <= 0 or f.iterations < 1 or f.busbw_floor_gbytes_per_s < 0:
        yield (f"fleet_check needs size_mib > 0, iterations >= 1 and busbw_floor_gbytes_per_s >= 0, got "
               f"{f.size_mib}, {f.iterations}, {f.busbw_floor_gbytes_per_s}")
    s = c.scaling_check
    if s.warmup_steps < 0 or s.steps < 1 or not 0 < s.efficiency_floor <= 1 or s.slow_rank_factor <= 1:
        yield (f"scaling_check needs warmup_steps >= 0, steps >= 1, 0 < efficiency_floor <= 1 and "
               f"slow_rank_factor > 1, got {s.warmup_steps}, {s.steps}, {s.efficiency_floor}, {s.slow_rank_factor}")
    yield from _model_problems(m)
    if m.n_heads % p.tp or m.vocab_size % p.tp or m.seq_len % p.tp:
        yield (f"parallel.tp={p.tp} must divide model.n_heads={m.n_heads}, model.vocab_size={m.vocab_size} "
               f"and model.seq_len={m.seq_len} (heads, vocabulary rows and sequence positions are split over it)")
    if m.resolved_kv_heads() % p.tp:
        yield (f"parallel.tp={p.tp} must divide the model's {m.resolved_kv_heads()} key/value heads "
               f"(model.n_kv_heads): each tensor-parallel rank holds whole key/value heads of its own")
    if p.tp > 1 and m.tie_embeddings:
        yield "model.tie_embeddings=true needs parallel.tp=1"
    if p.dp % p.resolved_dp_shard():
        yield f"parallel.dp_shard={p.dp_shard} must divide parallel.dp={p.dp}"
    if p.reshard_after_forward not in RESHARD_AFTER_FORWARD:
        yield f"parallel.reshard_after_forward={p.reshard_after_forward!r} must be one of {', '.join(RESHARD_AFTER_FORWARD)}"
    if t.activation_checkpoint not in ACTIVATION_CHECKPOINT_MODES:
        yield (f"training.activation_checkpoint={t.activation_checkpoint!r} must be one of "
               f"{', '.join(ACTIVATION_CHECKPOINT_MODES)}")
    if c.data.tokenizer == tokenizer.BYTES and m.vocab_size < tokenizer.ByteTokenizer.vocab_size:
        yield (f"model.vocab_size={m.vocab_size} is below the byte tokenizer's vocabulary "
               f"({tokenizer.ByteTokenizer.vocab_size})")
    if not c.data.tokenizer:
        yield "data.tokenizer is empty: bytes, or a tokenizer.json path or s3:// URI"
    if c.data.corpus not in ("", *CORPORA):
        yield f"data.corpus={c.data.corpus!r} is not a built-in corpus: {', '.join(CORPORA)}, or empty for none"
    if p.schedule not in SCHEDULES:
        yield f"parallel.schedule={p.schedule!r} is unknown; choose one of {sorted(SCHEDULES)}"
        return
    if p.timeout_s <= 0:
        yield f"parallel.timeout_s must be > 0, got {p.timeout_s}"
    if p.repair_wait_s <= 0:
        yield f"parallel.repair_wait_s must be > 0, got {p.repair_wait_s}"
    elif p.repair_file and p.repair_wait_s <= p.timeout_s:
        yield (f"parallel.repair_wait_s={p.repair_wait_s:g} must exceed parallel.timeout_s={p.timeout_s:g}: a rank "
               "that left a failed world waits for the repair order longer than a peer may be held in one of its "
               "collectives")
    n_stages = p.n_stages()
    if n_stages > m.n_layers:
        yield (f"{n_stages} pipeline stages (parallel.pp={p.pp} x {p.resolved_stages_per_rank()} per rank) "
               f"need at least as many layers, but model.n_layers={m.n_layers}")
    if p.layers_per_stage and (len(p.layers_per_stage) != n_stages or sum(p.layers_per_stage) != m.n_layers
                               or min(p.layers_per_stage) < 1):
        yield (f"parallel.layers_per_stage={p.layers_per_stage} must list {n_stages} stages of >= 1 layer "
               f"adding up to model.n_layers={m.n_layers}")
    if t.batch_size % p.dp:
        yield f"training.batch_size={t.batch_size} must be divisible by parallel.dp={p.dp}"
    elif (t.batch_size // p.dp) % p.microbatches:
        yield (f"parallel.microbatches={p.microbatches} must divide the per-replica batch "
               f"(training.batch_size / parallel.dp = {t.batch_size // p.dp})")
    if p.pp > 1:
        problem = schedule_problem(p.schedule, p.pp, p.resolved_stages_per_rank(), p.microbatches)
        if problem:
            yield problem
        if m.tie_embeddings:
            yield "model.tie_embeddings=true needs the embedding and the head in one process: use parallel.pp=1"
    if t.device not in ("auto", "cpu", "cuda"):
        yield f"training.device={t.device!r} must be auto, cpu or cuda"
    if o.lr <= 0 or not 0 <= o.min_lr_ratio <= 1:
        yield f"optim.lr must be > 0 and optim.min_lr_ratio in [0, 1], got {o.lr}, {o.min_lr_ratio}"
    if not 0 <= o.warmup_steps <= t.steps:
        yield f"optim.warmup_steps={o.warmup_steps} must be between 0 and training.steps={t.steps}"
    if o.decay_steps and not o.warmup_steps < o.decay_steps:
        yield f"optim.decay_steps={o.decay_steps} must be 0 (the last step) or past optim.warmup_steps={o.warmup_steps}"
    if o.grad_clip < 0 or o.weight_decay < 0:
        yield f"optim.grad_clip and optim.weight_decay must be >= 0, got {o.grad_clip}, {o.weight_decay}"
    if k.timeout_s <= 0:
        yield f"checkpoint.timeout_s must be > 0, got {k.timeout_s}"
    if k.memory_interval < 0:
        yield f"checkpoint.memory_interval must be >= 0 (0: no in-memory checkpoints), got {k.memory_interval}"
    if k.memory_interval and not k.memory_dir:
        yield "checkpoint.memory_interval needs checkpoint.memory_dir, the node's host-memory folder"
    if k.memory_interval and not k.uri:
        # Without it the copies would be silently off, and a repaired world would have nothing to restore.
        yield "checkpoint.memory_interval needs checkpoint.uri: the in-memory copies come beside the S3 checkpoints"
    if k.memory_resume and not k.memory_interval:
        yield "checkpoint.memory_resume needs checkpoint.memory_interval > 0"
    if p.repair_file and not k.memory_interval:
        yield "parallel.repair_file needs checkpoint.memory_interval > 0: a repaired world resumes from host memory"
    if k.interval < 1 or k.keep_last < 1:
        yield f"checkpoint.interval and checkpoint.keep_last must be >= 1, got {k.interval}, {k.keep_last}"
    if k.resume not in ("none", "latest") and not k.resume.isdigit():
        yield f"checkpoint.resume={k.resume!r} must be none, latest or a step number"
    if k.uri.startswith("s3://") and not k.uri[len("s3://"):].split("/")[0]:
        yield f"checkpoint.uri={k.uri!r} names no bucket"
    if t.init_from and not k.uri:
        yield "training.init_from needs checkpoint.uri, where the run's own steps go"
    if t.init_from.startswith("s3://") and not t.init_from[len("s3://"):].split("/")[0]:
        yield f"training.init_from={t.init_from!r} names no bucket"
    if k.resume != "none" and not k.uri:
        yield f"checkpoint.resume={k.resume!r} needs checkpoint.uri"
    if k.resume_uri and k.resume == "none":
        yield "checkpoint.resume_uri needs checkpoint.resume (latest or a step): it names where to resume from"
    if k.resume_uri and k.resume_uri.rstrip("/") == k.uri.rstrip("/"):
        yield "checkpoint.resume_uri is checkpoint.uri: leave it empty"
    if k.async_save and k.keep_last == 1:
        # The only committed checkpoint would be pruned while the next one may still be saving.
        yield "checkpoint.keep_last=1 with checkpoint.async_save=true could leave no complete checkpoint; keep 2+"


def _model_problems(m: ModelConfig):
    """Yield one message per model field that cannot build a model."""
    if m.architecture not in ARCHITECTURES:
        yield f"model.architecture={m.architecture!r} must be one of {', '.join(ARCHITECTURES)}"
        return
    defaults = ModelConfig()
    for family, names in _FAMILY_FIELDS.items():
        for name in names:
            if family != m.architecture and getattr(m, name) != getattr(defaults, name):
                yield (f"model.{name}={getattr(m, name)!r} applies to the {family} family only, "
                       f"not model.architecture={m.architecture!r}")
    if m.d_model % m.n_heads:
        yield f"model.n_heads={m.n_heads} must divide model.d_model={m.d_model}"
    elif m.architecture == "llama" and (m.d_model // m.n_heads) % 2:
        yield (f"model.d_model / model.n_heads = {m.d_model // m.n_heads} must be even: rotary embeddings "
               f"turn pairs of each head's dimensions")
    if m.n_heads % m.resolved_kv_heads():
        yield f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads}"
    if m.activation not in GPT_ACTIVATIONS:
        yield f"model.activation={m.activation!r} must be one of {', '.join(GPT_ACTIVATIONS)}"
    positive = {"norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "ffn_dim_multiplier": m.ffn_dim_multiplier}
    for name, value in positive.items():
        if not value > 0:
            yield f"model.{name} must be > 0, got {value}"
    bands = 0 < m.rope_low_freq_factor < m.rope_high_freq_factor
    if m.rope_scaling_factor and not (m.rope_scaling_factor >= 1 and bands):
        yield (f"model.rope_scaling_factor={m.rope_scaling_factor} (0: none) must be >= 1, with "
               f"0 < model.rope_low_freq_factor={m.rope_low_freq_factor} < model.rope_high_freq_factor="
               f"{m.rope_high_freq_factor}")


def check_world_size(config: JobConfig, world_size: int) -> None:
    """The launch must have exactly one process per (pp, dp, tp) position."""
    p = config.parallel
    needed = p.pp * p.dp * p.tp
    if world_size != needed:
        raise ConfigError(f"world size {world_size} != parallel.pp x dp x tp = {p.pp} x {p.dp} x {p.tp} = {needed}; "
                          f"launch {needed} processes or change the layout")


def _name(section) -> str:
    for f in dataclasses.fields(JobConfig):
        if isinstance(section, f.type):
            return f.name
    raise TypeError(section)


def load_config(argv: list[str]) -> JobConfig:
    """Defaults, then `--config FILE` (.toml, .yaml, .yml), then `--section.field=value` overrides; validated."""
    args = list(argv)
    file_path = _pop_option(args, "config")
    config = JobConfig()
    if file_path:
        _apply(config, _read_file(Path(file_path)), source=file_path)
    _apply(config, _parse_overrides(args), source="command line")
    return config.validate()


def config_from_sections(values: dict, source: str) -> JobConfig:
    """Defaults, then `values` ({section: {field: value}}, as a config file holds them); validated.
    Every ConfigError names `source` first."""
    config = JobConfig()
    _apply(config, values, source=source)
    try:
        return config.validate()
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _pop_option(args: list[str], name: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == f"--{name}":
            if i + 1 == len(args):
                raise ConfigError(f"--{name} needs a value")
            value = args[i + 1]
            del args[i:i + 2]
            return value
        if arg.startswith(f"--{name}="):
            del args[i]
            return arg.split("=", 1)[1]
    return None


def _read_file(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        data = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        import yaml  # here, not at the top: Validate's Lambda runs the checks above without pyyaml

        data = yaml.safe_load(text) or {}
    else:
        raise ConfigError(f"config file {path} must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold sections of fields")
    return data


def _parse_overrides(args: list[str]) -> dict:
    """["--a.b=1", "--c.d", "2"] -> {"a": {"b": "1"}, "c": {"d": "2"}}; values stay strings until typed."""
    nested: dict[str, dict] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.field=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 2
        else:
            raise ConfigError(f"{arg} needs a value")
        section, name = key.split(".", 1)
        nested.setdefault(section, {})[name] = value
    return nested


def _apply(config: JobConfig, values: dict, source: str) -> None:
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    for section_name, fields_ in values.items():
        if section_name not in sections or not isinstance(fields_, dict):
            raise ConfigError(f"{source}: unknown config section {section_name!r}; known: {sorted(sections)}")
        section = sections[section_name]
        known = {f.name: f for f in dataclasses.fields(section)}
        for name, raw in fields_.items():
            if name not in known:
                raise ConfigError(f"{source}: unknown field {section_name}.{name}; known: {sorted(known)}")
            setattr(section, name, _coerce(raw, known[name].type, f"{section_name}.{name}", source))


def _coerce(raw, annotation, field_name: str, source: str):
    """A file value or command-line string as the field's type, or a ConfigError naming the field."""
    try:
        if typing.get_origin(annotation) is list:
            (item_type,) = typing.get_args(annotation)
            items = [s for s in raw.split(",") if s.strip()] if isinstance(raw, str) else raw
            return [_coerce(item, item_type, field_name, source) for item in items]
        if annotation is bool:
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() in ("true", "1", "yes"):
                return True
            if str(raw).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if isinstance(raw, bool) or (annotation is int and isinstance(raw, float)):
            raise ValueError
        if annotation is str:
            return str(raw)
        return annotation(raw)
    except (ValueError, TypeError, AttributeError):
        type_name = getattr(annotation, "__name__", str(annotation))
        raise ConfigError(f"{source}: {field_name}={raw!r} is not a valid {type_name}") from None
