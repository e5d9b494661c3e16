"""DOT views of a split program: one cluster per stage, boundary edges labelled with what they carry."""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any, Sequence

import graphviz
import torch.fx as fx

from pipesplit.errors import PipesplitError
from pipesplit.meta import COMPUTE_OPS, node_cost, node_module_paths
from pipesplit.passes.annotate.flops import op_name
from pipesplit.units import format_cost, human_bytes, human_count

if TYPE_CHECKING:
    from pipesplit.passes.split.program import SplitProgram

_MAX_GROUPS = 40
_SHADES = ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6"]


def _module_path(node: fx.Node) -> str:
    paths = node_module_paths(node)
    return paths[-1] if paths else ""


def _group_key(node: fx.Node, depth: int) -> str:
    path = _module_path(node)
    return ".".join(path.split(".")[:depth]) if path else "(top)"


def _auto_depth(prog: "SplitProgram") -> int:
    nodes = [n for s in prog.stages for n in s.module.graph.nodes if n.op in COMPUTE_OPS]
    best = 1
    for depth in range(1, 8):
        groups = {(id(n.graph), _group_key(n, depth)) for n in nodes}
        if len(groups) > _MAX_GROUPS:
            break
        best = depth
    return best


def _edge_label(b: Any) -> str:
    if b.kind != "tensor":
        return f"{b.name}\\n{b.kind}"
    shape = "×".join("B" if d is None else str(d) for d in (b.shape or ()))
    dtype = str(b.dtype).replace("torch.", "")
    return f"{b.name}\\n[{shape}] {dtype}\\n{human_bytes(b.nbytes)}"


def build_dot(
    prog: "SplitProgram", detail: str = "module", depth: int | None = None, stage_times: Sequence[float] | None = None
) -> graphviz.Digraph:
    """A ``graphviz.Digraph`` of the program (building it needs no graphviz binary).

    Stage clusters are shaded by the plan's stage costs, or by ``stage_times`` (seconds,
    e.g. measured by :func:`pipesplit.benchmark`) when given.
    """
    if detail not in ("module", "node"):
        raise PipesplitError(f"detail must be 'module' or 'node', got {detail!r}.")
    if detail == "module" and depth is None:
        depth = _auto_depth(prog)
    dot = graphviz.Digraph("pipesplit", graph_attr={"rankdir": "TB", "compound": "true", "fontname": "Helvetica"},
                           node_attr={"shape": "box", "style": "rounded,filled", "fontname": "Helvetica", "fontsize": "10"},
                           edge_attr={"fontname": "Helvetica", "fontsize": "9"})
    if stage_times is not None and len(stage_times) != prog.num_stages:
        raise PipesplitError(f"stage_times has {len(stage_times)} entries for {prog.num_stages} stages.")
    costs = list(stage_times) if stage_times is not None else (prog.plan.stage_costs or [0.0] * prog.num_stages)
    top = max(costs) or 1.0
    where: dict[tuple[int, str], str] = {}  # (stage, value name) -> dot node id
    passed: dict[tuple[int, str], str] = {}  # stage inputs no compute node uses (returned as they are)
    dot.node("inputs", "inputs\\n" + ", ".join(i.name for i in prog.inputs), shape="oval", fillcolor="#eeeeee")
    for stage in prog.stages:
        s = stage.index
        shade = _SHADES[min(int(costs[s] / top * (len(_SHADES) - 1) + 0.5), len(_SHADES) - 1)]
        with dot.subgraph(name=f"cluster_{s}") as sub:
            cost = format_cost(costs[s], prog.plan.cost_name)
            what = f"{costs[s] * 1e3:.3g} ms" if stage_times is not None else f"cost {cost}"
            sub.attr(label=f"stage {s} · {stage.device} · {what}", style="filled", fillcolor=shade)
            graph = stage.module.graph
            members: dict[str, list[fx.Node]] = {}
            for n in graph.nodes:
                if n.op in COMPUTE_OPS:
                    key = n.name if detail == "node" else _group_key(n, depth or 1)
                    members.setdefault(key, []).append(n)
            for key, nodes in members.items():
                gid = f"s{s}_{key}"
                if detail == "node":
                    n = nodes[0]
                    label = f"{n.name}\\n{op_name(n.target)}\\n{_module_path(n)}"
                else:
                    ops = Counter(op_name(n.target) for n in nodes)
                    common = ", ".join(f"{o}×{c}" if c > 1 else o for o, c in ops.most_common(3))
                    priced = [node_cost(n) for n in nodes if "pipesplit_cost" in n.meta]
                    fwd, bwd = sum(c.fwd_flops for c in priced), sum(c.bwd_flops for c in priced)
                    # the report's columns: forward FLOPs and backward FLOPs, each named
                    label = f"{key}\\n{len(nodes)} ops: {common}\\nfwd {human_count(fwd)}, bwd {human_count(bwd)} FLOPs"
                sub.node(gid, label, fillcolor="white")
                for n in nodes:
                    where[(s, n.name)] = gid
            for ph in (n for n in graph.nodes if n.op == "placeholder"):
                where.setdefault((s, ph.name), f"s{s}_in_{ph.name}")
                if not any(u.op in COMPUTE_OPS for u in ph.users):  # only handed on to the outputs
                    passed[(s, ph.name)] = where[(s, ph.name)]
                    sub.node(passed[(s, ph.name)], f"{ph.name}\\n(passed through)", shape="note", fillcolor="white")
            edges = set()
            for n in graph.nodes:
                if n.op not in COMPUTE_OPS:
                    continue
                for a in n.all_input_nodes:
                    if a.op in COMPUTE_OPS and where[(s, a.name)] != where[(s, n.name)]:
                        edges.add((where[(s, a.name)], where[(s, n.name)]))
            for a, b in sorted(edges):
                sub.edge(a, b)
    firsts: dict[tuple[int, str], str] = {}
    for stage in prog.stages:
        for n in stage.module.graph.nodes:
            if n.op in COMPUTE_OPS:
                for a in n.all_input_nodes:
                    if a.op == "placeholder":
                        firsts.setdefault((stage.index, a.name), where[(stage.index, n.name)])
    for stage in prog.stages:
        for name, kind, src in stage.inputs:
            if kind == "input":
                target = firsts.get((stage.index, name)) or passed.get((stage.index, name))
                if target:
                    dot.edge("inputs", target, label=name, style="dashed")
    for bound in prog.boundaries:
        head = firsts.get((bound.dst, bound.name)) or passed.get((bound.dst, bound.name))
        tail = where.get((bound.src, bound.name))
        if head and tail and bound.kind != "tensor":  # a size or scalar: a few bytes, drawn lightly
            dot.edge(tail, head, label=_edge_label(bound), color="#999999", fontcolor="#777777", penwidth="1",
                     style="dashed")
        elif head and tail:
            dot.edge(tail, head, label=_edge_label(bound), color="#d62728", fontcolor="#d62728", penwidth="2")
    dot.node("outputs", "outputs", shape="oval", fillcolor="#eeeeee")
    dot.attr(label=_legend(prog, stage_times is not None), labelloc="b", fontsize="9")
    last = prog.stages[-1]
    for name in last.outputs:
        made = where.get((last.index, name))
        if made is None:  # passed through the last stage from an earlier one
            made = next((where[(b.src, name)] for b in prog.boundaries if b.name == name and (b.src, name) in where), None)
        if made:
            dot.edge(made, "outputs", style="dashed")
    return dot


