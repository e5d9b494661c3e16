"""The split program: stage modules, their boundaries, and one-process reference execution."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import nn

from pipesplit.capture import Captured, InputInfo, static_dim
from pipesplit.compat import pytree
from pipesplit.devices import concrete_device
from pipesplit.errors import PipesplitError, PlanError, partial_program
from pipesplit.passes.split.generalise import output_batch_dims
from pipesplit.passes.split.merges import output_merges
from pipesplit.inputs import batch_sizes
from pipesplit.passes.split.devices import capture_device, retarget
from pipesplit.passes.split.modes import eval_module
from pipesplit.passes.split import Boundary, SplitGraph
from pipesplit.plan import Plan
from pipesplit.rng import seeded
from pipesplit.passes.split.placing import StatePlacing
from pipesplit.passes.split.program_inputs import ProgramInputs
from pipesplit.state import Placement, Tied
from pipesplit.passes.split.sizes import input_symbols


@dataclass
class Stage:
    """One pipeline stage: a GraphModule owning its parameters under the original names."""

    index: int
    module: fx.GraphModule
    device: torch.device
    inputs: list[tuple[str, str, int]]  # (name, "input" | "stage", flat input index | source stage)
    outputs: list[str]
    nodes: list[str]
    cost: float = 0.0
    attr_targets: tuple[str, ...] = ()  # get_attr targets of its graph
    mutated_inputs: frozenset[str] = frozenset()  # inputs the stage writes in place (relu_, +=)
    modes: dict[bool, fx.GraphModule] = field(default_factory=dict, repr=False)  # training -> module
    graph_device: torch.device = torch.device("meta")  # the device its graphs' constants name (see place_graphs)

    def module_for(self, training: bool) -> fx.GraphModule:
        """This stage's module in training or eval mode (the eval twin is derived on first use)."""
        if training not in self.modes:
            base = self.modes[True]
            self.modes[False] = eval_module(base, f"Stage{self.index}Eval")
        return self.modes[training]

    def place_graphs(self, device: torch.device) -> None:
        """Make the devices its graphs create tensors on (``arange(..., device=h.device)``) ``device``,
        where its tensors now live (placed, materialised from ``meta``, or moved to a rank's GPU)."""
        for module in self.modes.values():
            retarget(module, self.graph_device, device)
        self.graph_device = device

    @property
    def input_names(self) -> list[str]:
        return [name for name, _, _ in self.inputs]

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        out: tuple[Any, ...] = self.module(*args)
        return out


