"""Building a stage's forward, input-gradient and weight-gradient graphs (F, I, W) from one trace.

The joint graph: ``make_fx`` traces, on fake tensors (nothing real runs, no buffer moves), the
stage's forward followed by ``torch.autograd.grad`` of its outputs with respect to its inputs that
need a gradient and its trainable parameters. Its nodes split three ways:

- **F**: every node that does not depend on an output gradient: the stage's outputs, and the
  values the backward reads (saved for it);
- **I**: what the inputs' gradients need; it also hands W the values W reads from it (the
  gradient at a linear's output feeds both its input's gradient and its weight's);
- **W**: the rest of what the weights' gradients need.

:mod:`pipesplit.runtime.graphs.stage_graphs` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx

from pipesplit.compat import fake_mode, make_fx
from pipesplit.runtime.graphs.compile_limits import ancestors


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


_NUMBERS = (int, float, bool)


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
    # a size crossing a cut (a length captured dynamic) is a plain number here: the parts are built per
    # microbatch shape, that number among their key, and trace it as the constant it is in that shape
    if not all(isinstance(v, (torch.Tensor, *_NUMBERS)) for v in (*outs, *args)):
        return "it takes or returns values that are neither tensors nor numbers"
    differentiable = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
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
        return [*(o.detach() if isinstance(o, torch.Tensor) else o for o in got_outs), *(g for g in got if g is not None)]

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
