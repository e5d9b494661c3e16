"""What a GPU's element-wise work and memory traffic cost, measured where a GPU's rates show.

On a CPU an op on a small transformer's activations (256 x 128) shows its per-element cost.
On a GPU it shows the launch and the synchronisation: GELU's backward on 32K elements read
2e-9 s per element on an H100, so a GPT 12x768 stage at seq 512 was priced 62 ms of backward
where it ran in 12 (issue 24). Here every rate is a slope: the time at 16M elements less the
time at 1M, over the 15M elements between, which cancels every fixed cost (launch, sync,
allocation) and leaves what the device spends per element at the sizes a GPU stage runs.
"""

from __future__ import annotations

from typing import Callable

import torch

SMALL, LARGE = 1 << 20, 1 << 24  # elements; float32 tensors of 4 MiB and 64 MiB (past an H100's 50 MB of L2)
_WIDTH = 512


def _slope(time_at: Callable[[int], float]) -> float:
    """Seconds per element: (t(LARGE) - t(SMALL)) / (LARGE - SMALL), never below 0."""
    return max(time_at(LARGE) - time_at(SMALL), 0.0) / (LARGE - SMALL)


def gpu_bandwidth(dev: torch.device, timed: Callable[[Callable[[], object]], float]) -> float:
    """Bytes per second of an add (two reads, one write per element), as a slope."""
    def add(n: int) -> float:
        u, v = torch.randn(n, device=dev), torch.empty(n, device=dev)
        return timed(lambda: torch.add(u, u, out=v))

    return 3 * 4 / max(_slope(add), 1e-15)


def gpu_per_element(dev: torch.device, timed: Callable[[Callable[[], object]], float]
                    ) -> tuple[tuple[float, float], tuple[float, float]]:
    """Seconds per element (forward, backward) of GELU and of an affine layer norm, as slopes."""
    gamma = torch.ones(_WIDTH, device=dev, requires_grad=True)
    beta = torch.zeros(_WIDTH, device=dev, requires_grad=True)
    ops: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (
        torch.nn.functional.gelu, lambda t: torch.nn.functional.layer_norm(t, (_WIDTH,), gamma, beta))
    out = []
    for op in ops:
        def fwd(n: int, op: Callable[[torch.Tensor], torch.Tensor] = op) -> float:
            x = torch.randn(n // _WIDTH, _WIDTH, device=dev)
            return timed(lambda: op(x))

        def both(n: int, op: Callable[[torch.Tensor], torch.Tensor] = op) -> float:
            x = torch.randn(n // _WIDTH, _WIDTH, device=dev, requires_grad=True)
            grad = torch.ones_like(x)
            return timed(lambda: torch.autograd.grad(op(x), x, grad))

        f = _slope(fwd)
        out.append((f, max(_slope(both) - f, 0.0)))
    return out[0], out[1]


_SLOWDOWN: dict[tuple[str, int], float] = {}


def gpu_slowdown(device: str, threads: int) -> float:
    """How much longer each of ``threads`` streams' work takes when they run on one GPU at once
    (as the local executor runs stages placed on the same GPU: a thread and a stream each) than
    when one runs alone: >= 1, measured once per device and count.

    Large kernels fill the GPU, so two streams of them take about twice as long each; small
    ones leave room and overlap. The work is a transformer block's shapes in float32 (a
    1024 x 768 by 768 x 3072 multiply and its GELU), measured, not assumed: 4 stages of a
    GPT 12x768 on one H100 ran each stage's forward 1.5-2x its time alone (issue 24).
    """
    key = (device, threads)
    if threads <= 1:
        return 1.0
    if key in _SLOWDOWN:
        return _SLOWDOWN[key]
    import threading
    import time

    dev = torch.device(device)
    a, b = torch.randn(1024, 768, device=dev), torch.randn(768, 3072, device=dev)
    streams = [torch.cuda.Stream(dev) for _ in range(threads)]

    def work(stream: torch.cuda.Stream) -> None:
        torch.cuda.set_device(dev)  # a new thread has no current device (cuBLAS warns, then guesses)
        with torch.cuda.stream(stream):
            for _ in range(40):
                torch.nn.functional.gelu(torch.mm(a, b))
        stream.synchronize()

    def alone() -> float:
        torch.cuda.synchronize(dev)
        start = time.perf_counter()
        work(streams[0])
        return time.perf_counter() - start

    def together() -> float:
        torch.cuda.synchronize(dev)
        pool = [threading.Thread(target=work, args=(s,)) for s in streams]
        start = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return time.perf_counter() - start

    alone(), together()  # warm up: kernels loaded, the allocator's blocks in place
    _SLOWDOWN[key] = max(1.0, min(together() for _ in range(3)) / min(alone() for _ in range(3)))
    return _SLOWDOWN[key]
