"""Zero-bubble's split backward without doing the work twice.

The I action needs the gradients of a stage's inputs; the W action needs those of its
weights. Running W as a second backward from the stage's outputs computes every
activation gradient again (I + W cost 1.6–1.7x one fused backward). Instead, the forward
also returns the outputs of the ops that consume a weight (a ``linear``, an ``embedding``,
a ``layer_norm``...); I asks autograd for the gradients of the stage inputs *and* of those
outputs, and W turns each output's gradient into its weights' gradients through that one
op alone, as torch's ``stage_backward_weight`` does.

Each ``autograd.grad`` call walks the whole graph upstream of its roots before it runs
anything, so W as one call per op cost 1.3x the fused backward's weight work on a small
GPT (29 calls per stage, each ~40-120 µs). For the ops of a transformer (``linear``,
``layer_norm``, ``embedding``) W calls the weight-gradient kernels autograd would call, on
the op's saved input, without the engine: one matrix multiply per ``linear``. Other ops,
and an op whose input is written in place after it, go through autograd as before.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, cast

import torch
import torch.fx as fx

from pipesplit.compat import GROUP_NORM_WEIGHT_GRAD_ALONE_CRASHES, pytree
from pipesplit.meta import is_sparse_lookup
from pipesplit.passes.aliasing import StorageClasses, storage_classes
from pipesplit.passes.annotate.rates import measured_once, quartile_seconds


# What nn.Module keeps about forward hooks: the hooks, and which of them take kwargs or always
# run. FSDP2's fully_shard registers its pre-forward hook with with_kwargs=True.
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")


@dataclass(frozen=True)
class Direct:
    """How W computes one op's weight gradients without autograd: the op, and where each of its
    positional arguments is (``extras[i]`` for a tensor, else the constant)."""

    op: Any  # aten.linear.default, aten.layer_norm.default or aten.embedding.default
    args: tuple[tuple[str, Any], ...]  # ("extra", index) or ("const", value), per positional argument
    aliased: tuple[int, ...]  # the positions that hold weight aliases, in the order W lists the aliases

    def arg(self, i: int, extras: list[torch.Tensor], default: Any = None) -> Any:
        if i >= len(self.args):
            return default
        kind, value = self.args[i]
        return extras[value] if kind == "extra" else value


aten = torch.ops.aten
# Ops whose backward W must not run for the weights alone: torch before 2.15 crashes (a segmentation
# fault, on CPU) in GroupNorm's backward over a channels_last input when its input gradient is not
# asked for. W asks for it too and drops it (one GroupNorm input gradient more per microbatch).
_ALSO_INPUT = {aten.group_norm.default, aten.native_group_norm.default} if GROUP_NORM_WEIGHT_GRAD_ALONE_CRASHES else set()
# per op: the positions that may hold a weight (the rest must be activations or constants)
_DIRECT_WEIGHTS = {aten.linear.default: {1, 2}, aten.layer_norm.default: {2, 3}, aten.embedding.default: {0}}


def _direct_grads(d: Direct, g: torch.Tensor, extras: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per aliased position of ``d``, the gradient of the weight there given the op's output gradient ``g``:
    the kernels autograd's own backward of the op calls, a linear's product taken in the order that
    lays it out as the weight (adding a transposed gradient into ``.grad`` cost 9x a contiguous one)."""
    if d.op is aten.linear.default:
        x = d.arg(0, extras)
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        by = {1: lambda: g2.t().mm(x2), 2: lambda: g2.sum(0)}  # laid out as the weight: adds fast
    elif d.op is aten.layer_norm.default:
        x, shape, w, b = d.arg(0, extras), d.arg(1, extras), d.arg(2, extras), d.arg(3, extras)
        _, mean, rstd = aten.native_layer_norm.default(x, shape, None, None, d.arg(4, extras, 1e-5))
        mask = [False, 2 in d.aliased, 3 in d.aliased]
        _, gw, gb = aten.native_layer_norm_backward.default(g, x, shape, mean, rstd, w, b, mask)
        by = {2: lambda: gw, 3: lambda: gb}
    else:  # embedding
        w, indices = d.arg(0, extras), d.arg(1, extras)
        by = {0: lambda: aten.embedding_dense_backward.default(
            g, indices, w.shape[0], d.arg(2, extras, -1), d.arg(3, extras, False))}
    return [by[i]() for i in d.aliased]


