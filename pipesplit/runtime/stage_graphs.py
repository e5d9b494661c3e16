"""A stage's forward, input-gradient and weight-gradient work as three explicit graphs, each compiled:
what ``Pipeline(..., compile=...)`` runs for the stages of a schedule that splits the backward into
I and W actions (zb_h1, zb_v, dualpipe_v).

The joint graph: ``make_fx`` traces, on fake tensors (nothing real runs, no buffer moves), the
stage's forward followed by ``torch.autograd.grad`` of its outputs with respect to its inputs that
need a gradient and its trainable parameters. Its nodes split three ways:

- **F**: every node that does not depend on an output gradient: the stage's outputs, and the
  values the backward reads (saved for it);
- **I**: what the inputs' gradients need; it also hands W the values W reads from it (the
  gradient at a linear's output feeds both its input's gradient and its weight's);
- **W**: the rest of what the weights' gradients need.

Each part is compiled with the Pipeline's ``torch.compile`` options (through its
:class:`~pipesplit.runtime.compiled.StageCompiler`). At run time a custom autograd function puts F
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
from pipesplit.compat import fake_mode, make_fx
from pipesplit.runtime import cuda_graphs
from pipesplit.runtime.compile_limits import ancestors, failure, unsupported
from pipesplit.runtime.cuda_graphs import Slots, capture_blocker, tensors_in

Run = Callable[..., Any]  # (part graph module, *args) -> its outputs, compiled


@dataclass
class Parts:
    """The three graphs of a stage at one microbatch shape, and how their values line up."""

    forward: fx.GraphModule  # (params, buffers, inputs) -> outputs + saved
    backward_input: fx.GraphModule  # (saved for I, output grads) -> input grads + kept for W
    backward_weight: fx.GraphModule  # (saved for W, kept, output grads) -> weight grads
    num_outputs: int
    differentiable: list[bool]  # per output: a gradient comes back for it
    grad_inputs: list[int]  # positions of the inputs that get a gradient
    saved_i: list[int]  # indices into F's saved values that I reads
    saved_w: list[int]  # ... that W reads
    param_slots: list[tuple[dict[str, Any], str]]  # where F's first inputs are read, each call
    buffer_slots: list[tuple[dict[str, Any], str]]  # then these
    trainable: list[int]  # the parameters W returns gradients for, in order
    # per output: which of grad_inputs / trainable it depends on. An output whose gradient does not come
    # back (a cut that carries none, an output the loss ignores) is not a path: what only it reaches
    # keeps no gradient, as in plain autograd (not the zeros the graphs compute from a zero gradient)
    inputs_by_output: list[set[int]] = field(default_factory=list)
    weights_by_output: list[set[int]] = field(default_factory=list)
    input_ready: bool = False  # I compiled, on the stage's thread (see _prepare_input)

    def params(self) -> list[torch.Tensor]:
        return [slots[name] for slots, name in self.param_slots]

    def buffers(self) -> list[torch.Tensor]:
        return [slots[name] for slots, name in self.buffer_slots]


def _split(joint: fx.GraphModule, num_primals: int, counts: tuple[int, int]) -> tuple[Any, ...] | None:
    """F, I, W graph modules from the joint graph, and which saved values I and W read; None if an
    output depends on an output gradient. The joint's first ``num_primals`` placeholders are F's
    inputs, the rest the output gradients; its flat results are ``counts`` = (outputs, input
    gradients) and then the weights' gradients."""
    graph = joint.graph
    places = [n for n in graph.nodes if n.op == "placeholder"]
    primals, tangents = places[:num_primals], places[num_primals:]
    flat = list(next(n for n in graph.nodes if n.op == "output").args[0])
    outs, in_grads, w_grads = flat[:counts[0]], flat[counts[0]:counts[0] + counts[1]], flat[counts[0] + counts[1]:]
    depends: set[fx.Node] = set(tangents)
    for node in graph.nodes:
        if node.op == "call_function" and any(a in depends for a in node.all_input_nodes):
            depends.add(node)
    if any(isinstance(o, fx.Node) and o in depends for o in outs):
        return None
    i_nodes = {n for n in ancestors(in_grads) if n in depends and n.op != "placeholder"}
    w_nodes = {n for n in ancestors(w_grads) if n in depends and n.op != "placeholder"} - i_nodes
    f_nodes = {n for n in graph.nodes if n.op == "call_function" and n not in depends}
    results_i = {g for g in in_grads if isinstance(g, fx.Node)}
    results_w = {g for g in w_grads if isinstance(g, fx.Node)}

    def read_by(n: fx.Node, part: set[fx.Node], results: set[fx.Node]) -> bool:
        return n in results or any(u in part for u in n.users)

    # F's values (its inputs included: a weight the input gradient multiplies by) that I or W read
    saved = [n for n in graph.nodes if (n in f_nodes or n in primals)
             and (read_by(n, i_nodes, results_i) or read_by(n, w_nodes, results_w))]
    saved_i = [k for k, n in enumerate(saved) if read_by(n, i_nodes, results_i)]
    saved_w = [k for k, n in enumerate(saved) if read_by(n, w_nodes, results_w)]
    kept = [n for n in graph.nodes if n in i_nodes and read_by(n, w_nodes, results_w)]  # I's values W reads

    def build(inputs: list[fx.Node], nodes: set[fx.Node], results: list[Any]) -> fx.GraphModule:
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for k, n in enumerate(inputs):
            env[n] = g.placeholder(f"in_{k}")
            env[n].meta = dict(n.meta)
        for n in graph.nodes:
            if n in nodes and n not in env:
                env[n] = g.node_copy(n, lambda a: env[a])
        g.output(tuple(env[r] if isinstance(r, fx.Node) else r for r in results))
        return fx.GraphModule(joint, g)

    fwd = build(primals, f_nodes, [*outs, *saved])
    bwd_i = build([saved[k] for k in saved_i] + tangents, i_nodes, [*in_grads, *kept])
    bwd_w = build([saved[k] for k in saved_w] + kept + tangents, w_nodes, list(w_grads))
    return fwd, bwd_i, bwd_w, saved_i, saved_w


