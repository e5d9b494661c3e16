"""Building a user's model from ``MODULE:FACTORY`` and example inputs from ``--input-shape``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import os
import sys
from typing import Any, Sequence

import torch
from torch import nn

from pipesplit.errors import PipesplitError

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "double": torch.float64,
    "float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32, "bool": torch.bool,
}


class CLIError(PipesplitError):
    """A command-line mistake: the message says what is wrong, ``hint`` how to fix it."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _import(module: str) -> Any:
    if module.endswith(".py") or os.sep in module:
        path = os.path.abspath(module)
        if not os.path.isfile(path):
            raise CLIError(f"cannot import {module!r}: no such file",
                           "give MODULE as a dotted name or a path to a .py file")
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod
    if os.getcwd() not in sys.path:  # a console script does not put the working directory on the path
        sys.path.insert(0, os.getcwd())
    return importlib.import_module(module)


def parse_kwargs(items: Sequence[str]) -> dict[str, Any]:
    """``["layers=4", "name=x"]`` -> ``{"layers": 4, "name": "x"}`` (Python literals where they parse)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise CLIError(f"--kwarg expects KEY=VALUE, got {item!r}", "e.g. --kwarg layers=4")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def load_model(spec: str, kwargs: dict[str, Any] | None = None) -> nn.Module:
    """Import ``MODULE:FACTORY`` and call the factory (a class or function; an ``nn.Module`` is used as is)."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise CLIError(f"expected MODULE:FACTORY, got {spec!r}", "e.g. pipesplit.models:gpt or my_model.py:build")
    try:
        mod = _import(module)
    except CLIError:
        raise
    except Exception as e:
        raise CLIError(
            f"cannot import module {module!r} ({_first_line(e)})",
            "MODULE must be importable from the current directory, or be a path to a .py file",
        ) from e
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(mod) if not n.startswith("_") and callable(getattr(mod, n)))[:12]
            raise CLIError(f"module {module!r} has no attribute {attr!r}",
                           f"callables it defines: {', '.join(names) or 'none'}")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        if kwargs:
            raise CLIError(f"{spec} is a model instance, not a factory; it takes no --kwarg", "drop --kwarg")
        return obj
    if not callable(obj):
        raise CLIError(f"{spec} is a {type(obj).__name__}, not a model factory",
                       "point at a class or a function returning an nn.Module")
    try:
        model = obj(**(kwargs or {}))
    except Exception as e:
        raise CLIError(f"calling {spec}() failed: {_first_line(e)}",
                       "check the factory's arguments (--kwarg KEY=VALUE)") from e
    if not isinstance(model, nn.Module):
        raise CLIError(f"{spec}() returned a {type(model).__name__}, not an nn.Module",
                       "the factory must return the model")
    return model


def parse_shape(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """``"8x64"``, ``"8,64"`` or ``"8x64:int64"`` -> ((8, 64), dtype)."""
    dims, _, dtype_name = text.partition(":")
    dtype = _DTYPES.get(dtype_name or "float32")
    if dtype is None:
        raise CLIError(f"unknown dtype {dtype_name!r} in --input-shape {text!r}", f"choose one of {', '.join(_DTYPES)}")
    try:
        shape = tuple(int(d) for d in dims.replace(",", "x").split("x"))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise CLIError(f"--input-shape {text!r} is not a shape", "write sizes separated by x, e.g. 8x64 or 8x64:int64")
    nbytes = math.prod(shape) * dtype.itemsize
    memory = _physical_memory()
    if nbytes >= 2**62 or (memory is not None and nbytes > memory):
        raise CLIError(f"--input-shape {text!r} is {nbytes / 2**30:.4g} GiB, more than this machine's "
                       f"{(memory or 0) / 2**30:.4g} GiB of memory", "pass a smaller example, e.g. --input-shape 8x64")
    return shape, dtype


def _physical_memory() -> int | None:
    """Bytes of memory this machine has, None where the system does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def make_inputs(shapes: Sequence[str], int_high: int = 2, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random example inputs: normal floats, integers in ``[0, int_high)``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for text in shapes:
        shape, dtype = parse_shape(text)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        elif dtype is torch.bool:
            out.append(torch.randint(0, 2, shape, generator=gen).bool())
        else:
            out.append(torch.randint(0, max(int_high, 1), shape, generator=gen, dtype=dtype))
    return tuple(out)


def default_int_high(model: nn.Module, shapes: Sequence[str]) -> int:
    """The range of integer inputs without ``--int-high``: the smallest vocabulary of the model's embeddings."""
    dtypes = [(text, parse_shape(text)[1]) for text in shapes]
    ints = [text for text, dtype in dtypes if not dtype.is_floating_point and dtype is not torch.bool]
    if not ints:
        return 2  # unused: no integer inputs
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if not sizes:
        raise CLIError(f"--input-shape {ints[0]} is an integer input, but {type(model).__name__} has no nn.Embedding "
                       "to take its range from", "give the range with --int-high N (integers are drawn from [0, N))")
    return min(sizes)


def check_fits(model: nn.Module, inputs: tuple[Any, ...], shapes: Sequence[str]) -> None:
    """Run the model once eagerly, so a shape that does not fit fails with the model's own message."""
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as e:
        shown = ", ".join(shapes)
        raise CLIError(
            f"input shape {shown} does not fit {type(model).__name__}: {_first_line(e)}",
            "pass one --input-shape per positional input, e.g. --input-shape 8x64:int64 for token ids",
        ) from e
