"""The planner's own scaling, apart from capture: ``solve_chain`` on random chains of up to 20,000
nodes against a greedy pass and the exact optimum, and ``plan_partition`` on synthetic graphs
(``bench_compile.py`` prints both tables)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from common import best_of, emit, markdown_table, ratio, seconds
from pipesplit.meta import NodeCost, set_node_cost
from pipesplit.passes.plan.chain import Chain, build_chain
from pipesplit.passes.plan.partition import solve_chain
from pipesplit.passes.plan.planner import cost_function, evaluate, plan_partition

SOLVE_AT = 20_000  # "well under a second" for a 20,000-node chain (bench_compile.SOLVE_TARGET_S)


# --------------------------------------------------------------------------- solve_chain
def random_chain(n: int, rng: np.random.Generator) -> Chain:
    """Heavy-tailed costs (a few matmuls, many cheap ops), random cut sizes, 5% forbidden cuts."""
    cost = np.rint(10 ** rng.uniform(2, 7, n))
    mem = rng.integers(0, 1 << 20, n)
    cut_bytes = np.rint(10 ** rng.uniform(3, 6, n + 1)).astype(np.int64)
    allowed = rng.random(n + 1) > 0.05
    allowed[0] = allowed[n] = True
    return Chain([None] * n, cost, mem, cut_bytes, allowed)


def greedy_pass(chain: Chain, k: int) -> float:
    """Baseline: one Python pass, cutting (where allowed) once a stage reaches total/k. Returns its bottleneck."""
    w, allowed = chain.cost.tolist(), chain.allowed.tolist()
    target = float(np.cumsum(chain.cost)[-1]) / k
    run = worst = 0.0
    stages = 1
    for i, c in enumerate(w):
        if run > 0 and run + c > target and allowed[i] and stages < k:
            worst, run, stages = max(worst, run), 0.0, stages + 1
        run += c
    return max(worst, run)


def bench_solve(
    sizes: list[int], stage_counts: list[int], repeats: int, clock: Callable[[], float]
) -> tuple[str, dict]:
    rng = np.random.default_rng(0)
    rows, worst_at = [], {}
    for n in sizes:
        chain = random_chain(n, rng)
        for k in stage_counts:
            t_solve, sol = best_of(lambda: solve_chain(chain, k), repeats, clock)
            t_greedy, greedy_bottleneck = best_of(lambda: greedy_pass(chain, k), repeats, clock)
            rows.append([f"{n:,}", k, seconds(t_solve), seconds(t_greedy), ratio(t_solve / t_greedy),
                         f"{sol.bottleneck / sol.optimal_bottleneck:.3f}",
                         f"{greedy_bottleneck / sol.optimal_bottleneck:.3f}"])
            if n == SOLVE_AT:
                worst_at[k] = t_solve
        emit(f"  solve_chain {n:,} nodes done")
    table = markdown_table(
        ["chain nodes", "stages", "solve_chain s", "greedy pass s (baseline)", "solve / greedy",
         "solve bottleneck / optimum (slack 0.05)", "greedy bottleneck / optimum"], rows)
    return table, worst_at


# --------------------------------------------------------------------------- plan pass
def synthetic_graph(n: int, rng: np.random.Generator) -> fx.GraphModule:
    """A residual chain of ~n annotated compute nodes: blocks of 8 ops, one parameter per block."""
    root = nn.Module()
    g = fx.Graph()
    x = g.placeholder("x")
    set_node_cost(x, NodeCost(out_bytes=1 << 17))
    aten = torch.ops.aten
    ops = [aten.mul.Tensor, aten.add.Tensor, aten.relu.default, aten.gelu.default,
           aten.mm.default, aten.add.Tensor, aten.relu.default]
    blocks = max(1, n // 8)
    params = []
    for b in range(blocks):
        name = f"w{b}"
        root.register_parameter(name, nn.Parameter(torch.zeros(1)))
        params.append(g.get_attr(name))
    h = x
    for b in range(blocks):
        block_in, y = h, h
        for i, op in enumerate(ops):
            y = g.call_function(op, (y, params[b]) if i == 0 else (y,))
            set_node_cost(y, NodeCost(fwd_flops=int(10 ** rng.uniform(2, 7)), igrad_flops=int(10 ** rng.uniform(2, 7)),
                                      out_bytes=1 << 17))
        h = g.call_function(aten.add.Tensor, (block_in, y))
        set_node_cost(h, NodeCost(fwd_flops=1 << 15, igrad_flops=1 << 15, out_bytes=1 << 17))
    out = g.output((h,))
    set_node_cost(out, NodeCost())
    for p in params:
        set_node_cost(p, NodeCost(param_bytes=1 << 20, trainable=True))
    return fx.GraphModule(root, g)


def one_pass(gm: fx.GraphModule) -> float:
    """Baseline: one Python pass over the graph reading every node's cost."""
    from pipesplit.meta import node_cost

    return float(sum(node_cost(n).total_flops for n in gm.graph.nodes if n.op == "call_function"))


def bench_plan(sizes: list[int], k: int, repeats: int, clock: Callable[[], float]) -> tuple[str, dict]:
    rng = np.random.default_rng(1)
    rows, at = [], {}
    name, fn = cost_function("flops")
    for n in sizes:
        gm = synthetic_graph(n, rng)
        nodes = len(gm.graph.nodes)
        t_plan, _ = best_of(lambda: plan_partition(gm, k, "flops"), repeats, clock)
        t_chain, chain = best_of(lambda: build_chain(gm, fn), repeats, clock)
        t_solve, sol = best_of(lambda: solve_chain(chain, k), repeats, clock)
        bounds = list(sol.starts) + [chain.n]
        stages = [[nd.name for nd in chain.nodes[a:b]] for a, b in zip(bounds, bounds[1:])]
        t_eval, _ = best_of(lambda: evaluate(gm, stages, name, fn, "planner"), repeats, clock)
        t_pass, _ = best_of(lambda: one_pass(gm), repeats, clock)
        rows.append([f"{nodes:,}", f"{chain.n:,}", k, seconds(t_plan), seconds(t_chain), seconds(t_solve), seconds(t_eval),
                     seconds(t_pass), ratio(t_plan / t_pass)])
        at[chain.n] = t_plan
        emit(f"  plan_partition {nodes:,} nodes done")
    table = markdown_table(
        ["graph nodes", "compute nodes", "stages", "plan_partition s", "build_chain s", "solve_chain s", "evaluate s",
         "one pass over nodes s (baseline)", "plan / pass"], rows)
    return table, at


# --------------------------------------------------------------------------- main
