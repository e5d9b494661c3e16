"""Transform: the eval-mode twin of a training-mode stage graph.

A module's mode reaches the training-IR graph as flags of a few ops: dropout's ``train``,
BatchNorm's ``training`` (batch statistics, running stats updated in place) and the
attention kernel's ``dropout_p``. Switching those gives what ``model.eval()`` computes.
Python branches on ``self.training`` were resolved when the model was captured and
cannot be switched; compile from ``model.eval()`` for such models.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.fx as fx

from pipesplit.rng import seed_random_ops, seeded

aten = torch.ops.aten

_DROPOUTS = {aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
             aten.feature_alpha_dropout.default}
_BATCH_NORMS = {aten.batch_norm.default: 5, aten.native_batch_norm.default: 5}
_SDPA = {aten.scaled_dot_product_attention.default}


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


def eval_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with dropout off and BatchNorm on its running statistics.

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
        target = node.target
        if target in _DROPOUTS:
            _set_arg(node, 2, "train", False)
        elif target is aten.native_dropout.default:
            _set_arg(node, 2, "train", False)
        elif target in _BATCH_NORMS:
            _set_arg(node, _BATCH_NORMS[target], "training", False)
        elif target is aten._native_batch_norm_legit.default:
            x, w, b, mean, var, _training, momentum, eps = (list(node.args) + [None] * 8)[:8]
            node.target = aten._native_batch_norm_legit_no_training.default
            node.args = (x, w, b, mean, var, momentum, eps)
            node.kwargs = {}
        elif target in _SDPA:
            _set_arg(node, 4, "dropout_p", 0.0)
    seed_random_ops(new)
    new.lint()
    return new
