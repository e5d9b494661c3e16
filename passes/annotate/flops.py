"""FLOP formulas per aten op from the shapes stored on graph nodes.

Each formula returns the forward FLOPs and, per operand position, the FLOPs of
computing that operand's gradient. The cost pass turns operand gradients into
input-gradient or weight-gradient work, depending on where the operand comes from.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence, cast

import torch
import torch.fx as fx

from pipesplit.compat import OpOverload, OpOverloadPacket, hint_at



@dataclass(frozen=True)
class OpFlops:
    """Forward FLOPs and gradient FLOPs per operand position (``node.args`` index)."""

    fwd: int
    grads: dict[int, int] = field(default_factory=dict)


# the sizes the symbols of a dynamic capture take while one pricing runs (at_sizes); empty: the example's
_SIZES: contextvars.ContextVar[Mapping[Any, int]] = contextvars.ContextVar("pipesplit_sizes", default={})


@contextlib.contextmanager
def at_sizes(sizes: Mapping[Any, int]) -> Iterator[None]:
    """Within the block, :func:`hint` (every FLOP and byte count) reads the symbols ``sizes`` names
    (``{s1: 128}``: a length captured dynamic) at those sizes instead of the example's."""
    token = _SIZES.set(dict(sizes))
    try:
        yield
    finally:
        _SIZES.reset(token)


def hint(x: Any) -> int:
    """A concrete int for a possibly symbolic size: the example's value, or the size :func:`at_sizes` gives."""
    if isinstance(x, int):
        return x
    return hint_at(x, _SIZES.get())


def shape_of(x: Any) -> tuple[int, ...] | None:
    val = x.meta.get("val") if isinstance(x, fx.Node) else x
    if isinstance(val, torch.Tensor):
        return tuple(hint(d) for d in val.shape)
    return None


def numel_of(x: Any) -> int:
    s = shape_of(x)
    return math.prod(s) if s is not None else 0


def _out(node: fx.Node) -> tuple[int, ...]:
    return shape_of(node) or ()


def _linear(node: fx.Node) -> OpFlops:
    x, w = node.args[0], node.args[1]
    out_f, in_f = shape_of(w) or (0, 0)
    rows = numel_of(x) // max(in_f, 1)
    mm = 2 * rows * in_f * out_f
    grads = {0: mm, 1: mm}
    bias = node.args[2] if len(node.args) > 2 else None
    if bias is not None:
        grads[2] = rows * out_f
    return OpFlops(mm + (rows * out_f if bias is not None else 0), grads)


def _matmul(node: fx.Node) -> OpFlops:
    a = node.args[0]
    k = (shape_of(a) or (1,))[-1]
    mm = 2 * math.prod(_out(node)) * k
    return OpFlops(mm, {0: mm, 1: mm})


def _addmm(node: fx.Node) -> OpFlops:  # addmm/baddbmm(bias, a, b)
    k = (shape_of(node.args[1]) or (1,))[-1]
    n = math.prod(_out(node))
    return OpFlops(2 * n * k + n, {0: n, 1: 2 * n * k, 2: 2 * n * k})


def _einsum(node: fx.Node) -> OpFlops:
    """Pairwise contractions left to right, as ``torch.einsum`` runs them.

    An index that appears in one operand only (and not in the output) is summed out
    first, which costs no multiply-adds; each contraction then costs 2 FLOPs per
    point of the union of its two operands' indices.
    """
    equation, operands = str(node.args[0]).replace(" ", ""), cast(Sequence[fx.Node], node.args[1])
    lhs, arrow, rhs = equation.partition("->")
    terms = [t.replace("...", ".") for t in lhs.split(",")]  # "." stands for the ellipsis dims
    sizes: dict[str, int] = {}
    for term, op in zip(terms, operands):
        shape = shape_of(op) or ()
        if "." in term:
            head, tail = term.index("."), len(term) - term.index(".") - 1
            sizes["."] = max(sizes.get(".", 1), math.prod(shape[head : len(shape) - tail]))
            shape = shape[:head] + shape[len(shape) - tail :]
        for letter, d in zip(term.replace(".", ""), shape):
            sizes[letter] = max(sizes.get(letter, 1), d)
    letters = [set(t) for t in terms]
    if arrow:
        out = set(rhs.replace("...", "."))
    else:  # implicit output: the indices that appear once, and the ellipsis
        flat = "".join(terms)
        out = {c for c in flat if flat.count(c) == 1 or c == "."}
    kept = [s & out.union(*letters[:i], *letters[i + 1 :]) for i, s in enumerate(letters)]
    acc, total = kept[0], 0
    for i in range(1, len(kept)):
        union = acc | kept[i]
        total += 2 * math.prod(sizes[c] for c in union)
        acc = union & out.union(*kept[i + 1 :])
    return OpFlops(total, {1: total})


