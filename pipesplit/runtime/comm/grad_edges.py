"""Which cuts carry a gradient in this step: the program's, grown where a parameter frozen at compile
time is trainable now, or an input that did not require grad at compile time now does."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.fx as fx

from pipesplit.compat import pytree
from pipesplit.errors import PipesplitError
from pipesplit.meta import node_cost
from pipesplit.passes.aliasing import written_operand
from pipesplit.passes.annotate.costs import stops_grad
from pipesplit.passes.split.program import SplitProgram
from pipesplit.runtime.comm.exchange import program_edges
from pipesplit.schedules.rendezvous import Edge


def _floating(node: fx.Node) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in pytree.tree_leaves(node.meta.get("val")))


def gradient_nodes(prog: SplitProgram, flat_inputs: Sequence[Any]) -> set[str]:
    """Names of the captured graph's values whose gradient a backward computes with the parameters'
    ``requires_grad`` as they are now (held ones; others as compiled) and these inputs: the cost
    pass's rule (:func:`pipesplit.passes.annotate.costs.annotate_costs`) on today's flags."""
    held = {idx: t.requires_grad for idx, t in prog.held_items()}
    needs: dict[fx.Node, bool] = {}
    inputs = iter(flat_inputs)
    graph = prog.captured_gm.graph
    for node in graph.nodes:
        if node.op == "placeholder":
            x = next(inputs, None)
            needs[node] = isinstance(x, torch.Tensor) and x.requires_grad
        elif node.op == "get_attr":
            idx = prog.target_to_entry.get(str(node.target))
            needs[node] = held[idx] if idx in held else bool(getattr(node_cost(node), "trainable", False))
        elif node.op != "output":
            passed = written_operand(node)
            needs[node] = (needs.get(passed, False) if passed is not None else
                           _floating(node) and not stops_grad(node) and any(needs.get(a, False)
                                                                            for a in node.all_input_nodes))
    reached: set[fx.Node] = set()  # some path to an output carries the gradient
    for node in reversed(graph.nodes):
        if node.op == "output" or node in reached:
            reached.update(a for a in node.all_input_nodes if needs.get(a, False))
    return {n.name for n in reached}


class GradientEdges:
    """A Pipeline's view of which cuts carry a gradient: grown to today's flags before each training
    step, and whether the communication plans built last (``built``) still match the program's."""

    def __init__(self, prog: SplitProgram):
        self.prog = prog
        self.built: tuple[Edge, ...] = ()  # the edges the pipeline's plans were built from
        self._flags: Any = None  # the flags the program's cuts were last grown for

    def stale(self, flat_inputs: Sequence[Any], training: bool, distributed: bool) -> bool:
        """Grow the cuts for a training step; True if the plans must be rebuilt (this or another
        Pipeline on the program grew them)."""
        if training:
            self._grow(flat_inputs, distributed)
        return program_edges(self.prog) != self.built

    def _grow(self, flat_inputs: Sequence[Any], distributed: bool) -> None:
        """Mark the cuts that carry a gradient now but did not when the program was compiled. Cuts are
        only ever added: one that no longer needs its gradient sends zeros. Under torchrun a rank does
        not see the other ranks' parameters, so there a missing cut is refused instead."""
        prog = self.prog
        flags = (prog.held_requires_grad(),
                 tuple([isinstance(x, torch.Tensor) and x.requires_grad for x in flat_inputs]), id(prog.captured_gm))
        if flags == self._flags:
            return
        needed = gradient_nodes(prog, flat_inputs)
        missing = [i for i, b in enumerate(prog.boundaries)
                   if b.kind == "tensor" and not b.requires_grad and b.name in needed]
        if missing and distributed:
            b = prog.boundaries[missing[0]]
            raise PipesplitError(
                f"the value {b.name!r} sent from stage {b.src} to stage {b.dst} needs a gradient now, but the "
                f"program was compiled without one there ({len(missing)} such cut(s)): a parameter frozen at "
                "compile time is trainable now, or an input requires grad that did not in the example. Compile "
                "with those parameters trainable (freeze them after compiling) and the example input requiring "
                "grad (x.requires_grad_()), or use the local executor."
            )
        for i in missing:
            prog.boundaries[i] = dataclasses.replace(prog.boundaries[i], requires_grad=True)
        self._flags = flags
