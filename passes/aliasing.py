"""Storage analysis: which nodes of a graph share storage, and which ops write it in place.

Nodes fall into *storage classes*: a node joins the class of every input its output may
alias. That is read from the op's schema (``view``, ``t``, ``select``, ``detach``, ``to``,
``expand``... mark ``self`` ``Tensor(a)``; in-place and ``out=`` ops mark the written
argument ``Tensor(a!)`` and return it), from ``getitem`` of such an op's list or tuple,
and for higher-order ops from their subgraph. A class is *written* when some op writes
one of its members in place: a ``Tensor(a!)`` argument, the running statistics of
``batch_norm(training=True)`` (whose schema marks no write), or a write inside a
higher-order op's subgraph to one of its operands. Ops it does not know are taken to alias
their inputs and to be impure: the analysis may see sharing that is not there.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
from networkx.utils import UnionFind

from pipesplit.compat import HigherOrderOperator, OpOverload, pytree
from pipesplit.rng import seeded

# Their schema marks no write, but in training they update running_mean/var in place: per op, the
# argument that says so (instance_norm updates them from each instance's statistics, averaged).
BATCH_NORM_OPS = {"batch_norm": "training", "native_batch_norm": "training", "_native_batch_norm_legit": "training",
                  "cudnn_batch_norm": "training", "instance_norm": "use_input_stats"}
# Their schema promises a new tensor, but they return the input itself where they change nothing
# (p == 0, or not training): a later in-place write to the result writes the input.
RETURNS_INPUT_OPS = {"dropout", "alpha_dropout", "feature_dropout", "feature_alpha_dropout"}


def _nodes_in(x: Any) -> list[fx.Node]:
    return [a for a in pytree.tree_leaves(x) if isinstance(a, fx.Node)]


def _schema_arg(node: fx.Node, i: int, name: str) -> Any:
    return node.args[i] if i < len(node.args) else node.kwargs.get(name)


def _may_return_input(node: Any) -> bool:
    """A dropout (``input, p, train``) returns its input itself only where ``p == 0`` or it does not
    train; with both known and ``p > 0`` in training it makes a new tensor. Treating that as an
    alias at run time made a write to the mask's result a write to the input: pipesplit copied the
    input back to the caller, and a stage that had saved the input for its backward failed (the
    fuzzer). The split itself serves both modes and keeps the alias (eval mode returns the input)."""
    p = _schema_arg(node, 1, "p")
    train = _schema_arg(node, 2, "train")
    known = isinstance(p, (int, float)) and not isinstance(p, bool) and isinstance(train, bool)
    return not (known and p > 0 and train)


def _has_tensor(node: fx.Node) -> bool:
    """The node's value holds a tensor (a node without a recorded value may)."""
    if "val" not in node.meta:
        return True
    return any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(node.meta["val"]))


def _attr(root: torch.nn.Module, target: str) -> Any:
    try:
        return operator.attrgetter(target)(root)
    except AttributeError:
        return None


def _subgraph(node: fx.Node) -> tuple[fx.Graph, list[fx.Node]] | None:
    """A higher-order op's single subgraph and the operands its placeholders receive, if it has that form
    (``wrap_with_set_grad_enabled(enabled, gm, *operands)``, ``wrap_with_autocast(..., gm, *operands)``)."""
    root = node.graph.owning_module
    if root is None:
        return None
    modules = {i: _attr(root, str(a.target)) for i, a in enumerate(node.args)
               if isinstance(a, fx.Node) and a.op == "get_attr"}
    subs = [i for i, m in modules.items() if isinstance(m, fx.GraphModule)]
    if len(subs) != 1:
        return None
    graph = modules[subs[0]].graph
    operands = [a for a in node.args[subs[0] + 1:] if isinstance(a, fx.Node)]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if node.kwargs or len(placeholders) != len(operands) or len(operands) != len(node.args[subs[0] + 1:]):
        return None
    return graph, operands


@dataclass
class StorageClasses:
    """Storage classes of one graph (see the module docstring)."""

    find: UnionFind
    writes: dict[fx.Node, list[fx.Node]]  # writing node -> the nodes whose storage it writes
    written: set[Any]  # roots of the written classes
    pure_subgraph: dict[fx.Node, bool]  # higher-order op -> its subgraph writes nothing and draws no random numbers

    def root(self, node: fx.Node) -> Any:
        return self.find[node]

    def is_written(self, node: fx.Node) -> bool:
        """Some op of the graph writes this node's storage in place (before or after it is computed)."""
        return self.find[node] in self.written


