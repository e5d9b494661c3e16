"""Where the last stage's backward goes: GPT 12x768 (vocab 8192, seq 512, microbatch 2) in 4 stages;
the last stage alone, forward + cross-entropy, then backward, timed with CUDA events and profiled.

Issue 24: on an H100 this stage's backward measured 14 ms where the other three took 6-7 ms.
``python benchmarks/gpu_last_stage.py [--device cpu --small]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pipesplit  # noqa: E402
from pipesplit.models import gpt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true")
    a = p.parse_args()
    layers, dim, vocab, seq = (2, 32, 256, 16) if a.small else (12, 768, 8192, 512)
    torch.manual_seed(0)
    model = gpt(layers=layers, dim=dim, vocab=vocab, seq=seq, heads=max(dim // 64, 2))
    x, y = torch.randint(0, vocab, (2, seq)), torch.randint(0, vocab, (2, seq))
    prog = pipesplit.compile(model, x, num_stages=4, devices=[a.device] * 4, schedule="1f1b", num_microbatches=8,
                             progress=False)
    print(prog.report())
    # the last stage's inputs: run the program's stages in turn, keep what reaches the last one
    captured = {}
    last = prog.stages[-1].module
    orig = last.forward

    def keep(*args):
        captured["args"] = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in args]
        return orig(*args)

    last.forward = keep
    with torch.no_grad():
        prog(x.to(a.device))
    last.forward = orig
    yd = y.to(a.device)
    sync = (lambda: torch.cuda.synchronize()) if a.device.startswith("cuda") else (lambda: None)

    def fwd():
        args = [t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in (u.detach() if isinstance(u, torch.Tensor) else u for u in captured["args"])]
        out = last(*args)[0]
        return F.cross_entropy(out.flatten(0, 1), yd.flatten()), out

    for _ in range(3):
        loss, _ = fwd()
        loss.backward()
    sync()
    tf, tb = [], []
    for _ in range(10):
        t0 = time.perf_counter(); loss, _ = fwd(); sync(); t1 = time.perf_counter()
        loss.backward(); sync(); t2 = time.perf_counter()
        tf.append(t1 - t0), tb.append(t2 - t1)
    print(f"last stage alone: forward+loss {sorted(tf)[5] * 1e3:.2f} ms, backward {sorted(tb)[5] * 1e3:.2f} ms (medians)")
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    loss, _ = fwd()
    with profile(activities=acts) as prof:
        loss.backward()
        sync()
    key = "self_cuda_time_total" if a.device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
