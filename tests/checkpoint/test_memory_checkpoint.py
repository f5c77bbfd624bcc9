"""In-memory checkpoints of the real trainer (trainer/memory_checkpoint.py): six ranks, two to a
"node" (each node its own host-memory folder), pp=3 x dp=2, a copy every step and an S3
checkpoint every 5. The world is killed mid-interval and resumed: a lost node's folder is
emptied, as its replacement's memory would be. S3 is a moto server in this process, so every
object it serves is heard. The nodes' ranks in the launch spec are not torchrun's order (which
follows their addresses): the processes torchrun would number 0-1 run on node rank 2, and the
trainer numbers its ranks by node rank (train.rank_by_node), so they are ranks 4-5."""

import json
import os
import shutil
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from checkpoint_fixtures import bucket, processes, rank_image, s3  # noqa: F401 (fixtures)
from test_checkpoint_trainer import kill, losses, run_to_end, trainer_args, uninterrupted, wait_for
from trainer_rank import LOST_IN_ALL_REDUCE_ENV

from conftest import free_port, spawn_ranks
from localcloud.glue import s3 as s3_glue
from localcloud.waiting import until
from trainer import checkpoint_catalog as catalog
from trainer.config import load_config
from trainer.memory_checkpoint import buddy_of
from trainfleet.core import memory_plan
from trainer.progress import NODE_RANK_ENV

pytestmark = pytest.mark.slow

WORLD, PER_NODE = 6, 2
NODES = WORLD // PER_NODE
LAYOUT = ["--model.n_layers=6", "--parallel.pp=3", "--parallel.dp=2", "--parallel.microbatches=3",
          "--training.batch_size=6", "--checkpoint.memory_interval=1"]


def memory_of(tmp_path: Path, node: int) -> Path:
    return tmp_path / f"node{node}-shm"


def launch(tmp_path, processes, uri, metrics, *overrides, hooks=(), node_args=lambda node: [], nodes=None,
           logs: str | None = None, node_env=lambda node: {}):
    """Start the world's ranks (`nodes`: only these launch folders'), logging to tmp_path/`logs`
    (the metrics file's name by default)."""
    log_dir = tmp_path / (logs or metrics.removesuffix(".jsonl"))
    log_dir.mkdir()
    args = trainer_args(tmp_path, uri, metrics, *LAYOUT, f"--checkpoint.result_file={log_dir / 'restore.json'}",
                        *overrides)
    procs = processes.launch(WORLD, free_port(), args, log_dir, list(hooks), ranks_per_node=PER_NODE,
                             node_args=lambda node: [f"--checkpoint.memory_dir={memory_of(tmp_path, node)}",
                                                     *node_args(node)],
                             node_env=lambda node: {NODE_RANK_ENV: str(NODES - 1 - node), **node_env(node)},
                             nodes=nodes)
    return procs, log_dir


LLAMA = ["--model.architecture=llama", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.multiple_of=16",
         "--model.rope_scaling_factor=8", "--model.rope_original_seq_len=16"]
"""The model in the llama family: grouped-query attention, SwiGLU, Llama 3's rotary scaling."""


@pytest.fixture(scope="module")
def straight(tmp_path_factory, moto_endpoint, rank_image):
    """The uninterrupted run of the same layout: the losses every resumed run must repeat."""
    tmp_path, _ = uninterrupted(tmp_path_factory, rank_image, lambda tmp_path, ranks, uri: launch(
        tmp_path, ranks, uri, "straight.jsonl"))
    return Straight(losses(tmp_path, "straight.jsonl"), tmp_path)


@pytest.fixture(scope="module")
def straight_llama(tmp_path_factory, moto_endpoint, rank_image):
    """`straight` of the llama family."""
    tmp_path, _ = uninterrupted(tmp_path_factory, rank_image, lambda tmp_path, ranks, uri: launch(
        tmp_path, ranks, uri, "straight.jsonl", *LLAMA))
    return Straight(losses(tmp_path, "straight.jsonl"), tmp_path)


@dataclass
class Straight:
    losses: dict[int, float]
    folder: Path
    """Where its nodes' host-memory folders are (memory_of)."""


