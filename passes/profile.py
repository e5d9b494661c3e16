"""Profiling pass: measured forward time of every node on a device (warm-up, repeats, minimum)."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.fx as fx
from tqdm.auto import tqdm

from pipesplit.meta import node_cost, set_node_cost


class _TimingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, device: torch.device, mutated: set[str], warmup: int, repeats: int, bar: Any):
        super().__init__(gm, garbage_collect_values=True)
        self.device, self.mutated = device, mutated
        self.warmup, self.repeats, self.bar = warmup, repeats, bar
        self.cache: dict[str, Any] = {}

    def fetch_attr(self, target: str) -> Any:
        if target not in self.cache:
            obj = super().fetch_attr(target)
            if isinstance(obj, torch.Tensor):
                # Copies of state that ops write in place: profiling must not move running stats.
                obj = obj.detach().to(self.device, copy=target in self.mutated)
            self.cache[target] = obj
        return self.cache[target]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "call_module", "call_method"):
            return super().run_node(n)
        for _ in range(self.warmup):
            super().run_node(n)
        best = float("inf")
        result = None
        for _ in range(max(self.repeats, 1)):
            self._sync()
            start = time.perf_counter()
            result = super().run_node(n)
            self._sync()
            best = min(best, time.perf_counter() - start)
        set_node_cost(n, node_cost(n).with_time(best))
        self.bar.update(1)
        return result


def profile_nodes(
    gm: fx.GraphModule,
    example_flat: Sequence[Any],
    device: str | torch.device = "cpu",
    *,
    mutated_targets: set[str] = frozenset(),  # type: ignore[assignment]
    warmup: int = 2,
    repeats: int = 5,
    progress: bool = True,
) -> fx.GraphModule:
    """Run ``gm`` once, node by node, on ``device`` and store each node's forward time.

    Each node runs ``warmup`` times untimed, then ``repeats`` times; the minimum is
    kept, which is the figure least disturbed by other load on the machine. Needs
    ``annotate_costs`` first. Buffers that ops update in place are profiled on copies.
    """
    device = torch.device(device)
    inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in example_flat]
    total = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_module", "call_method"))
    with tqdm(total=total, desc="profiling nodes", disable=not progress, leave=False) as bar, torch.no_grad():
        _TimingInterpreter(gm, device, set(mutated_targets), warmup, repeats, bar).run(*inputs)
    return gm
