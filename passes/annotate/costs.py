"""Cost annotation pass: FLOPs (forward, input-grad, weight-grad) and bytes per node."""

from __future__ import annotations

import operator
import logging
from collections import Counter
from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.fx as fx

from pipesplit.compat import data_dependent, pytree
from pipesplit.meta import NodeCost, node_cost, set_node_cost
from pipesplit.passes.aliasing import storage_classes, written_operand
from pipesplit.passes.annotate.flops import OpFlops, hint, op_flops, op_name

log = logging.getLogger(__name__)

_SCALAR_TYPES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool, type(None))


def _bytes(val: Any) -> int:
    total = 0
    for leaf in pytree.tree_leaves(val):
        if isinstance(leaf, torch.Tensor):
            n = 1
            for d in leaf.shape:
                n *= hint(d)
            total += n * leaf.element_size()
    return total


def _is_sendable(val: Any) -> bool:
    """Tensors, sizes and scalars may cross a stage boundary; tuples and lists may not, nor a value whose
    size is computed from the inputs' values (``torch.nonzero``'s rows): a receiver sizes its buffer from
    the batch size alone."""
    return isinstance(val, (torch.Tensor,) + _SCALAR_TYPES) and not data_dependent(val)


def _subgraph_flops(gm: fx.GraphModule, node: fx.Node) -> OpFlops | None:
    """FLOPs of a higher-order op (e.g. ``wrap_with_set_grad_enabled``): its body's sum."""
    bodies = [a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    subs = [operator.attrgetter(str(b.target))(gm) for b in bodies]
    subs = [s for s in subs if isinstance(s, fx.GraphModule)]
    if not subs:
        return None
    fwd = 0
    for sub in subs:
        for inner in sub.graph.nodes:
            if inner.op == "call_function":
                f = op_flops(inner)
                fwd += f.fwd if f else 0
    return OpFlops(fwd, {})


def annotate_costs(gm: fx.GraphModule, inputs_require_grad: Sequence[bool] = ()) -> fx.GraphModule:
    """Write a :class:`~pipesplit.meta.NodeCost` into every node's meta; returns ``gm``.

    Gradient work of an operand counts as *weight-gradient* FLOPs when the operand
    derives from parameters alone, and *input-gradient* FLOPs when it depends on the
    program's inputs; operands that need no gradient cost nothing backward, nor do
    values behind a ``detach`` or a ``no_grad`` block, whose gradient never flows.

    >>> import torch
    >>> from pipesplit.capture import capture
    >>> cap = capture(torch.nn.Linear(8, 4), torch.randn(2, 8))
    >>> gm = annotate_costs(cap.gm)
    >>> [node_cost(n).fwd_flops for n in gm.graph.nodes if n.op == "call_function"]
    [136]
    """
    needs_grad: dict[fx.Node, bool] = {}
    from_input: dict[fx.Node, bool] = {}
    requires = iter(inputs_require_grad)
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            needs_grad[node] = bool(next(requires, False))
            from_input[node] = True
            set_node_cost(
                node, NodeCost(out_bytes=_bytes(val), sendable=_is_sendable(val), requires_grad=needs_grad[node])
            )
            continue
        if node.op == "get_attr":
            obj = operator.attrgetter(str(node.target))(gm)
            is_tensor = isinstance(obj, torch.Tensor)
            needs_grad[node] = is_tensor and obj.requires_grad
            from_input[node] = False
            nbytes = obj.numel() * obj.element_size() if is_tensor else 0
            set_node_cost(node, NodeCost(param_bytes=nbytes, trainable=needs_grad[node]))
            continue
        if node.op == "output":
            set_node_cost(node, NodeCost())
            continue
        inputs = node.all_input_nodes
        floating = any(
            isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in pytree.tree_leaves(val)
        )
        passed = written_operand(node)  # a block's in-place write hands back the tensor itself
        if passed is not None:
            needs_grad[node] = needs_grad.get(passed, False)
        else:
            needs_grad[node] = floating and not stops_grad(node) and any(needs_grad.get(a, False) for a in inputs)
        from_input[node] = any(from_input.get(a, False) for a in inputs)
        flops = op_flops(node) if node.op == "call_function" else None
        if flops is None and node.op == "call_function":
            flops = _subgraph_flops(gm, node)
        known = flops is not None
        if flops is None:  # reported by unknown_ops(); weighted by output size meanwhile
            n = _bytes(val) // 4
            flops = OpFlops(n, {i: n for i, a in enumerate(node.args) if isinstance(a, fx.Node)})
        igrad = wgrad = 0
        if needs_grad[node]:
            for i, f in flops.grads.items():
                arg = node.args[i] if i < len(node.args) else None
                operands = arg if isinstance(arg, (list, tuple)) else [arg]
                for a in operands:
                    if isinstance(a, fx.Node) and needs_grad.get(a, False):
                        if from_input.get(a, False):
                            igrad += f
                        else:
                            wgrad += f
        set_node_cost(
            node,
            NodeCost(
                fwd_flops=int(flops.fwd),
                igrad_flops=int(igrad),
                wgrad_flops=int(wgrad),
                out_bytes=_bytes(val),
                sendable=_is_sendable(val),
                requires_grad=needs_grad[node],
                known=known,
            ),
        )
    _mark_new_storage(gm)
    _mark_loss_inputs(gm)
    reached = _gradient_reaches(gm, needs_grad)
    for node, needs in needs_grad.items():
        if needs and node not in reached and node.op != "get_attr":  # its gradient is never computed
            set_node_cost(node, replace(node_cost(node), igrad_flops=0, wgrad_flops=0, requires_grad=False))
    return gm


def _mark_loss_inputs(gm: fx.GraphModule) -> None:
    """``loss_elements`` on the nodes that make the model's floating-point outputs: a loss reads
    every output element once forward and once backward. Issue 24 measured on an H100: 4 stages of a
    GPT 12x768 with an 8192-word vocabulary, the last stage's backward 14 ms where the others' took
    6-7, the head and the cross-entropy the plan did not count."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in dict.fromkeys(a for a in pytree.tree_leaves(output.args) if isinstance(a, fx.Node)):
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and val.is_floating_point():
            n = 1
            for d in val.shape:
                n *= hint(d)
            set_node_cost(node, replace(node_cost(node), loss_elements=n))


def _mark_new_storage(gm: fx.GraphModule) -> None:
    """``held_bytes``: a node's ``out_bytes`` if it is the first of its storage class (the tensors
    sharing storage: a base, its views, the in-place writes to it), else 0; 0 as well for a class
    holding a parameter or an input, which the stage holds anyway. Summing out_bytes counted a
    GPT block's q, k and v (views of one linear's output) and their transposes again: 583 MiB for
    an 8x512 GPT at batch 4 where autograd saves 292 MiB; counting each storage once gives 327."""
    classes = storage_classes(gm.graph)
    external = {classes.root(n) for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")}
    counted: set[Any] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        root = classes.root(node)
        c = node_cost(node)
        held = 0 if root in external or root in counted else c.out_bytes
        counted.add(root)
        if held != c.held_bytes:
            set_node_cost(node, replace(c, held_bytes=held))


def stops_grad(node: fx.Node) -> bool:
    """The node's value carries no gradient: a detach, or a block run under ``no_grad``."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
        return not node.args[0]
    return op_name(node.target) == "detach"


def _gradient_reaches(gm: fx.GraphModule, needs_grad: dict[fx.Node, bool]) -> set[fx.Node]:
    """Nodes whose gradient backward computes: some path to an output carries it."""
    reached: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):
        if node.op == "output" or node in reached:
            reached.update(a for a in node.all_input_nodes if needs_grad.get(a, False))
    return reached


def unknown_ops(gm: fx.GraphModule) -> dict[str, int]:
    """Ops without a FLOP formula, with how many nodes use each (costed by output size)."""
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output") and not node_cost(node).known:
            counts[op_name(node.target) if node.op == "call_function" else str(node.target)] += 1
    return dict(counts)
