"""The GPU check: one CUDA device, bf16 training of a ~1B-parameter GPT, run unattended.

    bench/gpu_run.sh prepare                              # here: wheels a bare GPU machine lacks
    bench/gpu_run.sh run                                  # there: installs them, runs this under a timeout
    .venv/bin/python bench/gpu.py --tiny --device cpu     # the same checks on a tiny model, anywhere

What it prints, in order:
1. The software and the NCCL/EFA environment: torch, CUDA, NCCL versions, the device's exact
   name and memory, and the FI_*, NCCL_* and LD_LIBRARY_PATH variables torchrun would pass on.
2. Training: the trainer's own build and step (FSDP2 on a one-rank mesh, bf16 parameters and
   fp32 gradient reduction), warm-up, then the timed steps: ms/step, tokens/s and MFU. The model
   FLOPs per token are torchtitan's count: 6 x the parameters that are matmul weights (all but
   the token and position embeddings, which are lookups; an untied head is a matmul) + 12 L T d
   for attention's scores and weighted sum. The peak is the dense bf16 figure of NVIDIA's data
   sheet for the exact device name (an H100 PCIe is not an H100 SXM); an unknown name: MFU n/a.
   Every step's loss: a non-finite one fails the check, one that does not fall is flagged.
3. Memory at the peak of a step: torch.cuda.max_memory_allocated against the memory plan's
   tensors (trainfleet.core.memory_plan, this device's accelerator) as a ratio, flagged beyond 15 %;
   beside it the plan's allowance against what CUDA reports: memory outside PyTorch's allocator
   (total - free - reserved: the CUDA context, NCCL, other processes) and fragmentation (the
   allocator's peak reserved - its peak allocated).
4. Async checkpoint staging: GPU work is queued ahead of an optimizer step, and the step's
   kernels are still running when the checkpoint is saved asynchronously; the staging copy must
   wait for them. The checkpoint is loaded back and compared bit for bit with the post-step state.

The last line is machine-readable: `gpu_check=ok key=value ...`, or `gpu_check=failed: <why>`
with exit status 1, whatever went wrong (out of memory, with the allocator's figures; an NCCL
error; a package this machine lacks; a non-finite loss; --time-limit passing while a kernel or a
collective hangs). A traceback, if any, goes to stderr before it.
"""

import argparse
import faulthandler
import os
import re
import shlex
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def import_failure(exc: ImportError) -> str:
    return f"cannot import {exc.name or exc}: a package this machine lacks (bench/gpu_run.sh carries them): {exc}"


try:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from trainer.checkpoint import Checkpointer, storage_reader
    from trainer.checkpoint_catalog import step_dir_name
    from trainer.config import load_config
    from trainer.model import GPT
    from trainer.train import NonFiniteLossError, build, distributed, train_step
    from trainfleet.core import memory_plan
except ImportError as missing:
    traceback.print_exc()
    print(f"gpu_check=failed: {import_failure(missing)}", flush=True)
    sys.exit(1)

GIB = 2**30

DEVICES = {
    # torch.cuda.get_device_name -> (the memory plan's accelerator, dense bf16 tensor-core TFLOP/s
    # from NVIDIA's data sheets: their headline figures are with 2:4 sparsity, twice these).
    "NVIDIA A100-SXM4-40GB": ("A100", 312.0),
    "NVIDIA A100-SXM4-80GB": ("A100", 312.0),
    "NVIDIA A100-PCIE-40GB": ("A100", 312.0),
    "NVIDIA A100 80GB PCIe": ("A100", 312.0),
    "NVIDIA H100 80GB HBM3": ("H100", 989.0),   # SXM5
    "NVIDIA H100 PCIe": ("H100", 756.0),
    "NVIDIA H100 NVL": ("H100", 835.0),
    "NVIDIA H200": ("H200", 989.0),             # SXM
    "NVIDIA H200 NVL": ("H200", 835.0),
}