class SplitProgram(ProgramInputs, StatePlacing):
    """Stage modules with explicit send/recv boundaries, exact against the original model.

    Calling it runs the stages in order on their devices (the reference semantics
    every runtime matches) and returns outputs with the model's own pytree structure.
    """

    def __init__(self, captured: Captured, split: SplitGraph, plan: Plan, devices: list[str]):
        self.in_spec = captured.in_spec
        self.out_spec = captured.out_spec
        self.notes = list(captured.notes)
        self.defaults = dict(captured.defaults)  # keyword arguments every call gets (use_cache=False)
        self.training = captured.training  # the mode the stages run in; see train() / eval()
        self.captured_training = captured.training
        self.training_branches = list(captured.training_branches)  # why eval mode would differ (see train)
        self.export_seconds = captured.export_seconds
        self.batch_dim = captured.batch_dim  # the dimension microbatches are cut along
        # captures the model again with a dynamic batch (set by compile() for a static capture)
        self.recapture: Callable[[bool], Captured] | None = None
        self.batch_pinned: str | None = None  # why the batch cannot change, once a re-capture found out
        self.timings: dict[str, float] = {}  # seconds per compile phase (set by compile)
        # bumped whenever the stage graphs are swapped (respecialise): whatever was built on them
        # (a Pipeline's workers and communication plans) rebuilds when it sees another value
        self.generation = 0
        self._state = captured.state
        # the device export saw the model's tensors on, which the graphs' device constants name
        self.capture_device = capture_device(captured)
        self._state_keys = captured.state_keys
        self.target_to_entry = dict(captured.target_to_entry)
        self._set_graph(captured, split, plan)
        self._tied: list[Tied] = []
        placement = Placement(len(captured.state))
        self.stages: list[Stage] = []
        self.stage_entries: list[dict[int, torch.Tensor]] = []  # per stage: state index -> its tensor
        for piece, device_name in zip(split.stages, devices):
            device = concrete_device(device_name)
            take = self._taker(captured, placement, device)
            module = fx.GraphModule(self._holder(piece, take), piece.graph, class_name=f"Stage{piece.index}")
            cost = plan.stage_costs[piece.index] if plan.stage_costs else 0.0
            self.stages.append(
                Stage(piece.index, module, device, piece.inputs, piece.outputs, piece.nodes, cost, tuple(piece.attrs),
                      piece.mutated_inputs, {captured.training: module}, self.capture_device)
            )
            if self.capture_device.type != "meta":  # a meta model's stages move at materialize()
                self.stages[-1].place_graphs(device)
        self._hold_the_rest(captured, placement)
        self._build_root(split)

    def _set_graph(self, captured: Captured, split: SplitGraph, plan: Plan) -> None:
        """What the program knows of its captured graph and split (set again by ``respecialise``)."""
        d = self.batch_dim
        self.plan = plan
        self.boundaries: list[Boundary] = split.boundaries
        self.inputs: list[InputInfo] = captured.inputs
        self.mutated_targets = set(captured.mutated_targets)
        self._mutated_entries = {captured.target_to_entry[t] for t in captured.mutated_targets
                                 if t in captured.target_to_entry}
        # the only batch size the stage graphs take (captured at the example's shapes); None: any
        self.static_batch: int | None = captured.static_batch
        self.example_batch: int | None = captured.example_batch
        # the example's batched inputs agree on the batch size, so every call's must
        self.batch_shared = len(set(batch_sizes(captured.example_flat, self.inputs, d, check=False).values())) <= 1
        self.captured_gm = captured.gm
        self._outputs = split.outputs
        self.batch_symbols = {
            v.meta["val"].shape[d].node.expr
            for v in captured.gm.graph.nodes
            if v.op == "placeholder"
            and isinstance(v.meta.get("val"), torch.Tensor)
            and v.meta["val"].dim() > d
            and static_dim(v.meta["val"].shape[d]) is None
        }
        self.output_batch_dims = output_batch_dims(captured)  # where microbatches' outputs join (None: no batch)
        self.output_merges = output_merges(captured, self.output_batch_dims)  # how (passes/split/merges.py)
        self.size_symbols = input_symbols(captured.gm)  # (flat input, dimension, symbol): every dynamic size
        self.every_dim = captured.every_dim  # every dimension captured dynamic where the model allows
        self.random_ops = sum(n.target is seeded for p in split.stages for n in p.graph.nodes)  # dropout & co.

    def _build_root(self, split: SplitGraph) -> None:
        root = nn.Module()
        for stage in self.stages:
            root.add_module(f"stage_{stage.index}", stage.module)
        self.root = fx.GraphModule(root, split.root, class_name="SplitRoot")

    def respecialise(self, captured: Captured, split: SplitGraph, plan: Plan) -> None:
        """Swap in the stage graphs of another capture of the same model (a dynamic batch, see
        :mod:`pipesplit.passes.split.generalise`); the parameters and buffers stay the very same tensors."""
        if captured.target_to_entry != self.target_to_entry:
            raise PlanError("capturing the model again gave other parameters and buffers than the first capture; "
                            "was the model changed after compiling? Compile it again.")
        for piece, stage in zip(split.stages, self.stages):
            if stage.module is not None:  # another rank's stage stays dropped
                entries = self.stage_entries[stage.index]

                def take(idx: int, entries: dict[int, torch.Tensor] = entries, s: int = stage.index) -> torch.Tensor:
                    if idx not in entries:
                        raise PlanError(f"the new capture puts {self._state[idx].name!r} in stage {s}, which does "
                                        "not hold it; compile with dynamic_batch=True.")
                    return entries[idx]

                module = fx.GraphModule(self._holder(piece, take), piece.graph, class_name=f"Stage{piece.index}")
                stage.modes = {self.captured_training: module}
                retarget(module, self.capture_device, stage.graph_device)
                stage.module = stage.module_for(self.training)
            stage.inputs, stage.outputs, stage.nodes = piece.inputs, piece.outputs, piece.nodes
            stage.attr_targets, stage.mutated_inputs = tuple(piece.attrs), piece.mutated_inputs
        self._set_graph(captured, split, plan)
        self.generation += 1
        if self.root is not None:
            self._build_root(split)

    def train(self, mode: bool = True) -> "SplitProgram":
        """Run every stage in training (``True``) or eval mode, as ``model.train(mode)`` would.

        Eval mode turns dropout off and has BatchNorm use (and not update) its running
        statistics; it equals ``model.eval()``. A program compiled from a model in eval
        mode has no training behaviour to switch on: compile from ``model.train()``.
        """
        if mode and not self.captured_training:
            raise PipesplitError(
                "this program was compiled from a model in eval mode, so its graph holds no training behaviour "
                "(dropout, BatchNorm batch statistics) to switch on. Compile from model.train() and call "
                "prog.eval() when you need eval mode."
            )
        if not mode and self.training_branches:
            raise PipesplitError(
                f"eval mode would not be model.eval(): {', '.join(self.training_branches[:3])} branch on self.training "
                "in Python, which the capture fixed in training mode (spectral norm would still run its power "
                "iteration and write its buffers). Evaluate the model itself with the trained weights: "
                "model.load_state_dict(prog.state_dict()); model.eval()."
            )
        for stage in self.stages:
            if stage.module is None:  # another rank's stage
                continue
            stage.module = stage.module_for(bool(mode))
            if self.root is not None:
                setattr(self.root, f"stage_{stage.index}", stage.module)
        self.training = bool(mode)
        return self

    def eval(self) -> "SplitProgram":
        """Eval mode: ``prog.train(False)``."""
        return self.train(False)

    @property
    def on_meta(self) -> bool:
        """Whether some state this process holds is still on the meta device (see ``materialize``)."""
        return any(t.is_meta for _, t in self.held_state())

    def materialize(self, stages: set[int] | None = None) -> list[str]:
        """Give the state of ``stages`` (default: every stage this process keeps) real, uninitialised
        storage on their stages' devices; returns the names that still need values. See
        :mod:`pipesplit.materialize` to initialise them."""
        from pipesplit.materialize import materialize

        return materialize(self, stages)

    def keep_only(self, stages: set[int]) -> None:
        """Drop every other stage's module and state (a rank of a distributed run keeps its own)."""
        for stage in self.stages:
            if stage.index not in stages:
                stage.module = None  # type: ignore[assignment]
                stage.modes = {}
                self.stage_entries[stage.index] = {}
        self.rebuild_holders(stages)
        self.root = None  # type: ignore[assignment]

    # ----------------------------------------------------------------- running
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def run_flat(self, flat: list[Any]) -> list[Any]:
        """Run on flattened inputs; returns the flat outputs."""
        if self.root is None:  # keep_only: a rank of a distributed Pipeline holds its own stages alone
            raise partial_program([s.index for s in self.stages if s.module is not None], self.num_stages)
        self.sync_tied()
        return self.assemble_outputs(self.root(*flat))

    def assemble_outputs(self, last_stage_outputs: tuple[Any, ...]) -> list[Any]:
        """The flat program outputs from what the last stage returns (constants filled in)."""
        by_name = dict(zip(self.stages[-1].outputs, last_stage_outputs))
        return [by_name[v] if kind == "value" else v for kind, v in self._outputs]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self.flatten_inputs(args, kwargs)
        return pytree.tree_unflatten(self.run_flat(flat), self.out_spec)

    # -------------------------------------------------------------- inspection
    def report(self) -> str:
        """A per-stage table: nodes, parameters, FLOPs, cost, memory, bytes sent."""
        from pipesplit.report import format_report

        return format_report(self)

    def to_dot(self, detail: str = "module", depth: int | None = None, stage_times: Any = None) -> str:
        """The split graph as DOT text (no graphviz binary needed); see :mod:`pipesplit.dot`.

        Clusters are shaded by stage cost, or by ``stage_times`` (seconds per stage) when given.
        """
        from pipesplit.dot import program_dot

        return program_dot(self, detail=detail, depth=depth, stage_times=stage_times)

    def render(
        self, path: str | os.PathLike[str], detail: str = "module", depth: int | None = None, stage_times: Any = None
    ) -> str:
        """Render the split graph to ``path`` (format from its suffix: .svg, .png, .pdf, .dot)."""
        from pipesplit.dot import render

        return render(self, path, detail=detail, depth=depth, stage_times=stage_times)

    def __repr__(self) -> str:
        devs = ", ".join(str(s.device) for s in self.stages)
        return f"SplitProgram({self.num_stages} stages on [{devs}], {len(self.boundaries)} boundaries)"
