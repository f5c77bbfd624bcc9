"""The local demo run as a test scenario: real node agents and the real trainer on the local cloud.

1. localcloud.demo.run_on_local_cloud deploys template.yaml, runs events/local-demo-run.json on
   two local instances (pp=2, one rank per node), kills node rank 1's instance after the first
   committed checkpoint and waits for the recovered run to end. Then the same trainer config
   trains once more, uninterrupted, under a plain torchrun on this machine: the reference the
   resumed run must match.
2. The same RunSpec on Spot capacity, 500 steps checkpointed every 250, node rank 1 given a Spot
   interruption notice after the first checkpoint: its agent asks its trainer for a checkpoint,
   the control plane waits for that commit, then replaces the node.
3. 1,000 steps checkpointed every 100 with node rank 1's instance frozen (SIGSTOP: no EC2
   event, its agent silent) after the first checkpoint: the survivor's trainer hangs, the Train
   task's heartbeat times out after the demo's 10 s hang timeout (its collectives would wait
   longer), and Recover names the frozen node (its status check impaired, its agent silent),
   replaced on this first failure.

Each runs in a process of its own (tests/test_agent_local_run.py starts them): the local cloud
imports the deployed handlers, which must not already be imported from the working tree, and
they keep their stack's settings for the life of the process. The last line of stdout is one
JSON document: {"outcome": ..., "reference": {step: loss}} for the first, the outcome for the second.

    python tests/agent_local_run.py node-loss | spot-interruption | frozen-node
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from localcloud.demo import DEMO_RUN_SPEC, Narrator, run_on_local_cloud  # noqa: E402

PHASE_TIMEOUT_S = 240
REFERENCE_TIMEOUT_S = 180


def uninterrupted_losses(trainer_config: dict, folder: Path) -> dict[int, float]:
    """step -> loss of the same training, pp=2 on this machine, never interrupted."""
    metrics = folder / "metrics.jsonl"
    config = json.loads(json.dumps(trainer_config))
    config["training"]["metrics_file"] = str(metrics)
    config["data"]["shards"] = str(folder / "data")
    (folder / "trainer.yaml").write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={config['parallel']['pp']}", "-m", "trainer.train",
               "--config", str(folder / "trainer.yaml")]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True,
                          timeout=REFERENCE_TIMEOUT_S, start_new_session=True)
    if done.returncode != 0:
        raise RuntimeError(f"the reference run failed ({done.returncode}): {done.stderr[-3000:]}")
    return {record["step"]: record["loss"] for record in map(json.loads, metrics.read_text().splitlines())}


def node_loss(template: dict) -> dict:
    outcome = run_on_local_cloud(template, Narrator(), timeout_s=PHASE_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="uninterrupted-") as folder:
        return {"outcome": outcome, "reference": uninterrupted_losses(template["trainer"], Path(folder))}


SPOT_STEPS, SPOT_CHECKPOINT_EVERY = 500, 250
# Nominal, scaled by the demo's time scale of 0.02 to 30 s: AWS gives 120 s, but the default's
# 2.4 s here is shorter than one checkpoint's round trip (request, save, commit, announcement)
# on these shared cores.
SPOT_NOTICE_S = 1500.0


def spot_interruption(template: dict) -> dict:
    template["capacity"]["kind"] = "spot"
    # No interval checkpoint falls between the notice (after step 250) and the requested one, and
    # the trainer, tens of steps a second here, is still training when its agent asks.
    template["trainer"]["training"]["steps"] = SPOT_STEPS
    template["checkpoint"]["interval_steps"] = SPOT_CHECKPOINT_EVERY
    return run_on_local_cloud(template, Narrator(), disruption="spot", spot_notice_seconds=SPOT_NOTICE_S,
                              timeout_s=PHASE_TIMEOUT_S)


FROZEN_STEPS, FROZEN_CHECKPOINT_EVERY = 1000, 100
FROZEN_TIMEOUT_S = 60
"""The trainer's process-group timeout in the frozen-node scenario: how long the survivor's ranks
wait on the frozen peer before they fail. Well above the demo's hang timeout (10 s), so what
detects the freeze is the Train task's heartbeat timeout, not a crash of the survivor."""


def frozen_node(template: dict) -> dict:
    # Still training when node rank 1 freezes, once the first checkpoint is recorded (by then the
    # trainer, tens of steps a second here, is a few hundred steps further).
    template["trainer"]["training"]["steps"] = FROZEN_STEPS
    template["checkpoint"]["interval_steps"] = FROZEN_CHECKPOINT_EVERY
    template["trainer"]["parallel"]["timeout_s"] = FROZEN_TIMEOUT_S
    return run_on_local_cloud(template, Narrator(), disruption="freeze", timeout_s=PHASE_TIMEOUT_S)


SCENARIOS = {"node-loss": node_loss, "spot-interruption": spot_interruption, "frozen-node": frozen_node}

if __name__ == "__main__":
    if sys.argv[1:] not in ([name] for name in SCENARIOS):
        sys.exit(f"usage: {sys.argv[0]} {' | '.join(SCENARIOS)}")
    print(json.dumps(SCENARIOS[sys.argv[1]](json.loads(DEMO_RUN_SPEC.read_text())), default=str))