def _direct(node: fx.Node, aliases: list[fx.Node], classes: StorageClasses, derived: dict[fx.Node, set[str]],
            place: Callable[[fx.Node], int]) -> Direct | None:
    """The :class:`Direct` of ``node``, each tensor argument where ``place`` puts it in the extras, or
    None (and nothing placed) where W must go through autograd: another op, keyword arguments, a
    weight where an activation goes, a sparse embedding, an activation whose storage is written
    in place anywhere in the graph, or an output written in place after the op (``h = a(x);
    h.mul_(2)``): the gradient I leaves at that tensor is the last writer's output's, which
    autograd carries back through the writers to the op, and the op's own kernels would not."""
    allowed = _DIRECT_WEIGHTS.get(node.target)  # type: ignore[call-overload]
    if allowed is None or node.kwargs or not _tensor_val(node) or classes.is_written(node):
        return None
    if is_sparse_lookup(node):
        return None
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node) and a in aliases:
            if i not in allowed:
                return None
        elif isinstance(a, fx.Node):
            if i in allowed or a in derived or classes.is_written(a):
                return None
        elif isinstance(a, (list, tuple)) and any(isinstance(v, fx.Node) for v in a):
            return None  # a symbolic size: keep to autograd
    positions = [[i for i, a in enumerate(node.args) if a is alias] for alias in aliases]
    if not aliases or any(len(p) != 1 for p in positions):  # each alias once, as an argument of its own
        return None
    args = tuple(("extra", place(a)) if isinstance(a, fx.Node) else ("const", a) for a in node.args)
    return Direct(node.target, args, tuple(p[0] for p in positions))  # in the order W lists the aliases' gradients


@dataclass
class WeightGraph:
    """A stage module that also returns, per weight-consuming op, its output and the weights it
    consumed, each through an alias of its own (so W reaches the weights through that op alone)."""

    module: fx.GraphModule
    num_outputs: int  # the stage's own outputs come first
    groups: list[tuple[list[int], list[int]]]  # per op: (its outputs, its weight aliases) as indices in the extras
    direct: list[Direct | None]  # per op: how W computes its weight gradients without autograd, if it can
    weights: list[list[torch.Tensor]]  # per op: the weights behind its aliases (each once)
    rest: list[torch.Tensor]  # weights no op covers: W reaches them from the stage outputs, as before
    # per op: activations whose gradient W asks for beside the weights' (and drops): see _ALSO_INPUT
    also: list[list[int]] = field(default_factory=list)


