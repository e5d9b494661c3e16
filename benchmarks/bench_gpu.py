"""The GPU check in one command: CUDA tests, exactness, overhead, predicted vs measured, oracle, memory.

    python benchmarks/bench_gpu.py --out gpu_check                     # on a GPU: at most ~9 minutes
    python benchmarks/bench_gpu.py --device cpu --quick --out /tmp/gc  # the same code paths on CPU

Parts (``--parts`` picks some; ``benchmarks/_gpu_parts.py`` holds them):

- ``tests``: ``pytest -m cuda`` (every CUDA test of the suite);
- ``exact``: ``prog(x)`` and ``Pipeline.step`` against gradient accumulation on the plain model,
  a few models x every schedule, then one optimizer step;
- ``cuda_graphs``: compiled stages replayed as CUDA graph slots (``compile={"mode": "reduce-overhead"}``)
  against compiled stages without them, the plain model and ``torch.compile(model)`` with and without
  its own CUDA graphs, 1 and 2 stages, on the host-bound GPT (``benchmarks/_gpu_graphs.py``);
- ``overhead``: a 1-stage Pipeline step against the plain model's step and ``torch.compile(model)``'s
  on a host-bound GPT (12 x 256), interleaved rounds, medians; a ``torch.profiler`` table of where
  host time goes in each;
- ``compiled``: the plain model and ``torch.compile(model)`` against 2-stage pipelines, eager and
  compiled, under 1f1b and zb_h1 (whose stages run as compiled F/I/W graphs);
- ``predict``: ``pipesplit.benchmark`` predicted vs measured, default and ``profile`` cost, 2 and 4 stages;
- ``oracle``: every module-boundary split of a GPT measured against the planner's
  (``benchmarks/bench_oracle.py``'s machinery);
- ``memory``: the planner's memory estimate against ``torch.cuda.max_memory_allocated``.

Every part runs in a subprocess of its own with its own time limit: a part that crashes or runs
over is recorded as such and the next one starts. A part writes its result after each row, so one
cut off still reports what it finished. Writes ``report.md`` and ``report.json`` to ``--out``.
Runs from a plain copy of the repository on the machine's own torch (no installs): the checkout is
put on ``sys.path`` when pipesplit is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
try:
    import pipesplit  # noqa: F401
except ImportError:  # a plain copy of the repository: the checkout is the package
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common import header, now  # noqa: E402
from pipesplit.devices import device_name  # noqa: E402

# seconds per part on a GPU (the budget, 9 minutes, cuts the last parts short if they all run long)
LIMITS = {"tests": 80, "exact": 50, "cuda_graphs": 100, "overhead": 60, "compiled": 100, "predict": 80, "oracle": 45,
          "memory": 25}
PARTS = tuple(LIMITS)


def versions(device: str) -> dict[str, str]:
    """torch, CUDA, cuDNN and the device, as this run found them."""
    out = {"date": now(), "torch": torch.__version__, "python": sys.version.split()[0], "device": device,
           "float32 matmul precision": torch.get_float32_matmul_precision()}
    if torch.cuda.is_available():
        idx = torch.device(device).index or 0 if device.startswith("cuda") else 0
        props = torch.cuda.get_device_properties(idx)
        out.update(cuda=str(torch.version.cuda), cudnn=str(torch.backends.cudnn.version()),
                   gpu=f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}",
                   gpus=str(torch.cuda.device_count()))
    return out


def run_part(name: str, args: argparse.Namespace, limit: float) -> dict:
    """Run part ``name`` in a subprocess for at most ``limit`` seconds; its record."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "part.json")
        cmd = [sys.executable, os.path.join(HERE, "_gpu_parts.py"), name, "--device", args.device, "--result", result,
               "--limit", str(limit)] + (["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]))
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            log = proc.stdout[-3000:] + proc.stderr[-5000:]
        except subprocess.TimeoutExpired as e:
            status, log = f"timed out after {limit:.0f} s", _text(e.stdout)[-3000:] + _text(e.stderr)[-3000:]
        wall = time.perf_counter() - start
        record = {"status": status, "wall_s": round(wall, 1), "limit_s": limit, "markdown": "", "data": {}}
        if os.path.exists(result):
            with open(result) as f:
                record.update(json.load(f))
        if status != "ok":
            record["log"] = log
        return record


def _text(x: bytes | str | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def report(info: dict, records: dict[str, dict], command: str) -> str:
    notes = [f"{k}: {v}" for k, v in info.items() if k != "date"]
    lines = [header("GPU check (benchmarks/bench_gpu.py)", command=command, notes=notes), ""]
    lines += ["| part | status | wall s | limit s |", "|:--|:--|--:|--:|"]
    lines += [f"| {name} | {r['status']} | {r['wall_s']} | {r['limit_s']:.0f} |" for name, r in records.items()]
    for name, r in records.items():
        lines += ["", f"### {name}", "", r.get("markdown") or "(no result)"]
        if r.get("log"):
            lines += ["", "```", r["log"].strip()[-4000:], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small models and few rounds (the CPU smoke run)")
    p.add_argument("--smoke", action="store_true", help="smaller still: what tests/test_bench_gpu.py runs")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for all parts together")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every part's time limit")
    p.add_argument("--out", required=True, help="folder for report.md and report.json")
    args = p.parse_args(argv)
    args.device = device_name(args.device)  # "cuda": the current GPU, as pipesplit itself takes it
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = [x for x in parts if x not in LIMITS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    info = versions(args.device)
    print("  ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    deadline = time.perf_counter() + args.budget
    records: dict[str, dict] = {}
    for name in parts:
        left = deadline - time.perf_counter()
        if left < 5:
            records[name] = {"status": "not run: the budget was spent", "wall_s": 0, "limit_s": 0, "data": {}}
            continue
        records[name] = run_part(name, args, min(LIMITS[name] * args.scale, left))
        print(f"{name}: {records[name]['status']} in {records[name]['wall_s']} s", flush=True)
    command = "python benchmarks/bench_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(report(info, records, command))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump({"versions": info, "command": command, "parts": records}, f, indent=1, default=str)
    print(f"wrote {os.path.join(args.out, 'report.md')} and report.json", flush=True)
    return 0 if all(r["status"] == "ok" for r in records.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
