"""Transform pass: cut a graph by a plan into stage GraphModules and a root graph.

The root graph calls each stage module in order; every value that crosses a stage
boundary goes through an explicit ``comm.send`` / ``comm.recv`` pair, and every
program input through ``comm.feed``. The last stage returns all program outputs.
The input graph is never modified.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

import torch
import torch.fx as fx

from pipesplit.compat import is_concrete_int
import pipesplit.passes.split.comm as comm
from pipesplit.devices import device_name
from pipesplit.errors import PlanError
from pipesplit.meta import COMPUTE_OPS
from pipesplit.passes.aliasing import StorageClasses, inplace_inputs, storage_classes
from pipesplit.passes.annotate.flops import hint
from pipesplit.passes.split.snapshots import snapshot_state_reads
from pipesplit.rng import seed_random_ops


@dataclass(frozen=True)
class Boundary:
    """One send/recv edge: value ``name`` produced by stage ``src`` and used by stage ``dst``."""

    name: str
    src: int
    dst: int
    kind: str  # "tensor", "int" (a size), "float" / "bool" (derived from sizes) or "scalar"
    shape: tuple[int | None, ...] | None  # None marks a dynamic (batch) dimension
    dtype: torch.dtype | None
    nbytes: int  # at the example's shapes
    requires_grad: bool = False  # a gradient flows back along this edge in training
    sizes: tuple[Any, ...] | None = field(default=None, compare=False, repr=False)  # symbolic shape (or int value)


@dataclass
class StagePiece:
    """A stage as the split pass builds it, before devices are attached."""

    index: int
    graph: fx.Graph
    attrs: dict[str, Any]  # get_attr target -> object (tensor or submodule) the stage needs
    inputs: list[tuple[str, str, int]]  # (placeholder name, "input" | "stage", flat index | src stage)
    outputs: list[str]  # names of the values it returns, in order
    nodes: list[str]
    mutated_inputs: frozenset[str] = frozenset()  # placeholders the stage writes in place


@dataclass
class SplitGraph:
    stages: list[StagePiece]
    root: fx.Graph
    boundaries: list[Boundary]
    outputs: list[tuple[str, Any]]  # per flat program output: ("value", name) or ("const", literal)


def _expr(d: Any) -> Any:
    return d if isinstance(d, int) else d.node.expr


def _value_info(node: fx.Node) -> tuple[str, tuple[int | None, ...] | None, torch.dtype | None, int, Any]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = tuple(int(d) if is_concrete_int(d) else None for d in val.shape)  # export may pin a SymInt
        n = 1
        for d in val.shape:
            n *= hint(d)
        return "tensor", shape, val.dtype, n * val.element_size(), tuple(_expr(d) for d in val.shape)
    if isinstance(val, (bool, torch.SymBool)):  # before int: a bool is an int
        return "bool", None, None, 8, (val if isinstance(val, bool) else val.node.expr,)
    if isinstance(val, (int, torch.SymInt)):
        return "int", None, None, 8, (_expr(val),)
    if isinstance(val, (float, torch.SymFloat)):  # e.g. x.shape[0] ** -0.5
        return "float", None, None, 8, (val if isinstance(val, float) else val.node.expr,)
    return "scalar", None, None, 8, None


def split_graph(
    gm: fx.GraphModule,
    stages: Sequence[Sequence[str]],
    devices: Sequence[str],
    recompute: Collection[str] = (),
) -> SplitGraph:
    """Cut ``gm`` into ``len(stages)`` stage graphs and a root graph wiring them.

    A value named in ``recompute`` (see :mod:`pipesplit.passes.plan.recompute`) is not sent to
    a later stage that uses it: that stage rebuilds it from the program inputs instead.
    """
    k = len(stages)
    last = k - 1
    stage_of: dict[fx.Node, int] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for s, names in enumerate(stages):
        for name in names:
            stage_of[by_name[name]] = s
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_index = {n: i for i, n in enumerate(placeholders)}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat_outputs = list(output_node.args[0])

    # What each stage needs from outside, and which consumer stages each value has.
    needs: list[dict[fx.Node, None]] = [{} for _ in range(k)]
    attrs: list[dict[str, None]] = [{} for _ in range(k)]
    rebuilt: list[dict[fx.Node, None]] = [{} for _ in range(k)]  # recomputed in that stage

    def use(s: int, a: fx.Node) -> None:
        if a.op == "get_attr":
            attrs[s][str(a.target)] = None
        elif a.op == "placeholder":
            needs[s][a] = None
        elif stage_of[a] != s and a.name in recompute:
            if a not in rebuilt[s]:
                for b in a.all_input_nodes:
                    use(s, b)
                rebuilt[s][a] = None
        elif stage_of[a] != s:
            needs[s][a] = None

    for node in gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            for a in node.all_input_nodes:
                use(stage_of[node], a)
    for out in flat_outputs:
        if isinstance(out, fx.Node) and not (out.op in COMPUTE_OPS and stage_of[out] == last):
            needs[last][out] = None
    routed = _written_input_sources(gm, placeholders, needs, rebuilt, stage_of)
    consumers: dict[fx.Node, list[int]] = {}
    for s in range(k):
        for a in needs[s]:
            if a.op != "placeholder":
                consumers.setdefault(a, []).append(s)
    sent_inputs: list[list[fx.Node]] = [[] for _ in range(k)]  # program inputs a stage sends on, written
    for (_, a), writer in routed.items():
        if a not in sent_inputs[writer]:
            sent_inputs[writer].append(a)

    attr_nodes: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            attr_nodes.setdefault(str(node.target), []).append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    pieces: list[StagePiece] = []
    classes: StorageClasses | None = None
    for s, names in enumerate(stages):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs = []
        for a in needs[s]:
            ph = graph.placeholder(a.name)
            ph.meta = dict(a.meta)
            env[a] = ph
            inputs.append((a.name, "stage", routed[(s, a)]) if (s, a) in routed else
                          (a.name, "input", input_index[a]) if a.op == "placeholder" else (a.name, "stage", stage_of[a]))
        for target in attrs[s]:
            new = graph.get_attr(target)
            new.meta = dict(attr_nodes[target][0].meta)
            for src in attr_nodes[target]:
                env[src] = new
        for node in sorted(rebuilt[s], key=order.__getitem__):
            env[node] = graph.node_copy(node, lambda x: env[x])
        for name in names:
            node = by_name[name]
            env[node] = graph.node_copy(node, lambda x: env[x])
        produced = [by_name[x] for x in names]
        if s == last:
            outs = list(dict.fromkeys(o for o in flat_outputs if isinstance(o, fx.Node)))
        else:
            outs = [n for n in produced if n in consumers] + sent_inputs[s]
        graph.output(tuple(env[o] for o in outs))
        attr_objs = {t: operator.attrgetter(t)(gm) for t in attrs[s]}
        graph.owning_module = gm  # for the analyses: a higher-order op's subgraph is an attribute of gm
        snapshot_state_reads(graph, lambda t: _is_buffer(attr_objs.get(t)))
        mutated = frozenset(inplace_inputs(graph))
        if mutated:
            classes = classes or storage_classes(gm.graph)  # once for the whole graph, where any stage needs it
            _refuse_written_aliases(s, needs[s], mutated, classes)
        graph.owning_module = None
        seed_random_ops(graph)  # reproducible per (stage, microbatch) under a pipeline; see pipesplit.rng
        graph.lint()
        pieces.append(StagePiece(s, graph, attr_objs, inputs, [o.name for o in outs], list(names), mutated))

    if classes is not None:
        _refuse_stale_aliases(gm, classes, needs, rebuilt, stage_of, order, flat_outputs)
    root, boundaries = _root_graph(gm, pieces, placeholders, devices, stage_of, by_name)
    outputs = [("value", o.name) if isinstance(o, fx.Node) else ("const", o) for o in flat_outputs]
    return SplitGraph(pieces, root, boundaries, outputs)


def _written_input_sources(gm: fx.GraphModule, placeholders: list[fx.Node], needs: list[dict[fx.Node, None]],
                           rebuilt: list[dict[fx.Node, None]], stage_of: dict[fx.Node, int]) -> dict[tuple[int, fx.Node], int]:
    """(stage, program input) -> the earlier stage it receives that input from: the last one before it
    that writes the input in place (through a view, so the model reads the input itself again after the
    write: ``x.transpose(1, 2).mul_(2)``, later ``+ x``). Each stage reads the caller's inputs as given;
    under torchrun a stage on another rank never saw the write (the fuzzer, seed 22 draw 14: loss 74% off), so the
    written input travels from its writer as any value does. A stage reading the input before the write
    in the model's order keeps the caller's."""
    readers = [p for p in placeholders if sum(p in n for n in needs) > 1]
    if not readers:
        return {}
    classes = storage_classes(gm.graph)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writers: dict[Any, list[fx.Node]] = {}
    for w, written in classes.writes.items():
        for x in written:
            if w in stage_of:
                writers.setdefault(classes.root(x), []).append(w)
    routed: dict[tuple[int, fx.Node], int] = {}
    for p in readers:
        for s, need in enumerate(needs):
            before = [w for w in writers.get(classes.root(p), ()) if stage_of[w] < s and p in needs[stage_of[w]]]
            if p not in need or not before:
                continue
            last = max(before, key=order.__getitem__)
            uses = [u for u in p.users if stage_of.get(u) == s or u in rebuilt[s]]
            if all(order[u] > order[last] for u in uses):
                routed[(s, p)] = stage_of[last]
    return routed


def _refuse_written_aliases(stage: int, inputs: Collection[fx.Node], mutated: frozenset[str],
                            classes: StorageClasses) -> None:
    """A stage may write an input in place only where no other input of it is the same tensor in the
    model (a view, or dropout's result at p == 0): across a cut the two travel as separate tensors, so
    the write would not reach the other, which the model reads written."""
    by_root: dict[Any, list[str]] = {}
    for a in inputs:
        by_root.setdefault(classes.root(a), []).append(a.name)
    for names in by_root.values():
        written = [n for n in names if n in mutated]
        if written and len(names) > 1:
            raise PlanError(
                f"stage {stage} receives {', '.join(repr(n) for n in names)}, which are one tensor in the model "
                f"(views or aliases of each other), and writes {written[0]!r} in place. Across a cut they travel as "
                "separate tensors, so the write would not reach the others and the program would differ from the "
                "model. Keep the ops that make and write them in one stage (compile(..., split_points=[...]) "
                "elsewhere), or write out of place (x.relu() instead of x.relu_())."
            )


def _refuse_stale_aliases(gm: fx.GraphModule, classes: StorageClasses, needs: list[dict[fx.Node, None]],
                          rebuilt: list[dict[fx.Node, None]], stage_of: dict[fx.Node, int],
                          order: dict[fx.Node, int], flat_outputs: list[Any]) -> None:
    """A stage writes in place a value it received; another stage (or the program's output) reads
    that value, or an alias of it made before the write (a view, dropout's result at p == 0), after
    the write in the model's order. The writer works on its own copy, so the reader would see the
    value unwritten where the model sees it written: refused by name (the fuzzer found
    ``v3 = dropout(v0, 0.0); v0.relu_()`` in another stage, ``return v3``: loss 32% off)."""
    members: dict[Any, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        members.setdefault(classes.root(n), []).append(n)
    stages_of = {n: {s} for n, s in stage_of.items()}
    for t, nodes in enumerate(rebuilt):
        for n in nodes:
            stages_of.setdefault(n, set()).add(t)
    outputs = {o for o in flat_outputs if isinstance(o, fx.Node)}
    for writer, written in classes.writes.items():
        s = stage_of.get(writer)
        for x in written:
            cls = members[classes.root(x)]
            if s is None or not any(b in needs[s] and b.op != "get_attr" for b in cls):
                continue  # storage made in this stage (or a parameter's: handled by the state's own checks)
            for b in cls:
                if order[b] >= order[writer] or stage_of.get(b) == s or b.op in ("placeholder", "get_attr"):
                    continue
                late = [u for u in b.users if order[u] > order[writer] and stages_of.get(u, {s}) - {s}]
                if late or b in outputs:
                    reader = (f"{late[0].name!r} in stage {min(stages_of[late[0]] - {s})}" if late
                              else "the program's output")
                    raise PlanError(
                        f"stage {s} writes {x.name!r} in place ({writer.name!r}), and {reader} reads "
                        f"{b.name!r}{' (the same tensor)' if b is x else f', an alias of it,'} after that write in the "
                        f"model. Stage {s} writes its own copy of what it receives, so the reader would see the "
                        "value unwritten. Keep the ops that make, write and read it in one stage "
                        "(compile(..., split_points=[...]) elsewhere), or write out of place (x.relu() instead of "
                        "x.relu_()).")


def _is_buffer(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) and not isinstance(obj, torch.nn.Parameter)


def _root_graph(
    gm: fx.GraphModule,
    pieces: list[StagePiece],
    placeholders: list[fx.Node],
    devices: Sequence[str],
    stage_of: dict[fx.Node, int],
    by_name: dict[str, fx.Node],
) -> tuple[fx.Graph, list[Boundary]]:
    root = fx.Graph()
    inputs = [root.placeholder(p.name) for p in placeholders]
    produced: dict[str, fx.Node] = {}  # value name -> root node holding it (on its producer's device)
    boundaries: list[Boundary] = []
    for piece in pieces:
        s, device = piece.index, str(devices[piece.index])
        args = []
        for name, kind, where in piece.inputs:
            if kind == "input":
                args.append(root.call_function(comm.feed, (inputs[where],), {"index": where, "dst": s, "device": device}))
                continue
            sent = root.call_function(comm.send, (produced[name],), {"src": where, "dst": s, "name": name})
            args.append(root.call_function(comm.recv, (sent,), {"src": where, "dst": s, "name": name, "device": device}))
            vkind, shape, dtype, nbytes, sizes = _value_info(by_name[name])
            grad = bool(getattr(by_name[name].meta.get("pipesplit_cost"), "requires_grad", False))
            boundaries.append(Boundary(name, where, s, vkind, shape, dtype, nbytes, grad, sizes))
        call = root.call_module(f"stage_{s}", tuple(args))
        for i, out in enumerate(piece.outputs):
            produced[out] = root.call_function(operator.getitem, (call, i))
    last = pieces[-1]
    root.output(tuple(produced[name] for name in last.outputs))
    return root, boundaries


def check_devices(devices: Sequence[Any], num_stages: int) -> list[str]:
    if len(devices) != num_stages:
        raise PlanError(
            f"devices lists {len(devices)} device(s) for {num_stages} stages; give one per stage "
            "(stages may share a device, e.g. devices=['cuda:0'] * n)."
        )
    return [device_name(d) for d in devices]
