"""Activation checkpointing within a stage: the stage's first blocks recompute their forward, the rest keep theirs.

Megatron's ``--recompute-method block --recompute-num-layers N`` recomputes the first ``N``
layers of each stage. Under 1f1b stage ``s`` of ``p`` holds ``p - s`` microbatches, so a
stage a little over the memory cap needs only a few of its blocks recomputed, not all of
them. A stage ``[a, b)`` recomputing its head ``[a, h)`` holds, besides its training state,
its inputs for each microbatch in flight (what the head replays from), the tail's
activations and the values crossing from the head into the tail for each unit of
:func:`activation_units_per_stage`, and the head's activations for one microbatch while it
recomputes; its backward runs the head's forward again. The head ends at a block boundary
(a change of the model's repeated block, :func:`repeated_blocks`), or at any node where the
model has no repeated blocks. For a fixed split the cheapest choice per stage is plain: the
shortest head that fits the cap (a longer one only adds recompute).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch.fx as fx

from pipesplit.errors import PlanError
from pipesplit.meta import node_module_paths
from pipesplit.passes.plan.advice import repeated_in
from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.objective import MemoryModel
from pipesplit.passes.plan.stage_bytes import stage_bytes
from pipesplit.plan import Plan


@dataclass(frozen=True)
class Blocks:
    """Which repeated block each chain position's node ran in (-1: none); ``unit`` names them in reports."""

    ids: np.ndarray  # int64 per node
    prefix: str | None  # "layers" for layers.0, layers.1, ...; None: every node its own unit
    act_sum: np.ndarray  # cumulative activation bytes, n + 1

    @property
    def unit(self) -> str:
        return "block" if self.prefix is not None else "node"

    def ends(self, a: int, b: int) -> list[int]:
        """Where a head of 1, 2, ... of stage ``[a, b)``'s units ends (the last one: ``b``, the whole stage)."""
        if self.prefix is None:
            return list(range(a + 1, b + 1))
        ids = self.ids[a:b]
        seen: list[int] = []
        last: dict[int, int] = {}
        for i, block in enumerate(ids.tolist()):
            if block >= 0:
                if block not in last:
                    seen.append(block)
                last[block] = a + i + 1
        out, reach = [], a
        for block in seen:
            reach = max(reach, last[block])
            out.append(reach)
        if not out:
            return [b]
        out[-1] = b  # the last block's head is the whole stage, its trailing nodes too
        return out

    def label(self, a: int, b: int, h: int) -> str:
        """``"blocks 0-3 of 8 (layers.0 to layers.3)"``: what the head ``[a, h)`` of stage ``[a, b)`` recomputes."""
        ends = self.ends(a, b)
        n = ends.index(h) + 1 if h in ends else sum(1 for e in ends if e <= h)
        text = f"{self.unit}s 0-{n - 1} of {len(ends)}" if n > 1 else f"{self.unit} 0 of {len(ends)}"
        if self.prefix is not None:
            named = sorted({int(i) for i in self.ids[a:h].tolist() if i >= 0})
            if named:
                text += f" ({self.prefix}.{named[0]}" + (f" to {self.prefix}.{named[-1]})" if len(named) > 1 else ")")
        return text


_INDEXED = re.compile(r"^(?:(.*)\.)?(\d+)$")


def find_blocks(chain: Chain) -> Blocks:
    """The chain's nodes by the repeated block ``prefix.i`` they ran in (the model's, :func:`repeated_in`)."""
    return node_blocks(chain.nodes, chain.act)


def node_blocks(nodes: Sequence[fx.Node], act: np.ndarray | None = None) -> Blocks:
    """:func:`find_blocks` of nodes in a chain's order (``act``: their activation bytes; None: not counted)."""
    found = repeated_in(nodes)
    prefix = found[0] if found is not None else None
    ids = np.full(len(nodes), -1, dtype=np.int64)
    if prefix is not None:
        for i, node in enumerate(nodes):
            ids[i] = _block_of(node, prefix)
    act = act if act is not None else np.zeros(len(nodes), dtype=np.int64)
    return Blocks(ids, prefix if prefix is not None and (ids >= 0).any() else None,
                  np.concatenate([[0], np.cumsum(act)]))


def _block_of(node: fx.Node, prefix: str) -> int:
    for path in node_module_paths(node):
        m = _INDEXED.match(path)
        if m and (m.group(1) or "") == prefix:
            return int(m.group(2))
    return -1


