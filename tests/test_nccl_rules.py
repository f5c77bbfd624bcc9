"""The test world's NCCL rules (nccl_rules.py): what NCCL would hang on fails, named, in every
rank a test starts; what NCCL runs still runs, with the right data.

Each world's ranks report to a JSON file per rank rather than raising: a rank that raises ends
its world at once, while the point here is what every rank saw."""

import inspect
import json
import os
import re
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import free_port, spawn_ranks
from torch.multiprocessing import ProcessExitedException
from localcloud.fleet import INSTANCE_SITE
from localcloud.waiting import run_captured, wait_for_exit
from localcloud.warm_image import WarmImage

pytestmark = pytest.mark.slow


def unbatched_ring(rank: int, world: int) -> torch.Tensor:
    """The fleet check's first exchange: isend to the next rank, then irecv from the previous one,
    each waited for on a thread of its own."""
    buffer, inbox = torch.full((1024,), float(rank)), torch.empty(1024)
    sending, receiving = dist.isend(buffer, (rank + 1) % world), dist.irecv(inbox, (rank - 1) % world)
    waiter = threading.Thread(target=sending.wait)
    waiter.start()
    receiving.wait()
    waiter.join()
    return inbox


def batched_ring(rank: int, world: int) -> torch.Tensor:
    buffer, inbox = torch.full((1024,), float(rank)), torch.empty(1024)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, buffer, (rank + 1) % world),
                                        dist.P2POp(dist.irecv, inbox, (rank - 1) % world)]):
        work.wait()
    return inbox


def ordered_pair(rank: int, world: int) -> torch.Tensor:
    """Blocking send and receive, rank 0 sending first and rank 1 receiving first."""
    buffer, inbox = torch.full((8,), float(rank)), torch.empty(8)
    if rank == 0:
        dist.send(buffer, 1)
        dist.recv(inbox, 1)
    else:
        dist.recv(inbox, 0)
        dist.send(buffer, 0)
    return inbox


def swapped_tags(rank: int, world: int) -> torch.Tensor:
    """Two sends told apart by tag, received in the other order: gloo matches them by tag."""
    first, second = torch.full((8,), 1.0), torch.full((8,), 2.0)
    if rank == 0:
        works = [dist.isend(first, 1, tag=1), dist.isend(second, 1, tag=2)]
    else:
        works = [dist.irecv(second, 0, tag=2), dist.irecv(first, 0, tag=1)]
    for work in works:
        work.wait()
    return first


def unanswered(rank: int, world: int) -> torch.Tensor:
    """Rank 1 never sends (a peer lost: NCCL waits for ever); rank 0 aborts its groups from a
    thread while it waits, as a repair does (trainer/repair.py)."""
    inbox = torch.empty(8)
    if rank == 0:
        threading.Timer(0.5, dist.distributed_c10d._abort_process_group).start()
        dist.irecv(inbox, 1).wait()
    return inbox


EXCHANGES = {"unbatched_ring": unbatched_ring, "batched_ring": batched_ring, "ordered_pair": ordered_pair,
             "swapped_tags": swapped_tags, "unanswered": unanswered}