def _conv(node: fx.Node, transposed: bool | None = None) -> OpFlops:
    x, w = node.args[0], node.args[1]
    wshape = shape_of(w) or (0, 0)
    args = list(node.args)
    if transposed is None:  # aten.convolution carries the flag
        transposed = bool(args[6]) if len(args) > 6 else False
    kernel = math.prod(wshape[2:])
    if transposed:
        mm = 2 * numel_of(x) * wshape[1] * kernel
    else:
        mm = 2 * math.prod(_out(node)) * wshape[1] * kernel
    grads = {0: mm, 1: mm}
    if len(args) > 2 and args[2] is not None:
        grads[2] = math.prod(_out(node))
    return OpFlops(mm, grads)


def _sdpa(node: fx.Node) -> OpFlops:
    q, k, v = (shape_of(a) or (0, 0) for a in node.args[:3])
    batch = math.prod(q[:-2])
    length, e, s, ev = q[-2], q[-1], k[-2], v[-1]
    qk, av = 2 * batch * length * s * e, 2 * batch * length * s * ev
    # dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q: backward is twice the forward.
    return OpFlops(qk + av, {0: av + qk, 1: qk, 2: av})


def _grouped_mm(node: fx.Node) -> OpFlops:
    a, b = shape_of(node.args[0]) or (0, 0), shape_of(node.args[1]) or (0, 0)
    mm = 2 * math.prod(a) * b[-1]
    return OpFlops(mm, {0: mm, 1: mm})


def _embedding(node: fx.Node) -> OpFlops:
    return OpFlops(0, {0: math.prod(_out(node))})  # weight grad: a scatter-add


def _scaled(fwd: int, bwd: int) -> Callable[[fx.Node], OpFlops]:
    """FLOPs proportional to the first operand's size (norms, softmax, reductions)."""

    def formula(node: fx.Node) -> OpFlops:
        n = numel_of(node.args[0]) if node.args else 0
        grads = {0: bwd * n}
        for i, a in enumerate(node.args[1:], start=1):
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                grads[i] = n  # per-channel weight/bias: one reduction over the input
        return OpFlops(fwd * n, grads)

    return formula


def _pointwise(node: fx.Node) -> OpFlops:
    n = math.prod(_out(node))
    return OpFlops(n, {i: n for i, a in enumerate(node.args) if isinstance(a, fx.Node)})


def _free(node: fx.Node) -> OpFlops:
    return OpFlops(0, {})


