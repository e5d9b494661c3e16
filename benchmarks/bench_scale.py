"""Plans at the sizes people train, on the meta device: pipesplit's plan against expert layouts.

For each shape (a Llama-3-8B, a Llama-2-13B in bf16 with mixed-precision AdamW, a Llama-3-70B
at 16 stages, a ViT-H/14) the model is built on the meta device (no memory, no weights) and
``pipesplit.compile(..., schedule="1f1b", num_microbatches=16, max_stage_memory=80 GiB,
checkpoint="auto")`` plans it: cuts and activation checkpointing chosen together. Against it,
the expert layouts: every split at decoder-layer boundaries of the form "the first stage ``a``
layers lighter (it holds the embedding), the last ``b`` lighter (the head), the rest as even
as the count allows" (``a`` in 0..2, ``b`` in 0..3), each with its best checkpointing among none,
all and the first ``j`` stages (the cheapest that keeps every stage under the cap). Every
layout, pipesplit's included, is priced by the same simulator (``passes/plan/pricing.py``:
stage forward, input- and weight-gradient times at this CPU's measured rates, communication
at the cuts, the memory model with the schedule's microbatches in flight); the predicted
seconds are this CPU's, so only the ratios matter. Then the planning time (whole compile, on
meta) at 32, 80 and 126 layers (8B, 70B and 405B widths).

    python benchmarks/bench_scale.py            # the real shapes (~10-20 minutes on 2 busy cores)
    python benchmarks/bench_scale.py --smoke    # tiny shapes in seconds (tests/test_bench_scale.py)
"""

from __future__ import annotations

import argparse
import os
from unittest import mock
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pipesplit  # noqa: E402
from pipesplit.meta import node_module_paths  # noqa: E402
from pipesplit.passes.annotate.rates import device_rates, largest_matmul  # noqa: E402
from pipesplit.passes.plan.chain import build_chain, compute_nodes  # noqa: E402
from pipesplit.passes.plan.objective import (  # noqa: E402
    CommModel, MemoryModel, activation_units_per_stage, in_flight_per_stage, split_stages, step_time,
)
from pipesplit.passes.plan.partial_checkpoint import find_blocks, shortest_heads  # noqa: E402
from pipesplit.passes.plan.planner import cheap_to_recompute, cost_function  # noqa: E402
from pipesplit.passes.plan.pricing import price_plan  # noqa: E402
from pipesplit.passes.plan.step_planner import figures_for, node_seconds, stage_state  # noqa: E402
from pipesplit.schedules import get_schedule  # noqa: E402

GiB = 2**30


@dataclass
class Shape:
    name: str
    build: Callable[[], nn.Module]  # on the meta device
    inputs: Callable[[], tuple[Any, ...]]
    layer: str  # module path of layer i, with {i}
    layers: int
    stages: int
    memory: MemoryModel = field(default_factory=MemoryModel)
    cap: int = 80 * GiB
    microbatches: int = 16
    timed: bool = False  # a row of the planning-time table too


def llama(layers: int, dim: int, ffn: int, heads: int, kv: int, vocab: int, seq: int,
          dtype: torch.dtype = torch.float32) -> tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]:
    def build() -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        with torch.device("meta"):
            return LlamaForCausalLM(cfg).to(dtype)

    return build, lambda: (torch.randint(0, vocab, (1, seq), device="meta"),)


