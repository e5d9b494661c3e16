"""Checking the example call before and after the export: a bad input is named as the input's fault, not the model's."""

from __future__ import annotations

import inspect
from typing import Any, Collection, Mapping, Sequence

import torch
import torch.fx as fx
from torch import nn

from pipesplit.compat import pytree
from pipesplit.errors import CaptureError

# ops whose tensor operands must share one dtype: an input read straight by one beside a
# parameter of another dtype fails in eager mode, though the export's fake tensors let it pass
# (normalisations are left out: some take a float32 weight beside a half-precision input)
_SAME_DTYPE_OPS = {
    "linear", "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "mm", "addmm", "bmm", "matmul",
}


def described(value: Any) -> str:
    """An example leaf as the user would recognise it: ``Tensor[4, 7] float32``, ``str 'hello'``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')} on {value.device}"
    return f"{type(value).__name__} {value!r}"[:80]


def keyword_inputs(kwargs: Any) -> dict[str, Any]:
    """``example_kwargs`` as a dict of forward() argument name -> value (None: no keyword inputs)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise CaptureError(f"example_kwargs takes a dict of forward() argument name -> value, got {kwargs!r} "
                           f"({type(kwargs).__name__}); pass positional inputs as a tuple: compile(model, (x, y)).")
    return dict(kwargs)


def check_example(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], batch_dim: Any,
                  unbatched: Collection[str]) -> None:
    """What can be told wrong about the example call without running the model: a model without
    ``forward``, a ``batch_dim`` no tensor has, an empty example batch."""
    if type(model).forward is nn.Module.forward:
        raise CaptureError(f"{type(model).__name__} defines no forward(), so there is nothing to capture; "
                           "compile the module whose forward() runs the model.")
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int) or batch_dim < 0:
        raise CaptureError(f"batch_dim must be a dimension index >= 0 (an int), got {batch_dim!r} "
                           f"({type(batch_dim).__name__}); e.g. batch_dim=0 for (batch, ...) inputs.")
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError:
        return  # capture() reports a call that does not fit forward()'s signature
    tensors = {f"{name}{_where(path)}": leaf for name, value in bound.items() if name not in unbatched
               for path, leaf in pytree.tree_flatten_with_path(value)[0] if isinstance(leaf, torch.Tensor)}
    if tensors and all(t.dim() <= batch_dim for t in tensors.values()):
        shapes = ", ".join(f"{n}: {tuple(t.shape)}" for n, t in tensors.items())
        raise CaptureError(f"batch_dim={batch_dim}, but no example tensor has a dimension {batch_dim} ({shapes}); "
                           "batch_dim names the inputs' batch dimension, counted from 0 (batch_dim=0 for (batch, ...)).")
    empty = [n for n, t in tensors.items() if t.dim() > batch_dim and t.shape[batch_dim] == 0]
    if empty:
        raise CaptureError(
            f"the example batch is empty: {', '.join(f'{n} has 0 rows' for n in empty)} along batch_dim={batch_dim}. "
            "torch.export traces the model on the example, and an empty batch tells it nothing (it specialises "
            "on size 0); pass an example with 2 or more rows."
        )


def _outline(value: Any) -> str:
    """An example argument's structure with its tensors as ``Tensor[4, 8] float32 on cpu``."""
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_outline(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_outline(v)}" for k, v in list(value.items())[:4]) + "}"
    return described(value)


def _where(path: Sequence[Any]) -> str:
    return "".join(str(k) for k in path)


def check_input_dtypes(gm: fx.GraphModule, model_name: str) -> None:
    """Refuse an example tensor that the model's first operation on it reads beside a parameter of
    another dtype (an int64 or float64 batch into a float32 ``nn.Linear``): the export lets it pass,
    the model itself would refuse it at the first call."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        name, val = node.name, node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for user in node.users:
            op = getattr(getattr(user.target, "_overloadpacket", None), "__name__", "")
            if op not in _SAME_DTYPE_OPS:
                continue
            for arg in user.all_input_nodes:
                other = arg.meta.get("val")
                if arg.op == "get_attr" and isinstance(other, torch.Tensor) and other.dtype != val.dtype:
                    model_fix = (f", or convert the model to it (model.to({val.dtype}))" if val.dtype.is_floating_point
                                 else "")
                    raise CaptureError(
                        f"example input {name!r} is {val.dtype}, but {model_name}'s first operation on it "
                        f"({op}, with {arg.target!r} of dtype {other.dtype}) takes {other.dtype}: the model itself "
                        f"would refuse it when run. Cast the example to {other.dtype} ({name}.to({other.dtype})){model_fix}."
                    )


# words of torch's errors about an operand that does not fit the operation (shape, dtype, type)
_MISFIT = ("shape", "size", "dtype", "scalar type", "must be tensor", "has no attribute", "expected input",
           "not supported between", "argument", "channels", "dim", "device")


# words of torch's errors about the model's code, whatever the inputs (a branch on values, a pinned size)
_MODEL_FAULT = ("data-dependent", "data dependent", "guard", "constraint", "specializ", "unsupported", "dynamiccache")


def blamed_on_input(error: CaptureError, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CaptureError:
    """A failed export's error, led by what the example inputs are when they, not the model, look
    at fault: no tensor at all, an empty tensor, or torch's complaint about an operand's shape,
    dtype or type. Otherwise ``error`` itself."""
    leaves = pytree.tree_leaves((args, kwargs))
    cause = error.__cause__
    said = f"{type(cause).__name__}: {cause}".lower() if cause is not None else ""
    if not leaves:
        why = "the example call passes no input"
    elif not any(isinstance(x, torch.Tensor) for x in leaves):
        why = "the example inputs hold no tensor"
    elif any(isinstance(x, torch.Tensor) and x.numel() == 0 for x in leaves):
        why = "an example tensor is empty"
    elif any(word in said for word in _MISFIT) and not any(word in said for word in _MODEL_FAULT):
        why = "torch refused an example input's shape, dtype or type"
    else:
        return error
    shown = ", ".join(_outline(a) for a in (*args, *kwargs.values()))
    sig = f"{type(model).__name__}.forward{inspect.signature(model.forward)}"
    message = (f"the example input looks at fault, not the model: {why} ({shown or 'nothing'}). Check it against "
               f"{sig}: the shapes, dtypes and devices its layers take (run model(example) once to see).\n{error}")
    out = CaptureError(message)
    out.__cause__ = cause
    return out
