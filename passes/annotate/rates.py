"""What the default cost model prices an operation at: measured rates of the device it plans for.

A FLOP count alone prices a LayerNorm, a residual add or a reshape at almost nothing, so on a
model of small operations it is off by orders of magnitude. The default prices every
operation as the time it really takes, to first order::

    seconds = per-op overhead + FLOPs / FLOP rate + bytes moved / bandwidth

with the three rates measured here, once per device, thread count and process, by three
micro-benchmarks (tiny linear / layer-norm / GELU / add blocks through autograd, matrix
multiplies of four sizes, since a small one runs at a fraction of a large one's rate, and
a large add) that take
well under a second together. The backward of an op costs its own overhead (autograd's per
node), its input-gradient or weight-gradient FLOPs at the same rate, and the bytes it moves.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, TypeVar, cast

import torch
import torch.fx as fx

from pipesplit.devices import concrete_device
from pipesplit.meta import NodeCost, node_cost
from pipesplit.passes.annotate.attention import ATTENTION, FUSED, attention_kernel, fused_work
from pipesplit.passes.annotate.flops import numel_of, op_name, shape_of
from pipesplit.passes.annotate.gpu_rates import gpu_bandwidth, gpu_per_element


@dataclass(frozen=True)
class DeviceRates:
    """Measured on one device: seconds per forward op, per backward op, per FLOP and per byte moved."""

    device: str
    forward_op_s: float
    backward_op_s: float
    flops_per_s: float  # on the largest matrix multiply measured
    bytes_per_s: float
    # (FLOPs of one op, FLOP/s at that size), ascending: small matrix multiplies run far below the peak
    flop_curve: tuple[tuple[float, float], ...] = ()
    # seconds per element (forward, backward) of the ops a FLOP count misses: transcendental
    # activations and softmax (GELU measured), and normalisations (layer norm measured)
    activation_s: tuple[float, float] = (0.0, 0.0)
    norm_s: tuple[float, float] = (0.0, 0.0)

    @property
    def kind(self) -> str:
        """The device type: ``"cpu"``, ``"cuda"``..."""
        return torch.device(self.device).type

    def flop_seconds(self, flops: float) -> float:
        """Seconds for one op of ``flops`` FLOPs, at the rate measured for ops of that size
        (interpolated in log FLOPs between the sizes measured; the ends held flat)."""
        if flops <= 0:
            return 0.0
        return flops / self.rate_at(flops)

    def rate_at(self, flops: float) -> float:
        curve = self.flop_curve
        if not curve:
            return self.flops_per_s
        if flops <= curve[0][0]:
            return curve[0][1]
        for (f0, r0), (f1, r1) in zip(curve, curve[1:]):
            if flops <= f1:
                t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
        return curve[-1][1]

    def forward(self, c: NodeCost, moved: float, elements: tuple[float, float] = (0.0, 0.0)) -> float:
        """``elements``: the op's activation and normalisation elements (see :func:`heavy_elements`)."""
        per = elements[0] * self.activation_s[0] + elements[1] * self.norm_s[0]
        return self._op(self.forward_op_s, self.flop_seconds(c.fwd_flops) + max(moved / self.bytes_per_s, per))

    def input_grad(self, c: NodeCost, moved: float, elements: tuple[float, float] = (0.0, 0.0)) -> float:
        if not c.requires_grad:
            return 0.0
        per = elements[0] * self.activation_s[1] + elements[1] * self.norm_s[1]
        return self._op(self.backward_op_s, self.flop_seconds(c.igrad_flops) + max(moved / self.bytes_per_s, per))

    def _op(self, host: float, work: float) -> float:
        """One op: the host's fixed cost and the device's work. A CPU does both in turn; a GPU runs
        its kernels while the host launches the next ones, so an op costs the longer of the two
        (a run of tiny kernels is host-bound, a large multiply device-bound)."""
        return max(host, work) if self.kind == "cuda" else host + work

    def weight_grad(self, c: NodeCost, weight_bytes: float) -> float:
        if not c.wgrad_flops:
            return 0.0
        return self.flop_seconds(c.wgrad_flops) + 2 * weight_bytes / self.bytes_per_s

    def describe(self) -> str:
        return (f"{self.device}: {self.forward_op_s * 1e6:.1f} µs per op forward, {self.backward_op_s * 1e6:.1f} µs "
                f"backward, {self.flops_per_s / 1e9:.1f} GFLOP/s"
                + (f" ({self.flop_curve[0][1] / 1e9:.1f} on a {self.flop_curve[0][0] / 1e6:.2g} MFLOP multiply)"
                   if len(self.flop_curve) > 1 else "")
                + f", {self.bytes_per_s / 1e9:.1f} GB/s")


