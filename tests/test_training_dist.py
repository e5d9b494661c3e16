"""Training semantics under real torchrun (gloo, 2 ranks): accumulation with tied weights,
dropout bit-identical to the local executor, in-place ops at cuts."""

from __future__ import annotations

import re

import pytest

from tests.launch import torchrun
pytestmark = pytest.mark.slow


def test_training_semantics_hold_across_processes():
    result = torchrun("train_check.py", 2, "--schedule", "1f1b,zb_h1,zb_v", "--timeout", "60")
    for schedule in ("1f1b", "zb_h1", "zb_v"):
        for what in ("accumulation over 2 steps, tied", "dropout bit-identical to the local executor",
                     "in-place ResNet"):
            ranks = set(re.findall(rf"rank (\d): ok \({re.escape(what)}[^)]*\b{schedule}\b", result.stdout))
            assert ranks == {"0", "1"}, f"{what} ({schedule}) not confirmed by both ranks:\n{result.stdout}"
