"""A stage's forward, input-gradient and weight-gradient work as three explicit graphs, each compiled:
what ``Pipeline(..., compile=...)`` runs for the stages of a schedule that splits the backward into
I and W actions (zb_h1, zb_v, dualpipe_v), and under every schedule when the stages replay CUDA graphs.
:mod:`pipesplit.runtime.graphs.stage_parts` builds the three graphs (F, I, W) from one joint trace.

Each part is compiled with the Pipeline's ``torch.compile`` options (through its
:class:`~pipesplit.runtime.graphs.compiled.StageCompiler`). At run time a custom autograd function puts F
under the stage's outputs: autograd's backward through the stage runs I and keeps what W needs;
the W action runs W and adds the weights' gradients into ``.grad`` as AccumulateGrad would. A
stage that would need more is left to the eager split (:func:`unsupported` says why): random ops
(pipesplit's per-microbatch streams), writes in place (BatchNorm's statistics), autocast,
checkpointing, sparse gradients, parameter hooks or tensor subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from pipesplit.runtime.graphs import cuda_graphs
from pipesplit.runtime.graphs.compile_limits import failure, unsupported
from pipesplit.runtime.graphs.cuda_graphs import Slots, capture_blocker, tensors_in
from pipesplit.runtime.graphs.stage_parts import Parts, build_parts

Run = Callable[..., Any]  # (part graph module, *args) -> its outputs, compiled


@dataclass
class Deferred:
    """One microbatch's F, I and W: the graphs, how they run, and the values between them."""

    parts: Parts
    run: Run  # (part, *args) -> its outputs, compiled
    anchor: torch.Tensor  # an empty tensor that requires grad: see run_forward
    saved: list[Any] = field(default_factory=list)  # F's, for I and W
    for_w: list[Any] | None = None  # what W takes, once I has run
    live: set[int] = field(default_factory=set)  # the outputs whose gradient came back (set by I)
    finish: Callable[[], None] | None = None  # after W: gives the CUDA graph slot back


class _Explicit(torch.autograd.Function):
    """F under the stage's outputs; its backward is I."""

    @staticmethod
    def forward(ctx: Any, record: Deferred, anchor: torch.Tensor, *xs: Any) -> Any:
        parts = record.parts
        flat = record.run(parts.forward, *parts.params(), *parts.buffers(), *xs)
        outs, record.saved = list(flat[:parts.num_outputs]), list(flat[parts.num_outputs:])
        if not parts.input_ready or getattr(record.run, "needs_input_capture", False):
            _prepare_input(record, outs)
        ctx.record, ctx.num_inputs = record, len(xs)
        ctx.set_materialize_grads(False)  # None for an output no gradient came back for, not zeros
        ctx.out_meta = [(o.shape, o.dtype, o.device) if isinstance(o, torch.Tensor) else None for o in outs]
        fixed = [o for o, d in zip(outs, parts.differentiable) if isinstance(o, torch.Tensor) and not d]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        record = ctx.record
        parts = record.parts
        # contiguous, as they were traced: autograd's formulas call .contiguous() on a gradient where a
        # kernel needs it (GroupNorm's backward), a no-op on the traced zeros that left no trace in I
        # (a transposed gradient from the next stage: an embedding's gradient 122% off, found by the fuzzer)
        tangents = [torch.zeros(meta[0], dtype=meta[1], device=meta[2]) if g is None else _dense(g)
                    for g, meta, d in zip(grads, ctx.out_meta, parts.differentiable) if d]
        saved = record.saved
        # on a GPU this runs on autograd's device thread: it must not wait on the compile gate
        flat = record.run(parts.backward_input, *[saved[k] for k in parts.saved_i], *tangents, blocking=False)
        n = len(parts.grad_inputs)
        record.for_w = [*[saved[k] for k in parts.saved_w], *flat[n:], *tangents]
        record.saved = []
        record.live = {k for k, g in enumerate(grads) if g is not None and parts.differentiable[k]}
        reached = set().union(*(parts.inputs_by_output[k] for k in record.live))
        out: list[Any] = [None] * ctx.num_inputs
        for j, (k, g) in enumerate(zip(parts.grad_inputs, flat[:n])):
            out[k] = g if j in reached else None
        return (None, None, *out)