def _exchange_rank(rank: int, world: int, port: int, exchange: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    report = {"ruled": dist.isend is sys.modules["nccl_rules"].isend}
    try:
        report["received"] = EXCHANGES[exchange](rank, world).tolist()
    except Exception as error:  # noqa: BLE001 (reported to the test)
        report["error"] = f"{type(error).__name__}: {error}"
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    if "error" not in report and dist.is_initialized():
        dist.destroy_process_group()
    elif rank == 0:
        # Rank 0 serves the store the rules read: gone, a rank still finding the deadlock would see
        # its connection reset instead. It stays until every rank has reported.
        while len(list(Path(out).glob("rank-*.json"))) < world:
            time.sleep(0.05)


def run_exchange(exchange: str, world: int, tmp_path) -> list[dict]:
    spawn_ranks(_exchange_rank, (world, free_port(), exchange, str(tmp_path)), world)
    return [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(world)]


def test_the_unbatched_exchange_of_two_ranks_is_named_a_deadlock_on_each(tmp_path):
    reports = run_exchange("unbatched_ring", 2, tmp_path)
    for report in reports:
        assert report["error"].startswith("NcclDeadlock: NCCL would deadlock"), report
        assert ("rank 0's isend->1 waits for rank 1 to post its irecv<-0, queued behind its own isend->0"
                in report["error"]), report


def test_the_unbatched_ring_of_three_ranks_is_named_a_deadlock_of_their_communicators(tmp_path):
    reports = run_exchange("unbatched_ring", 3, tmp_path)
    for report in reports:
        assert report["error"].startswith("NcclDeadlock: NCCL would deadlock"), report
        assert "ranks [0, 1, 2] wait for each other" in report["error"], report
        assert ("rank 0 creating the communicator of ranks 0 and 1 (process group 0) (for its isend->1) waits for "
                "rank 1 to create it too" in report["error"]), report


@pytest.mark.parametrize("world", [2, 3])
def test_the_batched_exchange_completes_with_each_neighbours_data(tmp_path, world):
    reports = run_exchange("batched_ring", world, tmp_path)
    assert [report["received"] for report in reports] == [[float((r - 1) % world)] * 1024 for r in range(world)]
    assert all(report["ruled"] for report in reports)


def test_a_send_met_by_a_receive_posted_first_completes(tmp_path):
    reports = run_exchange("ordered_pair", 2, tmp_path)
    assert [report["received"] for report in reports] == [[1.0] * 8, [0.0] * 8]


def test_ops_matched_by_tag_out_of_order_are_refused(tmp_path):
    # gloo delivers each tensor to its tag's receive; NCCL, by order, would swap them.
    # Either rank may see it first (and end the world, the store with it when it is rank 0).
    errors = [report.get("error") or "" for report in run_exchange("swapped_tags", 2, tmp_path)]
    assert any(error.startswith("NcclMismatch: on the communicator of ranks 0 and 1 (process group 0) NCCL matches "
                                "rank 0's isend->1 (32 bytes, tag 1) with rank 1's irecv<-0 (32 bytes, tag 2)")
               for error in errors), errors


def test_a_wait_on_a_peer_that_never_answers_ends_when_the_groups_are_aborted(tmp_path):
    waiting, _ = run_exchange("unanswered", 2, tmp_path)
    assert waiting["error"] == ("NcclAborted: rank 0's irecv<-1: creating the communicator of ranks 0 and 1 (process "
                                "group 0) was ended by an abort"), waiting


# --- collectives ----------------------------------------------------------------------------------

def collectives(rank: int, world: int) -> torch.Tensor:
    """A sum, an object gather, an object broadcast and a tensor gather."""
    summed = torch.full((4,), float(rank + 1))
    dist.all_reduce(summed)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank})
    sent = [100.0 if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    joined = torch.empty(2 * world)
    dist.all_gather_into_tensor(joined, torch.full((2,), float(rank)))
    return torch.cat([summed, torch.tensor([float(g["rank"]) for g in gathered]), torch.tensor(sent), joined])


def collective_behind_a_batch(rank: int, world: int) -> torch.Tensor:
    """Rank 0 posts a send to rank 1 in a batch, then an all-reduce; rank 1 the all-reduce, then
    the batch's receive: gloo runs all four, NCCL's one stream per communicator none."""
    buffer = torch.ones(8)
    if rank == 0:
        sending = dist.batch_isend_irecv([dist.P2POp(dist.isend, buffer, 1)])
        dist.all_reduce(buffer)
        for work in sending:
            work.wait()
    else:
        dist.all_reduce(buffer)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, 0)]):
            work.wait()
    return buffer


def collectives_out_of_order(rank: int, world: int) -> torch.Tensor:
    """An all-reduce and a broadcast, issued in one order on rank 0 and the other on rank 1."""
    reduced, broadcast = torch.ones(4), torch.ones(8)
    if rank == 0:
        dist.all_reduce(reduced)
        dist.broadcast(broadcast, src=0)
    else:
        dist.broadcast(broadcast, src=0)
        dist.all_reduce(reduced)
    return reduced


EXCHANGES.update(collectives=collectives, collective_behind_a_batch=collective_behind_a_batch,
                 collectives_out_of_order=collectives_out_of_order)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_complete_with_every_ranks_data(tmp_path, world):
    reports = run_exchange("collectives", world, tmp_path)
    total = float(sum(range(1, world + 1)))
    expected = [total] * 4 + [float(r) for r in range(world)] + [100.0] + [float(r) for r in range(world) for _ in "ab"]
    assert [report["received"] for report in reports] == [expected] * world, reports