def vit(layers: int, dim: int, ffn: int, heads: int, image: int, patch: int, batch: int) -> tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]:
    def build() -> nn.Module:
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(hidden_size=dim, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
                        image_size=image, patch_size=patch, num_labels=1000, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
        with torch.device("meta"):
            return ViTForImageClassification(cfg)

    return build, lambda: (torch.randn(batch, 3, image, image, device="meta"),)


MIXED = MemoryModel(optimizer="adamw", master_weights=True)  # bf16 weights, fp32 master and moments: 16 B/param
LLAMA = "model.layers.{i}"


def full_shapes() -> list[Shape]:
    return [
        Shape("Llama-3-8B fp32", *llama(32, 4096, 14336, 32, 8, 128256, 4096), LLAMA, 32, 8),
        Shape("Llama-3-8B bf16 mixed AdamW", *llama(32, 4096, 14336, 32, 8, 128256, 4096, torch.bfloat16), LLAMA, 32,
              8, MIXED, timed=True),
        Shape("Llama-2-13B bf16 mixed AdamW", *llama(40, 5120, 13824, 40, 40, 32000, 4096, torch.bfloat16), LLAMA, 40,
              8, MIXED),
        Shape("Llama-3-70B bf16 mixed AdamW", *llama(80, 8192, 28672, 64, 8, 128256, 4096, torch.bfloat16), LLAMA, 80,
              16, MIXED, timed=True),
        Shape("ViT-H/14 fp32, 64 images", *vit(32, 1280, 5120, 16, 224, 14, 64), "vit.layers.{i}", 32, 8),
    ]


def smoke_shapes() -> list[Shape]:
    return [Shape("tiny Llama", *llama(8, 64, 128, 4, 2, 512, 64), LLAMA, 8, 4, cap=0, microbatches=8, timed=True)]


def timing_only(smoke: bool) -> list[Shape]:
    """Planning time only (the 32-layer row comes from the comparison's own compile)."""
    if smoke:
        return []
    # 70B does not fit 16 stages of 80 GiB (its state alone is 65 GiB a stage): timed at two GPUs a stage.
    # 405B's training state alone is 6.5 TB: a stage of 16 is a node of 8 GPUs (8 x 80 GiB), not one GPU
    return [Shape("Llama-3-70B bf16 mixed AdamW, 160 GiB", *llama(80, 8192, 28672, 64, 8, 128256, 4096, torch.bfloat16),
                  LLAMA, 80, 16, MIXED, cap=160 * GiB),
            Shape("Llama-3.1-405B bf16 mixed AdamW", *llama(126, 16384, 53248, 128, 8, 128256, 4096, torch.bfloat16),
                  LLAMA, 126, 16, MIXED, cap=640 * GiB)]


def timing_row(shape: Shape, prog: Any, wall: float, cpu: float) -> list[Any]:
    return [shape.name, shape.layers, shape.stages, f"{shape.cap / GiB:.0f}", f"{prog.timings['capture']:.1f}",
            f"{prog.timings['plan']:.1f}", f"{wall:.1f}", f"{cpu:.1f}", checkpoint_text(prog.plan),
            f"{max(prog.plan.stage_memory) / GiB:.1f}"]


def layouts(layers: int, k: int) -> dict[str, list[int]]:
    """Layers per stage: the first ``a`` lighter, the last ``b`` lighter, the rest as even as the count allows."""
    out: dict[str, list[int]] = {}
    base = -(-layers // k)
    for a in range(3):
        for b in range(4):
            first, last = base - a, base - b
            rest = layers - first - last
            if k < 3 or first < 1 or last < 1 or rest < k - 2:
                continue
            q, r = divmod(rest, k - 2)
            counts = [first] + [q + (1 if i < r else 0) for i in range(k - 2)] + [last]
            if max(counts[1:-1]) > base + 1:
                continue
            out.setdefault(tuple(counts), f"first -{a}, last -{b}")  # type: ignore[call-overload]
    return {name: list(counts) for counts, name in out.items()}  # type: ignore[misc]


def expert_layouts(shape: Shape, chain: Any, seconds: Any, sched: Any, cap: int, nodes: list[Any]) -> list[dict[str, Any]]:
    """Every expert layout with its best checkpointing, priced like pipesplit's plan."""
    k = shape.stages
    in_flight, units = in_flight_per_stage(sched), activation_units_per_stage(sched)
    first_of = {}
    for i, n in enumerate(nodes):
        for p in node_module_paths(n):
            first_of.setdefault(p, i)
    experts = []
    act = chain.act if chain.act is not None else np.zeros(chain.n, dtype=np.int64)
    blocks = find_blocks(chain)
    for label, counts in layouts(shape.layers, k).items():
        layer0 = [sum(counts[:s]) for s in range(k)]
        starts = [0] + [first_of[shape.layer.format(i=b)] for b in layer0[1:]]
        bounds = starts + [chain.n]
        # checkpointing: none, all or the first j stages; Megatron's "the first N layers of every stage"
        # (--recompute-num-layers N); and the first layers each stage needs to fit, stage by stage
        choices: list[tuple[str, list[int], dict[int, int]]] = [
            (str(list(range(j))), list(range(j)), {}) for j in range(k + 1)]
        for n in range(1, max(counts)):
            heads = {s: first_of[shape.layer.format(i=layer0[s] + n)] for s in range(k) if n < counts[s]}
            choices.append((f"first {n} layers of each stage", [s for s in range(k) if n >= counts[s]], heads))
        plain = figures_for(chain, starts, seconds, in_flight, shape.memory, CommModel(), "cpu", units, ())
        states = [stage_state(chain, act, a, b) for a, b in zip(bounds, bounds[1:])]
        whole, heads = shortest_heads(chain, blocks, shape.memory, starts, plain.memory, states, in_flight, units, cap,
                                      split_stages(sched))
        choices.append(("first layers each stage needs", sorted(whole), heads))
        best = None
        for text, ckpt, heads in choices:
            fig = figures_for(chain, starts, seconds, in_flight, shape.memory, CommModel(), "cpu", units, ckpt, heads,
                              split=split_stages(sched))
            if max(fig.memory) > cap:
                continue
            step = step_time(sched, fig)
            if best is None or step < best["step"]:
                if heads:
                    text += ": " + ", ".join(f"{s}: {blocks.label(bounds[s], bounds[s + 1], h).split(' (')[0]}"
                                             for s, h in sorted(heads.items()))
                best = {"step": step, "memory": max(fig.memory), "checkpoint": text, "layout": counts, "name": label}
        experts.append(best or {"step": float("inf"), "memory": None, "checkpoint": None, "layout": counts,
                                "name": label})
    return experts


def compare(shape: Shape, cap: int) -> dict[str, Any]:
    model, args = shape.build(), shape.inputs()
    k = shape.stages
    sched = get_schedule("1f1b", num_stages=k, num_ranks=k, num_microbatches=shape.microbatches)
    start, cpu = time.perf_counter(), time.process_time()
    prog = pipesplit.compile(model, args, num_stages=k, schedule="1f1b", num_microbatches=shape.microbatches,
                             max_stage_memory=cap, checkpoint="auto", memory=shape.memory, progress=False)
    compile_s, compile_cpu = time.perf_counter() - start, time.process_time() - cpu
    gm = prog.captured_gm  # annotated in place by compile
    plan = prog.plan
    ours = {"step": plan.predicted_step_s, "memory": max(plan.stage_memory), "checkpoint": checkpoint_text(plan),
            "layout": [len(s) for s in plan.stages], "compile_s": compile_s}
    # the plan the search makes recomputing whole stages only (before partial checkpointing): what it gains
    with mock.patch("pipesplit.passes.plan.checkpoint_search.with_shortest_heads", lambda *a, **kw: None):
        stages_only = pipesplit.compile(model, args, num_stages=k, schedule="1f1b", num_microbatches=shape.microbatches,
                                        max_stage_memory=cap, checkpoint="auto", memory=shape.memory, progress=False)
    ours["stages_only"] = {"step": stages_only.plan.predicted_step_s, "memory": max(stages_only.plan.stage_memory),
                           "checkpoint": checkpoint_text(stages_only.plan),
                           "layout": [len(s) for s in stages_only.plan.stages]}
    # the same pricing a given split gets (compile(split_points=...)), for every expert layout at once
    name, fn = cost_function("flops")
    nodes = compute_nodes(gm)
    rebuild = cheap_to_recompute(gm, prog.mutated_targets, CommModel(), "cpu")
    chain = build_chain(gm, fn, state_factor=shape.memory.state_factor_for, recompute=rebuild, order=nodes)
    seconds = node_seconds(chain.nodes, name, fn, 5e10, device_rates("cpu", largest_matmul(gm.graph.nodes)))
    experts = expert_layouts(shape, chain, seconds, sched, cap, nodes)
    # pipesplit's own plan priced again the way a saved plan is, as a check that both pricings agree
    again = pipesplit.Plan(stages=plan.stages, recompute=plan.recompute)
    price_plan(gm, again, sched, memory=shape.memory, max_stage_memory=cap, checkpoint=plan.checkpoint,
               saved=plan.checkpoint_partial)
    ours["repriced"] = again.predicted_step_s
    return {"ours": ours, "experts": experts, "timing": timing_row(shape, prog, compile_s, compile_cpu)}


def checkpoint_text(plan: pipesplit.Plan) -> str:
    """``"[0, 1] + 2: blocks 0-3 of 5"``: the stages recomputed whole, then those recomputing their first blocks."""
    parts = [str(plan.checkpoint)] if plan.checkpoint or not plan.checkpoint_partial else []
    parts += [f"{s}: {t.split(' (')[0]}" for s, t in plan.checkpoint_labels.items()]
    return " + ".join(parts)


def step_text(seconds: float) -> str:
    """A predicted step in seconds, never in scientific notation (``10340``, ``0.0123``)."""
    return f"{seconds:.0f}" if seconds >= 100 else f"{seconds:.3g}"


def fmt_layout(counts: list[int]) -> str:
    return "/".join(map(str, counts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few seconds")
    parser.add_argument("--only", default=None, help="run only the shapes whose name contains this")
    parser.add_argument("--no-timing", action="store_true", help="skip the planning-time rows")
    a = parser.parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.common import header, markdown_table

    print(header("Plans at scale (meta device): pipesplit's plan against expert layouts",
                 notes=["1f1b, 16 microbatches of one sequence, cap 80 GiB a stage (smoke: the tightest cap a plain "
                        "split misses); predicted seconds at this CPU's rates: the ratios matter"]))
    shapes = smoke_shapes() if a.smoke else full_shapes()
    rows, timing, ok = [], [], True
    for shape in shapes:
        if a.only and a.only not in shape.name:
            continue
        cap = shape.cap
        if a.smoke:  # a cap that binds: 70% of the largest stage of the plan made without one
            free = pipesplit.compile(shape.build(), shape.inputs(), num_stages=shape.stages, schedule="1f1b",
                                     num_microbatches=shape.microbatches, memory=shape.memory, progress=False)
            cap = int(max(free.plan.stage_memory) * 0.7)
        try:
            got = compare(shape, cap)
        except pipesplit.PlanError as e:
            rows.append([shape.name, shape.stages, "does not fit", str(e)[:120], "", "", "", "", ""])
            continue
        ours, experts = got["ours"], got["experts"]
        if shape.timed:
            timing.append(got["timing"])
            print("timing:", " | ".join(map(str, timing[-1])), flush=True)
        fitting = [e for e in experts if e["memory"] is not None]
        best = min(fitting, key=lambda e: e["step"]) if fitting else None
        even = experts[0]
        ratio = ours["step"] / best["step"] if best else float("nan")
        ok &= (best is None or ratio <= 1 + 1e-6) and ours["memory"] <= cap
        unit = GiB if not a.smoke else 2**20
        mem = "GiB" if not a.smoke else "MiB"
        rows.append([shape.name, shape.stages, "pipesplit", fmt_layout(ours["layout"]) + " nodes",
                     str(ours["checkpoint"]), step_text(ours['step']), f"{ratio:.3f}",
                     f"{ours['memory'] / unit:.1f} / {cap / unit:.1f} {mem}", f"{ours['compile_s']:.1f}"])
        only = ours["stages_only"]
        rows.append([shape.name, shape.stages, "pipesplit, whole stages only", fmt_layout(only["layout"]) + " nodes",
                     only["checkpoint"], step_text(only['step']), f"{ours['step'] / only['step']:.3f}",
                     f"{only['memory'] / unit:.1f} / {cap / unit:.1f} {mem}", ""])
        for label, e in [("best expert", best), ("even expert", even)]:
            if e is None:
                rows.append([shape.name, shape.stages, label, "none fits", "", "", "", "", ""])
                continue
            fits = e["memory"] is not None
            rows.append([shape.name, shape.stages, f"{label} ({e['name']})", fmt_layout(e["layout"]) + " layers",
                         str(e["checkpoint"]) if fits else "none fits", step_text(e['step']) if fits else "-",
                         f"{ours['step'] / e['step']:.3f}" if fits else "-",
                         f"{e['memory'] / unit:.1f} / {cap / unit:.1f} {mem}" if fits else "-", ""])
        rows.append([shape.name, shape.stages, f"({len(experts)} expert layouts; pipesplit re-priced as a saved plan: "
                     f"{step_text(got['ours']['repriced'])})", "", "", "", "", "", ""])
        for row in rows[-5:-1]:  # as each shape completes (a long run)
            print("row:", " | ".join(map(str, row)), flush=True)
    print()
    print(markdown_table(["shape", "stages", "plan", "layout", "checkpointing (stages whole + first blocks)", "predicted step (s)",
                          "pipesplit / this", "peak stage memory / cap", "compile (s, wall)"], rows, "lrllrrrrr"))
    if not a.no_timing:
        for shape in timing_only(a.smoke):
            if a.only and a.only not in shape.name:
                continue
            start, cpu = time.perf_counter(), time.process_time()
            prog = pipesplit.compile(shape.build(), shape.inputs(), num_stages=shape.stages, schedule="1f1b",
                                     num_microbatches=shape.microbatches, memory=shape.memory,
                                     max_stage_memory=shape.cap, checkpoint="auto", progress=False)
            timing.append(timing_row(shape, prog, time.perf_counter() - start, time.process_time() - cpu))
            print("timing:", " | ".join(map(str, timing[-1])), flush=True)
        print()
        print(markdown_table(["model", "layers", "stages", "cap GiB", "capture (s, wall)", "plan (s, wall)",
                              "compile (s, wall)", "compile (s, CPU)", "checkpointed", "peak stage GiB"], timing,
                             "lrrrrrrrlr"))
    print()
    print("pipesplit no slower than the best expert layout, every stage under the cap:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