MODEL_1B = ["--model.n_layers=16", "--model.d_model=2048", "--model.n_heads=16", "--model.seq_len=2048",
            "--model.vocab_size=32768", "--training.batch_size=8", "--parallel.microbatches=4",
            "--optim.lr=3e-4"]  # GPT-3 XL's order of magnitude (2e-4): a fresh 1B model survives it
MODEL_TINY = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--model.seq_len=64",
              "--training.batch_size=4", "--parallel.microbatches=2", "--data.corpus=stdlib", "--data.corpus_bytes=100000",
              "--optim.lr=3e-3"]

MEMORY_TOLERANCE = 0.15
"""How far the measured tensors may be from the plan's before the figure is flagged."""

STAGING_DELAY_S = 2.0
"""GPU work queued ahead of the optimizer step saved, so that its kernels are still running while
the save starts and an unordered staging copy would read parameters mid-update."""


class CheckFailed(Exception):
    """A check's own verdict (not a crash): its message is the reason."""


class Watchdog:
    """Ends the process with the failure line once the time limit passes, whatever the main
    thread is stuck in (a kernel, an NCCL wait): a timer thread dumps every thread's stack to
    stderr, writes the line straight to stdout's descriptor (the main thread may hold Python's
    stdout lock) and leaves with os._exit (an exit would wait for the stuck thread)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.phase = "starting"
        """What the check is doing, for the failure line."""
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        faulthandler.dump_traceback(file=sys.stderr)
        os.write(1, f"\ngpu_check=failed: time limit of {self.seconds:g} s reached while {self.phase}\n".encode())
        os._exit(1)

    def cancel(self) -> None:
        self._timer.cancel()


@dataclass(frozen=True)
class CudaMemory:
    """What CUDA and PyTorch's caching allocator report, in bytes."""

    peak_allocated: int
    peak_reserved: int
    allocated: int
    reserved: int
    free: int
    total: int

    @classmethod
    def read(cls, device: torch.device) -> "CudaMemory":
        free, total = torch.cuda.mem_get_info(device)
        return cls(torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device),
                   torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), free, total)

    @property
    def outside_allocator(self) -> int:
        """The CUDA context, NCCL's buffers and any other process: memory in use that the
        allocator did not reserve."""
        return self.total - self.free - self.reserved

    @property
    def fragmentation(self) -> int:
        """Reserved but never handed out at the peak (reserved only grows between resets)."""
        return self.peak_reserved - self.peak_allocated


def device_facts(name: str) -> tuple[str, float | None]:
    """(the memory plan's accelerator, dense bf16 peak TFLOP/s) of a device, by its exact name;
    ("", None) for a device the table does not know."""
    return DEVICES.get(name, ("", None))


def flops_per_token(cfg) -> float:
    """Training FLOPs per token (forward and backward), torchtitan's get_num_flop_per_token:
    6 x the matmul parameters + 12 L T d for attention."""
    m = cfg.model
    with torch.device("meta"):
        model = GPT(m)
    parameters = sum(p.numel() for p in model.parameters())  # a tied head's weight is counted once
    lookups = sum(p.numel() for mod in model.modules() if isinstance(mod, nn.Embedding) for p in mod.parameters())
    if m.tie_embeddings:
        lookups -= m.vocab_size * m.d_model  # the token embedding is also the head's matmul weight
    return 6 * (parameters - lookups) + 12 * m.n_layers * m.seq_len * m.d_model


def planned_workload(cfg, accelerator: str) -> memory_plan.Workload:
    """This config as the memory plan sees it, on this accelerator with bf16 mixed precision."""
    return memory_plan.Workload.from_sections(asdict(cfg), mixed_precision=True, accelerator=accelerator)


