"""Balanced partition: contiguous stages minimising the bottleneck, then the bytes at the cuts.

The chain problem (split a sequence into ``k`` contiguous non-empty parts minimising
the largest part) is solved exactly: bisection over integer bottlenecks with a greedy
feasibility test that is optimal for non-negative weights. Among cuts within
``slack`` of that optimum, a dynamic programme over cut positions picks the ones that
carry the fewest bytes, then the smallest bottleneck that keeps those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipesplit.errors import PlanError
from pipesplit.passes.chain import Chain

_INF = np.iinfo(np.int64).max // 4


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
    scale = 2**52 / max(total, 1e-300)
    return np.rint(cost * scale).astype(np.int64)


class _Solver:
    def __init__(self, chain: Chain, mem_cap: int | None):
        self.n = chain.n
        self.w = _integer_weights(chain.cost)
        self.P = np.concatenate([[0], np.cumsum(self.w)])
        self.M = np.concatenate([[0], np.cumsum(chain.mem)])
        self.mem_cap = _INF if mem_cap is None else int(mem_cap)
        self.allowed = chain.allowed
        self.cut_bytes = chain.cut_bytes.astype(np.float64)
        # prev_allowed[j]: the largest allowed cut position <= j.
        idx = np.where(chain.allowed, np.arange(self.n + 1), -1)
        self.prev_allowed = np.maximum.accumulate(idx)

    def stages_needed(self, cap: int) -> int | None:
        """Fewest stages with every stage <= cap (cost) and <= mem_cap; None if impossible."""
        start, count = 0, 0
        while start < self.n:
            j = int(np.searchsorted(self.P, self.P[start] + cap, side="right")) - 1
            j = min(j, int(np.searchsorted(self.M, self.M[start] + self.mem_cap, side="right")) - 1)
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

    def fewest_bytes(self, k: int, cap: int) -> tuple[float, list[int]] | None:
        """Exactly ``k`` non-empty stages each <= cap, minimising the summed cut bytes."""
        n, P, M = self.n, self.P, self.M
        j = np.arange(n + 1)
        lo = np.maximum(np.searchsorted(P, P - cap, side="left"), np.searchsorted(M, M - self.mem_cap, side="left"))
        hi = j - 1
        inf = np.inf
        dp = np.full(n + 1, inf)
        ok0 = (lo <= 0) & (j >= 1) & self.allowed
        dp[ok0] = 0.0
        dp[ok0 & (j < n)] += self.cut_bytes[ok0 & (j < n)]
        choices = []
        for _ in range(k - 1):
            best, arg = _range_min(dp, lo, hi)
            new = np.where(self.allowed & (hi >= lo), best, inf)
            new[:1] = inf
            new = new + np.where(j < n, self.cut_bytes, 0.0)
            choices.append(arg)
            dp = new
        if not np.isfinite(dp[n]):
            return None
        starts, pos = [n], n
        for arg in reversed(choices):
            pos = int(arg[pos])
            starts.append(pos)
        return float(dp[n]), sorted(set(starts[1:]) | {0})


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and argmin of values[lo[j]..hi[j]] for every j (inf where the range is empty)."""
    n = len(values)
    tables, args = [values], [np.arange(n)]
    span = 1
    while span * 2 <= n:
        prev, parg = tables[-1], args[-1]
        left, right = prev[: n - 2 * span + 1], prev[span : n - span + 1]
        take_right = right < left
        tables.append(np.where(take_right, right, left))
        args.append(np.where(take_right, parg[span : n - span + 1], parg[: n - 2 * span + 1]))
        span *= 2
    empty = hi < lo
    lo_c = np.clip(lo, 0, n - 1)
    length = np.where(empty, 1, hi - lo + 1)
    level = np.floor(np.log2(length)).astype(np.int64)
    best = np.full(len(lo), np.inf)
    arg = np.zeros(len(lo), dtype=np.int64)
    for lv in np.unique(level):
        sel = (level == lv) & ~empty
        if not sel.any():
            continue
        table, targ = tables[lv], args[lv]
        a = lo_c[sel]
        b = hi[sel] - (1 << int(lv)) + 1
        take_b = table[b] < table[a]
        best[sel] = np.where(take_b, table[b], table[a])
        arg[sel] = np.where(take_b, targ[b], targ[a])
    return best, arg


def solve_chain(chain: Chain, num_stages: int, *, mem_cap: int | None = None, slack: float = 0.05) -> ChainSplit:
    """Split ``chain`` into ``num_stages`` contiguous stages (see the module docstring).

    >>> import numpy as np
    >>> from pipesplit.passes.chain import Chain
    >>> c = Chain([None] * 5, np.array([1., 8, 3, 4, 7]), np.zeros(5, np.int64),
    ...           np.zeros(6, np.int64), np.ones(6, bool))
    >>> solve_chain(c, 4, slack=0).bottleneck
    8.0
    """
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
            biggest = int(chain.mem.max(initial=0))
            what = (
                f"a single node needs {biggest:,} bytes" if need is None
                else f"the fewest stages that fit is {need}"
            )
            raise PlanError(
                f"no split into {num_stages} stages keeps every stage under max_stage_memory={mem_cap:,} bytes: "
                f"{what} (total {int(chain.mem.sum()):,} bytes). Use more stages or raise max_stage_memory."
            )
    best = solver.min_bottleneck(num_stages)
    scale = float(chain.cost.sum()) / max(int(solver.P[-1]), 1)
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
    bounds = list(starts) + [n]
    seg = [float(chain.cost[a:b].sum()) for a, b in zip(bounds, bounds[1:])]
    return ChainSplit(tuple(starts), max(seg), best * scale, int(bytes_))
