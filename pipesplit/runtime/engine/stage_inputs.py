"""A stage's input plumbing: which boundaries it receives and sends, at which shapes, and the
arguments it hands its graph for a microbatch (received values, the caller's inputs, their leaves
and in-place writes); :mod:`pipesplit.runtime.engine.worker` runs its actions on them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from pipesplit.compat import optimization_hint
from pipesplit.passes.aliasing import inplace_inputs
from pipesplit.passes.split.program import SplitProgram, Stage
from pipesplit.runtime.comm.exchange import RankComm
from pipesplit.runtime.comm.transport import Like
from pipesplit.schedules.rendezvous import Message

if TYPE_CHECKING:
    from pipesplit.runtime.engine.worker import StepData


class StageInputs:
    """The boundaries of one stage and what crosses them for a microbatch (:class:`~pipesplit.runtime.engine.worker.StageWorker`
    runs the stage's actions on them)."""

    def __init__(self, prog: SplitProgram, stage: Stage, checkpointing: bool):
        self.prog, self.stage = prog, stage
        self.checkpointing = checkpointing
        self.is_last = stage.index == prog.num_stages - 1
        self.index = stage.index
        self.in_bounds = {(b.name, b.src): b for b in prog.boundaries if b.dst == stage.index}
        self.bounds = {(b.name, b.src, b.dst): b for b in prog.boundaries if stage.index in (b.src, b.dst)}
        self.consumers: dict[str, list[int]] = {}
        for b in prog.boundaries:
            if b.src == stage.index:
                self.consumers.setdefault(b.name, []).append(b.dst)
        self.out_bounds = {(b.name, b.dst): b for b in prog.boundaries if b.src == stage.index}
        self._shapes: dict[tuple[str, int, Any], tuple[int, ...]] = {}  # (boundary, source, microbatch sizes)
        self._ints: dict[tuple[str, int, Any], int] = {}
        self._written: tuple[torch.nn.Module, frozenset[str]] | None = None
        self._layouts: tuple[torch.nn.Module, dict[str, list[int] | None]] | None = None  # see _layout
        self.written_inputs = {where for s in prog.stages for name, kind, where in s.inputs  # flat input indices
                               if kind == "input" and name in s.mutated_inputs}

    def _written_inputs(self) -> frozenset[str]:
        """The inputs the stage's graph in its current mode writes in place: the split's
        ``mutated_inputs`` (for both modes) less those only eval mode writes (a dropout returns
        its input itself in eval mode, a new tensor in training), found once per module."""
        module = self.stage.module
        if self._written is None or self._written[0] is not module:
            graph = getattr(module, "graph", None)
            now = inplace_inputs(graph, precise=True) if isinstance(graph, torch.fx.Graph) else self.stage.mutated_inputs
            self._written = (module, frozenset(self.stage.mutated_inputs & set(now)))
        return self._written[1]

    def _as_sent(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A received tensor the stage writes in place, in the memory layout the model made it with (a
        transposed view, say): a transport delivers it contiguous, and an op that reads it before the
        write then saves it itself where the model's saved a copy, so the write broke that op's backward
        under torchrun (a linear on a transposed conv output, then a ``mul_``: autograd's version error)."""
        order = self._layout(name)
        if order is None or len(order) != value.dim():
            return value
        inverse = [order.index(d) for d in range(value.dim())]
        return value.permute(order).contiguous().permute(inverse)

    def _layout(self, name: str) -> list[int] | None:
        """The order of input ``name``'s dimensions in memory, outermost first, as the capture saw it
        (None: row-major or unknown), found once per module."""
        module = self.stage.module
        if self._layouts is None or self._layouts[0] is not module:
            self._layouts = (module, {})
        known = self._layouts[1]
        if name not in known:
            graph = getattr(module, "graph", None)
            node = next((n for n in graph.nodes if n.op == "placeholder" and n.name == name), None) \
                if isinstance(graph, torch.fx.Graph) else None
            val = None if node is None else node.meta.get("val")
            order = None
            if isinstance(val, torch.Tensor) and val.dim() >= 2:
                try:
                    strides = [int(optimization_hint(st)) for st in val.stride()]
                    order = sorted(range(val.dim()), key=lambda d: -strides[d])
                except Exception:  # a layout export cannot say: as received
                    order = None
            known[name] = None if order == list(range(len(order or []))) else order
        return known[name]

    def like(self, msg: Message, data: StepData) -> Like:
        """Shape, dtype and device of ``msg`` as this stage receives it (an activation or its gradient)."""
        return self._like(self.bounds[(msg.name, msg.src, msg.dst)], data)

    def _like(self, b: Any, data: StepData) -> Like:
        key = (b.name, b.src, data.size_key)
        shape = self._shapes.get(key)
        if shape is None:  # sympy resolves the sizes in ~0.3 ms: once per microbatch shape
            shape = self._shapes[key] = self.prog.resolve_shape(b, data.microbatch_size, data.sizes)
        return shape, b.dtype, self.stage.device

    def _scalar(self, b: Any, data: StepData) -> Any:
        key = (b.name, b.src, data.size_key)
        value = self._ints.get(key)
        if value is None:
            value = self._ints[key] = self.prog.resolve_value(b, data.microbatch_size, data.sizes)
        return value

    def _to_device(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.device != self.stage.device:
            return v.to(self.stage.device, non_blocking=True)
        return v

    def stage_args(self, m: int, data: StepData, comm: RankComm, leaves: list[tuple[str, int, torch.Tensor]],
                   user_leaves: list[tuple[int, torch.Tensor]]) -> tuple[list[Any], set[int], list[tuple[int, torch.Tensor]]]:
        """Microbatch ``m``'s arguments of the stage's graph, in order: what it receives (taken from
        ``comm``) and the caller's inputs, each a leaf of its own where a gradient is taken at it
        (appended to ``leaves``: (boundary, source stage, leaf); ``user_leaves``: (flat input index,
        leaf)). Also the positions the stage writes in place (cloned inside the stage) and the
        caller's rows such a write goes back to."""
        received: dict[tuple[str, int], Any] = {}
        written_now = self._written_inputs()
        for name, kind, where in self.stage.inputs:
            if kind != "stage":
                continue
            b = self.in_bounds[(name, where)]
            if b.kind != "tensor":  # sizes are known from the microbatch size on every rank
                received[(name, where)] = self._scalar(b, data)
                continue
            value = self._to_device(comm.take(Message("F", name, where, self.index, m)))
            if name in written_now and isinstance(value, torch.Tensor):
                value = self._as_sent(name, value)
            if data.training and b.requires_grad:
                value = value.detach().requires_grad_(True)
            received[(name, where)] = value
        args: list[Any] = []
        own: set[int] = set()  # positions of the inputs the stage writes in place (relu_, +=): cloned inside
        write_back: list[tuple[int, torch.Tensor]] = []  # (position, the caller's rows) a write goes back to
        for name, kind, where in self.stage.inputs:
            value = data.inputs[m][where] if kind == "input" else received[(name, where)]
            if isinstance(value, torch.Tensor) and name in written_now:
                # Written in place: autograd forbids that on the leaf we take its gradient at, the sender
                # may still hold the storage, and checkpointing replays the stage from its inputs as given.
                # A clone made inside the (replayed) stage costs what the out-of-place op would have.
                own.add(len(args))
            if kind == "input":
                given, value = value, self._to_device(value)
                if data.training and isinstance(value, torch.Tensor) and value.requires_grad:
                    # the caller's tensor (or its microbatch, a view of it): its gradient is taken at a
                    # leaf of this stage's own and added to the caller's after the step, in order
                    value = value.detach().requires_grad_(True)
                    user_leaves.append((where, value))
                elif len(args) in own:  # the write goes back to the caller's rows, as the model's would
                    write_back.append((len(args), given))
                    if self.checkpointing and data.training:  # what checkpointing saves to replay from
                        value = value.clone()
                elif isinstance(value, torch.Tensor) and where in self.written_inputs:
                    # another stage writes this input in place, into the caller's rows: this stage reads
                    # its own copy, taken at its forward. Else a later write reaches what this stage
                    # still reads: what microbatch k - 1 saved for its backward (microbatches are views
                    # of one batch sharing its version counter), or the input a deferred W computes its
                    # weight gradient from (zb_v, one microbatch: an MHA's in_proj gradient 115% off)
                    value = value.clone()
                args.append(value)
                continue
            if isinstance(value, torch.Tensor) and value.requires_grad and value.is_leaf:
                leaves.append((name, where, value))
            args.append(value)
        return args, own, write_back

    def output_grads(self, m: int, outputs: Sequence[Any], comm: RankComm, tensors: list[torch.Tensor],
                     grads: list[torch.Tensor | None]) -> None:
        """Take microbatch ``m``'s gradients of the stage's ``outputs`` from ``comm``, summed over the
        stages that read each, into ``tensors`` and ``grads`` (what the backward starts from)."""
        if self.is_last:
            return
        for name, value in zip(self.stage.outputs, outputs):
            total = None
            for dst in self.consumers.get(name, ()):
                b = self.out_bounds[(name, dst)]
                if b.kind != "tensor" or not b.requires_grad:
                    continue
                g = self._to_device(comm.take(Message("B", name, self.index, dst, m)))
                total = g if total is None else total + g
            if total is not None and isinstance(value, torch.Tensor) and value.requires_grad:
                tensors.append(value)
                grads.append(total)

    def _live_outputs(self) -> tuple[int, ...]:
        """The outputs a gradient comes back for: the last stage's all, another's those whose cut carries one."""
        return tuple(i for i, name in enumerate(self.stage.outputs) if self.is_last or any(
            self.out_bounds[(name, dst)].requires_grad for dst in self.consumers.get(name, ())))
