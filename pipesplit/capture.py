"""Frontend: capture an nn.Module as an unlifted torch.export graph with its specs."""

from __future__ import annotations

import operator
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Collection

import torch
import torch.fx as fx
from torch import nn

from pipesplit.compat import EXPORTS_META_MODELS, is_concrete_int, pytree
from pipesplit.distinct import distinct_inputs
from pipesplit.dims import EVERY_DIM, DimSpec, check_declared
from pipesplit.dynamic_spec import argument_of_each_leaf, dynamic_shapes, ranges
from pipesplit.errors import CaptureError
from pipesplit.examples import blamed_on_input, check_example, check_input_dtypes, keyword_inputs
from pipesplit.export import export_quietly, unlift
from pipesplit.kv_cache import nested_cache_off, no_cache_kwargs
from pipesplit.passes.lookups import indexed_by, position_limits

log = logging.getLogger(__name__)

@dataclass
class StateEntry:
    """One distinct tensor of the model's state (a tied tensor is one entry)."""

    name: str  # canonical name: first name in the model's own order
    aliases: tuple[str, ...]  # every name the original model knows it by (name first)
    tensor: torch.Tensor  # the program's own copy (a clone of the user's tensor)
    is_param: bool
    persistent: bool


@dataclass
class InputInfo:
    """One flattened input of the captured program."""

    name: str
    is_tensor: bool
    shape: tuple[int | None, ...] | None  # None marks a dynamic dimension
    dtype: torch.dtype | None
    example: Any  # the example value itself for non-tensors
    # per dynamic dimension: the sizes torch.export assumed it can take, (low, high or None)
    ranges: dict[int, tuple[int, int | None]] = field(default_factory=dict)
    unbatched: bool = False  # marked by the user: the same whole tensor goes to every microbatch
    batched: bool = False  # cut into microbatches: its batch dimension is dynamic, or captured at the example's batch
    # another input whose values index this one along the batch dimension (table[idx]): a table, never cut
    indexed_by: str | None = None
    # per dynamic dimension the model bounds by a table's size, why (see pipesplit.passes.lookups.position_limits)
    limits: dict[int, str] = field(default_factory=dict)

    def has_batch_dim(self, d: int) -> bool:
        """A tensor input with a dimension ``d`` that the user did not mark unbatched."""
        return self.is_tensor and bool(self.shape) and len(self.shape) > d and not self.unbatched  # type: ignore[arg-type]


@dataclass
class Captured:
    """What ``capture`` returns: the graph, its pytree specs and the model's state.

    ``gm`` refers to the program's own copies of the parameters and buffers, never
    the user's tensors, so running it cannot change the user's model.
    """

    gm: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    inputs: list[InputInfo]
    example_flat: list[Any]
    state: list[StateEntry]
    target_to_entry: dict[str, int]  # get_attr target -> index into state
    state_keys: dict[str, int]  # the model's state_dict keys, in order -> index into state
    mutated_targets: set[str]
    module_paths: set[str]
    export_seconds: float
    training: bool
    notes: list[str] = field(default_factory=list)
    defaults: dict[str, Any] = field(default_factory=dict)  # keyword arguments pipesplit added (use_cache)
    # modules whose Python code branches on self.training beyond what the eval twin switches (spectral norm)
    training_branches: list[str] = field(default_factory=list)

    @property
    def mutated_names(self) -> set[str]:
        return {self.state[self.target_to_entry[t]].name for t in self.mutated_targets if t in self.target_to_entry}

    batch_dim: int = 0
    dynamic: bool = True  # the batch dimension was captured dynamic (False: at the example's size)
    every_dim: bool = False  # every dimension of the batched inputs was captured dynamic where the model allows

    @property
    def example_batch(self) -> int | None:
        """The example's batch size (its first batched input's), None if no input has a batch dimension."""
        return next((int(x.shape[self.batch_dim]) for x, i in zip(self.example_flat, self.inputs) if i.batched), None)

    @property
    def static_batch(self) -> int | None:
        """The one batch size the graph takes when captured statically (None: any, or no batch)."""
        return None if self.dynamic else self.example_batch

    @property
    def batch_dynamic(self) -> bool:
        d = self.batch_dim
        tensors = [i for i in self.inputs if i.has_batch_dim(d)]
        return bool(tensors) and all(i.shape[d] is None for i in tensors if i.shape)


