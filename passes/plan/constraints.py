"""Hand-written planner constraints: pin a module to a stage, forbid cuts inside a module."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch.fx as fx

from pipesplit.errors import PlanError, nearest_names
from pipesplit.meta import node_module_paths


def _inside(path: str, paths: list[str]) -> bool:
    """One of ``paths`` is the module ``path`` or a submodule of it."""
    return any(p == path or p.startswith(path + ".") for p in paths)


def module_positions(nodes: Sequence[fx.Node], path: str) -> list[int]:
    """The operations run inside module ``path`` or its submodules: a container such as an
    ``nn.ModuleList``, never called itself, has the operations of its children."""
    return [i for i, n in enumerate(nodes) if _inside(path, node_module_paths(n))]


def _whole_units(nodes: Sequence[fx.Node], path: str) -> list[str]:
    """What ``no_split`` keeps whole for ``path``: the module itself where it is called, else (a
    container, ``nn.ModuleList``/``ModuleDict``, whose forward never runs) each of its children."""
    stacks = [node_module_paths(n) for n in nodes]
    if any(path in paths for paths in stacks):
        return [path]
    depth = path.count(".") + 1
    return sorted({p for paths in stacks for p in paths if p.startswith(path + ".") and p.count(".") == depth})


def _resolve(pattern: str, known: set[str], what: str) -> list[str]:
    matched = sorted(p for p in known if fnmatch.fnmatchcase(p, pattern))
    if not matched:
        raise PlanError(f"{what} {pattern!r} matches no module of the model" + (nearest_names(pattern, known) or ".")
                        + " Module names are those of model.named_modules().")
    return matched


@dataclass(frozen=True)
class StageRanges:
    """Where each stage may start: ``start_lo[s] <= start of stage s <= start_hi[s]``."""

    start_lo: np.ndarray
    start_hi: np.ndarray


def forbid_cuts_inside(
    nodes: Sequence[fx.Node], allowed: np.ndarray, no_split: Sequence[str], known: set[str]
) -> np.ndarray:
    """A copy of ``allowed`` with every cut strictly inside the named modules removed.

    Patterns may use shell wildcards: ``"blocks.*"`` keeps every block whole. A container that
    is never called itself (``"blocks"``, an ``nn.ModuleList``) means each of its children, as
    ``"blocks.*"`` does: cuts between the blocks stay allowed.
    """
    out: np.ndarray = allowed.copy()
    for pattern in no_split:
        for path in _resolve(pattern, known, "no_split entry"):
            for unit in _whole_units(nodes, path):
                pos = module_positions(nodes, unit)
                if pos:
                    out[pos[0] + 1 : pos[-1] + 1] = False
    return out


def check_pins_cuttable(nodes: Sequence[fx.Node], allowed: np.ndarray, pins: Mapping[str, int],
                        no_split: Sequence[str]) -> None:
    """Two modules pinned to different stages leave a cut the chain allows between them (``no_split``
    may forbid every one); otherwise the two constraints contradict each other and neither is dropped."""
    spans = sorted((pos[0], pos[-1], stage, path) for path, stage in pins.items() if (pos := module_positions(nodes, path)))
    for (a0, a1, sa, pa), (b0, b1, sb, pb) in zip(spans, spans[1:]):
        if sa != sb and a1 < b0 and not allowed[a1 + 1 : b0 + 1].any():
            raise PlanError(
                f"pins {pa!r} -> stage {sa} and {pb!r} -> stage {sb} need a cut between them (operations {a1}..{b0}), "
                f"but no_split={list(no_split)!r} forbids every cut there. Pin both to one stage, or drop the "
                "no_split entry that covers them."
            )


def pin_ranges(
    nodes: Sequence[fx.Node], pins: Mapping[str, int], num_stages: int, known: set[str]
) -> StageRanges | None:
    """Start ranges that keep every pinned module whole inside its stage."""
    if not pins:
        return None
    n = len(nodes)
    lo = np.zeros(num_stages, dtype=np.int64)
    hi = np.full(num_stages, n - 1, dtype=np.int64)
    hi[0] = 0
    spans = []
    for path, stage in pins.items():
        if not isinstance(stage, int) or not 0 <= stage < num_stages:
            raise PlanError(f"pin {path!r} -> stage {stage!r}: stages are numbered 0..{num_stages - 1}.")
        _resolve(path, known, "pinned module")
        pos = module_positions(nodes, path)
        if not pos:
            raise PlanError(f"pinned module {path!r} runs no operation in the captured graph.")
        spans.append((pos[0], pos[-1], stage, path))
        hi[stage] = min(hi[stage], pos[0])
        if stage + 1 < num_stages:
            lo[stage + 1] = max(lo[stage + 1], pos[-1] + 1)
    spans.sort()
    for (a0, a1, sa, pa), (b0, b1, sb, pb) in zip(spans, spans[1:]):
        if sb < sa:
            raise PlanError(
                f"pins contradict the order modules run in: {pa!r} (operations {a0}..{a1}) is pinned to stage {sa} "
                f"but {pb!r}, which runs after it (operations {b0}..{b1}), to the earlier stage {sb}."
            )
        if b0 <= a1 and sa != sb:
            raise PlanError(f"pins {pa!r} -> {sa} and {pb!r} -> {sb} overlap (operations {b0}..{a1}) but name different stages.")
    for s in range(1, num_stages):  # a stage must start after the one before it
        lo[s] = max(lo[s], lo[s - 1] + 1)
    for s in range(num_stages - 2, -1, -1):
        hi[s] = min(hi[s], hi[s + 1] - 1) if s > 0 else 0
    bad = [s for s in range(num_stages) if lo[s] > hi[s]]
    if bad:
        s = bad[0]
        raise PlanError(
            f"the pins leave stage {s} no room: it would have to start at or after operation {lo[s]} and at or "
            f"before operation {hi[s]}. Check the pinned stages, or use more stages."
        )
    return StageRanges(lo, hi)
