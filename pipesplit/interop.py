"""Hand a split program's stages to ``torch.distributed.pipelining`` as chain-shaped stages.

PyTorch's ``PipelineStage`` expects stage ``i`` to take exactly what stage ``i-1``
returns. pipesplit's stages may instead take values from any earlier stage and
program inputs anywhere. :func:`chain_modules` wraps each stage so it takes the
tensors live across its incoming cut and returns those live across its outgoing
cut (relaying skip connections and late inputs), which PyTorch's schedules can run.
Sizes that cross a cut are recomputed from the microbatch size instead of sent.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

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


def tied_across_stages(prog: SplitProgram) -> dict[int, list[int]]:
    """Trainable state entries that several stages read (a head tied to the embedding): entry -> its stages."""
    out: dict[int, list[int]] = {}
    for s, entries in enumerate(prog.stage_entries):
        for idx, t in entries.items():
            if prog.state_entry(idx).is_param and t.requires_grad:
                out.setdefault(idx, []).append(s)
    return {idx: stages for idx, stages in sorted(out.items()) if len(stages) > 1}


def to_pipeline_stage(prog: SplitProgram, stage_index: int, device: Any = None, group: Any = None, *,
                      tied_grads: Literal["refuse", "sum"] = "refuse") -> Any:
    """A ``torch.distributed.pipelining.PipelineStage`` running stage ``stage_index``.

    Feed PyTorch's schedule the program's flat tensor inputs (``prog.flat_tensor_inputs(...)``)
    on stage 0; the last stage's output is the program's flat tensor outputs.

    A weight that several stages read (a head tied to the token embedding) gets a share of its
    gradient on each, and torch's schedules never add them up: such a program is refused unless
    ``tied_grads="sum"``, which promises a call of :func:`sum_tied_grads` on every rank after each
    schedule step, before the optimizer's.
    """
    from torch.distributed.pipelining import PipelineStage

    if tied_grads not in ("refuse", "sum"):
        raise PipesplitError(f"to_pipeline_stage(tied_grads={tied_grads!r}): pass 'refuse' (the default) or 'sum'.")
    tied = tied_across_stages(prog)
    if tied and tied_grads != "sum":
        names = "; ".join(f"{'/'.join(prog.state_entry(i).aliases) or prog.state_entry(i).name} (stages "
                          f"{', '.join(map(str, s))})" for i, s in tied.items())
        raise PipesplitError(
            f"the program ties weights across stages: {names}. Under torch's schedules each stage gets its own share of "
            "such a weight's gradient and nothing adds them up, so the weight would train on part of its gradient. Pass "
            "to_pipeline_stage(..., tied_grads='sum') and call pipesplit.interop.sum_tied_grads(prog, [stage]) on every "
            "rank after each schedule step, before optimizer.step(); or run the program with pipesplit.Pipeline, which "
            "sums them itself."
        )
    module = chain_modules(prog)[stage_index]
    dev = concrete_device(device) if device is not None else prog.stages[stage_index].device
    return PipelineStage(module, stage_index, prog.num_stages, dev, group=group)


def sum_tied_grads(prog: SplitProgram, stages: Sequence[Any], group: Any = None) -> None:
    """Give each weight that several stages read its whole gradient: the sum of every stage's share, on the
    first of this rank's ``stages`` (``PipelineStage`` objects or stage indices) that reads it.

    Call it on every rank of ``group`` (the pipeline's ranks; default: every rank) once per
    optimizer step, after the schedule steps whose gradients it takes (with ``zero_grad`` between
    optimizer steps, as usual) and before ``optimizer.step()``: each rank then applies the same
    update to its own copy. Without ``torch.distributed`` initialised, ``stages`` are every stage
    that ran, in this process.
    """
    import torch.distributed as dist

    local = sorted({int(getattr(s, "stage_index", s)) for s in stages})
    distributed = dist.is_available() and dist.is_initialized()
    for idx, readers in tied_across_stages(prog).items():
        holders = list({id(t): t for t in (e[idx] for e in prog.stage_entries if idx in e)}.values())
        first = next((prog.stage_entries[s][idx] for s in local if s in readers), None)
        device = first.device if first is not None else getattr(stages[0], "device", holders[0].device)
        total = torch.zeros(holders[0].shape, dtype=holders[0].dtype, device=device)
        for t in holders:  # this process's shares: on its own stages, or moved to another holder by its hook
            if t.grad is not None:
                total += t.grad.to(device).to_dense()
                t.grad = None
        if distributed:
            dist.all_reduce(total, group=group)
        if first is not None:
            first.grad = total
