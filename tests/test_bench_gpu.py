"""benchmarks/bench_gpu.py, the one-command GPU check, runs end to end on CPU at its smallest sizes.

GPU time comes in short windows: a typo found there costs one. This runs every part of the
check (CUDA tests, exactness, overhead and profile, predicted vs measured, oracle, memory) through
the same driver and subprocesses as on a GPU, and checks the report and JSON it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "check"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_gpu.py"), "--device", "cpu",
                           "--smoke", "--scale", "3", "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "torch=" in proc.stdout and "date=" in proc.stdout, "the versions and the date are printed first"
    report = json.loads((out / "report.json").read_text())
    parts = report["parts"]
    assert list(parts) == ["tests", "exact", "cuda_graphs", "overhead", "compiled", "predict", "oracle", "memory"]
    assert {name: p["status"] for name, p in parts.items()} == {name: "ok" for name in parts}
    assert report["versions"]["torch"] and report["versions"]["device"] == "cpu"
    exact = parts["exact"]["data"]
    assert exact["failures"] == 0 and len(exact["rows"]) >= 8  # every schedule and prog(x)
    assert set(parts["overhead"]["data"]["step_s"]) == {"plain", "pipesplit 1 stage", "prog(x) + backward",
                                                        "stage graph + backward", "torch.compile (eager)"}
    assert "rates: cpu:" in parts["predict"]["markdown"] and "device share" in parts["predict"]["markdown"]
    assert "every thread" in parts["overhead"]["markdown"] or "calling thread only" in parts["overhead"]["markdown"]
    assert {row[0] for row in parts["predict"]["data"]["rows"]} == {"flops", "profile"}
    assert parts["oracle"]["data"]["oracle"]["best"]
    assert len(parts["memory"]["data"]["rows"]) == 2
    graphs = parts["cuda_graphs"]
    assert "EMULATED" in graphs["markdown"] and "slots" in graphs["markdown"], graphs["markdown"]
    assert {k for k in graphs["data"]["step_s"] if "CUDA graphs" in k} == {
        "pipesplit 1 stage, 1f1b, compiled + CUDA graphs", "pipesplit 2 stages, 1f1b, compiled + CUDA graphs",
        "pipesplit 2 stages, zb_h1, compiled + CUDA graphs"}
    md = (out / "report.md").read_text()
    for name in parts:
        assert f"### {name}" in md


def test_a_part_that_runs_over_is_recorded_and_the_next_one_runs(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_gpu

    out = tmp_path / "check"
    code = bench_gpu.main(["--device", "cpu", "--smoke", "--parts", "oracle,tests", "--scale", "0.02", "--out", str(out)])
    parts = json.loads((out / "report.json").read_text())["parts"]
    assert code == 1
    assert parts["oracle"]["status"].startswith("timed out after")  # 70 s x 0.02: cut off, recorded
    assert parts["tests"]["status"] != "not run"
    assert "timed out" in (out / "report.md").read_text()