def test_a_collective_queued_behind_a_batch_its_peer_waits_for_is_a_deadlock(tmp_path):
    reports = run_exchange("collective_behind_a_batch", 2, tmp_path)
    for report in reports:
        assert report["error"].startswith("NcclDeadlock: NCCL would deadlock"), report
        assert ("rank 1's all_reduce waits for rank 0 to post its all_reduce, queued behind its own isend->1 in a "
                "batch on the communicator of process group 0 (ops on one NCCL communicator start in issue order)"
                in report["error"]), report


def test_collectives_issued_in_another_order_are_refused(tmp_path):
    errors = [report.get("error") or "" for report in run_exchange("collectives_out_of_order", 2, tmp_path)]
    assert any(error.startswith("NcclMismatch: on the communicator of process group 0 NCCL pairs rank 0's all_reduce "
                                "(16 bytes) with rank 1's broadcast (32 bytes): a group's collectives are paired by "
                                "their order alone") or
               error.startswith("NcclMismatch: on the communicator of process group 0 NCCL pairs rank 1's broadcast "
                                "(32 bytes) with rank 0's all_reduce (16 bytes)") for error in errors), errors


# --- a lost peer, as NCCL's watchdog takes it -----------------------------------------------------

WATCHDOG = {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250"}
"""A watchdog that pauses a second (4 x 250 ms) between finding a failure and acting on it."""


def _lost_peer_rank(rank: int, port: int, environment: dict, scenario: str, out: str) -> None:
    """Rank 1's process ends before it joins (a node lost); rank 0 waits on it as `scenario` says
    and reports what it saw: whether its wait returned, with what, the world's failure as the
    trainer checks it, what its next op did. A rank the watchdog ends reports nothing."""
    from trainer.world_failure import current_world, failure

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    world = current_world()
    if rank == 1:
        os._exit(0)
    value = torch.full((4,), 1.0)
    report: dict = {}
    started = time.monotonic()
    try:
        if scenario == "all_reduce":
            dist.all_reduce(value)
        elif scenario == "all_reduce, the program aborting":
            threading.Timer(2.0, dist.distributed_c10d._abort_process_group).start()
            dist.all_reduce(value)
        elif scenario == "batch":
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, value, 1)]):
                work.wait()
        elif scenario == "wait after the failure was found":
            work = dist.all_reduce(value, async_op=True)
            while failure(world) is None:
                time.sleep(0.05)
            work.wait()
        report["returned_after_s"] = time.monotonic() - started
    except Exception as error:  # noqa: BLE001 (reported to the test)
        report["error"] = f"{type(error).__name__}: {error}"
    report |= {"value": value.tolist(), "failure": failure(world)}
    # Under no handling nothing aborts the failed group: a next op would wait out the store's
    # timeout (120 s) for the lost peer, and the test of that scenario asks only for the wait's error.
    if scenario != "wait after the failure was found":
        try:
            dist.all_reduce(value)
            report["next"] = "ran"
        except Exception as error:  # noqa: BLE001
            report["next"] = f"{type(error).__name__}: {error}"
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    os._exit(0)  # its world is broken: nothing to close


def lost_peer(tmp_path, scenario: str, **environment: str | None) -> dict:
    """What rank 0 reported, or the signal that ended its process; `environment` over the
    session's (None: unset)."""
    try:
        spawn_ranks(_lost_peer_rank, (free_port(), WATCHDOG | environment, scenario, str(tmp_path)), 2)
    except ProcessExitedException as ended:
        assert ended.error_index == 0, ended
        return {"ended_by": ended.signal_name}
    return json.loads((tmp_path / "rank-0.json").read_text())