def moved_bytes(node: fx.Node) -> int:
    """Bytes an op reads and writes: its output plus its tensor inputs."""
    total = node_cost(node).out_bytes
    for a in node.all_input_nodes:
        c = node_cost(a)
        total += c.param_bytes if a.op == "get_attr" else c.out_bytes
    return total


_ACTIVATIONS = {"gelu", "silu", "tanh", "sigmoid", "exp", "erf", "softmax", "_softmax", "log_softmax",
                "_log_softmax", "elu", "mish", "softplus", "logsigmoid"}
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm", "group_norm", "native_group_norm", "batch_norm",
          "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "instance_norm"}


def heavy_elements(node: fx.Node) -> tuple[float, float]:
    """Elements an op runs through a transcendental function (activations, attention's softmax)
    and through a normalisation: work a FLOP count prices near zero. Sizes are the example's
    (a dynamic batch dimension at its hint), as the FLOP counts take them."""
    name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
    if name in _ACTIVATIONS:
        return float(numel_of(node)), 0.0
    if name in _NORMS:
        return 0.0, float(numel_of(node))
    if name in ATTENTION and len(node.args) >= 2:  # the math kernel's softmax over the (..., T, S) scores
        q, k = (shape_of(a) if isinstance(a, fx.Node) else None for a in node.args[:2])
        if q and k:
            return float(math.prod(q[:-1]) * k[-2]), 0.0
    return 0.0, 0.0


def priced(node: fx.Node, rates: DeviceRates) -> tuple[float, float, float]:
    """Seconds of ``node``'s forward, input gradient and weight gradient at ``rates``.

    Attention is priced by the kernel the device runs (:mod:`pipesplit.passes.annotate.attention`):
    a fused one at its FLOPs and the bytes of q, k, v and the output (read and written again
    backward), the math one per element of the score matrix it materialises."""
    c = node_cost(node)
    moved = moved_bytes(node)
    weights = sum(node_cost(a).param_bytes for a in node.all_input_nodes
                  if a.op == "get_attr" and node_cost(a).trainable)
    if attention_kernel(node, rates.kind) in FUSED:
        fwd, bwd = fused_work(node, c.fwd_flops, c.igrad_flops)
        work = replace(c, fwd_flops=int(fwd), igrad_flops=int(bwd))
        return rates.forward(work, moved), rates.input_grad(work, 2 * moved), rates.weight_grad(c, weights)
    elements = heavy_elements(node)
    f, i, w = rates.forward(c, moved, elements), rates.input_grad(c, moved, elements), rates.weight_grad(c, weights)
    if c.loss_elements:  # a model output: the loss function reads every element, forward and backward
        f += c.loss_elements * rates.activation_s[0]
        i += c.loss_elements * rates.activation_s[1] if c.requires_grad else 0.0
    return f, i, w


def quartile_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
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


