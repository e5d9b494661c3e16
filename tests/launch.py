"""Launching a test script under real torchrun (gloo, CPU), with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(script: str, nproc: int, *args: str, timeout: float = 600,
             as_user: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``tests/<script>`` (or ``<dir>/<script>`` from the repository root) on ``nproc`` ranks; fails
    the calling test with the output if a rank failed. ``as_user``: without the checkout on the path,
    so the script sees the installed package only, as a user's would."""
    path = os.path.join(ROOT, script if "/" in script else os.path.join("tests", script))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", path, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", **({} if as_user else {"PYTHONPATH": ROOT}))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def end_rank(code: int) -> None:
    """End a torchrun rank after its process group is destroyed, skipping interpreter finalization.

    On gloo, torch 2.13 occasionally aborts a rank at interpreter exit ("terminate called
    without an active exception", SIGABRT) after every check has passed and the group was
    destroyed: roughly 1 run in 10 of tests/meta_check.py on 2 loaded cores. Finalization
    frees C++ process-group objects in no set order (see pytorch/pytorch#179291); nothing
    is left to run by then, so the rank leaves with its code and flushed output instead.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
