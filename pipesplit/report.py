"""Human-readable per-stage table of a split program."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipesplit.meta import node_cost
from pipesplit.passes.plan.checkpointing import describe
from pipesplit.units import format_cost, human_bytes, human_count

if TYPE_CHECKING:
    from pipesplit.passes.split.program import SplitProgram


def stage_rows(prog: "SplitProgram") -> list[dict[str, object]]:
    """One dict of figures per stage (what the report prints)."""
    plan = prog.plan
    rows = []
    for stage in prog.stages:
        nodes = [n for n in stage.module.graph.nodes if n.op in ("call_function", "call_module", "call_method")]
        costs = [node_cost(n) for n in nodes if "pipesplit_cost" in n.meta]
        params = sum(p.numel() for p in stage.module.parameters())
        rows.append(
            {
                "stage": stage.index,
                "device": str(stage.device),
                "nodes": len(nodes),
                "params": params,
                "fwd_flops": sum(c.fwd_flops for c in costs),
                "bwd_flops": sum(c.bwd_flops for c in costs),
                "cost": plan.stage_costs[stage.index] if plan.stage_costs else 0.0,
                "time_s": sum(c.time_s for c in costs if c.time_s is not None) if any(c.time_s is not None for c in costs) else None,
                "memory": plan.stage_memory[stage.index] if plan.stage_memory else 0,
                "checkpoint": stage.index in plan.checkpoint,
                "sent_bytes": sum(b.nbytes for b in prog.boundaries if b.src == stage.index),
            }
        )
    return rows


def format_report(prog: "SplitProgram") -> str:
    plan = prog.plan
    rows = stage_rows(prog)
    cap = plan.max_stage_memory
    memory = "memory" if cap is None else f"memory (cap {human_bytes(cap)})"
    head = ["stage", "device", "nodes", "params", "fwd FLOPs", "bwd FLOPs", f"cost ({plan.cost_name})", "time", memory,
            "recomputes", "sends"]
    table = [head]
    for r in rows:
        mark = " *" if r["stage"] == plan.bottleneck_stage and len(rows) > 1 else ""
        table.append(
            [
                f"{r['stage']}{mark}",
                str(r["device"]),
                str(r["nodes"]),
                human_count(float(r["params"])),  # type: ignore[arg-type]
                human_count(float(r["fwd_flops"])),  # type: ignore[arg-type]
                human_count(float(r["bwd_flops"])),  # type: ignore[arg-type]
                format_cost(float(r["cost"]), plan.cost_name),  # type: ignore[arg-type]
                "-" if r["time_s"] is None else f"{float(r['time_s']) * 1e3:.2f} ms",  # type: ignore[arg-type]
                human_bytes(float(r["memory"])) + (" OVER" if cap is not None and r["memory"] > cap else ""),  # type: ignore[operator, arg-type]
                (f"forward, {human_count(float(r['fwd_flops']))}" if r["checkpoint"]  # type: ignore[arg-type]
                 else plan.checkpoint_labels.get(int(r["stage"]), "-")),  # type: ignore[call-overload]
                human_bytes(float(r["sent_bytes"])),  # type: ignore[arg-type]
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = sum(plan.stage_costs) if plan.stage_costs else 0.0
    mean = total / max(len(rows), 1)
    lines.append("")
    lines.append(
        f"bottleneck: stage {plan.bottleneck_stage} ({format_cost(plan.bottleneck, plan.cost_name)}), "
        f"cost balance {plan.bottleneck / mean if mean else 1.0:.3f}x the mean stage cost ({_cost_words(plan.cost_name)}), "
        f"lower bound {format_cost(plan.lower_bound, plan.cost_name)}, gap {plan.gap * 100:.1f}%  [plan: {plan.source}]"
    )
    lines.append(boundary_summary(prog))
    if plan.schedule is not None and plan.predicted_step_s is not None:
        lines.append(
            f"schedule {plan.schedule!r} x{plan.num_microbatches}: predicted step {plan.predicted_step_s * 1e3:.4g} ms; "
            f"activation checkpointing on {describe(plan.checkpoint, plan.num_stages)} (each recomputes its forward "
            "before its backward)"
            + (f"; part of a stage on {', '.join(f'stage {s} ({t})' for s, t in plan.checkpoint_labels.items())} "
               "(the blocks recomputed before its backward)" if plan.checkpoint_labels else "")
        )
        if plan.lengths:
            steps = ", ".join(f"length {n} (weight {w:.3g}): {t * 1e3:.4g} ms"
                              for n, w, t in zip(plan.lengths, plan.length_weights, plan.length_steps_s))
            lines.append(f"planned for the expected step over lengths: {steps}; expected {plan.predicted_step_s * 1e3:.4g} ms")
    if plan.unknown_ops:
        ops = ", ".join(f"{k}×{v}" for k, v in sorted(plan.unknown_ops.items()))
        lines.append(f"unknown ops (no FLOP formula; costed by output size): {ops}")
    for note in prog.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def boundary_summary(prog: "SplitProgram") -> str:
    """``boundaries: 3 send/recv edges (3 tensors, 384.0 KiB per example batch; 3 integers: sizes)``: every
    edge the picture draws, the tensors (drawn solid) and the sizes and scalars (drawn dashed) counted apart."""
    tensors = [b for b in prog.boundaries if b.kind == "tensor"]
    others = [b for b in prog.boundaries if b.kind != "tensor"]
    small = ""
    if others:
        kinds = sorted({b.kind for b in others})
        small = f"; {len(others)} {'integers: sizes' if kinds == ['int'] else 'sizes or scalars'}"
    n, t = len(prog.boundaries), len(tensors)
    return (f"boundaries: {n} send/recv edge{'s' if n != 1 else ''} ({t} tensor{'s' if t != 1 else ''}, "
            f"{human_bytes(sum(b.nbytes for b in tensors))} per example batch{small})")


def _cost_words(cost_name: str) -> str:
    """What a stage's cost counts, in words: the report's balance is of these, the benchmark's of times."""
    return {"flops": "forward + backward FLOPs", "params": "parameter bytes", "profile": "profiled seconds",
            "hybrid": "fitted seconds", "uniform": "node counts"}.get(cost_name, cost_name)
