"""Balanced partition: contiguous stages minimising the bottleneck, then the bytes at the cuts.

The chain problem (split a sequence into ``k`` contiguous non-empty parts minimising
the largest part) is solved exactly: bisection over integer bottlenecks with a greedy
feasibility test that is optimal for non-negative weights. Among cuts within
``slack`` of that optimum, a dynamic programme over cut positions picks the ones that
carry the fewest bytes (of equal bytes, the fewest tensors), then the smallest bottleneck
that keeps those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pipesplit.errors import PlanError
from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.pushed import checkpointed_memory_ends, pushed_bytes

__all__ = [
    "ChainSplit", "StageLimits", "solve_chain", "solve_candidates", "stage_memory_limits", "checkpointed_memory_ends",
]

_INF = np.iinfo(np.int64).max // 4
# what a tensor crossing a cut adds to the fewest-bytes objective: 2**-20 byte, so 2**20 tensors over
# all cuts still weigh less than one byte, and float64 keeps it exact up to 2**32 bytes at a cut
_PER_TENSOR = 2.0**-20


@dataclass(frozen=True)
class ChainSplit:
    """A solution: stage start positions (``starts[0] == 0``) and its figures."""

    starts: tuple[int, ...]
    bottleneck: float
    optimal_bottleneck: float
    cut_bytes: int


def _integer_weights(cost: np.ndarray) -> np.ndarray:
    if np.any(cost < 0) or not np.all(np.isfinite(cost)):
        bad = int(np.argmax((cost < 0) | ~np.isfinite(cost)))
        raise PlanError(f"node costs must be finite and non-negative; position {bad} costs {cost[bad]!r}.")
    total = float(cost.sum())
    if total < 2**52 and np.all(cost == np.rint(cost)):
        return cost.astype(np.int64)
    return np.rint(cost / total * 2**52).astype(np.int64)  # divide first: 2**52 / total may overflow


class _Solver:
    def __init__(self, chain: Chain, mem_cap: int | None):
        self.n = chain.n
        self.w = _integer_weights(chain.cost)
        self.P = np.concatenate([[0], np.cumsum(self.w)])
        self.mem_cap = _INF if mem_cap is None else int(mem_cap)
        self.mem_lo = _memory_starts(chain, self.mem_cap)
        self.allowed = chain.allowed
        self.cut_bytes = chain.cut_bytes.astype(np.float64)
        if chain.cut_tensors is not None:  # the tie-break: equal bytes, fewer tensors (below one byte in all)
            self.cut_bytes += chain.cut_tensors * _PER_TENSOR
        # prev_allowed[j]: the largest allowed cut position <= j.
        idx = np.where(chain.allowed, np.arange(self.n + 1), -1)
        self.prev_allowed = np.maximum.accumulate(idx)

    def stages_needed(self, cap: int) -> int | None:
        """Fewest stages with every stage <= cap (cost) and <= mem_cap; None if impossible."""
        start, count = 0, 0
        while start < self.n:
            j = int(np.searchsorted(self.P, self.P[start] + cap, side="right")) - 1
            j = min(j, int(np.searchsorted(self.mem_lo, start, side="right")) - 1)
            j = int(self.prev_allowed[min(j, self.n)])
            if j <= start:
                return None
            start, count = j, count + 1
        return count

    def min_bottleneck(self, k: int) -> int:
        lo, hi = int(self.w.max(initial=0)), int(self.P[-1])
        while lo < hi:
            mid = (lo + hi) // 2
            need = self.stages_needed(mid)
            if need is not None and need <= k:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def fewest_bytes(self, k: int, cap: int, limits: "StageLimits | None" = None) -> tuple[float, list[int]] | None:
        """Exactly ``k`` non-empty stages each <= cap, minimising the summed cut bytes; with
        ``limits``, also within each stage's memory window and start range."""
        if limits is not None and limits.end_hi is not None:
            return pushed_bytes(self, k, cap, limits)
        n, P = self.n, self.P
        j = np.arange(n + 1)
        base = np.maximum(np.searchsorted(P, P - cap, side="left"), self.mem_lo)
        tail = np.where(j < n, self.cut_bytes, 0.0)
        ranged = limits is not None and limits.start_lo is not None and limits.start_hi is not None
        scaled = limits is not None and limits.cost_scale is not None
        per_stage = limits is not None and (limits.mem_lo is not None or ranged or scaled)

        def window(s: int) -> tuple[np.ndarray, np.ndarray]:
            if not per_stage:
                return base, j - 1
            lo = self.cost_starts(cap, limits, s)  # type: ignore[arg-type]
            lo = lo if limits.mem_lo is None else np.maximum(lo, limits.mem_lo[s])  # type: ignore[union-attr]
            hi = j - 1
            if ranged and s > 0:
                lo = np.maximum(lo, limits.start_lo[s])  # type: ignore[union-attr,index]
                hi = np.minimum(hi, limits.start_hi[s])  # type: ignore[union-attr,index]
            return lo, hi

        lo0, _ = window(0)
        dp = np.full(n + 1, np.inf)
        ok = (lo0 <= 0) & (j >= 1) & self.allowed
        dp[ok] = tail[ok]
        shared = None if per_stage else _RangeMin(base, j - 1, n + 1)  # one window for every stage
        history = []
        for s in range(1, k):
            lo, hi = window(s)
            open_ = self.allowed & (hi >= lo)
            open_[:1] = False
            history.append((dp, lo, hi))
            window_min = shared if shared is not None else _RangeMin(lo, hi, n + 1)
            dp = np.where(open_, window_min.min(dp), np.inf) + tail
        if not np.isfinite(dp[n]):
            return None
        starts, pos = [n], n
        for prev, lo, hi in reversed(history):  # leftmost argmin of the window that gave dp[pos]
            pos = int(lo[pos]) + int(np.argmin(prev[lo[pos] : hi[pos] + 1]))
            starts.append(pos)
        return float(dp[n]), sorted(set(starts[1:]) | {0})

    def cost_starts(self, cap: int, limits: "StageLimits", s: int) -> np.ndarray:
        """Per end ``j``: the first start whose stage ``s`` costs at most ``cap`` (its cost scaled by
        ``limits.cost_scale[s]``: a checkpointed stage runs its forward twice) and fits ``mem_cap``."""
        scale = 1.0 if limits.cost_scale is None else limits.cost_scale[s]
        room = cap if scale == 1.0 else int(cap / scale)
        lo: np.ndarray = np.maximum(np.searchsorted(self.P, self.P - room, side="left"), self.mem_lo)
        return lo