def storage_classes(graph: fx.Graph, precise: bool = False) -> StorageClasses:
    """Union the nodes of ``graph`` by shared storage and find every in-place write.

    ``precise``: a dropout whose ``p > 0`` and ``train`` are known does not alias its input (it
    makes a new tensor; only ``p == 0`` or eval mode returns the input itself). The planner's
    analyses keep the default, which holds for both modes of the one split; a stage deciding at
    run time whether its current graph writes an input asks precisely."""
    find = UnionFind()
    writes: dict[fx.Node, list[fx.Node]] = {}
    pure_subgraph: dict[fx.Node, bool] = {}
    hop_outputs: dict[fx.Node, list[list[fx.Node]]] = {}  # higher-order op -> operands each output may alias
    for node in graph.nodes:
        find[node]  # every node is its own class to begin with
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        target = node.target
        aliased: list[fx.Node] = []
        written: list[fx.Node] = []
        if isinstance(target, OpOverload):
            aliased, written = _overload_effects(node, precise)
        elif target is seeded and node.args and isinstance(node.args[0], OpOverload):  # a random op, seeded
            aliased, written = _overload_effects(_Unwrapped(node.args[0], node.args[1:], node.kwargs), precise)
        elif target is operator.getitem and isinstance(node.args[0], fx.Node):
            outputs, index = hop_outputs.get(node.args[0]), node.args[1]
            known = outputs is not None and isinstance(index, int) and -len(outputs) <= index < len(outputs)
            aliased = outputs[index] if known else [node.args[0]]  # type: ignore[index]
        elif isinstance(target, HigherOrderOperator):
            per_output, written, pure_subgraph[node] = _hop_effects(node)
            if per_output is None:  # a layout not understood: it may alias every operand
                aliased = node.all_input_nodes
            else:
                hop_outputs[node] = per_output  # its getitems join these; a tuple holds no storage
                if isinstance(node.meta.get("val"), torch.Tensor):
                    aliased = [o for outs in per_output for o in outs]
        elif node.op == "call_method":
            aliased = _nodes_in(node.args[:1])
            if isinstance(target, str) and target.endswith("_") and not target.startswith("__"):
                written = aliased
        elif node.op == "call_module" or not _is_plain_function(target):
            aliased = node.all_input_nodes
        if _has_tensor(node):
            for a in aliased:
                find.union(node, a)
        if written:
            writes[node] = written
    written_roots = {find[w] for ws in writes.values() for w in ws}
    return StorageClasses(find, writes, written_roots, pure_subgraph)


@dataclass
class _Unwrapped:
    """A random op routed through :func:`pipesplit.rng.seeded`, seen as the op it calls."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _overload_effects(node: Any, precise: bool = False) -> tuple[list[fx.Node], list[fx.Node]]:
    """What an aten (or custom) op's schema says: the inputs its output may alias, and those it writes."""
    schema = node.target._schema
    aliased: list[fx.Node] = []
    written: list[fx.Node] = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None:
            args = _nodes_in(_schema_arg(node, i, a.name))
            aliased += args
            if a.alias_info.is_write:
                written += args
    if schema.name.split("::")[-1] in RETURNS_INPUT_OPS and (not precise or _may_return_input(node)):
        aliased += _nodes_in(node.args[:1])
    flag = BATCH_NORM_OPS.get(schema.name.split("::")[-1])
    if flag is not None:
        index = {a.name: i for i, a in enumerate(schema.arguments)}
        if flag in index and _schema_arg(node, index[flag], flag):
            for stat in ("running_mean", "running_var"):
                if stat in index:
                    written += _nodes_in(_schema_arg(node, index[stat], stat))
    return aliased, written


def _hop_effects(node: fx.Node) -> tuple[list[list[fx.Node]] | None, list[fx.Node], bool]:
    """A higher-order op through its subgraph: the operands each output may alias (None: layout
    unknown), the operands it writes, and whether the subgraph is pure."""
    sub = _subgraph(node)
    if sub is None:  # assume the worst
        return None, node.all_input_nodes, False
    graph, operands = sub
    inner = storage_classes(graph)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    written = [o for p, o in zip(placeholders, operands) if inner.is_written(p)]
    out = next(n for n in graph.nodes if n.op == "output")
    per_output = [
        [o for p, o in zip(placeholders, operands) if inner.root(p) == inner.root(r)] if isinstance(r, fx.Node) else []
        for r in pytree.tree_leaves(out.args[0])
    ]
    pure = not inner.written and all(pure_op(n, inner) for n in graph.nodes if n.op == "call_function")
    return per_output, written, pure