def head_bytes(chain: Chain, blocks: Blocks, memory: MemoryModel, state: float, a: int, b: int, h: int,
               in_flight: int, units: float | None, split: int | None = None) -> float:
    """Bytes stage ``[a, b)`` holds recomputing its head ``[a, h)`` (see the module's docstring); ``split``:
    where the schedule splits its backward, the microbatches it holds until its I
    (:func:`~pipesplit.passes.plan.stage_bytes.stage_bytes`)."""
    return stage_bytes(chain, memory, state, a, b, in_flight, units, head=h, act_sum=blocks.act_sum, split=split)


def shortest_heads(
    chain: Chain, blocks: Blocks, memory: MemoryModel, starts: Sequence[int], plain: Sequence[float],
    states: Sequence[float], in_flight: Sequence[int], units: Sequence[float], cap: int,
    split: Mapping[int, int] | None = None,
) -> tuple[frozenset[int], dict[int, int]]:
    """For each stage over ``cap`` without checkpointing, the shortest head that fits (its end position),
    or the whole stage (in the set) where no head short of it fits; ``split``: the stages whose backward the
    schedule splits, each with the microbatches it holds until its I (:func:`~pipesplit.passes.plan.objective.split_stages`)."""
    bounds = list(starts) + [chain.n]
    whole: set[int] = set()
    heads: dict[int, int] = {}
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if plain[s] <= cap:
            continue
        for h in blocks.ends(a, b)[:-1]:
            if head_bytes(chain, blocks, memory, states[s], a, b, h, in_flight[s], units[s], (split or {}).get(s)) <= cap:
                heads[s] = h
                break
        else:
            whole.add(s)
    return frozenset(whole), heads


def asked_heads(blocks: Blocks, starts: Sequence[int], n: int, asked: Mapping[int, int]) -> tuple[frozenset[int], dict[int, int]]:
    """``compile(checkpoint={stage: blocks})`` on a split: the head end of each stage (the whole stage in the set
    where all its blocks are asked for); PlanError naming the stage where more are asked for than it has."""
    bounds = list(starts) + [n]
    whole: set[int] = set()
    heads: dict[int, int] = {}
    for s, count in sorted(asked.items()):
        if not 0 <= s < len(starts):
            raise PlanError(f"checkpoint names stages {[s]}; a plan of {len(starts)} stages has stages "
                            f"0..{len(starts) - 1}.")
        ends = blocks.ends(bounds[s], bounds[s + 1])
        if count > len(ends):
            raise PlanError(f"checkpoint={dict(asked)} asks stage {s} to recompute {count} {blocks.unit}s, but it has "
                            f"{len(ends)}; ask for 1 to {len(ends)} (all of them: the whole stage).")
        if count == len(ends):
            whole.add(s)
        else:
            heads[s] = ends[count - 1]
    return frozenset(whole), heads


def check_blocks_choice(value: Mapping[Any, Any]) -> None:
    """Raise PlanError unless ``value`` maps stage indices to counts of blocks >= 1."""
    for s, count in value.items():
        if not (isinstance(s, int) and not isinstance(s, bool) and s >= 0 and isinstance(count, int)
                and not isinstance(count, bool) and count >= 1):
            raise PlanError(f"checkpoint={value!r}: a dict maps a stage index to how many of its first blocks recompute "
                            f"their forward (e.g. {{0: 3, 1: 1}}); got {s!r}: {count!r}.")


def plan_fields(chain: Chain, starts: Sequence[int], heads: Mapping[int, int]) -> dict[str, dict[int, object]]:
    """``Plan.checkpoint_partial`` (stage -> how many of its first nodes recompute) and ``Plan.checkpoint_labels``."""
    if not heads:
        return {"checkpoint_partial": {}, "checkpoint_labels": {}}
    blocks, bounds = find_blocks(chain), list(starts) + [chain.n]
    return {"checkpoint_partial": {s: h - bounds[s] for s, h in sorted(heads.items())},
            "checkpoint_labels": {s: blocks.label(bounds[s], bounds[s + 1], h) for s, h in sorted(heads.items())}}


def ask_blocks(plan: Plan, chain: Chain, starts: Sequence[int], asked: Mapping[int, int]) -> None:
    """Write ``compile(checkpoint={stage: blocks})``'s choice on the split at ``starts`` into ``plan``."""
    whole, heads = asked_heads(find_blocks(chain), starts, chain.n, asked)
    plan.checkpoint = sorted(whole)
    for key, value in plan_fields(chain, starts, heads).items():
        setattr(plan, key, value)