def _memory_starts(chain: Chain, cap: int, mem: np.ndarray | None = None) -> np.ndarray:
    """lo[j]: the first start i whose stage [i, j) holds at most ``cap`` bytes (j if none does).

    Non-decreasing in j. Shared state counts once in every stage that reads it.
    ``mem`` overrides ``chain.mem`` (e.g. activations weighted by microbatches in flight).
    """
    mem = chain.mem if mem is None else mem
    M = np.concatenate([[0], np.cumsum(mem)])
    if not chain.shared:
        return np.searchsorted(M, M - cap, side="left")
    reads: list[list[int]] = [[] for _ in range(chain.n)]
    for s, (_, positions) in enumerate(chain.shared):
        for p in positions:
            reads[p].append(s)
    count = [0] * len(chain.shared)  # reads of each shared tensor inside the window [i, j)
    lo = np.zeros(chain.n + 1, dtype=np.int64)
    i = held = 0
    for j in range(1, chain.n + 1):
        held += int(mem[j - 1])
        for s in reads[j - 1]:
            held += chain.shared[s][0] if count[s] == 0 else 0
            count[s] += 1
        while held > cap and i < j:
            held -= int(mem[i])
            for s in reads[i]:
                count[s] -= 1
                held -= chain.shared[s][0] if count[s] == 0 else 0
            i += 1
        lo[j] = i
    return lo


