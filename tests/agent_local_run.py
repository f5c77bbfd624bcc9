"""The local demo run as a test scenario: real node agents and the real trainer on the local cloud.

localcloud.demo.run_on_local_cloud deploys template.yaml, runs events/local-demo-run.json on two
local instances (pp=2, one rank per node), kills node rank 1's instance after the first
committed checkpoint and waits for the recovered run to end. Then the same trainer config trains
once more, uninterrupted, under a plain torchrun on this machine: the reference the resumed run
must match. (Other faults at other moments are the chaos suite's: tests/chaos, localcloud.chaos.)

It runs in a process of its own (tests/test_agent_local_run.py starts it): the local cloud
imports the deployed handlers, which must not already be imported from the working tree, and
they keep their stack's settings for the life of the process. The last line of stdout is one
JSON document: {"outcome": ..., "reference": {step: loss}}.

    python tests/agent_local_run.py node-loss
    python tests/agent_local_run.py spares                (three nodes and a spare: one with a slow network,
                                                           then one lost mid-interval)
    python tests/agent_local_run.py poor-scaling          (two nodes on a slow network: the run does not scale)
"""

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from localcloud.chaos import reference_losses  # noqa: E402
from localcloud.cloud import exit_after_local_cloud  # noqa: E402
from localcloud.demo import DEMO_RUN_SPEC, SAMPLE_PROMPT, Narrator, run_on_local_cloud  # noqa: E402
from localcloud.glue import s3 as s3_requests  # noqa: E402
from localcloud.stack import agent_lines, local_stack, metrics_records  # noqa: E402
from trainer.checkpoint_catalog import marker_step  # noqa: E402

def node_loss(template: dict) -> dict:
    """The demo: its live view, its report, and the uninterrupted run to compare its losses with."""
    with tempfile.TemporaryDirectory(prefix="reports-") as reports:
        outcome = run_on_local_cloud(template, Narrator(), reports=Path(reports), export_model=True)
        page = Path(outcome["report_page"])
        outcome |= {"report_html": page.read_text(), "report_files": sorted(path.name for path in page.parent.iterdir()),
                    "exported": exported_summary(Path(outcome["model"]))}
    with tempfile.TemporaryDirectory(prefix="uninterrupted-") as folder:
        return {"outcome": outcome, "reference": reference_losses(template["trainer"], Path(folder))}


def exported_summary(folder: Path) -> dict:
    """The exported model's config, files, and a sample from it (the demo prints one)."""
    from trainer.export import exported_tokenizer, load_exported
    from trainer.sample import generate

    return {"config": json.loads((folder / "config.json").read_text()),
            "files": sorted(path.name for path in folder.iterdir()),
            "sample": generate(load_exported(folder), exported_tokenizer(folder), SAMPLE_PROMPT, new_tokens=40, seed=0)}


SLOW_DELAY_S = 0.5
"""Each transfer of the slow node waits this long: its links carry at most 8 MB a second."""
FLEET_CHECK = {"size_mib": 4, "iterations": 2, "busbw_floor_gbytes_per_s": 0.02}
"""A 4 MiB buffer over loopback all-reduces at hundreds of MB/s on three nodes (0.3 to 0.45
GB/s measured here, on idle cores); the floor is over ten times lower, so a world on cores shared
with other test runs still passes, and the slow node's links (at most 0.008) are below it."""


SCALING_CHECK = {"enabled": True, "warmup_steps": 2, "steps": 3, "efficiency_floor": 0.5}
"""A healthy local world of two one-rank nodes reaches about 0.8 (its hand-offs over loopback
cost little beside its compute); one whose transfers each wait SLOW_DELAY_S reaches a few hundredths."""


def poor_scaling(template: dict) -> dict:
    """The demo's two nodes (pp=2), the network of both made slow before the world forms (a slow
    fabric, no node to blame), the fleet check off: the scaling check must find the world's steps
    far slower than its compute predicts and end the run before it trains on, naming the
    figures and the slowest stage."""
    template.update(preflight={"fleet_check": False}, scaling_check=SCALING_CHECK)
    with local_stack(Narrator()) as stack:
        run = stack.start_run(template)
        watch = stack.watch(run)
        nodes = lambda: stack.store.nodes(run.run_name)  # noqa: E731
        watch.until(lambda: len(nodes()) == 2, "the two nodes recorded")
        for node in nodes():
            stack.cloud.fleet.slow_network(node.instance_id, SLOW_DELAY_S)
        try:
            watch.until(stack.ended(run), "the end of the run")
            watch.until(lambda: all(i.state == "terminated" for i in stack.instances(run)), "every instance terminated")
            with tempfile.TemporaryDirectory(prefix="report-") as folder:
                page = stack.operations().report(run.run_name, Path(folder))
                report_page = page.read_text()
        except Exception:
            stack.dump_consoles(run)
            raise
        said = [line for instance in stack.instances(run) for line in agent_lines(instance)
                if line["agent"].startswith("scaling check")]
        return {"outcome": stack.outcome(run) | {"scaling_checks": said, "report_page": report_page}}


