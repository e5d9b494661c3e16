"""Zero-bubble's split backward: I + W against one fused backward, on the same stage.

    python benchmarks/bench_split_backward.py [--repeats 20]

For each model, one stage holding the whole model: the step is forward, then either one
fused backward (B), or I (input and weight-op-output gradients) followed by W (weight
gradients through each weight op alone; runtime/engine/weight_grads.py), or the old W (a second
backward from the stage outputs). CPU time, one thread, interleaved rounds, medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time

import torch

import pipesplit
from pipesplit.models import gpt
from pipesplit.runtime.engine.weight_grads import input_grads, weight_backward, weight_graph


def _mlp() -> torch.nn.Module:
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256), torch.nn.LayerNorm(256)]
    return torch.nn.Sequential(*layers)


MODELS = {
    "gpt (6 blocks, dim 256, tied head)": (lambda: gpt(layers=6, dim=256, vocab=2048, seq=64, heads=4),
                                           lambda: torch.randint(0, 2048, (8, 64))),
    "mlp (8 x 256-512-256, LayerNorm)": (_mlp, lambda: torch.randn(256, 256)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("### Split backward: I + W against one fused backward\n")
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores; "
          f"torch {torch.__version__}, 1 thread; load average {os.getloadavg()[0]:.2f}")
    print(f"- command: `python benchmarks/bench_split_backward.py --repeats {args.repeats}`\n")
    print("| model | fused B (ms) | I (ms) | W (ms) | (I + W) / B | old W (ms) | (I + old W) / B |")
    print("|:--|--:|--:|--:|--:|--:|--:|")
    for name, (build, data) in MODELS.items():
        model = build()
        x = data()
        prog = pipesplit.compile(model, x, num_stages=1, progress=False)  # the stage graph is called at x's batch
        stage = prog.stages[0].module
        wg = weight_graph(stage)
        params = [p for p in stage.parameters() if p.requires_grad]
        times: dict[str, list[float]] = {"B": [], "I": [], "W": [], "oldW": []}

        def clock(fn):
            t = time.process_time()
            out = fn()
            return time.process_time() - t, out

        for r in range(args.repeats + 2):
            prog.zero_grad()
            out = stage(x)[0]
            g = torch.randn_like(out)
            tb, _ = clock(lambda: torch.autograd.backward([out], [g], inputs=params))
            prog.zero_grad()
            outs = wg.module(x)
            own, extras = outs[0], list(outs[wg.num_outputs:])
            ti, (_, grads) = clock(lambda: input_grads(wg, [own], [g], [], extras))
            tw, _ = clock(lambda: weight_backward(wg, extras, grads, [own], [g]))
            out = stage(x)[0]
            to, _ = clock(lambda: torch.autograd.backward([out], [g], inputs=params))  # the old W: a full pass
            if r >= 2:
                times["B"].append(tb), times["I"].append(ti), times["W"].append(tw), times["oldW"].append(to)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        print(f"| {name} | {med['B']:.1f} | {med['I']:.1f} | {med['W']:.1f} | {(med['I'] + med['W']) / med['B']:.2f} "
              f"| {med['oldW']:.1f} | {(med['I'] + med['oldW']) / med['B']:.2f} |")


if __name__ == "__main__":
    main()
