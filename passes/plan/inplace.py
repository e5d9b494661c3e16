"""Planner constraint: keep each in-place write in one stage with the reads a cut would separate from it.

The split refuses three kinds of cut around a write in place (:mod:`pipesplit.passes.split.graph`,
:func:`pipesplit.runtime.state.state_writes.check_input_writes`): a stage writes its own copy of
what it receives, so an alias made before the write (the value itself, a view, dropout's result at
p == 0) and read after it in another stage would be read unwritten; a stage that receives two
tensors of one storage and writes one would leave the other unwritten; and an input written by one
stage and read by another must have one of the two stages depend on the other. The planner keeps
clear of them by itself: each write gives a few *requirements*, each met by any one of its
*choices* (runs of the chain that must lie in one stage each), and per order of the nodes the
choice that forbids fewest cuts is kept. A user's ``split_points`` that cut there still get the refusal.

For an op ``b`` made before the write ``w`` whose storage ``w`` writes (the value itself, a view,
dropout's result at p == 0) and read after it (by an op, or the program's output), or read by ``w``
where another tensor of that storage made before ``w`` is read by ``w`` or after it: ``b`` and ``w``
in one stage. (Keeping ``w`` with the later reads instead would have its stage receive two tensors
of one storage.) Where such a ``b`` is read only before ``w``: ``b`` with its last reader, so that
``w``'s stage never receives it beside another.
For an input ``x`` whose
storage ``w`` writes and another op ``u`` reads (``u`` before ``w``, say): ``u`` and ``w`` in one
stage, or ``w`` with the nearest op that ``u`` feeds, or ``u`` with the nearest op that feeds
``w``, or ``u`` with one end of a tensor and ``w`` with the other (a tensor crossing from one stage
to the other orders them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
import torch.fx as fx

from pipesplit.errors import PlanError
from pipesplit.meta import COMPUTE_OPS
from pipesplit.compat import HigherOrderOperator, OpOverload
from pipesplit.passes.aliasing import BATCH_NORM_OPS, storage_classes
from pipesplit.rng import seeded

END = None  # the program's output: in the last stage


@dataclass(frozen=True)
class Choice:
    """Ops to keep in one stage: all of ``all_of`` (``END``: the last stage) and the nearest of ``near``.
    With ``edges`` (tensors ``a -> b``, ``b`` END for an output): ``all_of[0]`` with some ``a`` and
    ``all_of[1]`` with its ``b``, the edge that keeps fewest ops together (a tensor orders the stages)."""

    all_of: tuple[fx.Node | None, ...]
    near: frozenset[fx.Node] = frozenset()
    edges: tuple[tuple[fx.Node, fx.Node | None], ...] = ()


@dataclass(frozen=True)
class Requirement:
    """``writer`` writes ``value`` in place and ``reader`` (None: the program's output) reads ``alias``
    on the other side of it; one of ``choices`` keeps them apart from any cut the split refuses."""

    writer: fx.Node
    value: fx.Node
    alias: fx.Node
    reader: fx.Node | None
    after: bool  # the read comes after the write in the model
    choices: tuple[Choice, ...]

    def describe(self) -> str:
        op = f"{self.writer.name!r} ({self.writer.target})"
        if self.reader is self.writer:
            through = "" if self.alias is self.value else f" (through {self.value.name!r}, a view of it)"
            return f"{op} writes {self.alias.name!r}{through} in place, which an earlier op made"
        reader = "the program's output" if self.reader is None else repr(self.reader.name)
        alias = "the input " + repr(self.alias.name) if self.alias.op == "placeholder" else repr(self.alias.name)
        same = "" if self.alias is self.value else ", an alias of it,"
        return (f"{op} writes {self.value.name!r} in place, and {reader} "
                f"reads {alias}{same} {'after' if self.after else 'before'} that write")


def write_requirements(gm: fx.GraphModule) -> list[Requirement]:
    """What each in-place write of ``gm``'s graph needs kept in its stage (empty for a graph without writes)."""
    if not _may_write(gm.graph):
        return []
    classes = storage_classes(gm.graph)
    if not classes.written:
        return []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    members: dict[object, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        members.setdefault(classes.root(n), []).append(n)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = set(output.all_input_nodes)
    compute = {n for n in gm.graph.nodes if n.op in COMPUTE_OPS}
    out: list[Requirement] = []
    edges: tuple[tuple[fx.Node, fx.Node | None], ...] = ()
    for w, targets in classes.writes.items():
        if w not in compute:
            continue
        for x in dict.fromkeys(targets):
            early = [b for b in members[classes.root(x)] if order[b] < order[w] and b.op != "get_attr"]
            # the tensors of this storage that w's stage may have to receive (read by w or after it)
            held = [b for b in early if b in outputs or any(order[u] >= order[w] for u in b.users)]
            for b in early:
                if b.op == "placeholder":
                    edges = edges or _tensor_edges(gm.graph, compute)
                    out += _input_requirements(w, x, b, order, compute, edges)
                    continue
                late = [u for u in b.users if u in compute and order[u] > order[w]]
                if late or b in outputs or (w in b.users and len(held) > 1):
                    out.append(Requirement(w, x, b, late[0] if late else (None if b in outputs else w), True,
                                           (Choice((b, w)),)))
                elif b not in held and b.users and len(early) > 1:  # with its last reader: never received by w's stage
                    last = max(b.users, key=order.__getitem__)
                    out.append(Requirement(w, x, b, last, False, (Choice((b, last)),)))
    return out


def _may_write(graph: fx.Graph) -> bool:
    """Some op of ``graph`` may write in place (a cheap look before the storage analysis, which costs
    ~0.1 s on an 8B model's graph): a mutable schema, batch norm's statistics, a seeded random op, a
    trailing-underscore method, or a higher-order op (its subgraph may write)."""
    for node in graph.nodes:
        target = node.target
        if isinstance(target, OpOverload):
            if target._schema.is_mutable or target._schema.name.split("::")[-1] in BATCH_NORM_OPS:
                return True
        elif target is seeded or isinstance(target, HigherOrderOperator):
            return True
        elif node.op == "call_method" and isinstance(target, str) and target.endswith("_"):
            return True
    return False


def _input_requirements(w: fx.Node, x: fx.Node, p: fx.Node, order: dict[fx.Node, int], compute: set[fx.Node],
                        edges: tuple[tuple[fx.Node, fx.Node | None], ...]) -> list[Requirement]:
    """An input ``p`` that ``w`` writes (through ``x``): each other op reading it must be ordered with ``w``."""
    out = []
    for u in p.users:
        if u is w or u not in compute:
            continue
        first, second = (u, w) if order[u] < order[w] else (w, u)
        choices = [Choice((first, second)), Choice((first, second), edges=edges)]
        fed = _reach(first, down=True, compute=compute)
        feeding = _reach(second, down=False, compute=compute)
        if fed:
            choices.append(Choice((second,), frozenset(fed)))
        if feeding:
            choices.append(Choice((first,), frozenset(feeding)))
        out.append(Requirement(w, x, p, u, order[u] > order[w], tuple(choices)))
    return out


def _carries_tensor(node: fx.Node) -> bool:
    """A value that crosses a cut as a tensor (sizes travel no boundary that orders stages)."""
    val = node.meta.get("val")
    return not isinstance(val, (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))


def _tensor_edges(graph: fx.Graph, compute: set[fx.Node]) -> tuple[tuple[fx.Node, fx.Node | None], ...]:
    """Every tensor one compute op hands another (or the program's output: END)."""
    return tuple((a, END if u.op == "output" else u) for a in graph.nodes if a in compute and _carries_tensor(a)
                 for u in a.users if u in compute or u.op == "output")


def _reach(start: fx.Node, down: bool, compute: set[fx.Node]) -> set[fx.Node]:
    """The compute ops ``start`` feeds (``down``) or that feed it, along tensors, ``start`` excluded."""
    seen: set[fx.Node] = set()
    stack = [start]
    while stack:
        n = stack.pop()
        nxt: Iterable[fx.Node] = (
            (u for u in n.users if _carries_tensor(n)) if down
            else (a for a in n.all_input_nodes if _carries_tensor(a))
        )
        for m in nxt:
            if m in compute and m not in seen:
                seen.add(m)
                stack.append(m)
    return seen


def _spans(choice: Choice, pos: dict[fx.Node, int], n: int) -> list[list[tuple[int, int]]]:
    """The ways to meet ``choice``, each as runs of chain positions (first, last) to keep in one stage
    each (``n``: the program's end): one way, or one per nearby tensor for ``edges``."""
    at = [n if a is END else pos[a] for a in choice.all_of]
    if choice.edges:
        p, q = at
        ends = sorted(((pos[a], n if b is END else pos[b]) for a, b in choice.edges),
                      key=lambda e: abs(e[0] - p) + abs(min(e[1], n - 1) - min(q, n - 1)))
        return [[(min(a, p), max(a, p)), (min(b, q), max(b, q))] for a, b in ends[:NEAREST_EDGES]]
    lo, hi = min(at), max(at)
    if choice.near:
        z = min((pos[z] for z in choice.near if z in pos), key=lambda p: max(hi, p) - min(lo, p), default=None)
        if z is None:
            return [[(0, n)]]
        lo, hi = min(lo, z), max(hi, z)
    return [[(lo, hi)]]


NEAREST_EDGES = 16  # the tensors weighed per choice: those whose ends lie nearest the two ops


def keep_writes_with_reads(nodes: Sequence[fx.Node], allowed: np.ndarray,
                           requirements: Sequence[Requirement]) -> tuple[np.ndarray, list[tuple[Requirement, int, int]]]:
    """A copy of ``allowed`` without the cuts the requirements' choices forbid, and those runs
    (requirement, first, last position), for the error when too few cuts are left. Requirements
    with one choice go first; each other takes the choice that forbids fewest cuts still allowed
    (then the shortest)."""
    out: np.ndarray = allowed.copy()
    n = len(nodes)
    pos = {node: i for i, node in enumerate(nodes)}
    spans = []

    def cost(runs: list[tuple[int, int]]) -> tuple[int, int]:
        cut = set().union(*(range(lo + 1, min(hi, n - 1) + 1) for lo, hi in runs))
        return sum(1 for c in cut if out[c]), sum(hi - lo for lo, hi in runs)

    for req in sorted(requirements, key=lambda r: len(r.choices)):
        runs = min((way for c in req.choices for way in _spans(c, pos, n)), key=cost)
        for lo, hi in runs:
            if hi > lo:
                out[lo + 1 : min(hi, n - 1) + 1] = False
                spans.append((req, lo, hi))
    return out, spans


def check_cuts_left(num_stages: int, before: np.ndarray, after: np.ndarray,
                    spans: Sequence[tuple[Requirement, int, int]]) -> None:
    """Refuse, naming the writes, where keeping them with their reads leaves fewer cuts than ``num_stages`` needs
    (and the graph had enough without them)."""
    n = len(after) - 1
    had, left = int(before[1:n].sum()), int(after[1:n].sum())
    if num_stages - 1 <= left or num_stages - 1 > had:
        return
    worst = sorted(spans, key=lambda s: s[1] - s[2])[:2]
    what = "; and ".join(req.describe() for req, _, _ in worst)
    raise PlanError(
        f"num_stages={num_stages} needs {num_stages - 1} cut(s), but in-place writes leave only {left} of the graph's "
        f"{had} places to cut: {what}. A stage writes its own copy of what it receives, so a cut between such a write "
        "and a read on the other side would hand the reader the value unwritten (or leave the two stages unordered): "
        f"the planner keeps them in one stage. Use num_stages <= {left + 1}, or write out of place in the model "
        "(x = x.mul(2.0) instead of x.mul_(2.0), x.relu() instead of x.relu_())."
    )
