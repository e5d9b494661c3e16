"""How ``pipe(x)`` joins each output of the microbatches, read from the graph that computes it.

An output that carries the batch in a dimension of its own is concatenated there
(:func:`~pipesplit.passes.split.generalise.output_batch_dims`). One without a batch dimension
is taken once where it does not depend on a batched input (a table), and otherwise only where
the graph says how: a reduction over the batch of a per-sample value (the batch in exactly one
of its dimensions) splits into per-microbatch parts, followed by element-wise operations that
commute with the join. Everything else is refused by name; nothing is guessed from values.

==================================  ===================================================
the output                          joined from the microbatches' values as
==================================  ===================================================
``sum`` (any dims with the batch's)  their sum
``mean`` over the batch's dim       their mean weighted by the microbatch sizes
``amax``/``amin``/``max``/``min``   their maximum / minimum
``cross_entropy`` / ``nll_loss``,   their mean weighted by each microbatch's count of
mean over integer labels            labels other than ``ignore_index`` (a Hugging Face
                                    causal LM's ``loss`` with -100 labels)
the same, ``reduction="sum"``       their sum
``* c``, ``/ c``, ``-x``            the rule of ``x`` (``c`` batch-independent; a max
``x + c`` for a mean, max or min    or min only by a positive number, negation swaps)
``a + b`` of two sums or two means  the rule they share
==================================  ===================================================
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.fx as fx

from pipesplit.capture import Captured, static_dim

CAT, SAME, SUM, MEAN, MAX, MIN, REFUSE, UNKNOWN = "cat", "same", "sum", "mean", "max", "min", "refuse", "unknown"


@dataclasses.dataclass(frozen=True)
class OutputMerge:
    """How one flat output of the microbatches joins into the whole batch's.

    ``kind``: ``"cat"`` (along ``dim``), ``"same"`` (taken once), ``"sum"``, ``"mean"`` (weighted by
    the microbatch sizes, or by ``counts(*flat_inputs)`` of each microbatch), ``"max"``, ``"min"``,
    ``"refuse"`` (``why`` says what could not be derived) or ``"unknown"`` (a capture at the
    example's batch size cannot tell: the one with a dynamic batch decides).
    """

    kind: str
    dim: int | None = None
    counts: fx.GraphModule | None = None
    why: str = ""


_ATEN = torch.ops.aten
_VIEWS = {"view", "reshape", "_unsafe_view", "clone", "contiguous", "alias", "detach", "squeeze", "unsqueeze",
          "flatten", "lift_fresh_copy", "select", "slice", "permute", "transpose", "t", "numpy_T", "expand"}
_CASTS = {"_to_copy", "to", "type_as"}
_REDUCE = {"sum": SUM, "mean": MEAN, "amax": MAX, "amin": MIN, "max": MAX, "min": MIN}
_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"}
_SWAP = {MAX: MIN, MIN: MAX}


def output_merges(captured: Captured, batch_dims: Sequence[int | None]) -> list[OutputMerge]:
    """Per flat output of ``captured``, how the microbatches' values join (see the module's table).

    ``batch_dims`` are :func:`~pipesplit.passes.split.generalise.output_batch_dims`' answers: a
    dimension to concatenate along, ``None`` (no batch dimension: derived here), ``-1`` (the batch
    not in a dimension of its own, or in two: refused), ``-2`` (unknown until a dynamic capture) or
    ``-3`` (a size chosen by the inputs' values: refused).
    """
    gm = captured.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batched = {n for n, info in zip(placeholders, captured.inputs) if info.batched}
    d = captured.batch_dim
    symbols = {_expr(n.meta["val"].shape[d]) for n in batched
               if isinstance(n.meta.get("val"), torch.Tensor) and static_dim(n.meta["val"].shape[d]) is None}
    rules = _Rules(gm, placeholders, batched, symbols)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    merges = []
    for v, dim in zip(out_node.args[0], batch_dims):
        if dim is not None and dim >= 0:
            merges.append(OutputMerge(CAT, dim))
        elif dim == -2:
            merges.append(OutputMerge(UNKNOWN))
        elif dim == -1:
            merges.append(OutputMerge(REFUSE, why=_unmergeable_why(v, rules)))
        elif dim == -3:  # generalise.DATA_DEPENDENT
            merges.append(OutputMerge(REFUSE, why="it has a size computed from the inputs' values (rows picked by "
                                                  "torch.nonzero or a boolean mask), which no rule joins"))
        elif not isinstance(v, fx.Node) or not rules.depends(v):
            merges.append(OutputMerge(SAME))
        elif captured.static_batch is not None:
            merges.append(OutputMerge(UNKNOWN))  # sizes alone cannot tell (B, B) from (B, D): the dynamic capture
        else:
            merges.append(rules.of(v))
    return merges


def _unmergeable_why(v: Any, rules: "_Rules") -> str:
    val = v.meta.get("val") if isinstance(v, fx.Node) else None
    if isinstance(val, torch.Tensor) and len(rules.batch_dims(val)) > 1:
        return (f"it carries the batch in dimensions {rules.batch_dims(val)} (an in-batch similarity such as "
                "h @ h.T), so each microbatch computes only its own block of it")
    return ("it carries the batch, but not in a dimension of its own (e.g. seq-first rows flattened to "
            "seq * batch)")


class _Rules:
    """Derives a node's merge rule; every node that depends on the batch and is not understood refuses."""

    def __init__(self, gm: fx.GraphModule, placeholders: list[fx.Node], batched: set[fx.Node], symbols: set[Any]):
        self.gm, self.placeholders, self.symbols = gm, placeholders, symbols
        self.free = {x for s in symbols for x in s.free_symbols}
        self._depends: dict[fx.Node, bool] = {}
        for n in gm.graph.nodes:  # topological order
            self._depends[n] = n in batched or any(self._depends.get(a, False) for a in n.all_input_nodes)

    def depends(self, node: Any) -> bool:
        return isinstance(node, fx.Node) and self._depends.get(node, False)

    def batch_dims(self, val: torch.Tensor) -> list[int]:
        """The dimensions of ``val`` whose size involves the batch symbol."""
        return [j for j, s in enumerate(val.shape)
                if static_dim(s) is None and _expr(s).free_symbols & self.free]

    def per_sample_dim(self, node: Any) -> int | None:
        """The one dimension that carries the batch, as ``k * batch`` for a constant k, else None."""
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            return None
        dims = self.batch_dims(val)
        if len(dims) != 1:
            return None
        expr = _expr(val.shape[dims[0]])
        return dims[0] if any((expr / s).is_Integer for s in self.symbols) else None

    def of(self, node: fx.Node) -> OutputMerge:
        if not self.depends(node):
            return OutputMerge(SAME)
        val = node.meta.get("val")
        if node.op != "call_function" or not isinstance(val, torch.Tensor):
            return _refuse("it is not a tensor computed by an operation")
        if self.batch_dims(val):
            return _refuse(f"{node.name} ({_op(node)}) still carries the batch")
        name = _op(node)
        x = node.args[0] if node.args else None
        if name in _VIEWS | _CASTS and self._only_dependent(node) is x and self.batch_dims(x.meta["val"]):  # type: ignore[union-attr]
            return _refuse(f"{node.name} ({name}) takes part of a value that carries the batch without reducing "
                           "over it (a sample picked by position)")
        if name in _VIEWS and self._only_dependent(node) is x:
            return self.of(x)  # type: ignore[arg-type]
        if name in _CASTS and self._only_dependent(node) is x:
            inner = self.of(x)  # type: ignore[arg-type]
            if inner.kind in (SUM, MEAN) and not val.is_floating_point() and x.meta["val"].dtype != val.dtype:  # type: ignore[union-attr]
                return _refuse(f"{node.name} casts a sum or mean to {val.dtype}, which does not commute with adding")
            return inner
        if name in _REDUCE:
            return self._reduction(node, _REDUCE[name])
        if name in _LOSSES:
            return self._loss(node)
        if name == "neg":
            inner = self.of(x)  # type: ignore[arg-type]
            return dataclasses.replace(inner, kind=_SWAP.get(inner.kind, inner.kind))
        if name in ("mul", "div"):
            return self._scaled(node, name)
        if name in ("add", "sub"):
            return self._shifted(node, name)
        return _refuse(f"it is computed by {name} ({node.name}) from values that carry the batch, which "
                       "pipesplit cannot split into per-microbatch parts")

    def _only_dependent(self, node: fx.Node) -> fx.Node | None:
        """The one tensor input that depends on the batch (a size read from it, as a view's shape, is not one)."""
        dep = [a for a in node.all_input_nodes if self.depends(a) and isinstance(a.meta.get("val"), torch.Tensor)]
        return dep[0] if len(dep) == 1 else None

    def _reduction(self, node: fx.Node, kind: str) -> OutputMerge:
        """A reduction over (at least) the batch's dimension of a per-sample value."""
        x = node.args[0]
        j = self.per_sample_dim(x)
        if j is None or self._only_dependent(node) is not x:
            return _refuse(f"{_op(node)} ({node.name}) reduces a value that does not carry the batch in "
                           "exactly one dimension")
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        rank = x.meta["val"].dim()  # type: ignore[union-attr]
        if isinstance(dims, int):
            dims = [dims]
        if dims is not None and not isinstance(dims, (list, tuple)):
            return _refuse(f"{_op(node)} ({node.name}) is not a reduction over dimensions pipesplit can read")
        if dims and j not in {int(k) % rank for k in dims}:
            return _refuse(f"{_op(node)} ({node.name}) reduces other dimensions than the batch's")
        return OutputMerge(kind)

    def _loss(self, node: fx.Node) -> OutputMerge:
        """A classification loss: ``reduction="sum"`` sums; a mean divides by the labels other than ignore_index."""
        args: dict[str, Any] = dict(zip(("input", "target", "weight", "reduction", "ignore_index", "label_smoothing"),
                                        node.args))
        args.update(node.kwargs)
        target, weight = args.get("target"), args.get("weight")
        reduction, ignore = int(args.get("reduction", 1)), int(args.get("ignore_index", -100))
        if (self.per_sample_dim(args.get("input")) is None or self.per_sample_dim(target) is None
                or weight is not None or float(args.get("label_smoothing", 0.0)) != 0.0
                or target.meta["val"].is_floating_point()):  # type: ignore[union-attr]
            return _refuse(f"{_op(node)} ({node.name}) is a loss pipesplit can split only over per-sample "
                           "integer labels, without class weights or label smoothing")
        if reduction == 2:  # torch's Reduction enum: 0 none, 1 mean, 2 sum
            return OutputMerge(SUM)
        if reduction != 1:
            return _refuse(f"{_op(node)} ({node.name}) has reduction {reduction}")
        counts = self._counts(target, ignore)  # type: ignore[arg-type]
        if counts is None:
            return _refuse(f"the labels of {_op(node)} ({node.name}) are computed from the model's state, so "
                           "pipesplit cannot count each microbatch's labels other than ignore_index")
        return OutputMerge(MEAN, counts=counts)

    def _counts(self, target: fx.Node, ignore: int) -> fx.GraphModule | None:
        """A graph from the program's flat inputs to the number of labels other than ``ignore``."""
        needed, todo = set(), [target]
        while todo:
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(n.all_input_nodes)
        if any(n.op not in ("placeholder", "call_function") for n in needed):
            return None
        graph, env = fx.Graph(), {}
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = graph.placeholder(n.name)
            elif n in needed:
                env[n] = graph.node_copy(n, lambda a: env[a])
        kept = graph.call_function(_ATEN.ne.Scalar, (env[target], ignore))
        graph.output(graph.call_function(_ATEN.sum.default, (kept,)))
        return fx.GraphModule(torch.nn.Module(), graph)

    def _scaled(self, node: fx.Node, name: str) -> OutputMerge:
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else None
        if name == "mul" and not self.depends(a):
            a, b = b, a
        if not self.depends(a) or self.depends(b) or node.kwargs:
            return _refuse(f"{node.name} ({name}) {'divides by' if name == 'div' else 'multiplies'} a value computed "
                           "from the batch")
        inner = self.of(a)  # type: ignore[arg-type]
        if inner.kind in (SUM, MEAN, SAME, REFUSE, UNKNOWN):
            return inner
        if isinstance(b, (int, float)) and not isinstance(b, bool) and b != 0:
            return inner if b > 0 else dataclasses.replace(inner, kind=_SWAP[inner.kind])
        return _refuse(f"{node.name} scales a maximum or minimum by a tensor whose sign pipesplit cannot know")

    def _shifted(self, node: fx.Node, name: str) -> OutputMerge:
        """``a + alpha * b`` (``a - alpha * b``): linear in two sums or two means, a shift of one mean, max or min."""
        a, b = node.args[0], node.args[1] if len(node.args) > 1 else None
        alpha: Any = node.kwargs.get("alpha", 1)
        if not isinstance(alpha, (int, float)) or set(node.kwargs) - {"alpha"}:
            return _refuse(f"{node.name} ({name}) scales by a value pipesplit cannot read")
        if self.depends(a) and self.depends(b):
            left, right = self.of(a), self.of(b)  # type: ignore[arg-type]
            for side in (left, right):
                if side.kind in (REFUSE, UNKNOWN):
                    return side
            if left.kind == right.kind and left.kind in (SUM, MEAN) and left.counts is None and right.counts is None:
                return left
            return _refuse(f"{node.name} ({name}) combines a {left.kind} and a {right.kind} over the batch")
        sign = alpha * (-1 if name == "sub" else 1)
        inner, sign = (self.of(a), 1) if self.depends(a) else (self.of(b), sign)  # type: ignore[arg-type]
        if inner.kind == SUM:
            return _refuse(f"{node.name} ({name}) adds a value to a sum over the batch, which each microbatch "
                           "would add once")
        if inner.kind in (MAX, MIN) and sign < 0:
            return dataclasses.replace(inner, kind=_SWAP[inner.kind])
        return inner if sign != 0 else OutputMerge(SAME)


def _expr(size: Any) -> Any:
    """The sympy expression of a symbolic size."""
    return size.node.expr


def _op(node: fx.Node) -> str:
    return str(getattr(node.target, "_opname", getattr(node.target, "__name__", node.target)))


def _refuse(why: str) -> OutputMerge:
    return OutputMerge(REFUSE, why=why)


def run_counts(counts: fx.GraphModule, flat: Sequence[Any]) -> torch.Tensor:
    """Evaluate a merge's counting graph on one microbatch's flat inputs."""
    return counts(*flat)  # type: ignore[no-any-return]