def _dense(g: torch.Tensor) -> torch.Tensor:
    """``g`` with the strides I was compiled for: row-major, size-1 dimensions included
    (``.contiguous()`` keeps a size-1 dimension's odd stride, and dynamo, which guards strides, would
    recompile I there, on autograd's thread: the second review)."""
    strides, step = [], 1
    for size in reversed(g.shape):
        strides.append(step)
        step *= max(size, 1)
    return g if g.stride() == tuple(reversed(strides)) else g.clone(memory_format=torch.contiguous_format)


def _prepare_input(record: Deferred, outs: Sequence[Any]) -> None:
    """I compiled (and, over a CUDA graph slot, captured) here, on the stage's thread, from output
    gradients of zeros: I writes nothing. On a GPU autograd runs I on its device thread, which must not
    compile there: a compile waits on the gate, whose holder may be a stage tracing its joint graph with
    autograd, on that same thread."""
    parts = record.parts
    zeros = [torch.zeros_like(o, memory_format=torch.contiguous_format)
             for o, d in zip(outs, parts.differentiable) if d]
    record.run(parts.backward_input, *[record.saved[k] for k in parts.saved_i], *zeros)
    parts.input_ready = True


def run_forward(record: Deferred, xs: Sequence[Any]) -> tuple[Any, ...]:
    """The stage's outputs under an autograd node whose backward is I. ``record.anchor``, an empty
    tensor that requires grad, makes autograd run that backward even when no input needs a gradient
    (a first stage's token ids): name it among the tensors a backward differentiates for."""
    return tuple(_Explicit.apply(record, record.anchor, *xs))  # type: ignore[no-untyped-call]


def run_weights(record: Deferred) -> None:
    """W: the weights' gradients from what I kept, added into ``.grad`` as AccumulateGrad does."""
    try:
        _accumulate(record)
    finally:
        if record.finish is not None:
            record.finish()


def _accumulate(record: Deferred) -> None:
    if record.for_w is None:
        return
    parts, taken = record.parts, record.for_w
    record.for_w = None
    grads = record.run(parts.backward_weight, *taken)
    # what W read (an op's several outputs come as a tuple: LayerNorm's backward, run in I, hands W its
    # weight's gradient inside one). A gradient in one of those is copied: over a CUDA graph slot it is
    # the slot's memory, which the next microbatch's I overwrites (the emulation's test: 78-284% off)
    held = {t.untyped_storage().data_ptr() for t in tensors_in(taken)}
    params = parts.params()
    with torch.no_grad():
        reached = set().union(*(parts.weights_by_output[k] for k in record.live))
        handed: set[int] = set()  # storages given to a .grad or a hook in this call
        for j, (p, g) in enumerate(zip([params[k] for k in parts.trainable], grads)):
            if g is None or j not in reached:
                continue
            # a tensor of its own, as AccumulateGrad keeps one: a copy of a gradient that is what W read
            # (the slot's memory, an input), or already another weight's (h * (w1 + w2): one tensor for
            # both, which the next += would add to twice; the second review: 81% off)
            ptr = g.untyped_storage().data_ptr()
            if ptr in held or ptr in handed or not g.is_contiguous():
                g = g.detach().clone(memory_format=torch.contiguous_format)
            handed.add(g.untyped_storage().data_ptr())
            hooks = list((p._backward_hooks or {}).values())
            for hook in hooks:  # a tensor hook (register_hook) sees it first
                changed = hook(g)
                g = g if changed is None else changed
            if p.grad is None:  # a hook may keep what it saw: .grad is then a copy, as AccumulateGrad's
                p.grad = g.detach() if not hooks else g.detach().clone(memory_format=torch.contiguous_format)
            else:
                p.grad += g
            for post in (getattr(p, "_post_accumulate_grad_hooks", None) or {}).values():
                post(p)  # after the gradient is in, as autograd runs it (a tied replica's hands it to its owner)


