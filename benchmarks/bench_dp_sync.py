"""Data-parallel gradient sync for a pipeline: pipesplit's bucketed all-reduce against FSDP2.

Launches ``benchmarks/_dp_sync_worker.py`` under ``python -m torch.distributed.run --standalone``
(gloo, CPU, one intra-op thread per rank), once per layout and schedule. Each launch trains the
same ``pp``-stage split on a ``dp × pp`` mesh two ways:

- **allreduce** (the baseline): ``pipesplit.Pipeline(..., mesh=mesh)`` as shipped: each stage's
  gradients summed over the dp group in one bucket, launched (async) as soon as the stage's last
  backward of the step is done.
- **fsdp2**: ``torch.distributed.fsdp.fully_shard`` on each of the rank's stage modules on the
  dp sub-mesh, pipesplit's dp sum switched off, no gradient sync but on the last backward of
  the step (the reduce-scatter issued at the same point as the baseline's all-reduce).

First both are checked against the plain model (loss and every gradient, a few AdamW steps);
then one step of each per round, alternating which goes first, each step (zero_grad, pipeline
step, gradient sync, AdamW step) timed on rank 0 between barriers; then one profiled step of
each for memory. Reported: median step time ratio fsdp2 / allreduce, the median of the paired
ratios, spreads, and memory per rank.

Prints markdown (paste into the pipeline × data parallel part of benchmarks/RESULTS.md).
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
from common import MALLOC_ENV, emit, header, load_average, markdown_table, reuse_freed_memory  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_dp_sync_worker.py")


def iqr_half(xs: list[float]) -> str:
    if len(xs) < 4:
        return "n/a"
    q = statistics.quantiles(xs, n=4)
    return f"±{(q[2] - q[0]) / 2 / statistics.median(xs) * 100:.0f}%"


def mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def check_cell(c: dict) -> str:
    if "error" in c:
        return f"FAILS: {c['error']}"
    if c["missing"]:
        return f"WRONG: {len(c['missing'])} gradients None"
    return f"{max(c['loss_rel'], c['grad_rel']):.0e}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="2x2,1x2", help="pp x dp per launch (default: 2x2 on 4 ranks, 1x2 on 2)")
    ap.add_argument("--schedules", default="1f1b,zb_h1")
    ap.add_argument("--models", default="mlp")
    ap.add_argument("--microbatches", type=int, default=4, help="per replica")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--warmup", type=int, help="untimed steps per variant first (default 3, quick 1)")
    ap.add_argument("--steps", type=int, help="timed steps per variant (default 15, quick 4)")
    ap.add_argument("--quick", action="store_true", help="fewer steps (~1 min per launch)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--malloc-defaults", action="store_true", help="leave glibc malloc's settings as they are")
    args = ap.parse_args()
    malloc = reuse_freed_memory(not args.malloc_defaults)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    steps = args.steps or (4 if args.quick else 15)
    layouts = [tuple(int(v) for v in lay.split("x")) for lay in args.layouts.split(",")]

    head = header("Pipeline × data parallel: bucketed all-reduce vs FSDP2", notes=[malloc]).replace("## ", "### ", 1)
    emit(re.sub(r"torch threads: \d+", f"torch threads per rank: {args.threads}", head))
    emit(f"- worker: `OMP_NUM_THREADS={args.threads} python -m torch.distributed.run --standalone --nproc-per-node "
         "PP*DP benchmarks/_dp_sync_worker.py --pp PP --schedule S` (gloo, CPU)")
    emit(f"- {args.microbatches} microbatches per replica, global batch {args.batch}; {warmup} warm-up + {steps} "
         "timed steps per variant, alternating which goes first; a step = zero_grad + pipeline step + gradient "
         "sync + AdamW step, timed on rank 0 between two barriers")
    emit("- memory per rank: *resident* = parameters + optimizer state the rank holds between steps (FSDP2: its "
         "shards); *step peak* = the peak of live bytes allocated through torch's CPU allocator during one step "
         "above what was live at its start (profiler memory events at op granularity; FSDP2's all-gathered "
         "parameters and unsharded gradients count here); *peak* = the sum, the largest over the ranks")
    emit()
    rows, phase_rows, failed = [], [], []
    for pp, dp in layouts:
        for schedule in args.schedules.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(pp * dp),
                   WORKER, "--pp", str(pp), "--schedule", schedule, "--models", args.models,
                   "--microbatches", str(args.microbatches), "--batch", str(args.batch),
                   "--warmup", str(warmup), "--steps", str(steps)]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=ROOT, **MALLOC_ENV)
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
                failed.append(f"{pp}x{dp} {schedule}: exit code {proc.returncode}")
                continue
            result = json.loads(line[len("RESULT "):])
            for m in result["models"]:
                check = m["check"]
                base = [pp, dp, f"`{schedule}`", m["model"], check_cell(check["allreduce"]), check_cell(check["fsdp2"])]
                if "times" not in m:
                    rows.append(base + ["n/a"] * 7)
                    continue
                a, b = m["times"]["allreduce"], m["times"]["fsdp2"]
                mem = m["memory"]

                def peak(kind: str) -> float:
                    return max(r[kind]["resident"] + r[kind]["step_peak"] for r in mem)

                def resident(kind: str) -> float:
                    return max(r[kind]["resident"] for r in mem)

                ph = {k: [statistics.median(x[i] for x in m["phases"][k]) * 1e3 for i in (0, 1)] for k in m["phases"]}
                phase_rows.append([pp, dp, f"`{schedule}`", m["model"],
                                   f"{ph['allreduce'][0]:.0f} / {ph['fsdp2'][0]:.0f}",
                                   f"{ph['allreduce'][1]:.1f} / {ph['fsdp2'][1]:.1f}"])
                rows.append(base + [
                    f"{statistics.median(a) * 1e3:.0f}",
                    f"{statistics.median(b) / statistics.median(a):.3f}",
                    f"{statistics.median(y / x for x, y in zip(a, b)):.3f}",
                    f"{iqr_half(a)} / {iqr_half(b)}",
                    f"{mib(resident('allreduce'))} / {mib(resident('fsdp2'))}",
                    f"{mib(peak('allreduce'))} / {mib(peak('fsdp2'))}",
                    f"{peak('fsdp2') / peak('allreduce'):.2f}",
                ])
            for m in result["models"]:
                emit(f"- `{m['model']}` ({pp}x{dp}, `{schedule}`): {m.get('description', '')}; "
                     f"load average after: {load_average()}")
    emit()
    emit(markdown_table(
        ["pp", "dp", "schedule", "model", "allreduce vs plain model (rel. diff)", "fsdp2 vs plain model",
         "allreduce step (ms)", "fsdp2 / allreduce (medians)", "median of paired ratios", "noise allreduce / fsdp2",
         "resident MiB allreduce / fsdp2", "peak MiB allreduce / fsdp2", "peak fsdp2 / allreduce"],
        rows, "rrllllrrrrrrr"))
    emit()
    emit("Where rank 0's time goes (medians, ms):")
    emit()
    emit(markdown_table(["pp", "dp", "schedule", "model", "pipeline step incl. gradient sync, allreduce / fsdp2",
                         "AdamW step, allreduce / fsdp2"], phase_rows, "rrllrr"))
    for f in failed:
        emit(f"\n**launch failed: {f}**")
    emit(f"\n(load average at end (1/5/15 min): {load_average()})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
