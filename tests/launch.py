"""Launching a test script under real torchrun (gloo, CPU), with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``tests/<script>`` on ``nproc`` ranks; fails the calling test with the output if a rank failed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, "tests", script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result
