"""Hybrid costs: FLOP and byte counts calibrated to a device with a short profile.

A per-node profile is noisy, and pure FLOP counts weigh elementwise and
normalisation work (10-25% of a transformer's time) as zero. The hybrid model fits
``time = a * flops + b * bytes_moved + c`` to a quick profile by non-negative least
squares, then prices every node with the fitted rates: smooth like FLOPs, but with
memory-bound work weighed as the device actually runs it. A node's backward keeps the
ratio to its forward that the profile measured (an embedding's dense table gradient
is many times its forward; no FLOP ratio says so), applied to the fitted forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx

from pipesplit.meta import COMPUTE_OPS, node_cost, set_node_cost
from pipesplit.passes.annotate.profile import profile_nodes
from pipesplit.passes.annotate.rates import moved_bytes


@dataclass(frozen=True)
class Calibration:
    """Fitted device rates: seconds per FLOP, per byte moved, and per operation."""

    per_flop: float
    per_byte: float
    per_op: float
    r2: float  # fraction of the profile's variance the fit explains

    def seconds(self, flops: float, nbytes: float) -> float:
        return self.per_flop * flops + self.per_byte * nbytes + self.per_op


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active-set on 3 unknowns)."""
    active = list(range(x.shape[1]))
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))


def calibrate(
    gm: fx.GraphModule,
    example_flat: Sequence[Any],
    device: str | torch.device = "cpu",
    *,
    mutated_targets: set[str] = frozenset(),  # type: ignore[assignment]
    repeats: int = 3,
    progress: bool | None = None,
) -> Calibration:
    """Profile ``gm`` briefly, fit the device rates, and store calibrated times on every node.

    Backward times are the fitted forward times times each node's profiled backward /
    forward ratio; nodes whose backward was not profiled keep the FLOP-ratio estimate.
    """
    profile_nodes(gm, example_flat, device, mutated_targets=mutated_targets, warmup=1, repeats=repeats, progress=progress)
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    x = np.array([[node_cost(n).fwd_flops, moved_bytes(n), 1.0] for n in nodes], dtype=np.float64)
    y = np.array([node_cost(n).time_s or 0.0 for n in nodes], dtype=np.float64)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    coef = _nnls(x / scale, y) / scale
    fitted = x @ coef
    var = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - fitted) ** 2).sum()) / var if var > 0 else 1.0
    cal = Calibration(float(coef[0]), float(coef[1]), float(coef[2]), r2)
    for n, t in zip(nodes, fitted):
        c = node_cost(n)
        bwd = None
        if c.bwd_time_s is not None and c.time_s:
            bwd = float(t) * c.bwd_time_s / c.time_s
        set_node_cost(n, c.with_time(float(t)).with_backward_time(bwd))
    return cal