def spares(template: dict) -> dict:
    """Three workers (pp=3) and a spare, an in-memory checkpoint every step and an S3 one every 10.
    One worker's network is made slow before the world first forms: the fleet check must name it
    and the spare take its place before a step is trained. Then, once step 10's commit reaches S3
    and a later step is trained, node rank 1's instance is killed mid-interval: the spare that
    refilled the pool takes its place, and the world is repaired in place: node ranks 0 and 2 keep
    their trainers' processes and restore from their own memory, the newcomer from node rank 2's
    (its buddy). Every object S3 serves is heard, with when."""
    template.update(node_count=3, spare_count=1, preflight=FLEET_CHECK)
    template["trainer"]["model"]["n_layers"] = 6
    template["trainer"]["parallel"].update(pp=3, dp=1, microbatches=3)
    # Steps longer than a copy (as on GPUs, where a step takes seconds): a batch of 48 sequences,
    # a state of about a megabyte and a half per rank.
    template["trainer"]["training"].update(batch_size=48, steps=30)
    with local_stack(Narrator()) as stack:
        run = stack.start_run(template)
        watch = stack.watch(run)
        checkpoints = f"runs/{run.run_name}/checkpoints/"
        reads, committed, killed = [], threading.Event(), {}

        def heard(kind: str, key: str, body: bytes | None) -> None:
            if kind == "read" and key.startswith(checkpoints):
                reads.append((time.time(), key[len(checkpoints):]))
            if kind == "write" and key.startswith(checkpoints) and marker_step(key) == 10:
                committed.set()

        def past_the_commit() -> bool:
            # Not at the commit itself: it may be stored before step 11 is trained, and the kill
            # would fall at the checkpoint, not mid-interval.
            trained = [record["step"] for record in metrics_records(stack.instances(run), 1) if "loss" in record]
            return committed.is_set() and max(trained, default=0) > 10

        nodes = lambda: stack.store.nodes(run.run_name)  # noqa: E731
        watch.until(lambda: len(nodes()) == 4, "the four nodes recorded")
        first = {node.instance_id: node.role.value for node in nodes()}
        slow = min(instance for instance, role in first.items() if role == "WORKER")
        stack.cloud.fleet.slow_network(slow, SLOW_DELAY_S)
        try:
            with s3_requests.listen(heard):
                watch.until(lambda: past_the_commit() or stack.ended(run)(), "a step trained past step 10's commit")
                if not stack.ended(run)():
                    ranks = {node.instance_id: node.node_rank for node in nodes()
                             if node.role.value == "WORKER" and not node.state.is_retired}
                    victim = next(instance for instance, rank in ranks.items() if rank == 1)
                    killed.update(victim=victim, ranks=ranks, at=time.time())
                    stack.cloud.fleet.kill(victim)
                watch.until(stack.ended(run), "the end of the run")
            watch.until(lambda: all(i.state == "terminated" for i in stack.instances(run)), "every instance terminated")
        except Exception:
            stack.dump_consoles(run)
            raise
        instances = stack.instances(run)
        # Repaired in place, node rank 0's trainer goes on writing the files of the launch it started in.
        steps = sorted((record for attempt in (1, 2) for record in metrics_records(instances, attempt)
                        if "loss" in record), key=lambda record: record["time"])
        trained = [record["step"] for record in steps if record["time"] < killed["at"]]
        resumed = [record for record in steps if record["time"] > killed["at"]]
        fleet_checks = {instance.instance_id: [line for line in agent_lines(instance)
                                               if line["agent"].startswith("fleet check")] for instance in instances}
        outcome = stack.outcome(run) | {
            "first_roles": first, "slow": slow, "fleet_checks": fleet_checks,
            "fleet_check": stack.store.run(run.run_name).fleet_check.model_dump(mode="json"),
            "killed": killed, "last_step_before": max(trained), "first_step_after": resumed[0]["step"],
            "failure_to_first_step_s": resumed[0]["time"] - killed["at"],
            "reads_during_recovery": [key for at, key in reads if killed["at"] < at < resumed[0]["time"]],
            "restored": stack.store.run(run.run_name).restored.model_dump(mode="json"),
            "repaired_trainers": {instance.instance_id: sum(path.read_text(errors="replace").count(
                "world repaired: generation 1 ") for path in instance.workdir.glob("attempt-*/torchrun.log"))
                                  for instance in instances}}
    with tempfile.TemporaryDirectory(prefix="uninterrupted-") as folder:
        return {"outcome": outcome, "reference": reference_losses(template["trainer"], Path(folder))}


SCENARIOS = {"node-loss": node_loss, "spares": spares, "poor-scaling": poor_scaling}

if __name__ == "__main__":
    if sys.argv[1:] not in ([name] for name in SCENARIOS):
        sys.exit(f"usage: {sys.argv[0]} {' | '.join(SCENARIOS)}")
    print(json.dumps(SCENARIOS[sys.argv[1]](json.loads(DEMO_RUN_SPEC.read_text())), default=str))
    exit_after_local_cloud(0)
