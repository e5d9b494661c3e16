"""Splitting flat program inputs and loss targets into microbatches (outputs join in runtime/engine/merge.py)."""

from __future__ import annotations

from typing import Any, Collection, Sequence

import torch

from pipesplit.capture import InputInfo
from pipesplit.compat import pytree
from pipesplit.errors import InputError, did_you_mean
from pipesplit.inputs import batch_sizes, check_range


def batch_size(flat: Sequence[Any], infos: Sequence[InputInfo], batch_dim: int = 0) -> int:
    """The batch size shared by the inputs that carry the batch dimension."""
    sizes = batch_sizes(flat, infos, batch_dim)
    if not sizes:
        raise InputError(
            "no input has a dynamic batch dimension to split into microbatches "
            f"(batch_dim={batch_dim}). Compile with an example batch of 2 or more so torch.export keeps it dynamic."
        )
    return next(iter(sizes.values()))  # batch_sizes checked that they agree


def _is_batched(value: Any, info: InputInfo, batch_dim: int) -> bool:
    return isinstance(value, torch.Tensor) and info.batched and len(value.shape) > batch_dim


def split_microbatches(
    flat: Sequence[Any], infos: Sequence[InputInfo], num_microbatches: int, batch_dim: int = 0
) -> list[list[Any]]:
    """``num_microbatches`` lists of flat inputs; non-batched inputs are shared by all.

    The batch must divide into ``num_microbatches`` equal parts: uneven microbatches
    would make the pipeline's gradient differ from the full batch's for losses that
    average over the batch.
    """
    if num_microbatches < 1:
        raise InputError(f"num_microbatches must be at least 1, got {num_microbatches}.")
    size = batch_size(flat, infos, batch_dim)
    if size % num_microbatches:
        raise InputError(
            f"a batch of {size} does not split into {num_microbatches} equal microbatches "
            f"({size} % {num_microbatches} = {size % num_microbatches}). Use a batch that is a multiple of "
            f"{num_microbatches}, or num_microbatches among {[d for d in range(1, size + 1) if size % d == 0]}."
        )
    per = size // num_microbatches
    for value, info in zip(flat, infos):
        if num_microbatches > 1 and _is_batched(value, info, batch_dim) and info.indexed_by is not None:
            raise InputError(
                f"input {info.name!r} {tuple(value.shape)} was taken as batched (its dimension {batch_dim} has the "
                f"batch's size, {size}), but the model looks its rows up by the values of input "
                f"{info.indexed_by!r} (an embedding or {info.name}[{info.indexed_by}]), so it is a table: cut into "
                f"{num_microbatches} microbatches each would get {per} of its {size} rows and look up wrong rows "
                f"or fail. Compile with pipesplit.compile(..., unbatched=[{info.name!r}])."
            )
    for value, info in zip(flat, infos):
        if _is_batched(value, info, batch_dim) and batch_dim in info.ranges:
            check_range(info, batch_dim, per, f" (a microbatch: a batch of {size} in {num_microbatches} microbatches)")
    out: list[list[Any]] = [[] for _ in range(num_microbatches)]
    for value, info in zip(flat, infos):
        if _is_batched(value, info, batch_dim):
            for m, piece in enumerate(value.split(per, dim=batch_dim)):
                out[m].append(piece)
        else:
            for m in range(num_microbatches):
                out[m].append(value)
    return out