def written_operand(node: fx.Node) -> fx.Node | None:
    """For ``getitem(block, i)`` of a higher-order op whose output ``i`` is one of its operands written
    in place (``with torch.no_grad(): w.clamp_(...)`` hands back ``w`` itself): that operand. The value
    is the operand's own tensor, so it carries the operand's gradient even out of a no-grad block."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return None
    block, i = node.args[0], node.args[1]
    sub = _subgraph(block) if block.op == "call_function" else None
    if sub is None or not isinstance(i, int):
        return None
    graph, operands = sub
    outs = pytree.tree_leaves(next(n for n in graph.nodes if n.op == "output").args[0])
    v = outs[i] if i < len(outs) else None
    while isinstance(v, fx.Node) and v.op == "call_function" and isinstance(v.target, OpOverload) and v.args:
        aliased, written = _overload_effects(v)
        if v.args[0] not in written or v.args[0] not in aliased:
            return None
        v = v.args[0]  # an in-place op returns the tensor it wrote
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    return operands[placeholders.index(v)] if isinstance(v, fx.Node) and v in placeholders else None


def _is_plain_function(target: Any) -> bool:
    """Python functions of the graph on sizes and scalars (``operator.mul``, ``math.ceil``...)."""
    return getattr(target, "__module__", None) in ("_operator", "operator", "math", "builtins")


def pure_op(node: fx.Node, classes: StorageClasses) -> bool:
    """The op is a function of its inputs alone: it writes nothing in place, draws no random
    numbers, has no other side effect, and (a higher-order op) neither does its subgraph."""
    if node.op != "call_function" or node in classes.writes:
        return False
    target = node.target
    if isinstance(target, OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags:
            return False
        return _is_check(target) or not node.is_impure()
    if isinstance(target, HigherOrderOperator):
        return classes.pure_subgraph.get(node, False) and not node.is_impure()
    return target is operator.getitem or _is_plain_function(target)


def _is_check(op: OpOverload) -> bool:
    """An assertion (``_assert_tensor_metadata``, ``_assert_scalar``...): kept by dead-code
    elimination as a side effect, but running it again changes nothing."""
    name = op._schema.name.split("::")[-1]
    return not op._schema.is_mutable and (name.startswith("_assert") or name.startswith("sym_constrain_range"))


def written_get_attrs(graph: fx.Graph, classes: StorageClasses | None = None) -> set[str]:
    """Targets of the ``get_attr`` nodes whose storage some op writes in place, directly or through views."""
    classes = classes or storage_classes(graph)
    return {str(n.target) for n in graph.nodes if n.op == "get_attr" and classes.is_written(n)}


def ordering_edges(nodes: Iterable[fx.Node], classes: StorageClasses | None = None) -> list[tuple[fx.Node, fx.Node]]:
    """Edges that keep every in-place write in program order with every other access to its storage.

    An access to a written class is a member of it or an op that reads a member. Walking
    the accesses in program order, each write follows the previous write and every access
    since it, and each access follows the last write before it. Only edges between
    ``nodes`` are returned; they all point forward in program order.
    """
    members = list(nodes)
    if not members:
        return []
    graph = members[0].graph
    classes = classes or storage_classes(graph)
    if not classes.written:
        return []
    keep = set(members)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    accesses: dict[Any, set[fx.Node]] = {}
    writers: dict[Any, set[fx.Node]] = {}
    for w, targets in classes.writes.items():
        for t in targets:
            writers.setdefault(classes.root(t), set()).add(w)
    for node in graph.nodes:
        root = classes.root(node)
        if root not in classes.written:
            continue
        group = accesses.setdefault(root, set())
        group.update(u for u in [node, *node.users] if u in keep)
    for root, group in accesses.items():
        group.update(w for w in writers.get(root, ()) if w in keep)
    edges: list[tuple[fx.Node, fx.Node]] = []
    for root, group in accesses.items():
        last_write: fx.Node | None = None
        since: list[fx.Node] = []
        for a in sorted(group, key=pos.__getitem__):
            if last_write is not None:
                edges.append((last_write, a))
            if a in writers.get(root, ()):
                edges.extend((r, a) for r in since)
                last_write, since = a, []
            else:
                since.append(a)
    return edges


def inplace_inputs(graph: fx.Graph, precise: bool = False) -> set[str]:
    """Names of the placeholders whose storage the graph writes in place (directly or through a view);
    ``precise``: as this graph's mode runs it (see :func:`storage_classes`)."""
    classes = storage_classes(graph, precise)
    return {n.name for n in graph.nodes if n.op == "placeholder" and classes.is_written(n)}