def build_parts(module: torch.nn.Module, args: Sequence[Any], grad_inputs: list[int]) -> Parts | str:
    """The stage's F/I/W for inputs like ``args`` (``grad_inputs``: the positions that need a
    gradient), or why not."""
    named = list(module.named_parameters())
    params = [p for _, p in named]
    named_buffers = list(module.named_buffers())
    buffers = [b for _, b in named_buffers]
    owners = dict(module.named_modules())

    def slot(name: str, kind: str) -> tuple[dict[str, Any], str]:
        prefix, _, leaf = name.rpartition(".")
        return getattr(owners[prefix], kind), leaf

    trainable = [k for k, p in enumerate(params) if p.requires_grad]

    def leaves_of(xs: Sequence[Any]) -> list[Any]:
        return [x.detach().requires_grad_(True) if k in grad_inputs else x for k, x in enumerate(xs)]

    with fake_mode(), torch.enable_grad():  # which outputs carry a gradient, and their shapes
        outs = tuple(module(*leaves_of(args)))
    if not all(isinstance(o, torch.Tensor) for o in outs) or not all(isinstance(x, torch.Tensor) for x in args):
        return "it takes or returns values that are not tensors"
    differentiable = [o.requires_grad for o in outs]
    shapes = [(o.shape, o.dtype, o.device) for o, d in zip(outs, differentiable) if d]
    tangents = [torch.zeros(s, dtype=dt, device=dev) for s, dt, dev in shapes]

    def joint(p_vals: list[torch.Tensor], b_vals: list[torch.Tensor], xs: list[Any], gs: list[torch.Tensor]) -> Any:
        with torch.enable_grad():
            ps = [p.detach().requires_grad_(k in trainable) for k, p in enumerate(p_vals)]
            leaves = leaves_of(xs)
            state = {**{n: p for (n, _), p in zip(named, ps)}, **{n: b for (n, _), b in zip(named_buffers, b_vals)}}
            got_outs = tuple(torch.func.functional_call(module, state, tuple(leaves)))
            diff = [o for o, d in zip(got_outs, differentiable) if d]
            wanted = [leaves[k] for k in grad_inputs] + [ps[k] for k in trainable]
            got: Sequence[Any] = (torch.autograd.grad(diff, wanted, gs, allow_unused=True)
                                  if diff and wanted else [None] * len(wanted))
            # a tensor the outputs do not reach gets no gradient: None in plain PyTorch (an optimizer
            # skips it; AdamW would decay a zero). The graphs return only the others.
            reached[:] = [g is not None for g in got]
        return [*(o.detach() for o in got_outs), *(g for g in got if g is not None)]

    reached: list[bool] = []  # per wanted tensor (inputs, then weights): does a gradient reach it
    try:
        traced = make_fx(joint, tracing_mode="fake")(params, buffers, list(args), tangents)
    except Exception as e:  # noqa: BLE001 - data-dependent code and the like: the eager split runs it
        return f"tracing its forward and backward failed ({type(e).__name__}: {str(e)[:120]})"
    grad_inputs = [k for k, r in zip(grad_inputs, reached) if r]
    trainable = [k for k, r in zip(trainable, reached[len(reached) - len(trainable):]) if r]
    split = _split(traced, len(params) + len(buffers) + len(args), (len(outs), len(grad_inputs)))
    if split is None:
        return "an output depends on an output gradient"
    fwd, bwd_i, bwd_w, saved_i, saved_w = split
    for part, label in ((fwd, "F"), (bwd_i, "I"), (bwd_w, "W")):
        part.pipesplit_part = label  # the compile log names the part
    places = [n for n in fwd.graph.nodes if n.op == "placeholder"]
    results = list(next(n for n in fwd.graph.nodes if n.op == "output").args[0])[:len(outs)]
    deps = [ancestors([r]) for r in results]
    first_input = len(params) + len(buffers)
    return Parts(fwd, bwd_i, bwd_w, len(outs), differentiable, list(grad_inputs), saved_i, saved_w,
                 [slot(n, "_parameters") for n, _ in named], [slot(n, "_buffers") for n, _ in named_buffers], trainable,
                 [{j for j, k in enumerate(grad_inputs) if places[first_input + k] in d} for d in deps],
                 [{j for j, k in enumerate(trainable) if places[k] in d} for d in deps])


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
    :class:`~pipesplit.runtime.compiled.StageCompiler`, and replayed as CUDA graphs where asked for
    (:mod:`pipesplit.runtime.cuda_graphs`). A stage they cannot take runs its split eager (``split``:
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
              microbatch_size: int, checkpointing: bool, writes_inputs: bool) -> Parts | None:
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

    def deferred(self, parts: Parts, xs: Sequence[Any], microbatch_size: int) -> Deferred:
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

    def runner(self, microbatch_size: int) -> Run:
        compiler, index = self.compiler, self.index

        def run(part: Any, *args: Any, blocking: bool = True) -> Any:
            # plain values in: torch.compile would otherwise differentiate a graph whose inputs require
            # grad (the parameters F reads), which an I graph's backward ops cannot be (torch 2.15)
            plain = [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args]
            with torch.no_grad():
                return compiler.run(part, index, microbatch_size, *plain, blocking=blocking)

        return run


def part_flops(part: fx.GraphModule) -> dict[str, int]:
    """FLOPs of one of a stage's F, I or W graphs as torch's ``FlopCounterMode`` counts them (matrix
    multiplies and convolutions), per op, run on the fake values the trace left on its inputs: what
    the cost model's forward, input-gradient and weight-gradient FLOPs are checked against
    (``tests/test_backward_flops.py``)."""
    from torch.utils.flop_counter import FlopCounterMode

    vals = [n.meta.get("val") for n in part.graph.nodes if n.op == "placeholder"]
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    with mode if mode is not None else fake_mode(), FlopCounterMode(display=False) as counter:
        fx.Interpreter(part).run(*vals)
    return {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}
