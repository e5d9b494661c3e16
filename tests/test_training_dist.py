"""Training semantics under real torchrun (gloo, 2 ranks): accumulation with tied weights,
dropout bit-identical to the local executor, in-place ops at cuts."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def test_training_semantics_hold_across_processes():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(ROOT, "tests", "train_check.py"), "--schedule", "1f1b,zb_h1,zb_v", "--timeout", "60"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for schedule in ("1f1b", "zb_h1", "zb_v"):
        for what in ("accumulation over 2 steps, tied", "dropout bit-identical to the local executor",
                     "in-place ResNet"):
            ranks = set(re.findall(rf"rank (\d): ok \({re.escape(what)}[^)]*\b{schedule}\b", result.stdout))
            assert ranks == {"0", "1"}, f"{what} ({schedule}) not confirmed by both ranks:\n{result.stdout}"