# (m, k, n) of the matrix multiplies timed: from a small transformer's to past the caches' sweet spot
MATMUL_SIZES = ((64, 64, 64), (128, 128, 256), (256, 256, 256), (256, 512, 512))
Probe = tuple[int, int, int, str]  # (m, k, n, dtype name) of one matrix multiply timed
_MATMULS = {"linear", "mm", "bmm", "matmul", "addmm", "baddbmm"}
_PROBE_DIM = 16384  # a probe's sides are capped: its operands stay under a GiB even in float32


def largest_matmul(nodes: Iterable[fx.Node]) -> Probe | None:
    """(m, k, n, dtype) of the matrix multiply among ``nodes`` with the most FLOPs (batched ones
    flattened into m), or None without one."""
    best: tuple[int, Probe] | None = None
    for node in nodes:
        if node.op != "call_function" or op_name(node.target) not in _MATMULS:
            continue
        a = node.args[1] if op_name(node.target) in ("addmm", "baddbmm") else node.args[0]
        val, a_shape, out = node.meta.get("val"), shape_of(a), shape_of(node)
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or not a_shape or not out:
            continue
        k, n = a_shape[-1], out[-1]
        m = math.prod(out) // max(n, 1)
        if best is None or m * k * n > best[0]:
            best = (m * k * n, (m, k, n, str(val.dtype).removeprefix("torch.")))
    return best[1] if best else None


def probe_points(device_type: str, largest: Probe | None) -> tuple[Probe, ...]:
    """The matrix multiplies the FLOP-rate curve is measured on. On a GPU, the rate grows far past
    the fixed sizes (a 512-cube multiply reaches a tenth of an H100's) and with the dtype (bfloat16
    and TF32 run 2-8x float32): the fixed sizes in the graph's dtype plus the graph's own largest
    multiply. Elsewhere the fixed sizes in float32, which keeps the CPU's measurement short."""
    if device_type != "cuda" or largest is None:
        return tuple((m, k, n, "float32") for m, k, n in MATMUL_SIZES)
    m, k, n, dtype = largest
    own = (min(m, _PROBE_DIM), min(k, _PROBE_DIM), min(n, _PROBE_DIM), dtype)
    return tuple(sorted({(a, b, c, dtype) for a, b, c in MATMUL_SIZES} | {own}, key=lambda p: p[0] * p[1] * p[2]))


@functools.lru_cache(maxsize=None)
def _measure(device: str, threads: int, probes: tuple[Probe, ...] = ()) -> DeviceRates:
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
        return cast(torch.Tensor, aten.sum.default(y))

    forward_op = quartile_seconds(forward, 9, sync) / ops
    backward_op = max(quartile_seconds(lambda: forward().backward(), 9, sync) / ops - forward_op, forward_op)
    curve = []
    for m, k, n, dtype in probes or probe_points(dev.type, None):  # the rate grows with the size of the multiply
        kind = getattr(torch, dtype)
        a, b = torch.randn(m, k, device=dev, dtype=kind), torch.randn(k, n, device=dev, dtype=kind)
        seconds = quartile_seconds(lambda: torch.mm(a, b), 5, sync)
        curve.append((2.0 * m * k * n, 2.0 * m * k * n / max(seconds - forward_op, seconds / 2)))
    curve = sorted(dict(curve).items())  # ascending in FLOPs, one rate per size (interpolation divides by their gaps)
    if dev.type == "cuda":  # small tensors time the launch there: slopes between two large sizes
        timed = lambda fn: quartile_seconds(fn, 5, sync)  # noqa: E731
        activation, norm = gpu_per_element(dev, timed)
        bytes_per_s = gpu_bandwidth(dev, timed)
    else:
        activation, norm = _per_element(dev, sync, forward_op, backward_op)
        u, v = torch.randn(1 << 22, device=dev), torch.empty(1 << 22, device=dev)  # 48 MB: past the caches
        add = quartile_seconds(lambda: torch.add(u, u, out=v), 5, sync)  # into the same buffer: no page faults timed
        bytes_per_s = 3 * u.numel() * u.element_size() / max(add - forward_op, add / 2)
    return DeviceRates(
        device=str(dev),
        forward_op_s=forward_op,
        backward_op_s=backward_op,
        flops_per_s=curve[-1][1],
        bytes_per_s=bytes_per_s,
        flop_curve=tuple(curve),
        activation_s=activation,
        norm_s=norm,
    )


