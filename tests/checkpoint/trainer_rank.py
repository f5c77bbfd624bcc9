"""One rank of trainer.train, as torchrun would start it, with hooks for the checkpoint tests
(checkpoint_fixtures.Ranks forks them from a warm image).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python tests/checkpoint/trainer_rank.py [--hang-after STEP] [--block-write STEP RANK] -- TRAINER ARGS

--hang-after STEP: save STEP as if asked to (returns once committed), touch <signals>/reached.<rank>,
    then wait to be killed.
--block-write STEP RANK: RANK starts its shard of STEP (parts uploaded), touches <signals>/writing,
    and never finishes it.
--stop-after-copy STEP: finish the first in-memory copy at STEP or after (a copy still going at STEP
    skips it), write its step to <signals>/reached.<rank>, then wait to be killed.
--mark-copy STEP: the same, and train on.
--use-partial-values: a planted fault: the step uses what its all-reduce returned even when the
    world failed (the check after it is gone).
With LOST_IN_ALL_REDUCE_ENV=STEP in its environment a rank's process ends (as its node is lost)
where its step STEP would all-reduce the loss, once it touched <signals>/lost.<rank>: its peers,
their pipeline work done, are waiting in that all-reduce.

A rank prints every thread's stack on SIGUSR2 (`pkill -USR2 -f trainer_rank`: where a stuck world waits).
"""

import argparse
import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import logging  # noqa: E402

from trainer import checkpoint, memory_checkpoint, train  # noqa: E402


def hang_after(step: int, signals: Path) -> None:
    real_maybe_save = checkpoint.Checkpointer.maybe_save

    def maybe_save(self, at_step, state, force=False, final=False, agreed=None):
        if at_step != step:
            return real_maybe_save(self, at_step, state, force, final, agreed)
        real_maybe_save(self, at_step, state, force=True, final=final, agreed=agreed)
        (signals / f"reached.{self.rank}").touch()
        threading.Event().wait()

    checkpoint.Checkpointer.maybe_save = maybe_save


def block_write(step: int, rank: int, signals: Path) -> None:
    real_writer = checkpoint.storage_writer

    def writer(location: str, step_dir: str):
        inner = real_writer(location, step_dir)
        if step_dir == f"step-{step:09d}" and int(os.environ["RANK"]) == rank:
            def write_data(plan, planner):
                # Really start the shard: its first multipart parts go up, the object never completes.
                shard = inner.fs.concat_path(inner.path, f"{plan.storage_data.prefix}0.distcp")
                with inner.fs.create_stream(shard, "wb") as stream:
                    stream.write(bytes(20 * 2**20))
                    (signals / "writing").touch()
                    threading.Event().wait()

            inner.write_data = write_data
        return inner

    checkpoint.storage_writer = writer


def after_copy(step: int, signals: Path, stop: bool) -> None:
    real_maybe_copy = memory_checkpoint.MemoryCheckpoints.maybe_copy
    marked = threading.Event()

    def maybe_copy(self, at_step, state, agreed):
        started = real_maybe_copy(self, at_step, state, agreed)
        if started and at_step >= step and not marked.is_set():  # every rank starts the same copies
            self._wait()
            (signals / f"reached.{self.rank}").write_text(str(at_step))
            marked.set()
            if stop:
                threading.Event().wait()
        return started

    memory_checkpoint.MemoryCheckpoints.maybe_copy = maybe_copy


LOST_IN_ALL_REDUCE_ENV = "TRAINFLEET_TEST_LOST_IN_ALL_REDUCE"


def lost_in_all_reduce(step: int, signals: Path) -> None:
    real = train._loss_and_grad_norm
    steps = iter(range(1, step + 1))

    def loss_and_grad_norm(*args, **kwargs):
        if next(steps, None) == step:
            (signals / f"lost.{os.environ['RANK']}").touch()
            os._exit(1)
        return real(*args, **kwargs)

    train._loss_and_grad_norm = loss_and_grad_norm


def use_partial_values() -> None:
    train.raise_if_failed = lambda world, after: None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--signals", type=Path, required=True)
    parser.add_argument("--hang-after", type=int)
    parser.add_argument("--block-write", type=int, nargs=2, metavar=("STEP", "RANK"))
    parser.add_argument("--stop-after-copy", type=int)
    parser.add_argument("--mark-copy", type=int)
    parser.add_argument("--use-partial-values", action="store_true")
    parser.add_argument("trainer_args", nargs="*")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    logging.basicConfig(level=logging.INFO, format=f"rank{os.environ['RANK']} %(levelname)s %(name)s: %(message)s")
    if args.hang_after:
        hang_after(args.hang_after, args.signals)
    if args.block_write:
        block_write(*args.block_write, args.signals)
    if args.stop_after_copy:
        after_copy(args.stop_after_copy, args.signals, stop=True)
    if args.mark_copy:
        after_copy(args.mark_copy, args.signals, stop=False)
    if LOST_IN_ALL_REDUCE_ENV in os.environ:
        lost_in_all_reduce(int(os.environ[LOST_IN_ALL_REDUCE_ENV]), args.signals)
    if args.use_partial_values:
        use_partial_values()
    return train.main(args.trainer_args)


if __name__ == "__main__":
    sys.exit(main())