def memory_report(measured: CudaMemory, workload: memory_plan.Workload) -> tuple[list[str], float, bool]:
    """Lines comparing a step's memory with the plan's fullest rank; the ratio of the tensors and
    whether it is beyond MEMORY_TOLERANCE."""
    plan = memory_plan.fullest_rank(workload)
    ratio = measured.peak_allocated / plan.tensors
    flagged = abs(ratio - 1) > MEMORY_TOLERANCE
    communicators, accelerator = workload.layout.communicators, workload.accelerator
    context = memory_plan.CUDA_CONTEXT_BYTES
    nccl = communicators * memory_plan.NCCL_COMMUNICATOR_BYTES.get(accelerator, 0)
    fragmentation = plan.allowance - context - nccl
    lines = [
        f"memory plan ({workload.layout.describe()}):",
        memory_plan.format_memory(plan, measured.total / GIB),
        f"memory: tensors at the peak {measured.peak_allocated / GIB:.2f} GiB measured (max_memory_allocated), "
        f"{plan.tensors / GIB:.2f} GiB planned: ratio {ratio:.2f}",
        f"  outside the allocator (CUDA context, NCCL, other processes; total - free - reserved): "
        f"{measured.outside_allocator / GIB:.2f} GiB measured, {(context + nccl) / GIB:.2f} GiB allowed "
        f"(context {context / GIB:.2f} + NCCL {nccl / GIB:.2f} for {communicators} communicator"
        f"{'s' if communicators != 1 else ''} on {accelerator or 'an unknown accelerator'})",
        f"  fragmentation (peak reserved - peak allocated): {measured.fragmentation / GIB:.2f} GiB measured, "
        f"{fragmentation / GIB:.2f} GiB allowed ({memory_plan.FRAGMENTATION_FRACTION:.0%} of the tensors)",
        f"  in use at the peak: {(measured.peak_reserved + measured.outside_allocator) / GIB:.2f} GiB measured, "
        f"{plan.total / GIB:.2f} GiB planned",
    ]
    if flagged:
        lines.append(f"  FLAG: the tensors are {ratio - 1:+.0%} off the plan, beyond {MEMORY_TOLERANCE:.0%}")
    return lines, ratio, flagged


