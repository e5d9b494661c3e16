"""``compile(..., refine=n)``: measure the planned stages, correct the node times, plan again.

The measuring lives here, beside the benchmark's, and both price a schedule's step the same
way (:func:`~pipesplit.bench.predict.step_timeline`): stages are timed by
:func:`~pipesplit.runtime.engine.measure.measure_stage_costs` (in isolation, one microbatch; the
benchmark reads the same figures from a traced pipeline, :meth:`~pipesplit.runtime.engine.trace.Trace.stage_costs`),
and the times are corrected by the plan pass :func:`~pipesplit.passes.plan.refine.correct_node_times`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx
from tqdm.auto import tqdm

from pipesplit.bench.predict import step_timeline
from pipesplit.capture import Captured
from pipesplit.passes.plan.objective import CommModel
from pipesplit.passes.plan.refine import correct_node_times
from pipesplit.passes.split import split_graph
from pipesplit.passes.split.program import SplitProgram
from pipesplit.plan import Plan
from pipesplit.runtime.engine.measure import measure_stage_costs
from pipesplit.schedules import Schedule


def refine_plan(
    gm: fx.GraphModule, captured: Captured, plan: Plan, replan: Callable[[], Plan], devices: list[str],
    args: tuple[Any, ...], kwargs: dict[str, Any], *, rounds: int, schedule: Schedule | None, comm: CommModel,
    progress: bool | None,
) -> Plan:
    """Measure ``plan``'s stages, correct the node times, ``replan()``; up to ``rounds`` times, or
    until planning again gives a split already measured. Returns the best measured plan: the
    cheapest simulated ``schedule`` step, or without one the slowest stage's F + B."""
    seen: dict[tuple[tuple[str, ...], ...], tuple[float, Plan]] = {}
    bar = tqdm(total=rounds + 1, desc="refine", unit="round", disable=None if progress is None else not progress, leave=False)
    for _ in range(rounds + 1):
        key = tuple(map(tuple, plan.stages))
        if key in seen:  # planning again gave a split already measured: converged
            bar.total = bar.n  # the bar ends full at the rounds measured, not short of a total never reached
            bar.set_postfix_str("converged")
            break
        prog = SplitProgram(captured, split_graph(gm, plan.stages, devices, recompute=plan.recompute), plan, devices)
        measured = measure_stage_costs(prog, *args, repeats=3, warmup=1, reduce="min", backward="fused", **kwargs)
        if schedule is not None:
            score = step_timeline(prog, schedule, measured, prog.example_batch or 1, comm)[1].step_time
        else:
            score = max(c.forward + c.backward for c in measured)
        plan.measured_s = score
        seen[key] = (score, plan)
        correct_node_times(gm, plan.stages, measured)
        plan = replan()
        bar.update()
    bar.close()
    return min(seen.values(), key=lambda x: x[0])[1]