FORMULAS: dict[str, Callable[[fx.Node], OpFlops]] = {
    "linear": _linear,
    "mm": _matmul,
    "bmm": _matmul,
    "matmul": _matmul,
    "addmm": _addmm,
    "baddbmm": _addmm,
    "einsum": _einsum,
    "convolution": _conv,
    "conv1d": lambda n: _conv(n, False),
    "conv2d": lambda n: _conv(n, False),
    "conv3d": lambda n: _conv(n, False),
    "conv_transpose1d": lambda n: _conv(n, True),
    "conv_transpose2d": lambda n: _conv(n, True),
    "conv_transpose3d": lambda n: _conv(n, True),
    "scaled_dot_product_attention": _sdpa,
    "_scaled_dot_product_flash_attention": _sdpa,
    "_scaled_dot_product_efficient_attention": _sdpa,
    "_scaled_dot_product_cudnn_attention": _sdpa,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa,
    "_grouped_mm": _grouped_mm,
    "embedding": _embedding,
    "layer_norm": _scaled(5, 8),
    "native_layer_norm": _scaled(5, 8),
    "rms_norm": _scaled(4, 6),
    "group_norm": _scaled(5, 8),
    "batch_norm": _scaled(5, 8),
    "instance_norm": _scaled(5, 8),
    "softmax": _scaled(5, 4),
    "_softmax": _scaled(5, 4),
    "log_softmax": _scaled(5, 4),
    "_log_softmax": _scaled(5, 4),
    "cross_entropy_loss": _scaled(5, 4),
    "nll_loss": _scaled(1, 1),
    "nll_loss_nd": _scaled(1, 1),
    "mse_loss": _scaled(3, 2),
    "sum": _scaled(1, 1),
    "mean": _scaled(1, 1),
    "amax": _scaled(1, 1),
    "amin": _scaled(1, 1),
    "max": _scaled(1, 1),
    "min": _scaled(1, 1),
    "var": _scaled(3, 3),
    "std": _scaled(3, 3),
    "var_mean": _scaled(3, 3),
    "norm": _scaled(2, 2),
    "linalg_vector_norm": _scaled(2, 2),
    "logsumexp": _scaled(3, 3),
    "cumsum": _scaled(1, 1),
    "topk": _scaled(1, 1),
    "dropout": _pointwise,
    "native_dropout": _pointwise,
    "feature_dropout": _pointwise,
    "tril": _pointwise,
    "triu": _pointwise,
    "masked_fill": _pointwise,
    "where": _pointwise,
    "clamp": _pointwise,
    "gelu": _pointwise,
    "silu": _pointwise,
}

# Ops that move or describe data but do no arithmetic.
FREE_OPS = frozenset(
    "view reshape _unsafe_view expand expand_as permute transpose t slice select unsqueeze squeeze "
    "flatten unflatten contiguous clone copy copy_ to _to_copy alias detach cat stack split "
    "split_with_sizes chunk unbind index_select gather index index_put index_put_ narrow movedim "
    "zeros zeros_like ones ones_like full full_like empty empty_like new_zeros new_ones new_full "
    "new_empty arange scalar_tensor lift_fresh_copy sym_size sym_numel sym_stride repeat "
    "repeat_interleave roll pad constant_pad_nd diagonal view_as type_as as_strided "
    "_assert_tensor_metadata _assert_scalar sym_constrain_range_for_size scatter "
    "masked_select fill fill_ zero_ resize_ lift _set_grad_enabled".split()
)


def op_name(target: Any) -> str:
    """The bare aten op name of a call_function target (``aten.linear.default`` -> ``linear``)."""
    if isinstance(target, OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def op_flops(node: fx.Node) -> OpFlops | None:
    """FLOPs of one call_function node, or None when no formula is known for its op."""
    target = node.target
    if target is operator.getitem or not isinstance(target, (OpOverload, OpOverloadPacket)):
        if getattr(target, "__module__", None) in {"_operator", "operator", "math", "builtins"} or target is operator.getitem:
            return OpFlops(0, {})
        if "sym" in getattr(target, "__name__", ""):
            return OpFlops(0, {})
        return None
    name = op_name(target)
    base = name[:-1] if name.endswith("_") and not name.endswith("__") else name  # in-place variant
    for candidate in (name, base):
        if candidate in FORMULAS:
            return FORMULAS[candidate](node)
    if isinstance(target, OpOverload):
        if torch.Tag.pointwise in target.tags:
            return _pointwise(node)
        if target.is_view:
            return OpFlops(0, {})
    if name in FREE_OPS or base in FREE_OPS:
        return OpFlops(0, {})
    return None