def _legend(prog: "SplitProgram", measured: bool) -> str:
    """The picture's key, in the report's words (see :func:`pipesplit.report.boundary_summary`)."""
    from pipesplit.report import boundary_summary

    stage = "its measured time (forward + backward)" if measured else "the report's cost column"
    return (boundary_summary(prog) + ": solid red arrows carry tensors, dashed grey ones sizes or scalars.\\n"
            f"A stage's label gives {stage}; a box, the forward and the backward FLOPs of its ops.")


def program_dot(
    prog: "SplitProgram", detail: str = "module", depth: int | None = None, stage_times: Sequence[float] | None = None
) -> str:
    return str(build_dot(prog, detail, depth, stage_times).source)


def render(
    prog: "SplitProgram", path: str | os.PathLike[str], detail: str = "module", depth: int | None = None,
    stage_times: Sequence[float] | None = None,
) -> str:
    """Write the graph to ``path``; the suffix picks the format. Needs graphviz's ``dot`` except for .dot/.gv."""
    path = os.fspath(path)
    stem, ext = os.path.splitext(path)
    fmt = ext.lstrip(".") or "svg"
    dot = build_dot(prog, detail, depth, stage_times)
    if fmt in ("dot", "gv"):
        with open(path, "w") as f:
            f.write(dot.source)
        return path
    try:
        return str(dot.render(outfile=path, format=fmt, cleanup=True))
    except graphviz.ExecutableNotFound:
        raise PipesplitError(
            f"rendering {path} needs graphviz's `dot` program, which is not installed "
            "(Debian/Ubuntu: apt-get install graphviz). prog.to_dot() gives the DOT text without it."
        ) from None
