"""Measure each stage's compute time per microbatch, to feed the schedule simulator.

:func:`measure_stage_costs` runs one microbatch through the stages in order and times,
for every stage, the actions the runtime executes (see ``runtime/engine/worker.py``):

- ``forward``: the stage's GraphModule with autograd recording (on the last stage,
  also the loss when a ``loss_fn`` is given);
- ``backward_input`` (I): gradients of the stage's incoming boundary tensors, keeping
  the graph (what a ``BACKWARD_INPUT`` action does; ~0 on a stage whose inputs need no
  gradient, such as token ids);
- ``backward_weight`` (W): gradients of the stage's parameters from the same graph
  (what a ``BACKWARD_WEIGHT`` action does).

The simulator charges a full backward ``B`` (a ``FULL_BACKWARD`` action) ``I + W``. I also
keeps the gradients at the outputs of the ops that consume weights, and W turns them into
weight gradients through those ops alone (``runtime/engine/weight_grads.py``), so I + W is close
to one fused pass (1.06-1.11x on a small GPT at microbatches of 2-16; a W that walked the
graph again from the stage's outputs cost 1.5x). Two cost models:

- ``backward="split"`` (default): I and W as the runtime runs them; right for schedules
  that split the backward (``zb_h1``, ``zb_v``), an overestimate of B for the others;
- ``backward="fused"``: the fused B is timed too and W is reported as ``B - I``, so that
  ``I + W`` is the fused B; right for schedules with full backwards (``gpipe``, ``1f1b``,
  ``interleaved_1f1b``, ``looped_bfs``).

The measurement leaves the program as it found it: gradients are computed with
``torch.autograd.grad`` (nothing accumulates into ``.grad``), buffers updated in place
(BatchNorm statistics) are restored, and the RNG state is forked.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch

from pipesplit.compat import pytree
from pipesplit.errors import PipesplitError
from pipesplit.passes.split.program import SplitProgram
from pipesplit.runtime.engine.microbatch import batch_size, split_microbatches, split_target
from pipesplit.runtime.engine.weight_grads import input_grads, weight_backward, weight_graph
from pipesplit.schedules import StageCost
from pipesplit.deprecation import num_keywords

__all__ = ["measure_stage_costs"]


class _Clock:
    """Time of a block on one device.

    On GPU: CUDA events, synchronised. On CPU: wall time (``perf_counter``), or with
    ``cpu=True`` the process's CPU time (``process_time``), which leaves out the time the
    process waited while other processes held the cores: the quieter measure on a shared
    machine, exact when torch runs one intra-op thread.
    """

    def __init__(self, device: torch.device, cpu: bool = False):
        self.cuda = device.type == "cuda"
        self.device = device
        self.now = time.process_time if cpu else time.perf_counter

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3, out
        start_s = self.now()
        out = fn()
        return self.now() - start_s, out


def _reduce(samples: Sequence[float], how: str) -> float:
    return min(samples) if how == "min" else statistics.median(samples)


@num_keywords  # n_microbatches= must not fall into **example_kwargs
def measure_stage_costs(
    prog: SplitProgram,
    *example_args: Any,
    num_microbatches: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    reduce: str = "median",
    backward: str = "split",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    batch_dim: int = 0,
    clock: str = "wall",
    **example_kwargs: Any,
) -> list[StageCost]:
    """Time every stage's F, I and W on one microbatch; one :class:`StageCost` (seconds) per stage.

    Args:
        prog: the split program (every stage present, i.e. not a rank's ``keep_only`` copy).
        example_args, example_kwargs: a full batch, as passed to ``Pipeline.step``; it is
            cut into ``num_microbatches`` and the first microbatch is timed.
        num_microbatches: how the pipeline will cut the batch (sets the microbatch size).
        repeats: timed runs per stage after ``warmup`` untimed ones.
        reduce: ``"median"`` (default) or ``"min"`` of the repeats.
        backward: ``"split"`` (I and W as separate passes) or ``"fused"`` (``I + W`` is the
            one-pass full backward); see the module docstring.
        loss_fn, target: the pipeline's loss; when given, the last stage's forward
            includes it and its backward starts from it, as in ``Pipeline.step``.
            Without it, backward starts from all-ones output gradients.
        clock: ``"wall"`` (default) or ``"cpu"``: on CPU stages, the process's CPU time
            instead of wall time, so that time spent preempted by other processes is not
            counted (use with ``torch.set_num_threads(1)``: with several intra-op threads
            CPU time adds their times up). CUDA stages are timed by events either way.

    >>> import torch, pipesplit
    >>> from pipesplit.runtime.engine.measure import measure_stage_costs
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    >>> prog = pipesplit.compile(model, torch.randn(4, 16), num_stages=2)
    >>> costs = measure_stage_costs(prog, torch.randn(8, 16), num_microbatches=2, repeats=3)
    >>> len(costs), all(c.forward > 0 for c in costs)
    (2, True)
    """
    if repeats < 1 or warmup < 0:
        raise PipesplitError(f"measure_stage_costs: need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}.")
    if reduce not in ("median", "min"):
        raise PipesplitError(f"measure_stage_costs: reduce must be 'median' or 'min', got {reduce!r}.")
    if backward not in ("split", "fused"):
        raise PipesplitError(f"measure_stage_costs: backward must be 'split' or 'fused', got {backward!r}.")
    if clock not in ("wall", "cpu"):
        raise PipesplitError(f"measure_stage_costs: clock must be 'wall' or 'cpu', got {clock!r}.")
    if any(s.module is None for s in prog.stages):
        raise PipesplitError(
            "measure_stage_costs needs every stage of the program; this one was cut down to one rank's stages "
            "by a distributed Pipeline. Measure before building the Pipeline, or on a fresh compile."
        )
    flat = prog.flatten_inputs(tuple(example_args), example_kwargs, whole_batch=True)
    mb_inputs = split_microbatches(flat, prog.inputs, num_microbatches, batch_dim)[0]
    prog.ensure_batch(int(batch_size(mb_inputs, prog.inputs, batch_dim)))
    mb_target = split_target(target, num_microbatches, batch_dim)[0] if target is not None else None
    prog.sync_tied()

    buffers = [(b, b.detach().clone()) for s in prog.stages for b in s.module.buffers()]
    cuda_devices = sorted({s.device.index or 0 for s in prog.stages if s.device.type == "cuda"})
    costs: list[StageCost] = []
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            values: dict[tuple[str, int], Any] = {}  # (boundary name, source stage) -> value
            for stage in prog.stages:
                costs.append(_measure_stage(
                    prog, stage, mb_inputs, values, repeats, warmup, reduce, backward == "fused", loss_fn, mb_target,
                    clock == "cpu",
                ))
        finally:
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
    return costs


def _measure_stage(
    prog: SplitProgram,
    stage: Any,
    mb_inputs: list[Any],
    values: dict[tuple[str, int], Any],
    repeats: int,
    warmup: int,
    reduce: str,
    fused: bool,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    target: Any,
    cpu_clock: bool,
) -> StageCost:
    device = stage.device
    clock = _Clock(device, cpu_clock)
    is_last = stage.index == prog.num_stages - 1
    bounds_in = {(b.name, b.src): b for b in prog.boundaries if b.dst == stage.index}
    grad_outputs = {b.name for b in prog.boundaries if b.src == stage.index and b.kind == "tensor" and b.requires_grad}
    params = [p for p in stage.module.parameters() if p.requires_grad]

    def to_dev(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) and v.device != device else v

    raw = [to_dev(mb_inputs[where] if kind == "input" else values[(name, where)]) for name, kind, where in stage.inputs]
    wants_grad = [
        kind == "stage" and isinstance(v, torch.Tensor) and bounds_in[(name, where)].requires_grad
        for (name, kind, where), v in zip(stage.inputs, raw)
    ]

    weights = weight_graph(stage.module)  # I then W as the runtime runs them (runtime/engine/weight_grads.py)
    module = weights.module if weights is not None else stage.module
    extras: list[Any] = []

    def forward() -> tuple[list[torch.Tensor], tuple[Any, ...], list[torch.Tensor]]:
        args = [v.detach().requires_grad_(True) if g else v for v, g in zip(raw, wants_grad)]
        leaves = [a for a, g in zip(args, wants_grad) if g]
        with torch.enable_grad():
            outs = tuple(module(*args))
            if weights is not None:
                outs, extras[:] = outs[:weights.num_outputs], list(outs[weights.num_outputs:])
            if is_last and loss_fn is not None:
                tree = pytree.tree_unflatten(prog.assemble_outputs(outs), prog.out_spec)
                return leaves, outs, [loss_fn(tree, target)]
        if is_last:
            roots = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        else:
            roots = [o for n, o in zip(stage.outputs, outs)
                     if n in grad_outputs and isinstance(o, torch.Tensor) and o.requires_grad]
        return leaves, outs, roots

    op_grads: list[Any] = []

    def backward_input(leaves: list[torch.Tensor], roots: list[torch.Tensor], grads: list[torch.Tensor]) -> Any:
        if not roots:
            return None
        got, op_grads[:] = input_grads(weights, roots, grads, leaves, extras)
        return got

    def weight_grads(roots: list[torch.Tensor], grads: list[torch.Tensor]) -> Any:
        if not params or not roots:
            return None
        if weights is None:
            return torch.autograd.grad(roots, params, grads, allow_unused=True)
        weight_backward(weights, extras, op_grads, roots, grads, accumulate=False)
        return None

    def full_backward(leaves: list[torch.Tensor], roots: list[torch.Tensor], grads: list[torch.Tensor]) -> Any:
        if not roots or not (leaves or params):
            return None
        return torch.autograd.grad(roots, leaves + params, grads, allow_unused=True)

    f_t: list[float] = []
    i_t: list[float] = []
    w_t: list[float] = []
    b_t: list[float] = []
    outs: tuple[Any, ...] = ()
    for k in range(warmup + repeats):
        tf, (leaves, outs, roots) = clock(forward)
        grads = [torch.ones_like(r) for r in roots]  # what the next stage would send back
        ti, _ = clock(lambda: backward_input(leaves, roots, grads))
        tw, _ = clock(lambda: weight_grads(roots, grads))
        tb = 0.0
        if fused:
            _, (leaves, _, roots) = clock(forward)
            tb, _ = clock(lambda: full_backward(leaves, roots, grads))
        del leaves, roots, grads
        if k >= warmup:
            f_t.append(tf)
            i_t.append(ti)
            w_t.append(tw)
            b_t.append(tb)
    for name, value in zip(stage.outputs, outs):
        values[(name, stage.index)] = value.detach() if isinstance(value, torch.Tensor) else value
    f, i = _reduce(f_t, reduce), _reduce(i_t, reduce)
    w = max(_reduce(b_t, reduce) - i, 0.0) if fused else _reduce(w_t, reduce)
    return StageCost(f, i, w)