def _tensor_val(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _written_only_in_chain(out: fx.Node, classes: StorageClasses) -> bool:
    """Whether the gradient at ``out``'s tensor object, read after the step, is the gradient of the
    op's output: true unless the storage is written in place while something else still reads an
    earlier value (``h = a(x); early = h.sum(); h.mul_(2)``: ``early``'s share would be lost).
    Safe: never written, or written only by a chain of in-place ops each of which is the sole
    user of the value before it (``bn -> relu_``, ``conv -> add_ -> relu_``)."""
    if not classes.is_written(out):
        return True
    root = classes.root(out)
    writers = {w for w, ws in classes.writes.items() if any(classes.root(x) == root for x in ws)}
    chain, n = set(), out
    while len(n.users) == 1:
        (u,) = n.users
        if u not in writers or n not in classes.writes[u]:
            break
        chain.add(u)
        n = u
    return writers <= chain


def weight_graph(gm: fx.GraphModule) -> WeightGraph | None:
    """``gm`` rewritten to also return its weight consumers' outputs and weight aliases; None if it
    has no weights. A weight both consumed by an op and upstream of that op's activations (a tied
    embedding and head in one stage) is reached by W through the alias only, never twice."""
    params = {t for t, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}  # every alias
    graph = fx.Graph(owning_module=gm)
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    classes = storage_classes(graph)
    derived: dict[fx.Node, set[str]] = {}  # node -> the weights it is a pure function of (views, casts)
    found: list[tuple[fx.Node, set[str]]] = []
    unsafe: set[str] = set()  # weights W must reach from the stage outputs, as before
    for node in list(graph.nodes):
        if node.op == "get_attr" and str(node.target) in params:
            derived[node] = {str(node.target)}
            continue
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        ins = node.all_input_nodes
        used = set().union(*(derived.get(a, set()) for a in ins)) if ins else set()
        if not used:
            continue
        if all(a in derived or a.op == "get_attr" for a in ins):
            derived[node] = used  # a function of weights alone (t(), a cast): keep following
            continue
        outs = [node] if _tensor_val(node) else [u for u in node.users if u.target is operator.getitem]
        if any(classes.is_written(a) for a in ins if a in derived) or not all(_written_only_in_chain(o, classes)
                                                                              for o in outs):
            unsafe |= used  # W must go from the stage outputs: see _written_only_in_chain
            continue
        found.append((node, used))
    returned = set(pytree.tree_leaves(out))  # graph_copy made no output node: what the stage returns
    for node in derived:  # a weight-derived value the stage returns (sent over a cut): reached from the outputs
        if node in returned:
            unsafe |= derived[node]
    # An unsafe weight is reached from the stage outputs (``rest``) and gets no alias in any op: W
    # adding an alias's share on top would count it twice. A tensor derived from it and another
    # weight (a cat of both) makes that other weight unsafe too, or its share there would be lost.
    grown = True
    while grown:
        grown = False
        for node, _ in found:
            for a in node.all_input_nodes:
                if a in derived and derived[a] & unsafe and not derived[a] <= unsafe:
                    unsafe |= derived[a]
                    grown = True
    consumers: list[tuple[fx.Node, list[fx.Node], set[str]]] = []
    for node, _ in found:
        safe = [x for x in dict.fromkeys(node.all_input_nodes) if x in derived and not derived[x] & unsafe]
        if not safe:
            continue
        used = set().union(*(derived[x] for x in safe))
        aliases = []
        for a in safe:
            with graph.inserting_before(node):
                alias = graph.call_function(torch.ops.aten.alias.default, (a,))
            alias.meta = dict(a.meta)
            node.replace_input_with(a, alias)
            aliases.append(alias)
        consumers.append((node, aliases, used))
    extra: list[fx.Node] = []
    groups: list[tuple[list[int], list[int]]] = []
    direct: list[Direct | None] = []
    also: list[list[int]] = []
    targets: list[list[str]] = []
    position: dict[fx.Node, int] = {}  # where a tensor rides in the extras (an activation read by several ops, once)

    def place(n: fx.Node) -> int:
        if n not in position:
            position[n] = len(extra)
            extra.append(n)
        return position[n]

    for node, aliases, used in consumers:
        outs = [node] if _tensor_val(node) else [u for u in node.users if u.target is operator.getitem and _tensor_val(u)]
        first = len(extra)
        extra += outs
        position.update((t, first + k) for k, t in enumerate(outs + aliases))
        extra += aliases
        groups.append((list(range(first, first + len(outs))), list(range(first + len(outs), len(extra)))))
        targets.append(sorted(used))
        direct.append(_direct(node, aliases, classes, derived, place))
        also.append([place(node.args[0])] if node.target in _ALSO_INPUT and isinstance(node.args[0], fx.Node)
                    and node.args[0] not in derived else [])
    if not extra:
        return None
    own = list(out) if isinstance(out, (tuple, list)) else [out]
    graph.output(tuple(own) + tuple(extra))
    graph.lint()
    module = fx.GraphModule(gm, graph, class_name=type(gm).__name__ + "WithWeightInputs")
    for hooks in _HOOK_DICTS:  # the stage's hooks (shared: later ones apply too), with their kwargs flags
        setattr(module, hooks, getattr(gm, hooks))
    get = {t: operator.attrgetter(t)(gm) for g in targets for t in g}
    weights = [list({id(get[t]): get[t] for t in g}.values()) for g in targets]
    covered = {id(p) for g in weights for p in g}
    rest: list[torch.Tensor] = [p for p in gm.parameters() if p.requires_grad and id(p) not in covered]
    return WeightGraph(module, len(own), groups, direct, weights, rest, also)


def input_grads(weights: WeightGraph | None, outputs: list[torch.Tensor], output_grads: list[Any],
                leaves: list[torch.Tensor], extras: list[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """The I action: gradients of ``leaves`` (the stage inputs) and, for W, of the weight ops'
    outputs among ``extras``; keeps the graph. Returns (leaf gradients, gradients by extra)."""
    ops = [i for outs, _ in weights.groups for i in outs if extras[i].requires_grad] if weights else []
    wanted = leaves + [extras[i] for i in ops]
    by_extra: list[Any] = [None] * len(extras)
    if not wanted:
        return [None] * len(leaves), by_extra
    got = torch.autograd.grad(outputs, wanted, output_grads, retain_graph=True, allow_unused=True)
    for i, g in zip(ops, got[len(leaves):]):
        by_extra[i] = g
    return list(got[:len(leaves)]), by_extra


def _plain_leaf(alias: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """The parameter ``alias`` is a plain alias of, if W may add ``grad`` into its ``.grad`` itself as
    autograd's AccumulateGrad would: a dense tensor of the same shape, dtype and device, with no
    hooks that AccumulateGrad would run, and a dense ``grad``. None otherwise (a view, a cast, a
    DTensor, hooks, a sparse gradient)."""
    fn = alias.grad_fn
    if fn is None or len(fn.next_functions) != 1:
        return None
    p = getattr(fn.next_functions[0][0], "variable", None)  # an AccumulateGrad node holds its leaf
    if (p is None or type(p) not in (torch.Tensor, torch.nn.Parameter) or p._backward_hooks
            or getattr(p, "_post_accumulate_grad_hooks", None) is not None or p.layout != torch.strided
            or grad.layout != torch.strided  # a sparse embedding's: AccumulateGrad keeps it sparse
            or grad.shape != p.shape or grad.dtype != p.dtype or grad.device != p.device
            or (p.grad is not None and p.grad.layout != torch.strided)):
        return None
    return cast(torch.Tensor, p)


def _accumulate(p: torch.Tensor, grad: torch.Tensor) -> None:
    """``p.grad += grad``, or ``p.grad = grad`` laid out like ``p`` (autograd's layout contract)."""
    with torch.no_grad():
        if p.grad is None:
            p.grad = grad if grad.stride() == p.stride() else torch.empty_like(p).copy_(grad)
        else:
            p.grad.add_(grad)


def weight_backward(weights: WeightGraph, extras: list[torch.Tensor], grads: Sequence[torch.Tensor | None],
                    outputs: list[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                    accumulate: bool = True) -> None:
    """Accumulate the weights' gradients: each op's output gradient through that op to its weight
    aliases, then through the aliases (views and casts of weights only) into the weights (an
    alias of a plain parameter is added into its ``.grad`` here, without the engine); ``rest``
    (weights no op covers) from the stage outputs, as before. ``accumulate=False`` computes the
    same and drops it (timing without touching ``.grad``)."""

    def into(tensors: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        if accumulate:
            torch.autograd.backward(tensors, grads, inputs=inputs, retain_graph=True)
        else:
            torch.autograd.grad(tensors, inputs, grads, retain_graph=True, allow_unused=True)

    back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weight alias, its gradient through its op alone)
    wanted: dict[int, torch.Tensor] = {}
    for (outs, aliases), d, ps, also in zip(weights.groups, weights.direct, weights.weights,
                                           weights.also or [[]] * len(weights.groups)):
        pairs = [(extras[i], g) for i in outs if (g := grads[i]) is not None]
        if not pairs or not ps:
            continue
        via = [extras[i] for i in aliases]
        alias_grads: Sequence[torch.Tensor | None]
        if d is not None:  # the op's weight-gradient kernels, on its saved input: no walk of the graph
            with torch.no_grad():
                alias_grads = _direct_grads(d, pairs[0][1], extras)
        else:
            extra_inputs = [extras[i] for i in also if extras[i].requires_grad]
            alias_grads = torch.autograd.grad([t for t, _ in pairs], via + extra_inputs, [g for _, g in pairs],
                                              retain_graph=True, allow_unused=True)[:len(via)]
        for t, g in zip(via, alias_grads):
            if g is None:
                continue
            p = _plain_leaf(t, g)
            if p is None:
                back.append((t, g))
            elif accumulate:
                _accumulate(p, g)
        wanted.update((id(p), p) for p in ps)
    if back:  # one pass from every alias to the weights: those paths hold weights only, never activations
        into([t for t, _ in back], [g for _, g in back], list(wanted.values()))
    if weights.rest and outputs:
        into(outputs, output_grads, weights.rest)  # type: ignore[arg-type]


class _TinyBlocks(torch.nn.Module):
    """Linear + layer norm blocks on tiny tensors: the split backward's fixed cost per weight op."""

    def __init__(self, blocks: int, width: int):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(width, width) / width) for _ in range(blocks))
        self.g = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(width)) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w, g in zip(self.w, self.g):
            x = aten.layer_norm.default(aten.linear.default(x, w), [x.shape[-1]], g)
        return x


@functools.lru_cache(maxsize=None)
def _split_overhead(device: str, threads: int) -> float:
    from torch.fx import symbolic_trace

    dev = torch.device(device)
    blocks, width = 16, 8
    gm = symbolic_trace(_TinyBlocks(blocks, width).to(dev))
    for n in gm.graph.nodes:  # what weight_graph reads: tensor values
        if n.op in ("placeholder", "call_function", "get_attr"):
            n.meta["val"] = torch.empty(2, width, device="meta")
    weights = weight_graph(gm)
    assert weights is not None
    x = torch.randn(2, width, device=dev, requires_grad=True)
    params = list(gm.parameters())
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def fused() -> None:
        with torch.enable_grad():
            y = gm(x)
            torch.autograd.grad(y, [x, *params], torch.ones_like(y))

    def split() -> None:
        with torch.enable_grad():
            outs = tuple(weights.module(x))
            y, extras = outs[0], list(outs[1:])
            g = [torch.ones_like(y)]
            _, by_extra = input_grads(weights, [y], g, [x], extras)
            weight_backward(weights, extras, by_extra, [y], g, accumulate=False)

    return max(quartile_seconds(split, 9, sync) - quartile_seconds(fused, 9, sync), 0.0) / len(weights.groups)


def split_overhead_s(device: str | torch.device = "cpu") -> float:
    """Seconds a split backward (I, then W as :func:`weight_backward` runs it) costs per weight op
    over one fused backward, on tiny tensors: its fixed cost, which a FLOP count or a profile of the
    fused ops does not see. Measured once per device and thread count (~20 ms on a CPU core).

    >>> 0 <= split_overhead_s("cpu") < 1e-3
    True
    """
    return measured_once(_split_overhead, device)