def killed_at(step: int, tmp_path, processes, uri) -> tuple[int, dict[int, float]]:
    """Train until every rank's in-memory copy of `step` (or the first copy after it) is done and
    step 10's S3 checkpoint is committed, then kill -9 every rank; the step copied last and the
    losses trained."""
    procs, log_dir = launch(tmp_path, processes, uri, "interrupted.jsonl", hooks=["--stop-after-copy", str(step)])
    reached = [log_dir / f"reached.{rank}" for rank in range(WORLD)]
    # Step 10's S3 checkpoint commits in the background, maybe after step 13 is copied.
    wait_for(lambda: all(path.exists() and path.read_text() for path in reached)
             and catalog.is_committed(catalog.open_store(uri), 10), f"step {step} copied, step 10 committed", procs,
             log_dir)
    kill(procs)
    assert catalog.latest_committed(uri).step == 10
    (copied,) = {int(path.read_text()) for path in reached}
    return copied, losses(tmp_path, "interrupted.jsonl")


def resume(tmp_path, processes, uri):
    """Resume the world from host memory; the S3 objects read until it trained its first step,
    and what rank 0 wrote of where the state came from."""
    heard = []
    with s3_glue.listen(lambda kind, key, body: heard.append(key) if kind == "read" else None):
        procs, log_dir = launch(tmp_path, processes, uri, "resumed.jsonl", "--checkpoint.resume=latest",
                                "--checkpoint.memory_resume=true")
        wait_for(lambda: (tmp_path / "resumed.jsonl").exists(), "the first step after the resume", procs, log_dir)
        read_before_training = list(heard)
    run_to_end(procs, log_dir)
    return read_before_training, json.loads((log_dir / "restore.json").read_text())


def test_ranks_follow_the_launch_specs_node_ranks_not_torchruns_order(straight):
    # Node rank 0 (the processes torchrun numbered 4-5, folder 2) holds ranks 0-1, its buddy node
    # rank 1 (folder 1) their second copy; node rank 2 (folder 0) holds ranks 4-5 and 2-3.
    def shards(folder: int) -> set[int]:
        return {int(path.name[6:]) for path in memory_of(straight.folder, folder).glob("*/shard-*")}
    assert (shards(2), shards(1), shards(0)) == ({0, 1, 4, 5}, {2, 3, 0, 1}, {4, 5, 2, 3})


def test_buddies_are_the_same_local_rank_on_the_next_node_by_node_rank():
    in_order = [0, 0, 1, 1, 2, 2]
    assert [buddy_of(rank, in_order, 2) for rank in range(6)] == [2, 3, 4, 5, 0, 1]
    # torchrun ordered the nodes by address: ranks 0-1 are on node rank 2, 4-5 on node rank 0.
    shuffled = [2, 2, 1, 1, 0, 0]
    assert [buddy_of(rank, shuffled, 2) for rank in range(6)] == [4, 5, 0, 1, 2, 3]
    assert [buddy_of(rank, [0] * 4, 4) for rank in range(4)] == [0, 1, 2, 3]  # one node: no other copy


def test_a_lost_node_resumes_from_its_buddy_with_no_step_redone_and_no_s3_read(tmp_path, processes, bucket,
                                                                                 straight):
    uri = f"s3://{bucket}/runs/memory/checkpoints"
    copied, trained = killed_at(13, tmp_path, processes, uri)
    shutil.rmtree(memory_of(tmp_path, 1))  # node 1 is replaced: ranks 2 and 3 come back with empty memory

    read, restored = resume(tmp_path, processes, uri)

    assert read == []
    assert restored | {"seconds": 0} == {"step": copied, "source": "memory", "shards": 6, "own_memory": 4,
                                         "peers": 2, "peer_bytes": restored["peer_bytes"], "seconds": 0,
                                         "fallback": None}
    assert restored["peer_bytes"] > 0 and max(trained) - copied <= 1, "the step copied is the last one trained"
    assert trained == {s: straight.losses[s] for s in range(1, max(trained) + 1)}
    assert losses(tmp_path, "resumed.jsonl") == {s: straight.losses[s] for s in range(copied + 1, 21)}
    # The replacement holds its own shards again, of this timeline: the last copy whole everywhere
    # and the one after it.
    kept = sorted(int(p.name[5:14]) for p in memory_of(tmp_path, 1).glob("*/shard-00002/*"))
    assert len(kept) == 2 and copied < kept[0] < kept[1] <= 20, kept


