"""benchmarks/bench_scale.py runs end to end at its smallest shapes: pipesplit's plan priced against the expert layouts."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_scale_benchmark_smoke_run_finds_pipesplit_no_slower_than_the_experts(capsys):
    sys.path.insert(0, ROOT)
    from benchmarks import bench_scale

    assert bench_scale.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| tiny Llama | 4 | pipesplit |" in out and "best expert" in out
    assert "every stage under the cap: yes" in out


def test_expert_layouts_are_near_even_with_a_lighter_first_or_last_stage():
    sys.path.insert(0, ROOT)
    from benchmarks.bench_scale import layouts

    got = layouts(32, 8)
    assert got["first -0, last -0"] == [4] * 8
    assert all(sum(c) == 32 and len(c) == 8 for c in got.values())
    assert got["first -1, last -2"] == [3, 5, 5, 5, 4, 4, 4, 2]