def training_branches(model: nn.Module) -> list[str]:
    """Modules of ``model`` whose Python code does something else in eval mode than what the graph
    ops dropout and BatchNorm switch: spectral norm runs its power iteration, which writes its
    ``_u``/``_v`` buffers, only under ``if self.training``, so a graph captured in training mode
    runs it in eval mode too."""
    out = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        hooks = module._forward_pre_hooks.values()
        if module.training and (kind == "_SpectralNorm" or any(type(h).__name__ == "SpectralNorm" for h in hooks)):
            out.append(f"{name or type(model).__name__} (spectral norm)")
    return out


def as_args(example_input: Any) -> tuple[Any, ...]:
    """The positional arguments an example stands for: a tuple is the arguments, anything else the one argument."""
    return example_input if isinstance(example_input, tuple) else (example_input,)


def _state_entries(model: nn.Module) -> tuple[list[StateEntry], dict[int, int]]:
    """Distinct state tensors of ``model`` by identity, with every alias name."""
    entries: list[StateEntry] = []
    by_id: dict[int, int] = {}
    non_persistent = {
        f"{prefix}.{b}" if prefix else b
        for prefix, mod in model.named_modules(remove_duplicate=False)
        for b in mod._non_persistent_buffers_set
    }
    named: list[tuple[str, torch.Tensor, bool]] = [
        (n, t, True) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(n, t, False) for n, t in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_param in named:
        key = id(tensor)
        if key in by_id:
            entry = entries[by_id[key]]
            entry.aliases = entry.aliases + (name,)
            continue
        by_id[key] = len(entries)
        entries.append(StateEntry(name, (name,), tensor, is_param, name not in non_persistent))
    return entries, by_id


def _own_copy(t: torch.Tensor, is_param: bool) -> torch.Tensor:
    copy = t.detach().clone()
    return nn.Parameter(copy, requires_grad=t.requires_grad) if is_param else copy


def _mutated_targets(gm: fx.GraphModule) -> set[str]:
    """get_attr targets that some op writes in place: directly, through a view (``buf[0] = x``
    is get_attr -> select -> copy_), or inside a higher-order op's subgraph.

    The training-IR graph lists no buffer mutation for ``batch_norm(training=True)``
    and its schema carries no write annotation, so that family is matched by name
    (see :mod:`pipesplit.passes.aliasing`).
    """
    from pipesplit.passes.aliasing import written_get_attrs

    return written_get_attrs(gm.graph)


def static_dim(d: Any) -> int | None:
    """The size if it is fixed (export may specialize a SymInt to a constant), else None."""
    return int(d) if is_concrete_int(d) else None


def _input_infos(
    gm: fx.GraphModule, example_flat: list[Any], ep: Any, unbatched: list[bool], batch_dim: int, dynamic: bool
) -> list[InputInfo]:
    """One InputInfo per flat input. An input is batched where export kept its batch dimension
    dynamic, or (``dynamic=False``) wherever it has one and the user did not mark it unbatched."""
    infos = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example, fixed in zip(placeholders, example_flat, unbatched):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = tuple(static_dim(d) for d in val.shape)
            info = InputInfo(node.name, True, shape, val.dtype, None, ranges(ep, val), fixed)
            info.batched = info.has_batch_dim(batch_dim) and (not dynamic or shape[batch_dim] is None)
            infos.append(info)
        else:
            infos.append(InputInfo(node.name, False, None, None, example))
    lengths = {size.node.expr for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)
               for j, size in enumerate(n.meta["val"].shape) if j != batch_dim and static_dim(size) is None}
    for info, node in zip(infos, placeholders):
        if info.batched and dynamic and node.meta["val"].shape[batch_dim].node.expr in lengths:
            info.batched = False  # its dimension batch_dim is another input's length ((T, D) beside (B, T, D)): a table
        if info.batched:
            info.indexed_by = indexed_by(node, set(placeholders) - {node}, batch_dim)
    for (i, dim), (rows, why) in position_limits(gm, placeholders).items():  # a table export does not bound
        low, high = infos[i].ranges.get(dim, (2, None))
        if high is None or rows < high:
            infos[i].ranges[dim], infos[i].limits[dim] = (low, rows), why
    return infos


