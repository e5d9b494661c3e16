"""Chain partition under limits that depend on where a stage starts (activation checkpointing).

With checkpointing a stage keeps its *inputs* for every microbatch in flight, and their
size depends on the stage's first position, so the starts that fit under a memory cap
for a given end are no interval, and the pull-form DP of ``partition`` (a range minimum
over an interval of starts) does not apply. Here each start pushes its cost to the
interval of ends it may reach instead: a range-"chmin" (:func:`_range_chmin`), the push
counterpart of ``partition._RangeMin``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from pipesplit.passes.plan.chain import Chain
from pipesplit.passes.plan.objective import BACKWARD_WORKING_SET


def checkpointed_memory_ends(chain: Chain, cap: int, in_flight: Sequence[float]) -> tuple[np.ndarray, ...]:
    """``StageLimits.end_hi`` for activation checkpointing under a memory cap.

    A checkpointed stage ``[i, j)`` keeps its inputs (``cut_bytes[i]``) and its outputs (what
    it hands on at ``j``: :meth:`Chain.end_bytes`; its backward starts from them) for each of
    the ``in_flight[s]`` microbatches it holds, and one microbatch's activations while it
    recomputes, with its backward's working set: ``state + (1 + BACKWARD_WORKING_SET) * act(i, j)
    + in_flight[s] * (cut_bytes[i] + end_bytes[j])``, shared tensors once. The outputs make
    the bytes no longer grow with ``j``, so the limit is, per stage, the last end ``j`` such
    that every end from ``i + 1`` to ``j`` fits (``i`` itself when none does): any end the
    partition may take fits.
    """
    n = chain.n
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    # state + one microbatch's activations, recomputed, and its backward's working set
    M = np.concatenate([[0], np.cumsum(chain.mem + BACKWARD_WORKING_SET * act)])
    ends = chain.end_bytes()
    starts = np.arange(n + 1)
    # per start i, the first position at or after i that reads each shared tensor (n when none),
    # sorted, and the bytes of those read up to each: a stage [i, e) holds tensor t when that read < e
    if chain.shared:
        first = np.stack([np.append(np.array(pos), n)[np.searchsorted(np.array(pos), starts, side="left")]
                          for _, pos in chain.shared])
        order = np.argsort(first, axis=0, kind="stable")
        thresholds = np.take_along_axis(first, order, axis=0)
        counted = np.cumsum(np.array([nbytes for nbytes, _ in chain.shared], dtype=np.float64)[order], axis=0)

    def held(i: np.ndarray, j: np.ndarray, k: float, table: list[np.ndarray]) -> np.ndarray:
        """The most any end ``e`` in ``(i, j]`` holds (``i < j``): ``M[e] + k * end_bytes[e] - M[i] +
        k * cut_bytes[i]`` plus the shared tensors read in ``[i, e)``, exactly: the ends split into
        runs between the shared tensors' first reads, each run's maximum from the sparse table."""
        base = k * chain.cut_bytes[i] - M[i]
        if not chain.shared:
            out: np.ndarray = _range_max(table, i + 1, j) + base
            return out
        best = np.full(len(i), -np.inf)
        lo = i + 1
        for t in range(len(chain.shared) + 1):
            hi = j if t == len(chain.shared) else np.minimum(thresholds[t][i], j)
            extra = counted[t - 1][i] if t else 0.0
            ok = lo <= hi
            run = _range_max(table, np.where(ok, lo, hi), hi) + extra
            best = np.where(ok, np.maximum(best, run), best)
            if t < len(chain.shared):
                lo = np.maximum(lo, thresholds[t][i] + 1)
        result: np.ndarray = best + base
        return result

    cache: dict[float, np.ndarray] = {}
    for k in in_flight:
        if k in cache:
            continue
        kk = max(k, 1)
        table = _range_max_table(M + kk * ends)
        lo, hi = starts.copy(), np.full(n + 1, n)  # held(i, lo) fits (empty stage holds nothing we count)
        while np.any(lo < hi):
            mid = (lo + hi + 1) // 2
            live = lo < hi  # mid > lo >= i there: the ends (i, mid] are not empty
            fits = np.ones(n + 1, dtype=bool)
            fits[live] = held(starts[live], mid[live], kk, table) <= cap
            lo, hi = np.where(fits, mid, lo), np.where(fits, hi, mid - 1)
        cache[k] = lo
    return tuple(cache[k] for k in in_flight)


def _range_max_table(values: np.ndarray) -> list[np.ndarray]:
    """A sparse table: level ``l`` holds the maxima of ``values`` over windows of ``2**l``."""
    table = [values.astype(np.float64)]
    width = 1
    while 2 * width <= len(values):
        prev = table[-1]
        table.append(np.maximum(prev[:-width], prev[width:]))
        width *= 2
    return table


def _range_max(table: list[np.ndarray], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element, the maximum of the table's values over ``[a, b]`` (inclusive, ``a <= b``)."""
    level = np.floor(np.log2(np.maximum(b - a + 1, 1))).astype(np.int64)
    out = np.empty(len(a), dtype=np.float64)
    for lv in np.unique(level):
        sel = level == lv
        row = table[int(lv)]
        out[sel] = np.maximum(row[a[sel]], row[b[sel] - (1 << int(lv)) + 1])
    return out


