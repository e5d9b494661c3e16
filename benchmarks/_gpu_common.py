"""What bench_gpu.py's parts share: the result file a part writes as it goes, and the timing and loss helpers.

``_gpu_parts.py`` (every part but one) and ``_gpu_graphs.py`` (the ``cuda_graphs`` part) both import
this module; neither imports the other's helpers, so the two no longer import each other.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree


class Result:
    """What a part found, written to ``path`` after every addition."""

    def __init__(self, path: str):
        self.path, self.data, self.sections = path, {}, {}  # type: ignore[var-annotated]

    def add(self, key: str, value: Any, markdown: str | None = None) -> None:
        self.data[key] = value
        if markdown:  # one section per key: a later addition replaces it in place
            self.sections[key] = markdown
        with open(self.path, "w") as f:
            json.dump({"data": self.data, "markdown": "\n\n".join(self.sections.values())}, f, indent=1, default=str)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def mse_tree(out: Any, target: Any) -> torch.Tensor:
    """Mean squared error over every float output leaf (any model's outputs: tensors, tuples, dicts)."""
    pairs = [(o, t) for o, t in zip(pytree.tree_leaves(out), pytree.tree_leaves(target))
             if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return sum(F.mse_loss(o.float(), t.float()) for o, t in pairs)  # type: ignore[return-value]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    den = max(torch.linalg.vector_norm(a).item(), torch.linalg.vector_norm(b).item(), 1e-12)
    return torch.linalg.vector_norm(a - b).item() / den


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, device: str) -> dict[str, float]:
    """Median seconds of each function over ``rounds`` rounds, every function once per round, the
    order alternating (load that changes over time hits all alike)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            sync(device)
            start = time.perf_counter()
            fns[k]()
            sync(device)
            samples[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in samples.items()}


def ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
