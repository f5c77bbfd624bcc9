"""bench/gpu.py runs unattended: its tiny CPU mode goes through every check it makes on a GPU."""

import sys
from pathlib import Path

import pytest

from localcloud.waiting import run_captured

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_on_a_tiny_model():
    done = run_captured([sys.executable, "bench/gpu.py", "--tiny", "--device", "cpu", "--warmup", "1",
                         "--steps", "2"], what="bench/gpu.py", cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "async checkpoint staging: the saved state equals the post-step state" in lines
    assert lines[-1].startswith("gpu_check=ok tokens_per_s=")