def test_a_node_lost_with_its_buddy_resumes_from_s3_and_says_so(tmp_path, processes, bucket, straight):
    uri = f"s3://{bucket}/runs/memory-and-buddy/checkpoints"
    killed_at(13, tmp_path, processes, uri)
    for node in (1, 0):  # node rank 1 (ranks 2-3, folder 1) and its buddy, node rank 2 (folder 0)
        shutil.rmtree(memory_of(tmp_path, node))

    read, restored = resume(tmp_path, processes, uri)

    assert any(key.endswith(".distcp") for key in read)
    assert restored | {"seconds": 0} == {"step": 10, "source": "s3", "shards": 6, "seconds": 0,
                                         "fallback": "shards [2, 3] have no in-memory copy (a node and its buddy "
                                                     "were lost, or never held one)"}
    assert losses(tmp_path, "resumed.jsonl") == {s: straight.losses[s] for s in range(11, 21)}


def test_the_plan_states_what_a_copy_takes(tmp_path, straight):
    """Each shard's last copy against the memory plan's state_bytes for its pipeline rank: the plan
    (which Validate refuses layouts by) must not undercount what the trainer writes."""
    config = load_config(trainer_args(tmp_path, "s3://b/c", "sized.jsonl", *LAYOUT, f"--checkpoint.memory_dir={tmp_path}"))
    workload = memory_plan.Workload.from_sections(asdict(config), accelerator="none")
    for rank in range(WORLD):
        copy = max(straight.folder.glob(f"node*-shm/*/shard-{rank:05d}/step-*.pt"), key=lambda path: path.name)
        planned = memory_plan.state_bytes(workload, pp_rank=rank // 2)  # pp-major: dp=2 ranks a stage
        assert planned <= copy.stat().st_size <= planned + OVERHEAD_BYTES, (rank, copy.stat().st_size, planned)


OVERHEAD_BYTES = 128 * 2**10
"""What a copy holds beside the tensors' bytes: a few hundred bytes a tensor (its record in the
file, its name; AdamW keeps a step counter beside each parameter's two moments), the scheduler's,
sampler's and RNG's state. It grows with the number of tensors a rank holds (a few hundred), not
with their size: nothing beside a share of gigabytes."""


def test_an_s3_commit_newer_than_every_in_memory_copy_is_resumed_instead(tmp_path, processes, bucket, straight):
    """Copies every 6 steps (6, 12), S3 every 5: the world is stopped once step 15 is committed.
    The newest whole copy, 12, is older: it is not loaded, and the world resumes from S3's 15."""
    uri = f"s3://{bucket}/runs/s3-newer/checkpoints"
    procs, log_dir = launch(tmp_path, processes, uri, "interrupted.jsonl", "--checkpoint.memory_interval=6",
                            hooks=["--hang-after", "15"])
    wait_for(lambda: all((log_dir / f"reached.{rank}").exists() for rank in range(WORLD)), "step 15 committed",
             procs, log_dir)
    kill(procs)

    read, restored = resume(tmp_path, processes, uri)

    assert any(key.endswith(".distcp") for key in read)
    assert restored | {"seconds": 0} == {"step": 15, "source": "s3", "shards": 6, "seconds": 0,
                                         "fallback": "S3 holds step 15, newer than every in-memory copy"}
    assert losses(tmp_path, "resumed.jsonl") == {s: straight.losses[s] for s in range(16, 21)}


def repair_file(tmp_path: Path, node: int) -> Path:
    return tmp_path / f"node{node}-repair.json"


@pytest.mark.parametrize("lost_folder", [1, 0])
def test_a_lost_node_is_repaired_in_place_around_its_replacement(tmp_path, processes, bucket, straight, lost_folder):
    """A node is killed once step 13 is copied, before the first S3 checkpoint (step 18: no save
    of the failed world may still be reading S3 when the node dies): node rank 1 (launch folder 1),
    or node rank 2 (launch folder 0), whose first rank hosts the world's store, as torchrun's rank 0
    does on whichever node has the lowest address. Its replacement starts with the order of
    generation 1, the ranks of the other nodes receive it in their processes. They keep those
    processes, the world resumes from host memory without reading S3, and every loss is the
    uninterrupted run's."""
    repaired_in_place(tmp_path, processes, bucket, straight, lost_folder)


def test_a_llama_world_is_repaired_in_place_too(tmp_path, processes, bucket, straight_llama):
    repaired_in_place(tmp_path, processes, bucket, straight_llama, LOST, *LLAMA)


def repaired_in_place(tmp_path, processes, bucket, straight, lost_folder: int, *model: str) -> None:
    uri = f"s3://{bucket}/runs/repaired/checkpoints"
    procs, log_dir = launch(tmp_path, processes, uri, "repaired.jsonl", "--checkpoint.interval=18", *model,
                            hooks=["--mark-copy", "13"], node_args=repair_args(tmp_path))
    wait_for(lambda: all((log_dir / f"reached.{rank}").exists() for rank in range(WORLD)), "step 13 copied", procs,
             log_dir)
    lost = procs[PER_NODE * lost_folder:PER_NODE * (lost_folder + 1)]
    survivors = [proc for proc in procs if proc not in lost]
    heard = []
    with s3_glue.listen(lambda kind, key, body: heard.append(key) if kind == "read" else None):
        kill(lost)
        shutil.rmtree(memory_of(tmp_path, lost_folder))  # the replacement's memory is empty
        order_the_repair(tmp_path)
        replacement, replacement_logs = launch(tmp_path, processes, uri, "repaired.jsonl", "--checkpoint.interval=18",
                                               "--checkpoint.resume=latest", "--checkpoint.memory_resume=true", *model,
                                               node_args=repair_args(tmp_path), nodes=[lost_folder], logs="replacement")
        wait_for(lambda: "source" in restored(log_dir) and restored(log_dir)["step"] > 10, "the repaired world restored",
                 survivors + replacement, replacement_logs)
        read_on_the_way = list(heard)
    run_to_end(survivors, log_dir)
    run_to_end(replacement, replacement_logs)

    assert read_on_the_way == []
    result = restored(log_dir)
    assert result | {"seconds": 0, "peer_bytes": 0} == {"step": result["step"], "source": "memory", "shards": 6,
                                                        "own_memory": 4, "peers": 2, "peer_bytes": 0, "seconds": 0,
                                                        "fallback": None}
    # Steps 1..T in the first world, then from the restored step on in the repaired one.
    logged = [json.loads(line)["step"] for line in (tmp_path / "repaired.jsonl").read_text().splitlines()]
    after = list(range(result["step"] + 1, 21))
    trained_before = len(logged) - len(after)
    assert logged == list(range(1, trained_before + 1)) + after
    assert 13 <= result["step"] <= trained_before <= result["step"] + 1 < 18, (trained_before, result)
    assert all(line["loss"] == straight.losses[line["step"]] for line in metric_lines(tmp_path))  # none of a failed step
    assert all(proc.returncode == 0 for proc in survivors)  # the processes they started with trained to the end
    assert "joined generation 1" in (log_dir / "rank4.log").read_text()  # global rank 0


LOST = 1
"""The launch folder whose node is lost in the repair tests: node rank 1, ranks 2-3 (pipeline stage 1)."""


def repair_args(tmp_path: Path):
    return lambda node: [f"--parallel.repair_file={repair_file(tmp_path, node)}"]


def order_the_repair(tmp_path: Path) -> None:
    """Write generation 1's order where every node's ranks look, as each node's agent does."""
    order = json.dumps({"generation": 1, "store_host": "127.0.0.1", "store_port": free_port(), "host_node_rank": 0,
                        "nodes": NODES})
    for node in range(NODES):
        repair_file(tmp_path, node).write_text(order)


def repair_lost_in_all_reduce(tmp_path, processes, uri, at_step: int, *model: str,
                              hooks=()) -> tuple[list, Path, list, Path]:
    """Node LOST's ranks end where step `at_step` all-reduces its loss, the others waiting in it;
    its memory is emptied, the repair ordered and its replacement started (`model`: its
    overrides). The survivors and the replacement, and their log folders."""
    procs, log_dir = launch(tmp_path, processes, uri, "repaired.jsonl", "--checkpoint.interval=18", *model,
                            hooks=hooks,
                            node_args=repair_args(tmp_path),
                            node_env=lambda node: {LOST_IN_ALL_REDUCE_ENV: str(at_step)} if node == LOST else {})
    lost, survivors = procs[2 * LOST:2 * LOST + 2], procs[:2 * LOST] + procs[2 * LOST + 2:]
    wait_for(lambda: all((log_dir / f"lost.{rank}").exists() for rank in (2, 3)), f"node {LOST} lost in step "
             f"{at_step}'s all-reduce", survivors, log_dir)
    for proc in lost:
        proc.wait()
    shutil.rmtree(memory_of(tmp_path, LOST), ignore_errors=True)  # the replacement's memory is empty
    order_the_repair(tmp_path)
    replacement, replacement_logs = launch(tmp_path, processes, uri, "repaired.jsonl", "--checkpoint.interval=18",
                                           "--checkpoint.resume=latest", "--checkpoint.memory_resume=true", *model,
                                           hooks=hooks, node_args=repair_args(tmp_path), nodes=[LOST],
                                           logs="replacement")
    return survivors, log_dir, replacement, replacement_logs


def metric_lines(tmp_path: Path) -> list[dict]:
    """Every line of the repaired run's metrics, in order (a step redone after the repair twice)."""
    return [json.loads(line) for line in (tmp_path / "repaired.jsonl").read_text().splitlines()]


LOST_AT = 14
"""The step in whose all-reduce node LOST is lost."""


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_node_lost_in_the_steps_all_reduce_is_repaired_and_no_partial_value_is_used(tmp_path, processes, bucket,
                                                                                      request, family):
    """Under NCCL the survivors' all-reduce returns with partial sums (after the watchdog's abort,
    or the order's): the step checks its world and raises, so no loss but the uninterrupted run's
    is ever logged, and the world resumes from host memory. Either family: the check is the step's."""
    straight = request.getfixturevalue({"gpt": "straight", "llama": "straight_llama"}[family])
    survivors, log_dir, replacement, replacement_logs = repair_lost_in_all_reduce(
        tmp_path, processes, f"s3://{bucket}/runs/lost-in-all-reduce/checkpoints", LOST_AT,
        *(LLAMA if family == "llama" else []))
    run_to_end(survivors, log_dir)
    run_to_end(replacement, replacement_logs)

    result = restored(log_dir)
    assert result["source"] == "memory" and LOST_AT - 2 <= result["step"] < LOST_AT, result
    lines = metric_lines(tmp_path)
    assert [line["step"] for line in lines] == list(range(1, LOST_AT)) + list(range(result["step"] + 1, 21))
    assert all(line["loss"] == straight.losses[line["step"]] for line in lines), lines
    assert "WorldFailed: the world failed by the end of the step's all-reduce" in (log_dir / "rank4.log").read_text()


def test_a_planted_use_of_the_partial_all_reduce_logs_a_loss_no_step_had(tmp_path, processes, bucket, straight):
    """The same loss with the check after the all-reduce taken out: the step goes on with partial
    sums, and step 14 is logged (and would be reported to the agent) with a loss of no run's."""
    survivors, log_dir, replacement, replacement_logs = repair_lost_in_all_reduce(
        tmp_path, processes, f"s3://{bucket}/runs/partial-use/checkpoints", LOST_AT, hooks=["--use-partial-values"])
    run_to_end(survivors, log_dir)
    run_to_end(replacement, replacement_logs)

    wrong = [line for line in metric_lines(tmp_path) if line["loss"] != straight.losses[line["step"]]]
    assert [line["step"] for line in wrong] == [LOST_AT], wrong


def test_a_repaired_world_with_nothing_to_restore_raises_and_leaves_it_to_a_restart(tmp_path, processes, bucket):
    """Node LOST is lost in step 1, before any in-memory copy or S3 commit: the survivors hold
    their weights at step 0 and the replacement fresh ones. Every rank of the repaired world
    raises RepairError and its process ends, for the control plane to restart the world."""
    survivors, log_dir, replacement, replacement_logs = repair_lost_in_all_reduce(
        tmp_path, processes, f"s3://{bucket}/runs/nothing-to-restore/checkpoints", 1)
    for procs, logs in ((survivors, log_dir), (replacement, replacement_logs)):
        for proc in procs:
            assert proc.wait() != 0
    for rank, logs in ((0, log_dir), (1, log_dir), (4, log_dir), (5, log_dir), (2, replacement_logs),
                       (3, replacement_logs)):
        assert ("RepairError: the repaired world (generation 1) has nothing to restore: no node holds an in-memory "
                "copy, and S3 holds no commit" in (logs / f"rank{rank}.log").read_text()), rank
    assert not (tmp_path / "repaired.jsonl").exists()  # no step was trained
    assert restored(log_dir) | {"seconds": 0} == {"step": 0, "source": "none", "shards": 6, "seconds": 0,
                                                  "fallback": None}, "the first world's start; the repaired one said nothing"


def restored(log_dir: Path) -> dict:
    """What global rank 0 last wrote of where the state came from ({} while it is being written)."""
    try:
        return json.loads((log_dir / "restore.json").read_text())
    except (FileNotFoundError, ValueError):
        return {}


# --- the copies' own group and their memory --------------------------------------------------------

def _connections(store_port: int) -> int:
    """This process's TCP sockets but the store's: gloo's. The store's connections come and go
    with threads of their own (the test world's NCCL rules, tests/nccl_rules.py, connect its
    heartbeat monitor when it first looks; rank 0 also accepts the other ranks')."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            inodes.add(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile
            pass
    count = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            ports = {int(address.rsplit(":", 1)[1], 16) for address in fields[1:3]}
            count += f"socket:[{fields[9]}]" in inodes and store_port not in ports
    return count


def _grouped_rank(rank: int, world: int, port: int, memory_dir: str, out: str) -> None:
    """Make the in-memory copies' group (and gather the node ranks on it), counting the sockets
    that opened: the connections the group made."""
    import torch.distributed as dist

    from trainer.config import CheckpointConfig
    from trainer.memory_checkpoint import MemoryCheckpoints

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    before = _connections(port)
    MemoryCheckpoints(CheckpointConfig(memory_interval=1, memory_dir=memory_dir), key="k", ranks_per_node=1,
                      node_rank=rank)
    Path(out, f"rank-{rank}.json").write_text(json.dumps(_connections(port) - before))
    dist.barrier()
    dist.destroy_process_group()


def test_the_copies_group_connects_a_rank_to_its_neighbours_alone(tmp_path):
    """Eager, gloo would connect each of 6 ranks to the 5 others in every world the copies make;
    the copies' group connects the peers a rank talks to (its neighbours in the ring its gathers
    take, and its buddy and ward: here the same)."""
    spawn_ranks(_grouped_rank, (6, free_port(), str(tmp_path / "memory"), str(tmp_path)), 6)
    opened = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(6)]
    assert max(opened) <= 3, opened


def test_an_abandoned_copy_releases_the_staged_state(tmp_path):
    """The copies' stager keeps the staged state from one copy to the next; a repair that abandons
    the copies releases it (off the repair's path), the copy in flight finishing with what it holds."""
    import torch

    from trainer.config import CheckpointConfig
    from trainer.memory_checkpoint import MemoryCheckpoints

    class State:
        def __init__(self):
            self.weights = torch.ones(1024, 1024)

        def state_dict(self):
            return {"weights": self.weights}

    memory = MemoryCheckpoints(CheckpointConfig(memory_interval=1, memory_dir=str(tmp_path)), key="k",
                               ranks_per_node=1, node_rank=0)
    state = State()  # the stager keeps a staged copy of each storage while the storage lives
    assert memory.maybe_copy(1, state, agreed=torch.tensor([1.0, 0.0]))
    memory._wait()
    cache = memory._stager._state_dict_stager._cached_storage_mapping
    assert len(cache) == 1  # the staged state, kept for the next copy
    memory.abandon()
    until(lambda: len(cache) == 0, lambda: len(cache), what="the staged state released", poll_s=0.05)
