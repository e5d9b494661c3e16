"""Every private or recently added torch API pipesplit uses, with its fallback for older releases."""

# The one module that reaches into torch's private names (tests/test_layers.py checks that no
# other module does). Each entry says when torch added it, as read in the releases' own source
# (installed 2.10.0, 2.13.0, 2.15.0; 2.14.1's wheel); TORCH_FLOOR is the oldest tested. pytree,
# torch._ops, is_concrete_int, make_fx, FakeTensorMode, _LazyGraphModule and
# _has_compatible_shallow_copy_type are in every one of them: they sit here so that a release that moves them breaks one module.

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import sympy  # type: ignore[import-untyped]  # torch's own dependency, without stubs
import torch
import torch.utils._pytree as pytree  # private, but the module torch.export's specs are built from
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch.export.graph_signature import OutputKind
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx.experimental import symbolic_shapes
from torch.fx.experimental.proxy_tensor import make_fx  # traces a stage's forward + backward (stage_graphs)
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils._python_dispatch import TorchDispatchMode  # every op of a thread (bench/stage_memory: what a stage allocates)

__all__ = [
    "TORCH_FLOOR", "TORCH_VERSION", "HigherOrderOperator", "LazyGraphModule", "OpOverload", "OpOverloadPacket",
    "EXPORTS_META_MODELS", "GROUP_NORM_WEIGHT_GRAD_ALONE_CRASHES", "data_dependent", "forward_hooks", "set_forward_hooks", "STATE_MUTATIONS", "TORCH_LOGGERS", "FAKE_TENSOR_LOGGER", "fake_mode",
    "has_compatible_shallow_copy_type", "TorchDispatchMode",
    "hint_at", "is_concrete_int", "make_fx", "one_process_checkpoint", "optimization_hint", "pytree", "torch_csv_send_waits",
]

TORCH_FLOOR = (2, 10)
"""The oldest torch release pipesplit is tested on (pyproject's ``torch>=2.10``)."""


def _release(version: str) -> tuple[int, int, int]:
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:  # a source build with an odd version string: assume the newest
        return (99, 0, 0)
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


TORCH_VERSION = _release(torch.__version__)
"""The installed torch as (major, minor, patch): ``2.13.0+cpu`` -> ``(2, 13, 0)``."""


def _hint_before_2_12(x: torch.SymInt | int) -> int:
    """torch < 2.12 (no ``optimization_hint``): the example's value, as ``size_hint`` gives it."""
    if isinstance(x, int):
        return x
    return int(x.node.shape_env.size_hint(x.node.expr))


_optimization_hint: Callable[[Any], int] = getattr(symbolic_shapes, "optimization_hint", _hint_before_2_12)


def optimization_hint(x: torch.SymInt | int) -> int:
    """A concrete int for a possibly symbolic size: the value it had in the example, no guard added.

    ``symbolic_shapes.optimization_hint`` (absent in 2.10, and in 2.11 as issue 23 found; there
    in 2.13, 2.14.1, 2.15) or, before it, the shape environment's ``size_hint`` (there in all).

    A size computed from values (``torch.nonzero``'s rows), which has no example value, takes
    its largest possible value where export bounds it (every row of a fixed-size batch), so
    costs price the op as if every row were kept; torch's fallback otherwise.

    >>> optimization_hint(7)
    7
    """
    if isinstance(x, torch.SymInt) and data_dependent(x):
        upper = x.node.shape_env.bound_sympy(x.node.expr).upper
        if upper.is_finite and int(upper) < 2**31:
            return int(upper)
        try:
            return int(_optimization_hint(x))
        except symbolic_shapes.GuardOnDataDependentSymNode:  # torch < 2.12's size_hint has no fallback
            return UNBACKED_FALLBACK
    return int(_optimization_hint(x))


def hint_at(x: torch.SymInt | int, sizes: Mapping[Any, int]) -> int:
    """``x`` with the symbols ``sizes`` names (``{s1: 128}``) at those sizes and every other one at its
    :func:`optimization_hint`: what a dimension captured dynamic measures at another length.

    >>> hint_at(7, {})
    7
    """
    if isinstance(x, torch.SymInt) and sizes:
        expr = x.node.expr
        given = {s: sympy.Integer(v) for s, v in sizes.items() if s in expr.free_symbols}
        if given:
            expr = expr.xreplace(given)
            if expr.is_number:
                return int(expr)
            shape_env = x.node.shape_env
            rest = getattr(shape_env, "optimization_hint", None) or shape_env.size_hint  # torch < 2.12: size_hint
            return int(rest(expr))
    return optimization_hint(x)