class StageGraphs:
    """One stage's F/I/W graphs under a Pipeline's ``compile=``: made once per module, trainable set
    and input shapes, each part compiled and run through the Pipeline's
    :class:`~pipesplit.runtime.graphs.compiled.StageCompiler`, and replayed as CUDA graphs where asked for
    (:mod:`pipesplit.runtime.graphs.cuda_graphs`). A stage they cannot take runs its split eager (``split``:
    the schedule splits its backward) or compiled whole, without CUDA graphs; warned once with the reason."""

    def __init__(self, compiler: Any, index: int, split: bool, device: torch.device):
        self.compiler, self.index, self.split, self.device = compiler, index, split, device
        self.built: dict[tuple[Any, ...], Parts | str] = {}
        self.slots: dict[int, Slots | None] = {}  # id(parts) -> its CUDA graph slots (None: not captured)

    def _refused(self, why: str) -> None:
        if self.split:
            self.compiler.warn_eager_stage(self.index, why)
        else:
            self.compiler.warn_no_graphs(self.index, why)

    def parts(self, module: torch.nn.Module, params: Sequence[torch.Tensor], args: Sequence[Any],
              microbatch_size: Any, checkpointing: bool, writes_inputs: bool) -> Parts | None:
        grad_inputs = [i for i, x in enumerate(args) if isinstance(x, torch.Tensor) and x.requires_grad]
        key = (id(module), microbatch_size, tuple(p.requires_grad for p in params), tuple(grad_inputs),
               tuple((tuple(x.shape), x.stride()) if isinstance(x, torch.Tensor) else x for x in args),
               tuple(torch.is_autocast_enabled(kind) for kind in ("cpu", "cuda")))  # autocast: eager
        if key not in self.built:
            why = unsupported(module, params, checkpointing)
            if why is None and writes_inputs:
                why = "it writes its inputs in place"
            if why is not None:
                self.built[key] = why
            else:
                with self.compiler.exclusive():  # make_fx traces: nothing compiled may run meanwhile
                    self.built[key] = build_parts(module, args, grad_inputs)
        found = self.built[key]
        if isinstance(found, str):
            self._refused(found)
            return None
        return found

    def failed(self, parts: Parts, error: Exception) -> None:
        """``parts``' compiled code raised: the stage runs its split eager from now on (warned)."""
        why = f"its compiled graphs failed ({failure(error)})"
        for key, built in list(self.built.items()):
            if built is parts:
                self.built[key] = why
        self._refused(why)

    def deferred(self, parts: Parts, xs: Sequence[Any], microbatch_size: Any) -> Deferred:
        """The record of one microbatch's F, I and W: compiled, over a CUDA graph slot where asked for."""
        run = self.runner(microbatch_size)
        record = Deferred(parts, run, torch.empty(0, device=self.device, requires_grad=True))
        slots = self._slots(parts, xs, run) if self.compiler.graphs else None
        runner = slots.acquire(xs) if slots is not None else None
        if runner is not None:
            record.run, record.finish = runner, runner.release
            runner.bind(record)
        elif slots is not None and not slots.broken:
            self.compiler.warn_no_graphs(self.index, f"more than {cuda_graphs.MAX_SLOTS} microbatches in flight; "
                                         "the others run compiled without them")
        return record

    def _slots(self, parts: Parts, xs: Sequence[Any], run: Run) -> Slots | None:
        if id(parts) not in self.slots:
            backend = cuda_graphs.backend_for(self.device)
            why = capture_blocker(self.device, [*parts.params(), *parts.buffers(), *xs]) if backend else None
            if why is not None:
                self.compiler.warn_no_graphs(self.index, why)
            self.slots[id(parts)] = (Slots(parts, run, backend, self.index, self.compiler.exclusive,
                                           lambda why: self.compiler.warn_no_graphs(self.index, why))
                                     if backend is not None and why is None else None)
            if len(self.slots) > cuda_graphs.MAX_SHAPES:  # each shape's slots hold their graphs' memory: the oldest go
                del self.slots[next(iter(self.slots))]  # (busy ones finish their microbatch first)
        else:
            self.slots[id(parts)] = self.slots.pop(id(parts))  # the most recent last
        return self.slots[id(parts)]

    def runner(self, microbatch_size: Any) -> Run:
        compiler, index = self.compiler, self.index

        def run(part: Any, *args: Any, blocking: bool = True) -> Any:
            # plain values in: torch.compile would otherwise differentiate a graph whose inputs require
            # grad (the parameters F reads), which an I graph's backward ops cannot be (torch 2.15)
            plain = [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
            with torch.no_grad():
                return compiler.run(part, index, microbatch_size, *plain, blocking=blocking)

        return run
