"""The plan fingerprint that pairs up ranks' compile calls (pipesplit/agree.py); the multi-process
agreement itself runs under torchrun in tests/plan_check.py."""

from __future__ import annotations

import subprocess
import sys

import torch

import pipesplit
from pipesplit.agree import agree_on_plan, graph_fingerprint
from pipesplit.models import gpt

SCRIPT = """
import torch, pipesplit
from pipesplit.agree import graph_fingerprint
from pipesplit.models import gpt
prog = pipesplit.compile(gpt(layers=2, dim=32, vocab=64, seq=16, heads=2), torch.randint(0, 64, (2, 16)),
                         num_stages=2, progress=False)
print(graph_fingerprint(prog.captured_gm))
"""


def _prog(layers: int):
    return pipesplit.compile(gpt(layers=layers, dim=32, vocab=64, seq=16, heads=2), torch.randint(0, 64, (2, 16)),
                             num_stages=2, progress=False)


def test_the_fingerprint_names_the_graph_alike_in_every_process():
    here = graph_fingerprint(_prog(2).captured_gm)
    other = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == here
    assert graph_fingerprint(_prog(3).captured_gm) != here


def test_without_a_process_group_the_plan_is_kept():
    prog = _prog(2)
    assert agree_on_plan(prog.captured_gm, prog.plan) is prog.plan
