"""Checkpoint save/load speed and the training stall, against an S3 endpoint.

    .venv/bin/python bench/checkpoint.py                 # a moto server on 127.0.0.1, 256 MiB of state
    .venv/bin/python bench/checkpoint.py --state-mib 64
    AWS_ENDPOINT_URL=http://host:9000 .venv/bin/python bench/checkpoint.py --bucket mybucket

One process, fp32 on CPU: an MLP and its AdamW state (parameters x 3). Figures, side by side:
- sync save: maybe_save with async_save=false, until committed;
- async stall: the time the training loop is blocked by an async save (starting it, plus waiting
  for the CPU copy at the next optimizer step), as the Checkpointer measures it; and the step time
  of the step that saved next to a plain step;
- save and load throughput, and the raw S3 PUT and GET throughput of the same files at the same
  endpoint in the same run (boto3, one thread per file, as DCP writes one file per rank; the GET
  also in ranges of the connector's part size, one thread per range, as its client fetches).
The last two lines are `async_stall_ratio=<stall / sync save time>` and
`load_vs_raw_get=<load throughput / raw GET throughput>`.
"""

import argparse
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import botocore.exceptions
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import checkpoint_catalog as catalog  # noqa: E402
from trainer.local_ports import free_port  # noqa: E402
from trainer.checkpoint import S3_PART_BYTES, Checkpointer  # noqa: E402
from trainer.config import CheckpointConfig  # noqa: E402

WIDTH = 1024


def settings(uri: str, **changes) -> CheckpointConfig:
    return CheckpointConfig(uri=uri, interval=1, keep_last=2, **changes)


class State:
    """A model, its optimizer and a step: what a trainer's TrainState holds, minus the data."""

    def __init__(self, state_mib: int):
        layers = max(1, state_mib * 2**20 // (3 * 4 * WIDTH * WIDTH))  # params + exp_avg + exp_avg_sq, fp32
        self.model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.step = 0
        train_step(self)  # AdamW allocates its state on the first step

    def state_dict(self):
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "step": self.step}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.step = state["step"]


def train_step(state: State) -> float:
    started = time.perf_counter()
    loss = state.model(torch.randn(64, WIDTH)).square().mean()
    loss.backward()
    state.optimizer.step()  # the Checkpointer's pre-hook waits here for the CPU copy
    state.optimizer.zero_grad()
    state.step += 1
    return time.perf_counter() - started