def failure_reason(exc: BaseException, phase: str, memory: CudaMemory | None) -> str:
    """One line saying what went wrong and where."""
    message = str(exc).strip()
    first = message.splitlines()[0] if message else type(exc).__name__
    if isinstance(exc, CheckFailed):
        return message
    if isinstance(exc, ImportError):
        return import_failure(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        asked = re.search(r"Tried to allocate [\d.]+ [KMGT]?i?B", message)
        figures = (f"{memory.allocated / GIB:.2f} GiB allocated, {memory.reserved / GIB:.2f} GiB reserved by "
                   f"PyTorch (peak {memory.peak_allocated / GIB:.2f} GiB allocated), {memory.free / GIB:.2f} GiB "
                   f"free of {memory.total / GIB:.2f} GiB" if memory else "no memory figures")
        return f"CUDA out of memory while {phase}: {figures}" + (f"; {asked.group(0).lower()}" if asked else "")
    if isinstance(exc, NonFiniteLossError):
        return f"non-finite loss while {phase}: {first}"
    if isinstance(exc, dist.DistError):
        return f"{type(exc).__name__} (NCCL or the process group) while {phase}: {first}"
    return f"{type(exc).__name__} while {phase}: {first}"


def first_difference(saved: dict, expected: dict) -> str | None:
    """The first entry whose tensor is not bit for bit the expected one (or is missing), else None."""
    for key, want in expected.items():
        got = saved.get(key)
        if got is None or got.dtype != want.dtype or got.shape != want.shape:
            return key
        if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            return key
    return None


def tensors_of(state_dict: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) state dict by its dotted key: a copy on the host, whole."""
    return {key: _whole(value).detach().to("cpu", copy=True) for key, value in _flat(state_dict)
            if torch.is_tensor(value)}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _flat(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


class QueuedWork:
    """Matmuls queued on the current stream that keep the GPU busy for about `seconds` (timed once).
    Large ones: a few hundred launches, where a few thousand would fill CUDA's launch queue and
    block the host until the GPU caught up."""

    def __init__(self, device: torch.device, seconds: float, size: int = 16384):
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.a)
        trial = 10
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        self.queue(trial)
        torch.cuda.synchronize(device)
        self.count = max(1, round(seconds / ((time.perf_counter() - started) / trial)))

    def queue(self, count: int | None = None) -> None:
        for _ in range(count or self.count):
            torch.matmul(self.a, self.a, out=self.out)


def staging_check(run, workdir: str, watchdog: Watchdog) -> tuple[list[str], bool]:
    """Save asynchronously while the optimizer step is still in flight on the GPU and compare what
    was written with the post-step state, bit for bit (CheckFailed if they differ); the report's
    lines, and whether the step was still running when the save returned."""
    cfg = run.config.checkpoint
    cfg.uri, cfg.interval, cfg.async_save = str(Path(workdir) / "checkpoints"), 1, True
    cuda = run.env.device.type == "cuda"
    checkpointer = Checkpointer(cfg, layout={"pp": 1, "dp": 1, "tp": 1})
    watchdog.phase = "copying the state before the staging check's step"
    before = tensors_of(run.state.state_dict())
    delay = None
    if cuda:
        work = QueuedWork(run.env.device, STAGING_DELAY_S)
        # Ahead of the optimizer's kernels on the same stream: train_step returns with them still queued.
        delay = run.state.optimizers[0].register_step_pre_hook(lambda *_: work.queue())
    watchdog.phase = "saving asynchronously during an optimizer step"
    try:
        train_step(run)
    finally:
        if delay is not None:
            delay.remove()
    step_done = torch.cuda.Event() if cuda else None
    if step_done is not None:
        step_done.record()
    checkpointer.maybe_save(run.state.step, run.state)
    raced = step_done is not None and not step_done.query()
    expected = tensors_of(run.state.state_dict())  # on the compute stream: after the step's kernels
    checkpointer.close()
    watchdog.phase = "loading the staged checkpoint back"
    loaded = run.state.state_dict()
    dcp.load(loaded, storage_reader=storage_reader(cfg.uri, step_dir_name(run.state.step)), no_dist=True)  # one rank
    mismatch = first_difference(tensors_of(loaded), expected)
    if mismatch is not None:
        raise CheckFailed(f"the asynchronously staged checkpoint differs from the post-step state at {mismatch}")
    changed = sum(first_difference({key: before[key]}, {key: value}) is not None for key, value in expected.items())
    if not changed:
        raise CheckFailed("the staging check's optimizer step changed nothing: a stale copy would have passed")
    size = sum(t.numel() * t.element_size() for t in expected.values())
    if not cuda:
        race = "no GPU streams on CPU: there is no race to catch"
    elif raced:
        race = "the step's kernels were still running when the save returned: an unordered copy would have read them"
    else:
        race = "FLAG: the step had finished before the save returned; this run could not have caught an unordered copy"
    return [f"async checkpoint staging: the saved state equals the post-step state bit for bit "
            f"({len(expected)} tensors, {size / GIB:.2f} GiB; the step changed {changed} of them)", f"  {race}"], raced


def environment_report(device: torch.device) -> list[str]:
    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}"]
    if device.type == "cuda":
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        total = torch.cuda.get_device_properties(device).total_memory
        lines.append(f"device {torch.cuda.get_device_name(device)!r}, {total / GIB:.2f} GiB, NCCL {nccl}, "
                     f"{torch.cuda.device_count()} visible")
    for name in sorted(os.environ):
        if name.startswith(("FI_", "NCCL_")) or name == "LD_LIBRARY_PATH":
            lines.append(f"  {name}={os.environ[name]}")
    return lines


def run_checks(args, watchdog: Watchdog, workdir: str) -> dict[str, str]:
    """Every check in order, printing its figures; the final line's fields."""
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    accelerator, peak = device_facts(name)
    for line in environment_report(device):
        print(line, flush=True)
    cfg = load_config([*(MODEL_TINY if args.tiny else MODEL_1B), f"--training.device={args.device}",
                       f"--data.shards={workdir}/shards", f"--data.cache_dir={workdir}/cache",
                       f"--training.metrics_file={workdir}/metrics.jsonl",
                       f"--training.steps={args.warmup + args.steps + 1}", f"--optim.warmup_steps={args.warmup}"])
    per_token = flops_per_token(cfg)
    print(f"model FLOPs per token: {per_token / 1e9:.3f} G (6 x matmul parameters + 12 L T d); "
          + (f"peak {peak:g} TFLOP/s dense bf16 ({name})" if peak else f"no dense bf16 peak for {name!r}: MFU n/a"),
          flush=True)
    watchdog.phase = "starting the process group"
    with distributed(cfg) as env:
        watchdog.phase = "building the model"
        run = build(cfg, env)
        losses = []
        for step in range(args.warmup):
            watchdog.phase = f"warm-up step {step + 1} of {args.warmup}"
            losses.append(train_step(run)["loss"])
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        for step in range(args.steps):
            watchdog.phase = f"timed step {step + 1} of {args.steps}"
            losses.append(train_step(run)["loss"])  # synchronised by its loss, before its optimizer step
        if device.type == "cuda":
            torch.cuda.synchronize()  # the last optimizer step too
        seconds = (time.perf_counter() - started) / args.steps
        tokens_per_s = cfg.training.batch_size * cfg.model.seq_len / seconds
        mfu = tokens_per_s * per_token / (peak * 1e12) if peak else None
        print(f"training: {seconds * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s, "
              f"MFU {f'{mfu:.1%}' if mfu is not None else 'n/a'}", flush=True)
        falls = losses[-1] < losses[0]
        print(f"losses: {' '.join(f'{loss:.3f}' for loss in losses)}"
              + ("" if falls else "  FLAG: the loss did not fall"), flush=True)
        fields = {"device": name, "peak_tflops": f"{peak:g}" if peak else "n/a",
                  "tokens_per_s": f"{tokens_per_s:.0f}", "mfu": f"{mfu:.3f}" if mfu is not None else "n/a",
                  "loss_first": f"{losses[0]:.3f}", "loss_last": f"{losses[-1]:.3f}",
                  "loss_falls": "yes" if falls else "no"}
        if device.type == "cuda":
            watchdog.phase = "reading memory figures"
            lines, ratio, flagged = memory_report(CudaMemory.read(device), planned_workload(cfg, accelerator))
            print("\n".join(lines), flush=True)
            fields |= {"memory_ratio": f"{ratio:.2f}", "memory_flag": "yes" if flagged else "no"}
        lines, raced = staging_check(run, workdir, watchdog)
        print("\n".join(lines), flush=True)
        fields |= {"staging": "bit-exact",
                   "staging_race": ("yes" if raced else "no") if device.type == "cuda" else "n/a"}
        watchdog.phase = "closing the process group"
    return fields


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a tiny model: checks the script, not the GPU")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds; past it the check fails with its last line, whatever it is waiting for")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check=failed: no CUDA device", flush=True)
        return 1
    watchdog = Watchdog(args.time_limit)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-gpu-") as workdir:
            fields = run_checks(args, watchdog, workdir)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if not isinstance(exc, CheckFailed):
            traceback.print_exc()
        memory = None
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            memory = CudaMemory.read(torch.device(args.device))
        watchdog.cancel()
        print(f"gpu_check=failed: {failure_reason(exc, watchdog.phase, memory)}", flush=True)
        return 1
    watchdog.cancel()
    print("gpu_check=ok " + " ".join(f"{key}={shlex.quote(value)}" for key, value in fields.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
