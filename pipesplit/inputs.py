"""Checking a call against what was captured: input structure, shapes, dtypes and export's ranges."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipesplit.capture import InputInfo
from pipesplit.errors import InputError


class Shown(str):
    """Text that prints without quotes, to draw an input structure."""

    def __repr__(self) -> str:
        return str(self)


def shown(x: Any) -> Any:
    return Shown(f"Tensor{list(x.shape)}") if isinstance(x, torch.Tensor) else x


def describe_structure(tree: tuple[Any, Any]) -> str:
    args, kwargs = tree
    return f"args={args!r}, kwargs={kwargs!r}"


def ordered_like(tree: Any, template: Any) -> Any:
    """``tree`` with every dict that has the same keys as ``template``'s dict at that place in the
    template's key order (a pytree's structure includes the order of a dict's keys; a call names its
    keyword arguments in any order). Other values come back as they are.

    >>> ordered_like(((1,), {"labels": 2, "mask": 3}), ((None,), {"mask": None, "labels": None}))
    ((1,), {'mask': 3, 'labels': 2})
    """
    if type(tree) is dict and type(template) is dict:
        if tree.keys() != template.keys():
            return tree
        return {k: ordered_like(tree[k], template[k]) for k in template}
    if type(tree) in (tuple, list) and type(tree) is type(template) and len(tree) == len(template):
        return type(tree)(ordered_like(a, b) for a, b in zip(tree, template))
    return tree


def check_kind(value: Any, info: InputInfo, batch_dim: int) -> None:
    """``value`` is a tensor of ``info``'s rank and dtype where one was captured: what no batch size
    can change, checked before a call with another batch re-captures the model."""
    if not info.is_tensor or not isinstance(value, torch.Tensor) or info.shape is None:
        return
    if value.dim() != len(info.shape):
        check_input(value, info, batch_dim)  # says which rank it takes
    if value.dtype != info.dtype:
        raise _dtype_error(value, info)


def check_input(value: Any, info: InputInfo, free_dim: int | None = None, fixed: str | None = None,
                batch_dim: int = 0) -> None:
    """``value`` fits the captured input ``info``; a batched input's ``free_dim`` may take any size.
    ``fixed``: why a static dimension (besides ``batch_dim``) stays static in a capture that made every
    dimension dynamic it could."""
    if not info.is_tensor:
        if isinstance(value, torch.Tensor):
            raise InputError(f"input {info.name!r} was compiled as a constant {info.example!r}, got a tensor.")
        if value != info.example:
            raise InputError(
                f"input {info.name!r} was compiled as the constant {info.example!r} and the graph bakes it in; "
                f"got {value!r}. Compile again with this value."
            )
        return
    if not isinstance(value, torch.Tensor):
        raise InputError(f"input {info.name!r} must be a tensor, got {type(value).__name__}.")
    assert info.shape is not None
    free = free_dim if info.batched else None  # a dimension any size fits
    expected = ("(" + ", ".join("*" if d is None or i == free else str(d) for i, d in enumerate(info.shape))
                + ("," if len(info.shape) == 1 else "") + ")")
    if value.dim() != len(info.shape):
        raise InputError(
            f"input {info.name!r} has shape {tuple(value.shape)} ({value.dim()} dimensions); "
            f"the program takes {expected} ({len(info.shape)} dimensions)."
        )
    for dim, (got, want) in enumerate(zip(value.shape, info.shape)):
        if want is not None and got != want and not (dim == free_dim and info.batched):
            if fixed is not None and info.batched and dim != batch_dim:
                hint = (f" The model fixes this dimension: captured with every dimension dynamic, torch.export "
                        f"kept it at {want} ({fixed}).")
            elif free_dim is not None and dim != free_dim:
                hint = (
                    " The model fixes this dimension at compile time. If it holds the batch (an RNN's (layers, batch, "
                    "hidden) state, a (batch, seq) mask beside seq-first inputs): microbatches cut every input along "
                    f"one dimension, batch_dim={free_dim}, so pass this input with its batch there (transpose it "
                    "outside forward and back inside) or build it inside forward."
                )
            elif dim != 0:
                hint = " The model fixes this dimension at compile time."
            elif want == 1:
                hint = (
                    " The batch dimension is pinned by the example batch of 1: "
                    "compile with an example batch of 2 or more."
                )
            else:
                hint = (
                    f" The model pins the batch dimension to {want} (e.g. a reshape with a literal batch size; see "
                    "prog.notes): call it with that batch, or make the model read the batch size from its input."
                )
            raise InputError(
                f"input {info.name!r} has shape {tuple(value.shape)}; the program takes {expected}: "
                f"dimension {dim} must be {want}, got {got}.{hint}"
            )
    for dim in info.ranges:
        check_range(info, dim, int(value.shape[dim]))
    if value.dtype != info.dtype:
        raise _dtype_error(value, info)


def _dtype_error(value: torch.Tensor, info: InputInfo) -> InputError:
    return InputError(
        f"input {info.name!r} has dtype {value.dtype}; the program was compiled for {info.dtype}, and its graph "
        f"holds for that dtype only. Cast the input ({info.name}.to({info.dtype})), or compile again with an "
        f"example of dtype {value.dtype} (and the model converted to it where its layers need that)."
    )


def check_range(info: InputInfo, dim: int, size: int, what: str = "") -> None:
    """``size`` lies in the range torch.export assumed for ``info``'s dimension ``dim``.

    Export's default range for a dynamic size starts at 2 (sizes 0 and 1 are treated as
    special while tracing) yet its graphs hold for 1 as well, as torch's own module accepts;
    a larger lower bound, or any upper bound, comes from the model's code (``if x.shape[0] > 2``)
    and the graph is wrong outside it.
    """
    low, high = info.ranges[dim]
    low = min(low, 1) if low <= 2 else low
    if high is not None and size > high and dim in info.limits:  # a table caps it: no other capture helps
        raise InputError(
            f"input {info.name!r} has size {size} in dimension {dim}{what}, but the program takes at most {high} there: "
            f"{info.limits[dim]}. Pass at most {high} (cut or split the input)."
        )
    if size < low or (high is not None and size > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise InputError(
            f"input {info.name!r} has size {size} in dimension {dim}{what}, but the program was captured for sizes "
            f"{span} there: the model's code depends on that size (a branch such as `if x.shape[{dim}] > {low - 1}`), "
            "and its graph only holds inside that range. Use a size in the range, or compile with an example "
            "whose size takes the other branch."
        )


def batch_sizes(flat: Sequence[Any], infos: Sequence[InputInfo], batch_dim: int = 0, *, check: bool = True) -> dict[str, int]:
    """The size along ``batch_dim`` of each input that carries the batch, by name; with ``check``,
    raises InputError when they disagree (every batched input is cut into microbatches along it)."""
    sizes = {
        info.name: int(value.shape[batch_dim])
        for value, info in zip(flat, infos)
        if isinstance(value, torch.Tensor) and info.batched and value.dim() > batch_dim
    }
    if check and len(set(sizes.values())) > 1:
        batch = next(iter(sizes.values()))  # the first batched input's
        shapes = {info.name: tuple(value.shape) for value, info in zip(flat, infos) if info.name in sizes}
        elsewhere = [f"{n!r} {shapes[n]} (dimension {shapes[n].index(batch)}?)" for n, size in sizes.items()
                     if size != batch and batch in shapes[n]]
        raise InputError(
            f"inputs disagree on the batch size along dim {batch_dim}: {sizes}. Every input with a batch "
            "dimension is cut into microbatches along it; an input without one (a lookup table, a shared mask) "
            "must be marked when compiling: pipesplit.compile(..., unbatched=['<forward argument name>'])."
            + (f" The batch of {batch} appears elsewhere in {', '.join(elsewhere)}: an input whose batch is in another "
               f"dimension (an RNN's (layers, batch, hidden) state) is not a table; pass it with its batch in "
               f"dimension {batch_dim} (transpose it outside forward and back inside) or build it inside forward."
               if elsewhere else "")
        )
    return sizes