class _RangeMin:
    """Min of ``values[lo[j]..hi[j]]`` for every j, for fixed ranges and many ``values``.

    A sparse table: level ``l`` holds the minima of the windows of length ``2**l``;
    a range is the union of two (overlapping) windows of one level. Only the levels
    the longest range needs are built. Empty ranges (``hi < lo``) give inf.
    """

    def __init__(self, lo: np.ndarray, hi: np.ndarray, n: int):
        self.n = n
        self.empty = hi < lo
        length = np.where(self.empty, 1, hi - lo + 1)
        level = np.floor(np.log2(length)).astype(np.int64)
        self.levels = int(level.max(initial=0)) + 1
        a = np.where(self.empty, 0, np.clip(lo, 0, n - 1))
        b = np.where(self.empty, 0, hi - (1 << level) + 1)
        self.ia, self.ib = level * n + a, level * n + b  # flat indices into the table

    def min(self, values: np.ndarray) -> np.ndarray:
        n = self.n
        table = np.empty((self.levels, n))
        table[0] = values
        for lv in range(1, self.levels):
            span = 1 << (lv - 1)
            np.minimum(table[lv - 1, : n - span], table[lv - 1, span:], out=table[lv, : n - span])
            table[lv, n - span :] = np.inf  # windows running past the end: never read
        flat = table.ravel()
        best = np.minimum(flat[self.ia], flat[self.ib])
        best[self.empty] = np.inf
        return best


def solve_chain(chain: Chain, num_stages: int, *, mem_cap: int | None = None, slack: float = 0.05) -> ChainSplit:
    """Split ``chain`` into ``num_stages`` contiguous stages (see the module docstring).

    >>> import numpy as np
    >>> from pipesplit.passes.plan.chain import Chain
    >>> c = Chain([None] * 5, np.array([1., 8, 3, 4, 7]), np.zeros(5, np.int64),
    ...           np.zeros(6, np.int64), np.ones(6, bool))
    >>> solve_chain(c, 4, slack=0).bottleneck
    8.0
    """
    solver = _checked_solver(chain, num_stages, mem_cap)
    best = solver.min_bottleneck(num_stages)
    cap = best + int(best * max(slack, 0.0))
    found = solver.fewest_bytes(num_stages, cap)
    assert found is not None, "a feasible bottleneck always admits exactly k stages"
    bytes_, starts = found
    at_best = solver.fewest_bytes(num_stages, best) if cap > best else found
    assert at_best is not None
    if at_best[0] <= bytes_:
        bytes_, starts = at_best
    else:  # tighten: the smallest bottleneck that still achieves those bytes
        lo, hi = best, cap
        step = max(1, (cap - best) >> 8)  # 8 halvings: within slack/256 of the tightest
        while hi - lo > step:
            mid = (lo + hi) // 2
            trial = solver.fewest_bytes(num_stages, mid)
            if trial is not None and trial[0] <= bytes_:
                hi, starts = mid, trial[1]
            else:
                lo = mid + 1
    return ChainSplit(tuple(starts), largest_stage(chain, starts), largest_stage(chain, at_best[1]), int(bytes_))


def _checked_solver(chain: Chain, num_stages: int, mem_cap: int | None) -> "_Solver":
    """A solver for ``chain``, after checking that ``num_stages`` and ``mem_cap`` can be met at all."""
    n = chain.n
    if num_stages < 1:
        raise PlanError(f"num_stages must be at least 1, got {num_stages}.")
    cuts = int(chain.allowed[1:n].sum())
    if num_stages - 1 > cuts:
        raise PlanError(
            f"num_stages={num_stages} needs {num_stages - 1} cuts but the graph has only {cuts} places to cut "
            f"({n} compute nodes; a cut cannot separate a tuple from its getitems). Use num_stages <= {cuts + 1}."
        )
    solver = _Solver(chain, mem_cap)
    if mem_cap is not None:
        need = solver.stages_needed(int(solver.P[-1]))
        if need is None or need > num_stages:
            biggest = int(chain.node_memory().max(initial=0))
            what = (
                f"a single node needs {biggest:,} bytes" if need is None
                else f"the fewest stages that fit is {need}"
            )
            raise PlanError(
                f"no split into {num_stages} stages keeps every stage under max_stage_memory={mem_cap:,} bytes: "
                f"{what} (total {chain.total_memory():,} bytes). Use more stages or raise max_stage_memory."
            )
    return solver


def largest_stage(chain: Chain, starts: Sequence[int]) -> float:
    """The cost of the most expensive stage when ``chain`` is cut at ``starts``."""
    bounds = list(starts) + [chain.n]
    return max(float(chain.cost[a:b].sum()) for a, b in zip(bounds, bounds[1:]))


