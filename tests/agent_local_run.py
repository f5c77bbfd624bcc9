"""The local demo run as a test scenario: real node agents and the real trainer on the local cloud.

localcloud.demo.run_with_node_loss deploys template.yaml, runs events/local-demo-run.json on two
local instances (pp=2, one rank per node), kills node rank 1's instance after the first committed
checkpoint and waits for the recovered run to end. Then the same trainer config trains once more,
uninterrupted, under a plain torchrun on this machine: the reference the resumed run must match.

It runs in a process of its own (tests/test_agent_local_run.py starts it): the local cloud imports
the deployed handlers, which must not already be imported from the working tree. The last line of
stdout is one JSON document: {"outcome": ..., "reference": {step: loss}}.

    python tests/agent_local_run.py
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

from localcloud.demo import DEMO_RUN_SPEC, Narrator, run_with_node_loss  # noqa: E402

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


def main() -> None:
    template = json.loads(DEMO_RUN_SPEC.read_text())
    outcome = run_with_node_loss(template, Narrator(), timeout_s=PHASE_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="uninterrupted-") as folder:
        reference = uninterrupted_losses(template["trainer"], Path(folder))
    print(json.dumps({"outcome": outcome, "reference": reference}, default=str))


if __name__ == "__main__":
    main()
