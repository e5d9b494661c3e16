"""pipesplit's distributed executor against ``torch.distributed.pipelining`` on the same split.

Launches ``benchmarks/_torch_vs_pipesplit_worker.py`` under
``python -m torch.distributed.run --standalone --nproc-per-node 2`` (gloo, CPU, one
intra-op thread per rank). For each model (a deep residual MLP and the built-in GPT with
its head untied) and each schedule (1F1B, GPipe), both runtimes train the same two-stage
split: pipesplit's ``Pipeline`` and PyTorch's ``Schedule1F1B``/``ScheduleGPipe`` over
``pipesplit.interop.to_pipeline_stage``. They run in the same process launch, one step
each in alternating order, every step timed on rank 0 between barriers. Reported: the
median step-time ratio pipesplit / torch (target: <= 1.0 within noise).

Prints markdown (paste into the ``## Runtime`` section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, load_average, markdown_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_torch_vs_pipesplit_worker.py")


def r3(x: float) -> str:
    return f"{x:.3f}"


def iqr_half(xs: list[float]) -> str:
    if len(xs) < 4:
        return "n/a"
    q = statistics.quantiles(xs, n=4)
    return f"±{(q[2] - q[0]) / 2 / statistics.median(xs) * 100:.0f}%"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer steps (~30-60 s)")
    ap.add_argument("--models", default="mlp,gpt")
    ap.add_argument("--schedules", default="1f1b,gpipe")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--warmup", type=int, help="untimed steps per runtime first (default 3, quick 2)")
    ap.add_argument("--steps", type=int, help="timed steps per runtime (default 15, quick 5)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (default 1: 2 ranks, 2 cores)")
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    steps = args.steps or (5 if args.quick else 15)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
           "--models", args.models, "--schedules", args.schedules, "--microbatches", str(args.microbatches),
           "--warmup", str(warmup), "--steps", str(steps)] + (["--quick"] if args.quick else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=ROOT)
    head = header("Runtime: pipesplit vs torch.distributed.pipelining").replace("## ", "### ", 1)
    # the header describes this launcher process; the ranks run with --threads intra-op threads each
    emit(re.sub(r"torch threads: \d+", f"torch threads per rank: {args.threads}", head))
    emit(f"- worker: `OMP_NUM_THREADS={args.threads} python -m torch.distributed.run --standalone "
         f"--nproc-per-node 2 benchmarks/_torch_vs_pipesplit_worker.py` (gloo, CPU, 2 ranks, one stage each)")
    emit(f"- {args.microbatches} microbatches; {warmup} warm-up + {steps} timed steps per runtime, alternating "
         "which runtime goes first; each step timed on rank 0 between two barriers")
    emit()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        emit(f"**the torchrun launch failed (exit code {proc.returncode})**")
        return 1
    result = json.loads(line[len("RESULT "):])
    rows = []
    for m in result["models"]:
        for schedule, r in m["schedules"].items():
            ps, tt = r["times"]["pipesplit"], r["times"]["torch"]
            med_ratio = statistics.median(ps) / statistics.median(tt)
            paired = statistics.median(a / b for a, b in zip(ps, tt))
            rows.append([m["model"], f"`{schedule}`", r3(med_ratio), r3(paired),
                         f"{statistics.median(tt) * 1e3:.0f}", iqr_half(ps), iqr_half(tt), f"{r['loss_diff']:.1e}"])
    for m in result["models"]:
        emit(f"- `{m['model']}`: {m['description']}")
    emit()
    emit(markdown_table(
        ["model", "schedule", "pipesplit / torch (medians)", "median of paired ratios", "torch step (ms, context)",
         "pipesplit noise", "torch noise", "|loss diff|"],
        rows, "llrrrrrr"))
    emit()
    worst = max(float(r[2]) for r in rows)
    emit(f"Largest pipesplit / torch ratio: {worst:.3f} (target ≤ 1.0 within noise).")
    emit(f"\n(load average at end (1/5/15 min): {load_average()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