def state_bytes(state: State) -> int:
    tensors = [t for t in state.model.parameters()]
    tensors += [v for s in state.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def checkpoint_keys(uri: str, step: int) -> tuple[str, list[str]]:
    """The bucket and the keys of a committed step's files (its marker aside)."""
    store = catalog.open_store(uri)
    return store.bucket, [store.prefix + stored.name for stored in catalog.verified_manifest(store, step).files]


def raw_put_seconds(uri: str, step: int) -> float:
    """PUT the files of a saved step again, as plain objects, to the same endpoint."""
    bucket, keys = checkpoint_keys(uri, step)
    s3 = boto3.client("s3")
    bodies = {key: s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        list(pool.map(lambda item: s3.put_object(Bucket=bucket, Key=f"raw-put/{item[0]}", Body=item[1]),
                      bodies.items()))
    return time.perf_counter() - started


def raw_get_seconds(uri: str, step: int, range_bytes: int | None = None) -> float:
    """GET the files of a saved step into memory: what a load has to move at the least. Whole
    objects, or in ranges of `range_bytes`, all at once (as the connector's client fetches parts)."""
    bucket, keys = checkpoint_keys(uri, step)
    s3 = boto3.client("s3")
    requests = []
    for key in keys:
        size = s3.head_object(Bucket=bucket, Key=key)["ContentLength"]
        step_bytes = range_bytes or max(size, 1)
        requests += [(key, f"bytes={start}-{min(start + step_bytes, size) - 1}" if range_bytes else "")
                     for start in range(0, max(size, 1), step_bytes)]

    def get(request):
        key, byte_range = request
        extra = {"Range": byte_range} if byte_range else {}
        return s3.get_object(Bucket=bucket, Key=key, **extra)["Body"].read()

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        list(pool.map(get, requests))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-mib", type=int, default=256, help="approximate size of the training state")
    parser.add_argument("--bucket", help="an existing bucket at AWS_ENDPOINT_URL (default: a local moto server)")
    parser.add_argument("--repeats", type=int, default=3, help="saves of each kind; the median is reported")
    args = parser.parse_args()
    torch.manual_seed(0)

    if args.bucket:
        report(args, args.bucket)
        return
    # moto in a process of its own, as S3 would be: in this one it would compete for the GIL.
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        os.environ["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{port}"
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        s3 = boto3.client("s3")
        deadline = time.monotonic() + 60
        while True:
            try:
                s3.create_bucket(Bucket=bucket)
                break
            except botocore.exceptions.EndpointConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        report(args, bucket)
    finally:
        server.terminate()
        server.wait(timeout=30)


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def report(args, bucket: str) -> None:
    state = State(args.state_mib)
    mib = state_bytes(state) / 2**20
    layout = {"pp": 1, "dp": 1}
    print(f"endpoint: {os.environ['AWS_ENDPOINT_URL']}")
    print(f"state size: {mib:.0f} MiB ({sum(p.numel() for p in state.model.parameters()) / 1e6:.1f} M parameters)")

    # Sync saves and raw PUTs of the same files alternate, so that both see the same load.
    sync_uri = f"s3://{bucket}/bench/sync/checkpoints"
    sync = Checkpointer(settings(sync_uri, async_save=False), layout=layout, request_signal=None)
    sync_times, put_times = [], []
    for _ in range(args.repeats):
        train_step(state)
        started = time.perf_counter()
        sync.maybe_save(state.step, state)
        sync_times.append(time.perf_counter() - started)
        put_times.append(raw_put_seconds(sync_uri, state.step))
    sync.close()
    sync_s, put_s = median(sync_times), median(put_times)

    async_uri = f"s3://{bucket}/bench/async/checkpoints"
    checkpointer = Checkpointer(settings(async_uri), layout=layout, request_signal=None)
    stalls, to_commit, overlapped_step_s, plain_step_s = [], [], [], []
    for _ in range(args.repeats):
        train_step(state)
        saved_params = [p.detach().clone() for p in state.model.parameters()]
        blocked_before = checkpointer.blocked_seconds
        started = time.perf_counter()
        checkpointer.maybe_save(state.step, state)
        overlapped = [train_step(state)]  # training goes on while the copy and the upload proceed
        stalls.append(checkpointer.blocked_seconds - blocked_before)
        while not checkpointer.save_done():
            overlapped.append(train_step(state))
        to_commit.append(time.perf_counter() - started)
        overlapped_step_s.append(sum(overlapped) / len(overlapped))
        checkpointer.wait()
        plain_step_s += [train_step(state) for _ in range(3)]
    checkpointer.close()
    stall_s = median(stalls)

    # Loads and raw GETs of the same files alternate, so that both see the same load.
    load_times, get_times, ranged_get_times = [], [], []
    for _ in range(args.repeats):
        fresh = State(args.state_mib)
        loader = Checkpointer(settings(async_uri, resume="latest"), layout=layout, request_signal=None)
        started = time.perf_counter()
        loaded_step = loader.resume(fresh)
        load_times.append(time.perf_counter() - started)
        loader.close()
        get_times.append(raw_get_seconds(async_uri, loaded_step))
        ranged_get_times.append(raw_get_seconds(async_uri, loaded_step, range_bytes=S3_PART_BYTES))
    load_s, get_s, ranged_get_s = median(load_times), median(get_times), median(ranged_get_times)
    # The async copy is of the state at the save, not of what the next optimizer step made of it.
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), saved_params))

    print(f"sync save (until committed): {sync_s:.3f} s  ({mib / sync_s:.0f} MiB/s)")
    print(f"raw S3 PUT of the same files: {put_s:.3f} s  ({mib / put_s:.0f} MiB/s)")
    print(f"save throughput / raw PUT throughput: {put_s / sync_s:.2f}")
    print(f"load (resume latest, verified): {load_s:.3f} s  ({mib / load_s:.0f} MiB/s)")
    print(f"raw S3 GET of the same files: {get_s:.3f} s  ({mib / get_s:.0f} MiB/s)")
    print(f"raw S3 GET of the same files in {S3_PART_BYTES >> 20} MiB ranges: {ranged_get_s:.3f} s  "
          f"({mib / ranged_get_s:.0f} MiB/s)")
    print(f"async save until committed: {median(to_commit):.3f} s")
    print(f"async save, training loop blocked: {stall_s:.4f} s  (each: {', '.join(f'{s:.4f}' for s in stalls)})")
    print(f"step time: plain {median(plain_step_s):.3f} s, while an upload runs {median(overlapped_step_s):.3f} s "
          "(CPU shared with the upload and the server on this machine)")
    print(f"async_stall_ratio={stall_s / sync_s:.4f}")
    print(f"load_vs_raw_get={get_s / load_s:.2f}")


if __name__ == "__main__":
    main()