def _per_element(
    dev: torch.device, sync: Callable[[], None], forward_op: float, backward_op: float
) -> tuple[tuple[float, float], tuple[float, float]]:
    """Seconds per element, forward and backward, of GELU and of an affine layer norm on a 256 x 128
    input (a small transformer's activations)."""
    x = torch.randn(256, 128, device=dev, requires_grad=True)
    grad = torch.ones(256, 128, device=dev)
    gamma, beta = torch.ones(128, device=dev, requires_grad=True), torch.zeros(128, device=dev, requires_grad=True)
    out = []
    for op in (torch.nn.functional.gelu, lambda t: torch.nn.functional.layer_norm(t, (128,), gamma, beta)):
        fwd = quartile_seconds(lambda: op(x), 5, sync)
        both = quartile_seconds(lambda: torch.autograd.grad(op(x), x, grad), 5, sync)
        out.append((max(fwd - forward_op, 0.0) / x.numel(), max(both - fwd - backward_op, 0.0) / x.numel()))
    return out[0], out[1]


@functools.lru_cache(maxsize=None)
def concurrent_slowdown(threads: int) -> float:
    """How much longer CPU work takes when ``threads`` Python threads of this process run it at
    once (as the local executor's ranks do) than when one runs it alone: >= 1, measured once.

    The work is matrix multiplies, which release the interpreter lock: what shows up is cores
    shared with other ranks (or other processes) and the memory bus; a core per thread and
    nothing else running gives about 1. (Tiny ops serialise on the interpreter lock as well;
    that part is not modelled.)
    """
    if threads <= 1:
        return 1.0
    import threading

    a, b = torch.randn(256, 256), torch.randn(256, 512)

    def work() -> None:
        for _ in range(100):
            torch.mm(a, b)

    alone = quartile_seconds(work, 3, lambda: None)  # one untimed call, then the least of 3
    together = []
    for _ in range(3):
        pool = [threading.Thread(target=work) for _ in range(threads)]
        start = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        together.append(time.perf_counter() - start)
    return max(1.0, min(together) / alone)


def device_rates(device: str | torch.device = "cpu", largest: Probe | None = None) -> DeviceRates:
    """The rates of ``device`` (``"cpu"``, ``"cuda:0"``, ...) with torch's current thread count;
    ``"meta"`` (a model not built yet) gets the CPU's. ``largest``: the graph's largest matrix
    multiply (:func:`largest_matmul`), which a GPU also measures its FLOP rate on (:func:`probe_points`).

    Measured the first time they are asked for in this process (~0.1 s on a CPU core),
    then remembered.

    >>> r = device_rates("cpu")
    >>> r.flops_per_s > 1e8 and r.bytes_per_s > 1e8 and 0 < r.forward_op_s < 1e-3
    True
    """
    kind = torch.device(device).type
    probes = probe_points(kind, largest)
    return measured_once(lambda dev, threads: _measure(dev, threads, probes), device)


T = TypeVar("T")


def measured_once(measure: Callable[[str, int], T], device: str | torch.device) -> T:
    """``measure(device, threads)`` for ``device`` as a concrete device name (``"meta"``, a model not
    built yet, measured as the CPU; ``"cuda"`` as the current one) and torch's thread count, with the
    user's random number generators left as they were. ``measure`` caches: once per device and process.
    """
    dev = concrete_device(device)
    if dev.type == "meta":  # a model too big to build yet: nothing runs there, so price it as the CPU would
        dev = torch.device("cpu")
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # the user's RNG is untouched
        return measure(str(dev), torch.get_num_threads())