UNBACKED_FALLBACK = 8192
"""The size priced for a value-chosen size without a bound where torch gives none (torch's own
``optimization_hint`` falls back to the same 8192)."""


def data_dependent(x: Any) -> bool:
    """Whether a tensor's sizes (or a SymInt) hold a symbol torch.export made for a value computed while
    running, not for an input's size (``torch.nonzero``'s row count): ``free_unbacked_symbols``, in every
    release tested.

    >>> data_dependent(torch.ones(2))
    False
    """
    return bool(symbolic_shapes.free_unbacked_symbols(x))


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")


def forward_hooks(module: torch.nn.Module) -> tuple[Any, ...]:
    """The forward hooks and pre-hooks on ``module`` (handle id, hook) and their flags, comparable with ``==``:
    ``nn.Module``'s private dicts, the same in every release tested."""
    return tuple(tuple(getattr(module, name, {}).items()) for name in _HOOK_DICTS)


def set_forward_hooks(module: torch.nn.Module, hooks: tuple[Any, ...]) -> None:
    """Make ``module``'s forward hooks and pre-hooks those :func:`forward_hooks` returned, in the same dicts
    (a hook's handle holds its dict, so ``handle.remove()`` keeps working)."""
    for name, items in zip(_HOOK_DICTS, hooks):
        held = getattr(module, name, None)
        if held is not None:
            held.clear()
            held.update(items)


# OutputKind.PARAMETER_MUTATION: present in 2.10 (not in 2.6); the getattr keeps an older
# torch, which never emits it, importing.
STATE_MUTATIONS: tuple[OutputKind, ...] = tuple(
    getattr(OutputKind, name) for name in ("BUFFER_MUTATION", "PARAMETER_MUTATION") if hasattr(OutputKind, name)
)
"""The export output kinds that write a parameter or buffer back (``ep.module()`` copies them)."""

EXPORTS_META_MODELS = TORCH_VERSION >= (2, 13)
# GroupNorm's CPU backward over a channels_last input crashes the process when only the weight's gradient
# is asked for (seen on 2.10 and 2.13; 2.15 is fine): see pipesplit.runtime.engine.weight_grads._ALSO_INPUT
GROUP_NORM_WEIGHT_GRAD_ALONE_CRASHES = TORCH_VERSION < (2, 15)
"""Whether torch.export captures a model built on the meta device from real (CPU) example inputs:
2.10 and 2.12 fail in fake-tensor device propagation (``found two different devices meta, cpu``),
2.13 and 2.15 capture it (the README's meta-device recipe; tests/test_checkpoint.py)."""

TORCH_LOGGERS = (
    "torch._dynamo", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes",
    "torch._subclasses.fake_tensor", "torch._functorch",
)
"""torch's loggers that speak during a capture (silenced around torch.export)."""
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""The logger that prints a failed fake-tensor op's traceback before the error is raised."""


def fake_mode() -> Any:
    """A fake-tensor mode that takes real tensors as they come (``FakeTensorMode``, in every tested
    release): ops run on shapes and dtypes only, nothing real is read or written."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def has_compatible_shallow_copy_type(t: torch.Tensor, data: torch.Tensor) -> bool:
    """Whether ``t.data = data`` may swap the storage (CPU <-> CUDA), what ``Module.cuda()`` checks."""
    return bool(torch._has_compatible_shallow_copy_type(t, data))


def torch_csv_send_waits() -> bool:
    """Whether the installed torch's schedule CSV needs a ``WAIT_SEND_F``/``WAIT_SEND_B`` after
    each send (torch 2.15: its loader refuses a send without one; 2.14 has no such action)."""
    if not torch.distributed.is_available():
        return TORCH_VERSION >= (2, 15)
    from torch.distributed.pipelining import schedules

    return hasattr(schedules._ComputationType, "WAIT_SEND_F")


@contextlib.contextmanager
def one_process_checkpoint(alone: bool) -> Iterator[None]:
    """``torch.distributed.checkpoint`` in one process (``alone``) without its UserWarning "torch.distributed
    is disabled, unavailable or uninitialized, assuming the intent is to save in a single process": torch
    2.10-2.15 give it even with ``no_dist=True``, where one process is what pipesplit asked for."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
