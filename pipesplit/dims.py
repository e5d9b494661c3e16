"""Which input dimensions besides the batch a capture leaves dynamic (``compile(..., dynamic_dims=...)``),
and the refusal, in the user's terms, of a declared size the model cannot take.

A sequence length or an image size changes between batches. ``dynamic_dims`` names such
dimensions per ``forward()`` argument, with the sizes they will take or without; ``True``
asks for every dimension of every batched input, the way a program captured at the example's
shapes is captured again the first time a length changes
(:mod:`pipesplit.passes.split.generalise`). torch.export keeps a dimension dynamic where the
model allows and fixes it where the model does (a reshape to a constant, a weight's size);
:func:`check_declared` then says which declared dimension the model fixes or limits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence, Union

from pipesplit.errors import CaptureError

if TYPE_CHECKING:
    from pipesplit.capture import InputInfo

Range = tuple[int, Union[int, None]]  # (low, high or None: no bound)
DimSpec = dict[str, dict[int, Union[Range, None]]]  # argument -> dimension -> sizes it takes (None: any)

EVERY_DIM = "*"  # the key of a DimSpec asking for every dimension of every batched input


def parse_dynamic_dims(given: Any, batch_dim: int, unbatched: Sequence[str] = ()) -> DimSpec:
    """``compile``'s ``dynamic_dims=`` as {argument: {dimension: (low, high) or None}}.

    Takes ``True`` (every dimension of every batched input), or per ``forward()`` argument a
    dimension, a list of them, or {dimension: (low, high)} (``high`` None: no bound).

    >>> parse_dynamic_dims({"input_ids": 1}, batch_dim=0)
    {'input_ids': {1: None}}
    >>> parse_dynamic_dims({"x": {2: (8, 512)}, "mask": [1]}, batch_dim=0)
    {'x': {2: (8, 512)}, 'mask': {1: None}}
    """
    example = "dynamic_dims={'input_ids': 1} or {'input_ids': {1: (1, 4096)}}, or True for every dimension"
    if given is True:
        return {EVERY_DIM: {}}
    if not isinstance(given, Mapping):
        raise CaptureError(f"dynamic_dims takes a dict from forward() argument names to dimensions, got "
                           f"{type(given).__name__} {given!r}; e.g. {example}.")
    out: DimSpec = {}
    for name, dims in given.items():
        if not isinstance(name, str):
            raise CaptureError(f"dynamic_dims keys are forward() argument names, got {name!r}; e.g. {example}.")
        if name in unbatched:
            raise CaptureError(f"dynamic_dims names {name!r}, which unbatched= also names: an unbatched input keeps "
                               "its example's shape. Drop it from one of the two.")
        if isinstance(dims, int) and not isinstance(dims, bool):
            dims = {dims: None}
        elif isinstance(dims, (list, tuple, set)):
            dims = {d: None for d in dims}
        if not isinstance(dims, Mapping) or not dims:
            raise CaptureError(f"dynamic_dims[{name!r}] = {dims!r}: give a dimension, a list of them, or "
                               f"{{dimension: (low, high)}}; e.g. {example}.")
        out[name] = {_dim(name, d, batch_dim): _range(name, d, r) for d, r in dims.items()}
    return out


def _dim(name: str, d: Any, batch_dim: int) -> int:
    if not isinstance(d, int) or isinstance(d, bool) or d < 0:
        raise CaptureError(f"dynamic_dims[{name!r}] names dimension {d!r}; dimensions are counted from 0 "
                           "(a (batch, seq) input's length is dimension 1).")
    if d == batch_dim:
        raise CaptureError(f"dynamic_dims[{name!r}] names dimension {d}, the batch dimension (batch_dim={batch_dim}); "
                           "pipesplit makes the batch dynamic itself (dynamic_batch=True from the start).")
    return d


def _range(name: str, d: int, r: Any) -> Range | None:
    if r is None:
        return None
    ok = (isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], int) and r[0] >= 1
          and (r[1] is None or (isinstance(r[1], int) and r[1] >= r[0])))
    if not ok:
        raise CaptureError(f"dynamic_dims[{name!r}][{d}] = {r!r}: a range is (low, high) with 1 <= low <= high, "
                           "or (low, None) for no upper bound; e.g. (1, 4096).")
    return (int(r[0]), None if r[1] is None else int(r[1]))


def dims_for(spec: DimSpec, argument: str, ndim: int, batch_dim: int) -> dict[int, Range | None]:
    """The dimensions (besides the batch) of a tensor of ``argument`` with ``ndim`` dimensions to capture dynamic."""
    if EVERY_DIM in spec:
        return {d: None for d in range(ndim) if d != batch_dim}
    return {d: r for d, r in spec.get(argument, {}).items() if d < ndim}


def check_declared(spec: DimSpec, infos: Sequence["InputInfo"], owners: Sequence[str], example: Sequence[Any]) -> None:
    """Every dimension ``spec`` declares is one the capture kept dynamic over the declared sizes;
    otherwise a CaptureError naming the input, the dimension and what the model allows."""
    for info, owner, x in zip(infos, owners, example):
        if owner not in spec or owner == EVERY_DIM or not info.is_tensor or info.shape is None:
            continue
        for d, declared in spec[owner].items():
            if d >= len(info.shape):
                raise CaptureError(f"dynamic_dims[{owner!r}] names dimension {d}, but input {info.name!r} has "
                                   f"{len(info.shape)} dimensions ({tuple(x.shape)}).")
            if info.shape[d] is not None:
                one = " (an example of size 1 is always fixed: use one of 2 or more)" if info.shape[d] == 1 else ""
                raise CaptureError(
                    f"input {info.name!r} dimension {d}: the model fixes it at {info.shape[d]}{one}, so it cannot take "
                    f"other sizes (torch.export kept it static: a reshape to a constant, or a weight of that size). "
                    f"Drop it from dynamic_dims, or change the model to read the size from its input.")
            low, high = info.ranges.get(d, (0, None))
            limit = info.limits.get(d)
            if declared is not None and high is not None and (declared[1] is None or declared[1] > high):
                raise CaptureError(
                    f"input {info.name!r} dimension {d}: declared sizes {declared[0]}..{declared[1] or 'any'}, but the "
                    f"model takes at most {high} there{f' ({limit})' if limit else ''}. Declare a range up to {high}, "
                    "or give the model a larger table.")
            if declared is not None and declared[0] < low and low > 2:
                raise CaptureError(
                    f"input {info.name!r} dimension {d}: declared sizes from {declared[0]}, but the model's code "
                    f"needs at least {low} there (a branch on that size). Declare a range from {low}.")