@dataclass(frozen=True)
class StageLimits:
    """Limits that differ per stage: memory (activations times microbatches in flight) and pins.

    ``mem_lo[s]`` is :func:`_memory_starts` for stage ``s``'s memory (a stage ending at
    ``j`` starts at ``mem_lo[s][j]`` or later). ``end_hi[s][i]`` is the other way round: a
    stage ``s`` starting at ``i`` ends at ``end_hi[s][i]`` or earlier; it expresses limits
    whose feasible starts are no interval (checkpointing: the stage's inputs are held per
    microbatch in flight, and their size depends on where it starts). Stage ``s`` must
    start within ``[start_lo[s], start_hi[s]]``. ``cost_scale[s]`` multiplies stage ``s``'s
    cost against the bottleneck (a checkpointed stage runs its forward twice).
    """

    mem_lo: tuple[np.ndarray, ...] | None = None
    start_lo: np.ndarray | None = None
    start_hi: np.ndarray | None = None
    end_hi: tuple[np.ndarray, ...] | None = None
    cost_scale: tuple[float, ...] | None = None


def stage_memory_limits(chain: Chain, cap: int, in_flight: Sequence[float]) -> tuple[np.ndarray, ...]:
    """Per-stage memory windows when stage ``s`` holds ``in_flight[s]`` microbatches of activations."""
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    state = chain.mem - act
    cache: dict[float, np.ndarray] = {}
    for k in in_flight:
        if k not in cache:
            cache[k] = _memory_starts(chain, cap, state + max(k, 1) * act)
    return tuple(cache[k] for k in in_flight)


def solve_candidates(
    chain: Chain,
    num_stages: int,
    slacks: Sequence[float],
    *,
    limits: StageLimits = StageLimits(),
    mem_cap: int | None = None,
    precision: int = 20,
) -> list[ChainSplit]:
    """Splits to choose from: for each slack, the fewest cut bytes within that much of the best bottleneck.

    With per-stage limits the best bottleneck is found by bisection on the exact DP
    (to a relative precision of ``2**-precision``, 1e-6); without them, exactly (see :func:`solve_chain`).
    """
    solver = _checked_solver(chain, num_stages, mem_cap)
    if not any(x is not None for x in (limits.mem_lo, limits.start_lo, limits.end_hi, limits.cost_scale)):

        def feasible(cap: int) -> tuple[float, list[int]] | None:
            return solver.fewest_bytes(num_stages, cap)

        best = solver.min_bottleneck(num_stages)
    else:

        def feasible(cap: int) -> tuple[float, list[int]] | None:
            return solver.fewest_bytes(num_stages, cap, limits)

        lo = solver.min_bottleneck(num_stages)  # a bound: limits only remove splits
        total = int(solver.P[-1] * max(limits.cost_scale or (1.0,))) + 1  # a scaled stage may hold it all
        if feasible(total) is None:
            raise PlanError(
                f"no split into {num_stages} stages meets the per-stage limits (memory with microbatches in flight, "
                "pins) even ignoring balance. Use more stages, fewer microbatches in flight, activation "
                "checkpointing, a larger max_stage_memory, or fewer pins."
            )
        step = max(1, lo // 100)
        hi = lo
        while feasible(hi) is None:  # gallop up, then bisect
            lo, hi = hi + 1, min(total, hi + step)
            step *= 2
        while hi - lo > (hi >> precision):  # exact for small integers, to 1e-6 for large ones
            mid = (lo + hi) // 2
            if feasible(mid) is None:
                lo = mid + 1
            else:
                hi = mid
        best = hi
    out = []
    for slack in sorted(set(slacks) | {0.0}):
        found = feasible(best + int(best * max(slack, 0.0)))
        if found is not None:
            bytes_, starts = found
            out.append(ChainSplit(tuple(starts), largest_stage(chain, starts), largest_stage(chain, starts), int(bytes_)))
    optimal = min(c.bottleneck for c in out)
    return [ChainSplit(c.starts, c.bottleneck, optimal, c.cut_bytes) for c in out]
