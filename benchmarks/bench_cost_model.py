"""The default cost model per stage: predicted against measured forward and backward seconds.

For a few models (GPTs whose time is mostly matrix multiplies, and a residual MLP of small
layers whose time is mostly per-op overhead), compiled into 2 stages on the CPU, this
times every stage's forward and fused backward on one microbatch
(``pipesplit.measure_stage_costs``, median of repeats) and divides by what the default
cost predicts (``pipesplit.bench.predict.stage_seconds(prog, "flops", 1)``): per-op
overhead + FLOPs / FLOP rate + bytes / bandwidth at this device's measured rates
(``pipesplit.passes.annotate.rates``). The baseline, measured in the same run, is the pricing it
replaced: FLOPs at a nominal 5e10 FLOP/s, no per-op cost. 1.0 is a perfect prediction.

Prints markdown (paste into the ``## Benchmark API`` section of benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, header, markdown_table  # noqa: E402

import pipesplit  # noqa: E402
from pipesplit.bench.predict import stage_seconds  # noqa: E402
from pipesplit.meta import META_KEY  # noqa: E402
from pipesplit.passes.plan.chain import compute_nodes  # noqa: E402
from pipesplit.passes.plan.objective import DEFAULT_FLOPS_PER_S  # noqa: E402
from pipesplit.passes.plan.step_planner import node_seconds  # noqa: E402
from pipesplit.schedules import StageCost  # noqa: E402
from pipesplit.models import gpt  # noqa: E402
from pipesplit.passes.annotate.rates import device_rates  # noqa: E402
from pipesplit.runtime.engine.measure import measure_stage_costs  # noqa: E402


class SmallMLP(nn.Module):
    """Residual blocks of Linear(64, 64) + LayerNorm + GELU: each op takes microseconds."""

    def __init__(self, blocks: int = 16, width: int = 64):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
                                    for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def cases() -> list[tuple[str, nn.Module, torch.Tensor]]:
    return [
        ("GPT 8 blocks, width 128, vocab 1024, 16 x 64 tokens",
         gpt(layers=8, dim=128, vocab=1024, seq=64), torch.randint(0, 1024, (16, 64))),
        ("GPT 4 blocks, width 256, vocab 8192, 8 x 64 tokens",
         gpt(layers=4, dim=256, vocab=8192, seq=64), torch.randint(0, 8192, (8, 64))),
        ("MLP 16 x Linear(64) + LayerNorm + GELU, batch 32", SmallMLP(), torch.randn(32, 64)),
    ]


def flop_rate_only(prog: pipesplit.SplitProgram) -> list:
    """The old pricing: FLOPs at the nominal rate (the planner's ``flops_per_s`` path), no per-op cost."""
    out = []
    for stage in prog.stages:
        nodes = [n for n in compute_nodes(stage.module) if META_KEY in n.meta]
        rate = DEFAULT_FLOPS_PER_S.get(stage.device.type, DEFAULT_FLOPS_PER_S["cpu"])
        f, i, w = node_seconds(nodes, "flops", lambda n: 0.0, rate).sum(axis=0) if nodes else (0.0, 0.0, 0.0)
        out.append(StageCost(float(f), float(i), float(w)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--torch-threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    rates = device_rates("cpu")
    rows = []
    for name, model, x in cases():
        m = args.microbatches
        prog = pipesplit.compile(model, x[: x.shape[0] // m], num_stages=2, progress=False)
        measured = measure_stage_costs(prog, x, num_microbatches=m, repeats=args.repeats, backward="fused")
        new, old = stage_seconds(prog, "flops", 1.0), flop_rate_only(prog)
        for s, (got, a, b) in enumerate(zip(measured, new, old)):
            fwd, bwd = got.forward, got.backward_input + got.backward_weight
            rows.append([name, s, f"{fwd * 1e3:.2f}", f"{bwd * 1e3:.2f}",
                         f"{fwd / a.forward:.2f}", f"{bwd / (a.backward_input + a.backward_weight):.2f}",
                         f"{fwd / b.forward:.2f}", f"{bwd / (b.backward_input + b.backward_weight):.2f}"])
    emit(header("Default cost model: predicted against measured stage time",
                "python benchmarks/bench_cost_model.py",
                [f"measured rates: {rates.describe()}",
                 f"{args.microbatches} microbatches, 2 stages on the CPU, {args.repeats} timed runs per stage "
                 f"(median), torch threads {args.torch_threads}"]))
    emit(markdown_table(["model", "stage", "F ms", "B ms", "F meas/pred", "B meas/pred",
                         "F meas/pred, old", "B meas/pred, old"], rows, align="llrrrrrr"))


if __name__ == "__main__":
    main()
