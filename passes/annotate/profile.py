"""Profiling pass: measured forward and backward time of every node on a device (minimum of passes).

The graph runs ``warmup + repeats`` times, node by node; each pass times every node
once and the minimum over the timed passes is kept. Spreading a node's samples over
whole passes, rather than timing it several times in a row, keeps a burst of load from
another process from inflating all of its samples at once.

The backward of a node is timed on its own: its operands that carry a gradient are
re-entered as leaves, the op runs with autograd recording, and ``torch.autograd.grad``
computes their gradients from an all-ones output gradient. This sees costs that no
FLOP ratio predicts, such as the dense gradient of a whole embedding table. The fixed
cost of one ``autograd.grad`` call, measured on a trivial op, is subtracted.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
import torch.fx as fx
from tqdm.auto import tqdm

from pipesplit.compat import pytree
from pipesplit.devices import concrete_device
from pipesplit.meta import COMPUTE_OPS, node_cost, set_node_cost
from pipesplit.passes.aliasing import written_get_attrs



def _needs_grad(node: fx.Node) -> bool:
    c = node_cost(node)
    return c.trainable if node.op == "get_attr" else c.requires_grad


class _TimingInterpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, device: torch.device, mutated: set[str], backward: bool, bar: Any):
        super().__init__(gm, garbage_collect_values=True)
        self.device, self.mutated, self.backward, self.bar = device, mutated, backward, bar
        self.cache: dict[str, Any] = {}
        self.timing = False
        self.fwd: dict[fx.Node, float] = {}
        self.bwd: dict[fx.Node, float] = {}
        self.no_backward: set[fx.Node] = set()  # the op's backward could not be run alone

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

    def _clock(self) -> float:
        self._sync()
        return time.perf_counter()

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            return super().run_node(n)
        start = self._clock()
        result = super().run_node(n)
        elapsed = self._clock() - start
        if self.backward and n not in self.no_backward and node_cost(n).requires_grad:
            self._time_backward(n)
        if self.timing:
            self.fwd[n] = min(self.fwd.get(n, float("inf")), elapsed)
            self.bar.update(1)
        return result

    def _time_backward(self, n: fx.Node) -> None:
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        flat, spec = pytree.tree_flatten((args, kwargs))
        arg_nodes = pytree.tree_leaves((n.args, n.kwargs))
        if len(arg_nodes) != len(flat):
            self.no_backward.add(n)
            return
        leaves = []
        for i, (value, arg) in enumerate(zip(flat, arg_nodes)):
            if (isinstance(arg, fx.Node) and isinstance(value, torch.Tensor) and value.is_floating_point()
                    and _needs_grad(arg)):
                flat[i] = value.detach().requires_grad_(True)
                leaves.append(flat[i])
        args, kwargs = pytree.tree_unflatten(flat, spec)
        try:
            with torch.enable_grad():
                out = getattr(self, n.op)(n.target, args, kwargs)
                roots = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
                if not leaves or not roots:
                    self.no_backward.add(n)
                    return
                grads = [torch.ones_like(r) for r in roots]
                start = self._clock()
                torch.autograd.grad(roots, leaves, grads, allow_unused=True)
                elapsed = self._clock() - start
        except RuntimeError:  # an op whose backward cannot run on its own: fall back to FLOP ratios
            self.no_backward.add(n)
            return
        if self.timing:
            self.bwd[n] = min(self.bwd.get(n, float("inf")), elapsed)


def _grad_call_overhead(device: torch.device, repeats: int = 20) -> float:
    """Seconds one ``autograd.grad`` call costs on a trivial op (subtracted from every node's)."""
    x = torch.ones(1, device=device, requires_grad=True)
    best = float("inf")
    for _ in range(repeats):
        with torch.enable_grad():
            y = x * 1.0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.autograd.grad(y, x, torch.ones_like(y))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
    return best


def profile_nodes(
    gm: fx.GraphModule,
    example_flat: Sequence[Any],
    device: str | torch.device = "cpu",
    *,
    mutated_targets: set[str] = frozenset(),  # type: ignore[assignment]
    warmup: int = 2,
    repeats: int = 5,
    backward: bool = True,
    progress: bool | None = None,
) -> fx.GraphModule:
    """Run ``gm`` ``warmup + repeats`` times, node by node, on ``device``; store each node's times.

    Every compute node gets its forward time (``time_s``) and, with ``backward`` and
    where its output carries a gradient, its backward time (``bwd_time_s``): the minimum
    over the ``repeats`` timed passes, the figure least disturbed by other load on the
    machine. Needs ``annotate_costs`` first. Buffers that ops update in place (found in
    the graph, or named by ``mutated_targets``) and the inputs are profiled on copies, and
    the default random number generators are left as they were.
    """
    device = concrete_device(device)
    # copies: an op that writes an input in place must not change the caller's tensors
    inputs = [x.detach().to(device, copy=True) if isinstance(x, torch.Tensor) else x for x in example_flat]
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    overhead = _grad_call_overhead(device) if backward else 0.0
    # random ops (dropout) draw from the default generators: the caller's streams must not move
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with tqdm(total=len(nodes) * max(repeats, 1), desc="profiling nodes",
              disable=None if progress is None else not progress, leave=False) as bar, \
            torch.random.fork_rng(devices=cuda):
        written = set(mutated_targets) | written_get_attrs(gm.graph)  # through views too
        interp = _TimingInterpreter(gm, device, written, backward, bar)
        with torch.no_grad():
            for p in range(warmup + max(repeats, 1)):
                interp.timing = p >= warmup
                interp.run(*inputs)
    for n in nodes:
        c = node_cost(n).with_time(interp.fwd[n])
        if n in interp.bwd:
            c = c.with_backward_time(max(interp.bwd[n] - overhead, 0.0))
        set_node_cost(n, c)
    return gm
