"""Example inputs that share memory, made distinct before torch.export folds them into one."""

from __future__ import annotations

from typing import Any, cast

import torch

from pipesplit.compat import pytree


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    """What identifies ``t``'s memory: its device and storage address, or, where it has no storage to
    read (meta, sparse, empty), the tensor object itself."""
    ptr = 0
    if not t.is_meta and t.layout is torch.strided:
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
            ptr = 0
    if ptr:
        return (str(t.device), ptr)
    return ("object", id(t))


def _copy(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in memory of their own, with its layout and its ``requires_grad``."""
    return t.detach().clone().requires_grad_(t.requires_grad)


def distinct_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], list[str]]:
    """``(args, kwargs)`` with every tensor leaf that shares memory with an earlier one (the same
    tensor twice, or a view of it) replaced by a copy, and the paths of the leaves copied.

    torch.export fakifies a tensor once per storage: the same tensor given as two inputs
    (``compile(model, ids, example_kwargs={"labels": ids})``) becomes one input read twice, and
    the program would read the first argument for both on every later call. Copies keep each
    input its own; the containers are rebuilt, never the user's changed.

    >>> x = torch.ones(2, 3)
    >>> (a, b), _, copied = distinct_inputs((x, x), {})
    >>> a is x, b is x, torch.equal(a, b), copied
    (True, False, True, ['args[1]'])
    """
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    seen: set[tuple[str, int]] = set()
    copied: list[str] = []
    out = []
    for path, leaf in leaves:
        key = _storage_key(leaf) if isinstance(leaf, torch.Tensor) else None
        if key is not None and key in seen:
            out.append(_copy(leaf))
            copied.append(("args" if cast(Any, path[0]).idx == 0 else "kwargs") + pytree.keystr(path[1:]))
            continue
        if key is not None:
            seen.add(key)
        out.append(leaf)
    if not copied:
        return args, kwargs, []
    new_args, new_kwargs = pytree.tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs), copied