@pytest.mark.parametrize("scenario", ["all_reduce", "batch"])
def test_under_clean_up_only_the_watchdog_aborts_the_failed_group_and_the_wait_returns_with_what_it_had(
        tmp_path, scenario):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (the trainer's): no error where the rank waits; a second
    later (the watchdog's pause) it returns with its buffer as it was, nothing reduced or received;
    the group reports the error; an op issued on it afterwards raises."""
    report = lost_peer(tmp_path, scenario, TORCH_NCCL_ASYNC_ERROR_HANDLING="2")
    assert "error" not in report and report["returned_after_s"] >= 1.0, report
    assert report["value"] == [1.0] * 4
    assert report["failure"] == "process group 0 reports COMM_ERROR (NCCL's watchdog found an op of it failed)"
    assert report["next"].startswith("NcclAborted: all_reduce on process group 0, whose communicators NCCL's watchdog "
                                     "aborted after an op failed (COMM_ERROR)"), report


@pytest.mark.parametrize("setting", ["1", "3", None])
def test_under_tear_down_and_skip_clean_up_the_watchdog_ends_the_process(tmp_path, setting):
    """1 (torchrun's for its workers) and 3 (ProcessGroupNCCL's default): the watchdog's rethrow
    ends the process with SIGABRT; the rank never returns from its wait."""
    assert lost_peer(tmp_path, "all_reduce", TORCH_NCCL_ASYNC_ERROR_HANDLING=setting) == {"ended_by": "SIGABRT"}


def test_under_no_handling_the_wait_goes_on_until_the_program_aborts_the_groups(tmp_path):
    """0: the watchdog finds the failure and does nothing; only the program's abort (a repair
    order's) ends the wait, which returns normally with its partial values."""
    report = lost_peer(tmp_path, "all_reduce, the program aborting", TORCH_NCCL_ASYNC_ERROR_HANDLING="0")
    assert "error" not in report and report["returned_after_s"] >= 2.0, report
    assert report["value"] == [1.0] * 4
    assert report["failure"] == "its process groups were aborted (a repair was ordered) or destroyed"
    assert report["next"].startswith("ValueError: Default process group has not been initialized"), report


def test_a_wait_begun_after_the_watchdog_found_its_op_failed_raises(tmp_path):
    report = lost_peer(tmp_path, "wait after the failure was found", TORCH_NCCL_ASYNC_ERROR_HANDLING="0")
    assert report["error"].startswith("DistBackendError: NCCL error in all_reduce on process group 0 (COMM_ERROR): "
                                      ), report


def _monitored_rank(rank: int, port: int, out: str) -> None:
    """Ranks 0 and 2 share a group; rank 2's process ends; rank 0's all-reduce on the group
    fails, and rank 0 leaves its world (as a repair does). Rank 1 takes part in nothing."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_NCCL_ASYNC_ERROR_HANDLING="2",
                      TORCH_NCCL_DUMP_ON_TIMEOUT="1", TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="1",
                      TORCH_NCCL_COORD_CHECK_MILSEC="100", **WATCHDOG)
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=120))
    pair = dist.new_group([0, 2])
    if rank == 2:
        os._exit(0)
    if rank == 0:
        dist.all_reduce(torch.ones(4), group=pair)
        dist.distributed_c10d._abort_process_group()
    time.sleep(30)  # rank 0 hosts the store while rank 1's monitor counts down
    os._exit(0)


def test_with_dump_on_timeout_every_rank_still_in_the_failed_world_is_ended_by_its_monitor(tmp_path):
    """TORCH_NCCL_DUMP_ON_TIMEOUT (on by default): one rank's failure has every rank's heartbeat
    monitor end its process TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC later, unless it left the world."""
    with pytest.raises(ProcessExitedException) as ended:
        spawn_ranks(_monitored_rank, (free_port(), str(tmp_path)), 3)
    assert (ended.value.error_index, ended.value.signal_name) == (1, "SIGABRT")


# --- torch's own pipeline schedules ---------------------------------------------------------------

def _pipeline_rank(rank: int, port: int, schedule: str, out: str) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(4)]
    part = nn.Sequential(*layers[2 * rank:2 * rank + 2])
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipeline = schedule_class(stage, 4, loss_fn=lambda output, target: ((output - target) ** 2).mean())
    inputs, targets = torch.randn(8, 16), torch.randn(8, 16)
    losses: list[torch.Tensor] = []
    if rank == 0:
        pipeline.step(inputs)
    else:
        pipeline.step(target=targets, losses=losses)
    # The same model in one process, for the gradients of this rank's layers.
    whole = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    whole.load_state_dict({f"{i}.{name}": p for i, layer in enumerate(layers) for name, p in layer.state_dict().items()})
    for x, y in zip(inputs.chunk(4), targets.chunk(4)):
        (((whole(x) - y) ** 2).mean() / 4).backward()
    expected = [p.grad for layer in list(whole)[2 * rank:2 * rank + 2] for p in layer.parameters()]
    record = sys.modules["nccl_rules"]._world.record
    Path(out, f"rank-{rank}.json").write_text(json.dumps({
        "gradients_match": all(torch.allclose(p.grad, e, atol=1e-6) for p, e in zip(part.parameters(), expected)),
        "communicators": sorted(record.queues),
    }))
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipeline_runs_under_the_rules(tmp_path, schedule):
    spawn_ranks(_pipeline_rank, (free_port(), schedule, str(tmp_path)), 2)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert report["gradients_match"], report
        # Its hand-offs went through the rules: unbatched ones on the pair's communicator.
        assert "0/0,1" in report["communicators"], report


# --- ranks that torchrun starts on a local-cloud instance -----------------------------------------

RANK_MAIN = '''
dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    inbox = exchange(rank, dist.get_world_size())
    print(json.dumps({"rank": rank, "error": None, "received": inbox[0].item()}), flush=True)
except Exception as error:
    print(json.dumps({"rank": rank, "error": f"{type(error).__name__}: {error}"}), flush=True)
    # Alive until every rank has reported: the rules name a deadlock to each rank in it only once
    # each of their waiting threads has seen it, and a rank gone takes its threads along.
    store = dist.distributed_c10d._get_default_store()
    store.add("reported", 1)
    while store.add("reported", 0) < dist.get_world_size():
        time.sleep(0.05)
    os._exit(0)  # its world is deadlocked: nothing to close
'''


def torchrun_command(tmp_path, exchange=unbatched_ring, first: str = "") -> list[str]:
    """torchrun as a node runs it (node/torchrun.py), its two ranks running `exchange`, each
    importing the modules `first` names before torch."""
    imports = f"{first}import json, os, threading, time\nimport torch\nimport torch.distributed as dist\n"
    source = inspect.getsource(exchange) + f"exchange = {exchange.__name__}\n"
    (tmp_path / "exchange_rank.py").write_text(imports + source + RANK_MAIN)
    return [sys.executable, "-m", "node.torchrun", "--standalone", "--nproc-per-node=2", "-m", "exchange_rank"]


def instance_env() -> dict[str, str]:
    """As the local fleet starts an instance's processes: the session's environment, its own
    folder first on the PYTHONPATH."""
    return os.environ | {"PYTHONPATH": os.pathsep.join([str(INSTANCE_SITE), os.environ["PYTHONPATH"]])}


def rank_reports(output: str) -> list[dict]:
    # Ranks sharing one console can print their lines into each other: read every report where it starts.
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(output, start.start())[0] for start in re.finditer(r'\{"rank"', output)]


def named_deadlocks(output: str) -> list[int]:
    return sorted(report["rank"] for report in rank_reports(output)
                  if (report["error"] or "").startswith("NcclDeadlock: NCCL would deadlock"))


def test_torchrun_ranks_on_an_instance_follow_the_rules(tmp_path):
    done = run_captured(torchrun_command(tmp_path), what="torchrun's ranks", cwd=tmp_path, env=instance_env())
    assert named_deadlocks(done.stdout) == [0, 1], done.stdout[-3000:] + done.stderr[-3000:]


def test_torchrun_ranks_forked_from_a_warm_image_follow_the_rules(tmp_path):
    image = WarmImage.start(["node.torchrun"], path=[str(INSTANCE_SITE)])
    try:
        console = tmp_path / "console.log"
        child = image.fork(torchrun_command(tmp_path), tmp_path, instance_env(), console)
        wait_for_exit(child, [console], what="torchrun's ranks in the warm image")
    finally:
        image.stop()
    assert named_deadlocks(console.read_text()) == [0, 1], console.read_text()[-5000:]


def test_a_batched_exchange_on_an_instance_completes_after_the_aws_sdk_was_imported_first(tmp_path):
    # As in a node's trainer, which imports boto3 before torch: the instance's own changes to
    # torch's transfers must not hide from the rules which op of a batch is a send.
    done = run_captured(torchrun_command(tmp_path, batched_ring, first="import boto3\n"), what="torchrun's ranks",
                        cwd=tmp_path, env=instance_env())
    reports = sorted(rank_reports(done.stdout), key=lambda report: report["rank"])
    assert reports == [{"rank": 0, "error": None, "received": 1.0}, {"rank": 1, "error": None, "received": 0.0}], \
        done.stdout[-3000:] + done.stderr[-3000:]