def leaf_name(path: Sequence[Any]) -> str:
    """A target leaf's name as ``target_unbatched`` takes it: ``"w"`` for ``{"w": w}``, ``"1"`` for
    ``(y, w)``, ``"a.0"`` for ``{"a": (x, y)}``; ``""`` for a target that is one tensor."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def check_leaf_names(target: Any, whole: Collection[str]) -> None:
    """Every name in ``whole`` (``Pipeline(..., target_unbatched=...)``) is a leaf of ``target``."""
    names = [leaf_name(path) for path, _ in pytree.tree_flatten_with_path(target)[0]]
    unknown = [n for n in whole if n not in names]
    if unknown:
        raise InputError(
            f"target_unbatched names {unknown}, which the target does not hold; its leaves are {names} (a dict's "
            "keys, a tuple's positions, joined with '.' when nested)"
            + did_you_mean(unknown[0], names) + ". For a target that is one tensor, pass target_batch_dim=None."
        )


def split_target(target: Any, num_microbatches: int, batch_dim: int | None = 0, batch: int | None = None,
                 input_batch_dim: int = 0, whole: Collection[str] = ()) -> list[Any]:
    """Split a loss target (a tensor or a pytree of tensors) along the batch dimension.

    ``batch_dim=None`` hands the whole target to every microbatch, and so does a 0-dim leaf or one
    with no dimension at ``batch_dim`` (a seq-first model's ``(seq,)`` weights); such a leaf with
    the batch's size in some dimension is refused (a seq-first model's ``(batch,)`` labels need
    ``target_batch_dim=0``). With ``batch`` given, a tensor leaf whose size along
    ``batch_dim`` is not a multiple of the inputs' batch size is refused; a multiple is a
    flattened batch, e.g. ``(batch * seq,)`` token labels, taken in contiguous slices, which is
    right only where the inputs carry the batch first (``input_batch_dim=0``): a seq-first
    model's flattened ``(seq, batch)`` labels interleave the samples and are refused. The leaves
    named in ``whole`` (see :func:`leaf_name`) go whole to every microbatch.
    """
    leaves, spec = pytree.tree_flatten_with_path(target)
    check_leaf_names(target, whole)
    pieces: list[list[Any]] = [[] for _ in range(num_microbatches)]
    for path, leaf in leaves:
        where = "the target" + pytree.keystr(path)
        if leaf_name(path) in whole:
            for m in range(num_microbatches):
                pieces[m].append(leaf)
            continue
        if (batch_dim is not None and isinstance(leaf, torch.Tensor) and 0 < leaf.dim() <= batch_dim
                and batch is not None and batch in leaf.shape):  # (B,) labels; a (T,) weight goes whole
            raise InputError(
                f"{where} has shape {tuple(leaf.shape)}: no dimension {batch_dim} (target_batch_dim={batch_dim}) to cut "
                "into microbatches. Pass Pipeline(..., target_batch_dim=d) with the dimension that holds the batch "
                "(0 for (batch,) labels of a seq-first model), or target_batch_dim=None if every microbatch takes it whole."
            )
        if batch_dim is not None and isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
            size = leaf.shape[batch_dim]
            if batch is not None and size % batch:
                raise InputError(
                    f"{where} has size {size} along dim {batch_dim}, not a multiple of the inputs' batch of {batch}: "
                    "each microbatch "
                    f"takes its slice of the target. If the target has no batch dimension, pass "
                    f"Pipeline(..., target_batch_dim=None) so every microbatch gets it whole."
                )
            if batch is not None and size != batch and input_batch_dim != 0:
                raise InputError(
                    f"{where} has size {size} along dim {batch_dim}, {size // batch} x the batch of {batch}: a flattened "
                    f"batch, which microbatches take in contiguous slices. The inputs carry the batch in dimension "
                    f"{input_batch_dim}, so flattened labels ((seq, batch) -> seq * batch) interleave the samples and "
                    f"a slice would mix them: pass the target unflattened, with target_batch_dim={input_batch_dim}."
                )
            if size % num_microbatches:
                raise InputError(f"{where}'s batch of {size} does not split into {num_microbatches} microbatches.")
            for m, piece in enumerate(leaf.chunk(num_microbatches, dim=batch_dim)):
                pieces[m].append(piece)
        else:
            for m in range(num_microbatches):
                pieces[m].append(leaf)
    return [pytree.tree_unflatten(p, spec) for p in pieces]
