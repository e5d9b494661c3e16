"""A split program's calls: their inputs flattened and checked against the capture, the stage graphs
made to take a call's new batch size or lengths, and the sizes a boundary carries for a microbatch.

:class:`ProgramInputs` is a base of :class:`pipesplit.passes.split.program.SplitProgram`, which sets
the attributes it reads from the capture (and again when it swaps in another, see ``respecialise``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, cast

import torch

from pipesplit.capture import Captured, InputInfo
from pipesplit.compat import pytree
from pipesplit.errors import InputError, PipesplitError, PlanError
from pipesplit.inputs import Shown, shown, describe_structure, batch_sizes, check_input, check_kind, check_range, ordered_like
from pipesplit.passes.split import Boundary
from pipesplit.passes.split.sizes import sizes_of, substitute

if TYPE_CHECKING:
    from pipesplit.passes.split.program import SplitProgram


class ProgramInputs:
    """Checks a call's inputs against what the stage graphs take, generalises the graphs to new sizes
    (:mod:`pipesplit.passes.split.generalise`), and resolves the sizes boundaries carry."""

    in_spec: pytree.TreeSpec
    defaults: dict[str, Any]  # keyword arguments every call gets (use_cache=False)
    inputs: list[InputInfo]
    batch_dim: int  # the dimension microbatches are cut along
    batch_shared: bool  # the example's batched inputs agree on the batch size, so every call's must
    static_batch: int | None  # the only batch size the stage graphs take; None: any
    every_dim: bool  # every dimension captured dynamic where the model allows
    recapture: Callable[[bool], Captured] | None  # captures the model again (None: no more)
    batch_symbols: set[Any]  # the graphs' symbols for the batch size
    size_symbols: list[tuple[int, int, Any]]  # (flat input, dimension, symbol): every dynamic size

    def flatten_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, whole_batch: bool = False) -> list[Any]:
        """Flatten (args, kwargs) like the example, checking structure and shapes.

        A program captured at the example's batch size is generalised (once) when the inputs
        bring another; with ``whole_batch`` the caller cuts them into microbatches first and
        calls :meth:`ensure_batch` with the microbatch size itself.
        """
        kwargs = {**kwargs, **{k: v for k, v in self.defaults.items() if k not in kwargs}}
        template = pytree.tree_unflatten([None] * self.in_spec.num_leaves, self.in_spec)
        call = ordered_like((tuple(args), dict(kwargs)), template)  # keywords match by name, in any order
        flat, spec = pytree.tree_flatten(call)
        if spec != self.in_spec:
            got = describe_structure(pytree.tree_map(shown, (tuple(args), dict(kwargs))))
            raise InputError(
                "the program was called with inputs of another structure than the example it was compiled with.\n"
                f"  expected: {self._expected_structure()}\n  got:      {got}\n"
                "Pass the same positional arguments and keyword names as the example."
            )
        for value, info in zip(flat, self.inputs):  # a rank or dtype no batch size changes: named before a re-capture
            check_kind(value, info, self.batch_dim)
        if self.batch_shared:  # checked before a re-capture, as Pipeline.step checks it
            batch_sizes(flat, self.inputs, self.batch_dim)
        self.ensure_sizes(flat)
        free: int | None = None
        if self.static_batch is not None and whole_batch:
            free = self.batch_dim
        elif self.static_batch is not None:
            batch = next((v.shape[self.batch_dim] for v, i in zip(flat, self.inputs)
                          if i.batched and isinstance(v, torch.Tensor) and v.dim() > self.batch_dim), None)
            if batch is not None:
                self.ensure_batch(int(batch))
        fixed = "a reshape to a constant, a weight of that size, or an example of size 1" if self.every_dim else None
        for value, info in zip(flat, self.inputs):
            check_input(value, info, free, fixed, self.batch_dim)
        return flat

    def ensure_sizes(self, flat: list[Any]) -> bool:
        """Make the stage graphs take the sizes of ``flat`` besides the batch: the first time a batched
        input's other dimension (a sequence length, an image size) differs from what the graphs fix,
        the model is captured again with every dimension dynamic where it allows, once
        (:mod:`pipesplit.passes.split.generalise`). True if the graphs changed."""
        if self.every_dim or self.recapture is None:
            return False
        changed = [f"input {info.name!r} dimension {d} of {got} (captured at {want})"
                   for value, info in zip(flat, self.inputs)
                   if info.batched and isinstance(value, torch.Tensor) and info.shape and value.dim() == len(info.shape)
                   for d, (got, want) in enumerate(zip(value.shape, info.shape))
                   if d != self.batch_dim and want is not None and got != want]
        if not changed:
            return False
        from pipesplit.passes.split.generalise import generalise

        generalise(cast("SplitProgram", self), changed[0], lengths=True)
        return True

    def sizes_of(self, flat: list[Any]) -> dict[Any, int]:
        """The sizes besides the batch's that a microbatch's flat inputs give the graphs' symbols."""
        return sizes_of(flat, self.size_symbols, self.batch_symbols)

    def ensure_batch(self, size: int, what: str = "") -> bool:
        """Make the stage graphs take batches of ``size``: a program captured at the example's batch
        size captures the model again with a dynamic batch, once (:mod:`pipesplit.passes.split.generalise`).
        True if the graphs changed (a runtime built on the old ones must rebuild, see ``generation``).
        Raises InputError, before anything runs, if ``size`` lies outside the range the new capture
        holds for (a branch on the batch size); ``what`` says where the size came from."""
        if self.static_batch is None or size == self.static_batch:
            return False
        from pipesplit.passes.split.generalise import generalise

        generalise(cast("SplitProgram", self), f"a batch of {size} (captured at {self.static_batch})")
        for info in self.inputs:  # export's guard, as split_microbatches and check_input apply it later on
            if info.batched and self.batch_dim in info.ranges:
                check_range(info, self.batch_dim, size, what)
        return True

    def _expected_structure(self) -> str:
        if len(self.inputs) != self.in_spec.num_leaves:
            return str(self.in_spec)
        return describe_structure(pytree.tree_unflatten([Shown(i.name) for i in self.inputs], self.in_spec))

    def flat_tensor_inputs(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        """The checked flat inputs that are tensors (what chain-shaped stage 0 takes)."""
        flat = self.flatten_inputs(args, kwargs)
        return tuple(v for v, info in zip(flat, self.inputs) if info.is_tensor)

    def resolve_value(self, boundary: Boundary, batch: int, sizes: Mapping[Any, int] | None = None) -> Any:
        """The value of a non-tensor that crosses a boundary (a size, or a float or bool derived
        from sizes, such as ``x.shape[0] ** -0.5``) for a given (micro)batch size and, where the
        graphs have other dynamic sizes, their values (:meth:`sizes_of`)."""
        self._check_batch(batch)
        if boundary.sizes is None:
            raise PlanError(
                f"boundary {boundary.name!r} (stage {boundary.src} -> {boundary.dst}) carries a {boundary.kind} that "
                "is neither a tensor nor computed from sizes, so a pipeline stage cannot rebuild it. Keep its producer "
                f"and users in one stage (no_split=[...] or pins=...), or pass it as a tensor."
            )
        expr = boundary.sizes[0]
        if isinstance(expr, (bool, int, float)):
            return expr
        value = substitute(expr, self._size_env(expr, batch, sizes, "value"))
        if boundary.kind == "float":
            return float(value)
        if boundary.kind == "bool":
            return bool(value)
        return int(value)

    def resolve_shape(self, boundary: Boundary, batch: int, sizes: Mapping[Any, int] | None = None) -> tuple[int, ...]:
        """A boundary tensor's concrete shape for a given (micro)batch size and other sizes (see resolve_value)."""
        self._check_batch(batch)
        assert boundary.sizes is not None
        return tuple(d if isinstance(d, int) else int(substitute(d, self._size_env(d, batch, sizes, "size")))
                     for d in boundary.sizes)

    def _check_batch(self, batch: int) -> None:
        if self.static_batch is not None and batch != self.static_batch:
            raise PipesplitError(
                f"the boundaries were captured at a batch of {self.static_batch}, not {batch}: call "
                f"prog.ensure_batch({batch}) first (it captures the model again with a dynamic batch)."
            )

    def _size_env(self, expr: Any, batch: int, sizes: Mapping[Any, int] | None, what: str) -> dict[Any, int]:
        env = {**(sizes or {}), **{sym: batch for sym in self.batch_symbols}}
        unknown = expr.free_symbols - set(env)
        if unknown:
            read = {str(sym): f"input {self.inputs[i].name!r} dimension {d}" for i, d, sym in self.size_symbols}
            raise InputError(
                f"a boundary {what} {expr} depends on {', '.join(read.get(str(s), str(s)) for s in sorted(unknown, key=str))}"
                ", besides the batch size: pass the microbatch's sizes (prog.sizes_of(its flat inputs))."
            )
        return env
