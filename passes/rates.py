"""What the default cost model prices an operation at: measured rates of the device it plans for.

A FLOP count alone prices a LayerNorm, a residual add or a reshape at almost nothing, so on a
model of small operations it is off by orders of magnitude. The default prices every
operation as the time it really takes, to first order::

    seconds = per-op overhead + FLOPs / FLOP rate + bytes moved / bandwidth

with the three rates measured here, once per device, thread count and process, by three
micro-benchmarks (tiny linear / layer-norm / GELU / add blocks through autograd, a matrix
multiply, a large add) that take
well under a second together. The backward of an op costs its own overhead (autograd's per
node), its input-gradient or weight-gradient FLOPs at the same rate, and the bytes it moves.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx

from pipesplit.meta import NodeCost, node_cost


@dataclass(frozen=True)
class DeviceRates:
    """Measured on one device: seconds per forward op, per backward op, per FLOP and per byte moved."""

    device: str
    forward_op_s: float
    backward_op_s: float
    flops_per_s: float
    bytes_per_s: float

    def forward(self, c: NodeCost, moved: float) -> float:
        return self.forward_op_s + c.fwd_flops / self.flops_per_s + moved / self.bytes_per_s

    def input_grad(self, c: NodeCost, moved: float) -> float:
        if not c.requires_grad:
            return 0.0
        return self.backward_op_s + c.igrad_flops / self.flops_per_s + moved / self.bytes_per_s

    def weight_grad(self, c: NodeCost, weight_bytes: float) -> float:
        if not c.wgrad_flops:
            return 0.0
        return c.wgrad_flops / self.flops_per_s + 2 * weight_bytes / self.bytes_per_s

    def describe(self) -> str:
        return (f"{self.device}: {self.forward_op_s * 1e6:.1f} µs per op forward, {self.backward_op_s * 1e6:.1f} µs "
                f"backward, {self.flops_per_s / 1e9:.1f} GFLOP/s, {self.bytes_per_s / 1e9:.1f} GB/s")


def moved_bytes(node: fx.Node) -> int:
    """Bytes an op reads and writes: its output plus its tensor inputs."""
    total = node_cost(node).out_bytes
    for a in node.all_input_nodes:
        c = node_cost(a)
        total += c.param_bytes if a.op == "get_attr" else c.out_bytes
    return total


def priced(node: fx.Node, rates: DeviceRates) -> tuple[float, float, float]:
    """Seconds of ``node``'s forward, input gradient and weight gradient at ``rates``."""
    c = node_cost(node)
    moved = moved_bytes(node)
    weights = sum(node_cost(a).param_bytes for a in node.all_input_nodes
                  if a.op == "get_attr" and node_cost(a).trainable)
    return rates.forward(c, moved), rates.input_grad(c, moved), rates.weight_grad(c, weights)


def _quartile(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Lower-quartile seconds of ``fn`` after one untimed call: typical, but not thrown by a burst of
    load on a shared machine (a median of 9 once read a backward op at 10x its usual cost)."""
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4]


@functools.lru_cache(maxsize=None)
def _measure(device: str, threads: int) -> DeviceRates:
    dev = torch.device(device)
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    # per-op overhead on a realistic mix (linear, layer norm, gelu, residual add) of tiny tensors, with autograd
    blocks, width = 16, 8
    w, bias = torch.randn(width, width, device=dev, requires_grad=True), torch.zeros(width, device=dev, requires_grad=True)
    x0 = torch.randn(2, width, device=dev, requires_grad=True)
    ops = 4 * blocks + 1

    aten = torch.ops.aten  # what a stage's graph calls, op by op

    def forward() -> torch.Tensor:
        y = x0
        for _ in range(blocks):
            h = aten.layer_norm.default(aten.linear.default(y, w, bias), [width])
            y = aten.add.Tensor(y, aten.gelu.default(h))
        return aten.sum.default(y)

    forward_op = _quartile(forward, 9, sync) / ops
    backward_op = max(_quartile(lambda: forward().backward(), 9, sync) / ops - forward_op, forward_op)
    a, b = torch.randn(256, 512, device=dev), torch.randn(512, 512, device=dev)
    flops = 2 * 256 * 512 * 512
    matmul = _quartile(lambda: torch.mm(a, b), 5, sync)
    u, v = torch.randn(1 << 22, device=dev), torch.empty(1 << 22, device=dev)  # 48 MB: past the caches
    moved = 3 * u.numel() * u.element_size()
    add = _quartile(lambda: torch.add(u, u, out=v), 5, sync)  # into the same buffer: no page faults timed
    return DeviceRates(
        device=str(dev),
        forward_op_s=forward_op,
        backward_op_s=backward_op,
        flops_per_s=flops / max(matmul - forward_op, matmul / 2),
        bytes_per_s=moved / max(add - forward_op, add / 2),
    )


def device_rates(device: str | torch.device = "cpu") -> DeviceRates:
    """The rates of ``device`` (``"cpu"``, ``"cuda:0"``, ...) with torch's current thread count;
    ``"meta"`` (a model not built yet) gets the CPU's.

    Measured the first time they are asked for in this process (~0.1 s on a CPU core),
    then remembered.

    >>> r = device_rates("cpu")
    >>> r.flops_per_s > 1e8 and r.bytes_per_s > 1e8 and 0 < r.forward_op_s < 1e-3
    True
    """
    dev = torch.device(device)
    if dev.type == "meta":  # a model too big to build yet: nothing runs there, so price it as the CPU would
        dev = torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # the user's RNG is untouched
        return _measure(str(dev), torch.get_num_threads())