def _check_meta_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A model on the meta device with real example inputs needs a torch that can export it."""
    if EXPORTS_META_MODELS or not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    real = sorted({str(t.device) for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not t.is_meta})
    if real:
        raise CaptureError(
            f"{type(model).__name__} is built on the meta device and the example inputs are on {', '.join(real)}: "
            f"torch {torch.__version__} cannot export that (its fake tensors refuse to mix meta and {real[0]}); "
            "torch 2.13 or newer can. Upgrade torch (pip install 'torch>=2.13'), or build the model on a real device."
        )


def capture(
    model: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None = None,
    batch_dim: int = 0,
    unbatched: Collection[str] = (),
    dynamic: bool = True,
    copy_state: bool = True,
    dims: DimSpec | None = None,
) -> Captured:
    """Export ``model`` on the example inputs; the batch dimension is made dynamic where possible
    (``dynamic=False``: captured at the example's shapes, a faster export whose graph takes only
    the example's batch size; see :mod:`pipesplit.passes.split.generalise`).

    ``copy_state=False`` leaves the model's own tensors in the graph instead of the program's
    copies (a capture only read for its structure).

    ``dims`` (:func:`pipesplit.dims.parse_dynamic_dims`) makes more dimensions dynamic with the
    batch: a declared one the model fixes or bounds below its declared sizes raises CaptureError.

    ``unbatched`` names forward() arguments that have no batch dimension (a lookup table):
    they stay static and every microbatch gets them whole. A model whose ``forward`` takes
    ``use_cache`` and whose config, or a config nested in it (``config.text_config``), asks for a
    KV cache (Hugging Face's default) is called with ``use_cache=False``; one whose ``forward``
    does not name it is captured with those flags off and put back after
    (:mod:`pipesplit.kv_cache`); either unless the example kwargs say otherwise (see ``notes``).

    >>> cap = capture(torch.nn.Linear(4, 2), torch.randn(3, 4))
    >>> [i.shape for i in cap.inputs]
    [(None, 4)]
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"compile() takes an nn.Module, got {type(model).__name__}.")
    args = as_args(args)
    notes: list[str] = []
    given = keyword_inputs(kwargs)
    check_example(model, args, given, batch_dim, unbatched)
    kwargs = no_cache_kwargs(model, given, notes)
    try:
        owners = argument_of_each_leaf(model, args, kwargs)
        dyn = dynamic_shapes(model, args, kwargs, batch_dim, unbatched, dims)
    except TypeError as e:
        raise CaptureError(
            f"the example inputs do not fit {type(model).__name__}.forward{inspect.signature(model.forward)}: {e}. "
            "Pass positional inputs as a tuple and keyword inputs as example_kwargs."
        ) from None
    for what, named in (("unbatched", set(unbatched)), ("dynamic_dims", set(dims or {}) - {EVERY_DIM})):
        unknown = sorted(named - set(owners))
        if unknown:  # before the (slow) export
            raise CaptureError(
                f"{what} names {unknown}, which the example call does not pass; the arguments passed are "
                f"{sorted(set(owners))}."
            )
    _check_meta_export(model, args, kwargs)
    args, kwargs, copied = distinct_inputs(args, kwargs)  # export would fold inputs that share memory into one
    if copied:
        log.debug("pipesplit: example inputs %s share memory with an earlier one: captured from copies", copied)
    try:
        with nested_cache_off(model, kwargs, notes):
            ep, export_seconds = export_quietly(model, args, kwargs, dyn if dynamic else None)
    except CaptureError as e:
        raise blamed_on_input(e, model, args, kwargs) from e.__cause__
    gm, in_spec, out_spec = unlift(ep)  # flat in, flat out; the specs are kept here
    check_input_dtypes(gm, type(model).__name__)

    entries, by_id = _state_entries(model)
    target_to_entry: dict[str, int] = {}
    names_to_entry = {alias: i for i, e in enumerate(entries) for alias in e.aliases}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        obj = operator.attrgetter(node.target)(gm)
        if not isinstance(obj, torch.Tensor):
            continue
        idx = by_id.get(id(obj), names_to_entry.get(node.target))
        if idx is None:  # a constant lifted by export (not part of the model's state)
            entries.append(StateEntry(node.target, (), obj, False, False))
            idx = len(entries) - 1
        target_to_entry[node.target] = idx
    state_keys = {key: by_id[id(t)] for key, t in model.state_dict(keep_vars=True).items() if id(t) in by_id}
    if copy_state:
        for entry in entries:  # the program's own copies: the user's tensors are never touched
            entry.tensor = _own_copy(entry.tensor, entry.is_param)
        for target, idx in target_to_entry.items():
            rebind(gm, target, entries[idx].tensor)

    flat, _ = pytree.tree_flatten((args, kwargs))
    infos = _input_infos(gm, flat, ep, [o in unbatched for o in owners], batch_dim, dynamic)
    if dims:
        check_declared(dims, infos, owners, flat)
        for info, owner in zip(infos, owners):
            for d, declared in (dims.get(owner) or {}).items():
                if declared is not None and declared[1] is not None and d not in info.limits:
                    info.limits[d] = (f"compile(..., dynamic_dims=...) declared sizes {declared[0]}..{declared[1]} "
                                      "(declare a larger range for more)")
    captured = Captured(
        gm=gm,
        in_spec=in_spec,
        out_spec=out_spec,
        inputs=infos,
        example_flat=flat,
        state=entries,
        target_to_entry=target_to_entry,
        state_keys=state_keys,
        mutated_targets=_mutated_targets(gm),
        module_paths={n for n, _ in model.named_modules() if n},
        export_seconds=export_seconds,
        training=model.training,
        notes=notes,
        training_branches=training_branches(model),
        defaults={k: v for k, v in kwargs.items() if k not in given},
        batch_dim=batch_dim,
        dynamic=dynamic,
        every_dim=dynamic and bool(dims) and EVERY_DIM in (dims or {}),
    )
    if captured.training_branches:
        notes.append(f"{', '.join(captured.training_branches[:3])} branch on self.training in Python: the graph "
                     "holds training mode only, and prog.eval() / pipe.eval() are refused")
    for info in infos:
        if info.batched and info.indexed_by is not None:
            notes.append(f"input {info.name!r} is taken as batched but the model looks its rows up by the values of "
                         f"{info.indexed_by!r}: a table, which microbatches cannot cut; compile with "
                         f"unbatched=[{info.name!r}]")
            log.warning("pipesplit: %s", notes[-1])
    d = batch_dim
    if dynamic and any(i.has_batch_dim(d) for i in infos) and not captured.batch_dynamic:
        pinned = [f"{i.name}[{d}]={x.shape[d]}" for i, x in zip(infos, flat)
                  if i.has_batch_dim(d) and i.shape[d] is not None]  # type: ignore[index]
        why = " (an example batch of size 1 always pins it: use a batch of 2 or more)" if any(
            isinstance(x, torch.Tensor) and x.dim() > d and x.shape[d] == 1 for x in flat) else ""
        notes.append(f"the model pins the batch dimension ({', '.join(pinned)}){why}; "
                     "the program accepts only that batch size")
        read = {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.users}  # an unused input stays free
        free = [i.name for i in infos if i.has_batch_dim(d) and i.shape[d] is None and i.name in read]  # type: ignore[index]
        if free:  # some inputs the model reads keep a free batch: the pinned ones are likely tables, not batches
            names = [i.name for i in infos if i.has_batch_dim(d) and i.shape[d] is not None]  # type: ignore[index]
            notes[-1] += (f". {', '.join(map(repr, names))} kept dimension {d} fixed while "
                          f"{', '.join(map(repr, free))} took any size: if {'it has' if len(names) == 1 else 'they have'} "
                          f"no batch dimension (a table, a mask shared by every sample), compile with "
                          f"pipesplit.compile(..., unbatched={names!r})")
        log.warning("pipesplit: %s", notes[-1])
    return captured


def rebind(root: nn.Module, target: str, tensor: torch.Tensor) -> None:
    """Point ``root``'s attribute at dotted ``target`` (a parameter, buffer or plain attribute) to ``tensor``."""
    *prefix, leaf = target.split(".")
    mod = root
    for part in prefix:
        mod = getattr(mod, part)
    if leaf in mod._parameters:
        mod._parameters[leaf] = tensor  # type: ignore[assignment]
    elif leaf in mod._buffers:
        mod._buffers[leaf] = tensor
    else:
        setattr(mod, leaf, tensor)
