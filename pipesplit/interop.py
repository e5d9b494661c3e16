"""Hand a split program's stages to ``torch.distributed.pipelining`` as chain-shaped stages.

PyTorch's ``PipelineStage`` expects stage ``i`` to take exactly what stage ``i-1``
returns. pipesplit's stages may instead take values from any earlier stage and
program inputs anywhere. :func:`chain_modules` wraps each stage so it takes the
tensors live across its incoming cut and returns those live across its outgoing
cut (relaying skip connections and late inputs), which PyTorch's schedules can run.
Sizes that cross a cut are recomputed from the microbatch size instead of sent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipesplit.devices import concrete_device
from pipesplit.errors import PipesplitError
from pipesplit.passes.split.program import SplitProgram


def _boundaries(prog: SplitProgram) -> dict[tuple[str, int], Any]:
    """(value name, source stage) -> its boundary (the same for every consumer)."""
    return {(b.name, b.src): b for b in prog.boundaries}


def _live_sets(prog: SplitProgram) -> list[list[tuple[str, str, int]]]:
    """live[i]: the tensor values entering stage i as (name, "input"|"stage", index|src), in a fixed order."""
    k = prog.num_stages
    bounds = _boundaries(prog)
    last_use: dict[tuple[str, str, int], int] = {}
    for stage in prog.stages:
        for name, kind, where in stage.inputs:
            key = (name, kind, where)
            b = bounds[(name, where)] if kind == "stage" else None
            if kind == "input" and not prog.inputs[where].is_tensor:
                continue
            if b is not None and b.kind != "tensor":
                continue
            last_use[key] = max(last_use.get(key, -1), stage.index)
    live: list[list[tuple[str, str, int]]] = []
    for i in range(k):
        entering = []
        for key, last in last_use.items():
            name, kind, where = key
            born = 0 if kind == "input" else where + 1
            if born <= i <= last:
                entering.append(key)
        live.append(sorted(entering, key=lambda t: (t[1] != "input", t[2], t[0])))
    return live


class ChainStage(nn.Module):
    """Stage ``i`` of a split program with chain-shaped inputs and outputs."""

    def __init__(self, prog: SplitProgram, index: int, live_in: list[Any], live_out: list[Any] | None):
        super().__init__()
        self.prog, self.index = prog, index
        self.stage_module = prog.stages[index].module
        self.live_in, self.live_out = live_in, live_out
        self.position = {key: i for i, key in enumerate(live_in)}
        bounds = _boundaries(prog)
        # per value, the dimension whose size is the microbatch size (None: no such dimension)
        self.batch_axis = [
            _input_batch_axis(prog, w) if kind == "input" else _batch_axis(prog, bounds[(n, w)])
            for n, kind, w in live_in
        ]
        # per value, (dimension, symbol) of each dynamic size it carries (a sequence length): what sizes it tells
        symbols: dict[int, list[tuple[int, Any]]] = {}
        for where, d, sym in prog.size_symbols:
            symbols.setdefault(where, []).append((d, sym))
        self.size_axes = [
            symbols.get(w, []) if kind == "input" else [] if bounds[(n, w)].kind != "tensor" else
            [(i, e) for i, e in enumerate(bounds[(n, w)].sizes or ()) if not isinstance(e, int) and e.is_Symbol]
            for n, kind, w in live_in
        ]
        self.int_inputs = {
            (n, w): bounds[(n, w)]
            for n, kind, w in prog.stages[index].inputs
            if kind == "stage" and bounds[(n, w)].kind != "tensor"
        }

    def forward(self, *values: torch.Tensor) -> Any:
        batch = next((v.shape[ax] for v, ax in zip(values, self.batch_axis) if ax is not None), None)
        args = []
        for name, kind, where in self.prog.stages[self.index].inputs:
            if (name, where) in self.int_inputs:
                if batch is None:
                    raise PipesplitError(f"stage {self.index} cannot recompute size {name!r}: no batched input.")
                sizes = {sym: int(v.shape[d]) for v, axes in zip(values, self.size_axes) for d, sym in axes}
                args.append(self.prog.resolve_value(self.int_inputs[(name, where)], batch, sizes))
            elif kind == "input" and not self.prog.inputs[where].is_tensor:
                args.append(self.prog.inputs[where].example)
            else:
                value = values[self.position[(name, kind, where)]]
                if name in self.prog.stages[self.index].mutated_inputs:  # written in place (relu_, +=)
                    value = value.clone()
                args.append(value)
        outs = tuple(self.stage_module(*args))
        if self.live_out is None:  # the last stage: the program's flat outputs
            flat = self.prog.assemble_outputs(outs)
            tensors = tuple(o for o in flat if isinstance(o, torch.Tensor))
            return tensors[0] if len(tensors) == 1 else tensors
        produced = {(n, "stage", self.index): v for n, v in zip(self.prog.stages[self.index].outputs, outs)}
        return tuple(produced[key] if key in produced else values[self.position[key]] for key in self.live_out)


def _input_batch_axis(prog: SplitProgram, where: int) -> int | None:
    return prog.batch_dim if prog.inputs[where].batched else None


def _batch_axis(prog: SplitProgram, boundary: Any) -> int | None:
    """The first dimension of a boundary tensor whose size is the batch size itself."""
    if boundary.kind != "tensor" or boundary.sizes is None:
        return None
    for i, expr in enumerate(boundary.sizes):
        if not isinstance(expr, int) and expr.is_Symbol and expr in prog.batch_symbols:
            return i
    return None


def chain_modules(prog: SplitProgram) -> list[ChainStage]:
    """One chain-shaped module per stage; stage 0 takes the program's flat tensor inputs.

    torch's schedules feed microbatches of any size, so a program captured at the example's
    batch is generalised first (:mod:`pipesplit.passes.split.generalise`).
    """
    if prog.static_batch is not None:
        from pipesplit.passes.split.generalise import generalise

        generalise(prog, "torch's pipelining schedules feed microbatches of any size")
    live = _live_sets(prog)
    first = [(i.name, "input", n) for n, i in enumerate(prog.inputs) if i.is_tensor]
    modules = []
    for i in range(prog.num_stages):
        live_in = first if i == 0 else live[i]
        live_out = live[i + 1] if i + 1 < prog.num_stages else None
        modules.append(ChainStage(prog, i, live_in, live_out))
    return modules


def to_pipeline_stage(prog: SplitProgram, stage_index: int, device: Any = None, group: Any = None) -> Any:
    """A ``torch.distributed.pipelining.PipelineStage`` running stage ``stage_index``.

    Feed PyTorch's schedule the program's flat tensor inputs (``prog.flat_tensor_inputs(...)``)
    on stage 0; the last stage's output is the program's flat tensor outputs.
    """
    from torch.distributed.pipelining import PipelineStage

    module = chain_modules(prog)[stage_index]
    dev = concrete_device(device) if device is not None else prog.stages[stage_index].device
    return PipelineStage(module, stage_index, prog.num_stages, dev, group=group)