def _range_chmin(lo: np.ndarray, hi: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """``out[j]`` = min of ``values[i]`` over the ``i`` whose range ``[lo[i], hi[i]]`` holds ``j`` (inf if none).

    The push counterpart of :class:`_RangeMin`: each range is covered by two windows of
    length ``2**l``; window minima are pushed down level by level to single positions.
    """
    keep = (hi >= lo) & np.isfinite(values)
    lo, hi, values = lo[keep], hi[keep], values[keep]
    out = np.full(n, np.inf)
    if lo.size == 0:
        return out
    level = np.floor(np.log2(hi - lo + 1)).astype(np.int64)
    table = np.full((int(level.max()) + 1, n), np.inf)
    table[0] = out
    np.minimum.at(table, (level, lo), values)
    np.minimum.at(table, (level, hi - (1 << level) + 1), values)
    for lv in range(table.shape[0] - 1, 0, -1):
        span = 1 << (lv - 1)
        np.minimum(table[lv - 1], table[lv], out=table[lv - 1])
        np.minimum(table[lv - 1, span:], table[lv, : n - span], out=table[lv - 1, span:])
    result: np.ndarray = table[0]
    return result


def pushed_bytes(solver: Any, k: int, cap: int, limits: Any) -> tuple[float, list[int]] | None:
    """``partition._Solver.fewest_bytes`` for limits given per start (``StageLimits.end_hi``): each
    start pushes to the ends it may reach (``solver`` is a ``partition._Solver``)."""
    n, P = solver.n, solver.P
    j = np.arange(n + 1)
    tail = np.where(j < n, solver.cut_bytes, 0.0)
    mem_end = np.searchsorted(solver.mem_lo, j, side="right") - 1

    def reach(s: int) -> tuple[np.ndarray, np.ndarray]:
        """Per start i of stage s: is it a start stage s may take, and the last end it reaches."""
        scale = 1.0 if limits.cost_scale is None else limits.cost_scale[s]
        room = cap if scale == 1.0 else int(cap / scale)  # a checkpointed stage runs its forward twice
        end = np.minimum(np.searchsorted(P, P + room, side="right") - 1, mem_end)  # the last end within cap
        if limits.mem_lo is not None:
            end = np.minimum(end, np.searchsorted(limits.mem_lo[s], j, side="right") - 1)
        if limits.end_hi is not None:
            end = np.minimum(end, limits.end_hi[s])
        ok = solver.allowed.copy()
        if limits.start_lo is not None and limits.start_hi is not None and s > 0:
            ok &= (j >= limits.start_lo[s]) & (j <= limits.start_hi[s])
        return ok & (j < n), end

    dp = np.full(n + 1, np.inf)
    dp[0] = 0.0
    history = []
    for s in range(k):
        ok, end = reach(s)
        src = np.where(ok, dp, np.inf)
        history.append((src, end))
        dp = _range_chmin(j + 1, end, src, n + 1)
        dp = np.where(solver.allowed, dp, np.inf) + tail
    if not np.isfinite(dp[n]):
        return None
    starts, pos = [], n
    for src, end in reversed(history):  # the leftmost cheapest start that reaches pos
        cand = np.where((j < pos) & (end >= pos), src, np.inf)
        pos = int(np.argmin(cand))
        starts.append(pos)
    return float(dp[n]), sorted(starts)
