"""Transform: the eval-mode twin of a training-mode stage graph.

A module's mode reaches the training-IR graph only as arguments of the ops it calls, and
ATen names them alike: ``train`` (dropout and its variants, the RNNs' inter-layer dropout),
``training`` (batch norm, RReLU), ``use_input_stats`` (instance norm) and ``dropout_p``
(the attention kernels). The twin is found from each op's schema, not from a list of ops,
so every ATen op whose result depends on the mode is switched: what ``model.eval()`` computes.
A norm without running statistics (``track_running_stats=False``) keeps using the batch's,
as ``model.eval()`` does. Python branches on ``self.training`` were resolved when the model
was captured and cannot be switched; compile from ``model.eval()`` for such models. A flag
the model's code fixes itself (``F.dropout(x, training=True)``) looks the same in the graph
as one that follows ``self.training``, and is switched too.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.fx as fx

from pipesplit.compat import OpOverload
from pipesplit.rng import seed_random_ops, seeded

aten = torch.ops.aten

# schema argument name -> its value in eval mode
_EVAL_VALUES: dict[str, object] = {"train": False, "training": False, "use_input_stats": False, "dropout_p": 0.0}


def _arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _set_arg(node: fx.Node, index: int, name: str, value: object) -> None:
    if len(node.args) > index:
        args: list[Any] = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, name: cast(Any, value)}


def _counts_batches(node: fx.Node) -> bool:
    """BatchNorm's ``num_batches_tracked += 1``, which only training mode runs."""
    if node.target is not aten.add_.Tensor or not node.args:
        return False
    buf = node.args[0]
    return isinstance(buf, fx.Node) and buf.op == "get_attr" and str(buf.target).endswith("num_batches_tracked")


def mode_arguments(node: fx.Node) -> list[tuple[int, str]]:
    """(position, name) of each argument of ``node``'s op that carries the module's mode, where the
    op is one whose result depends on it (a norm with running statistics to use instead)."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, OpOverload):
        return []
    schema = op._schema.arguments
    names = [a.name for a in schema]
    if "momentum" in names and ("running_mean" not in names  # a norm: batch_norm's no_stats overload
                                or _arg(node, names.index("running_mean"), "running_mean") is None):
        return []  # no running statistics: the batch's are used in eval mode too
    return [(i, a.name) for i, a in enumerate(schema) if a.name in _EVAL_VALUES]


def _switch(node: fx.Node) -> None:
    if node.target is aten._native_batch_norm_legit.default:  # its eval form is another op
        x, w, b, mean, var, _training, momentum, eps = (list(node.args) + [None] * 8)[:8]
        node.target = aten._native_batch_norm_legit_no_training.default
        node.args, node.kwargs = (x, w, b, mean, var, momentum, eps), {}
        return
    for index, name in mode_arguments(node):
        _set_arg(node, index, name, _EVAL_VALUES[name])


def eval_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` as ``model.eval()`` runs it: no dropout, norms on their running
    statistics, which it leaves unchanged.

    Random ops routed through :func:`pipesplit.rng.seeded` are unwrapped first and
    routed again afterwards, so ops that stop being random run directly.
    """
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    for node in list(new.nodes):
        if node.op != "call_function":
            continue
        if node.target is seeded:
            node.target, node.args = node.args[0], node.args[1:]
        if _counts_batches(node):
            node.replace_all_uses_with(node.args[0])
            new.erase_node(node)
            continue
        _switch(node)
    seed_random_ops(new)
    new.lint()
    return new


def eval_module(base: fx.GraphModule, class_name: str) -> fx.GraphModule:
    """``base``'s eval twin (same tensors), with the bodies of its higher-order ops switched too."""
    twin = fx.GraphModule(base, eval_graph(base.graph), class_name=class_name)
    for node in twin.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = str(node.target).rpartition(".")
            parent = twin.get_submodule(owner) if owner else twin
            body = getattr(parent, name)
            if isinstance(body, fx.GraphModule):
                setattr(parent, name, eval_module(body, type(body).__name__))
    return twin
