"""passes/plan/block_layouts.py: the plan is never predicted slower than a split by whole blocks."""

from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

import pipesplit
from pipesplit.meta import node_cost
from pipesplit.passes.plan.block_layouts import count_layouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def work(node):
    """FLOPs, priced at the default rate (a cost of the user's: no measured rates, the same on every machine)."""
    return float(node_cost(node).total_flops)


@pytest.fixture(scope="module")
def vit():
    """A small ViT: its solver's cuts land a few nodes off its blocks' boundaries, within the planner's tie of them."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=64, num_hidden_layers=8, num_attention_heads=4, intermediate_size=256, image_size=32,
                    patch_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg).eval(), torch.randn(8, 3, 32, 32)


@pytest.mark.parametrize("schedule,cap", [("1f1b", None), ("zb_h1", None), ("1f1b", 0.8)])
def test_the_plan_is_no_slower_than_any_expert_layout_by_whole_blocks(vit, schedule, cap):
    """Every layout of benchmarks/bench_scale.py's experts (whole blocks a stage, the first and last a little
    lighter), priced as a given split with its best checkpointing, is predicted no faster than the plan."""
    sys.path.insert(0, ROOT)
    from benchmarks.bench_scale import layouts

    model, x = vit
    kw = dict(schedule=schedule, num_microbatches=8, cost=work, checkpoint="auto", progress=False)
    if cap is not None:
        free = pipesplit.compile(model, x, num_stages=4, **{**kw, "checkpoint": None})
        cap = int(max(free.plan.stage_memory) * cap)
    plan = pipesplit.compile(model, x, num_stages=4, max_stage_memory=cap, **kw).plan
    assert cap is None or max(plan.stage_memory) <= cap
    priced = 0
    for counts in layouts(8, 4).values():
        points = [f"vit.layers.{i}" for i in itertools.accumulate(counts[:-1])]
        hand = pipesplit.compile(model, x, split_points=points, max_stage_memory=cap, **kw).plan
        if cap is not None and max(hand.stage_memory) > cap:
            continue
        priced += 1
        assert plan.predicted_step_s <= hand.predicted_step_s * (1 + 1e-9), (counts, plan.predicted_step_s,
                                                                               hand.predicted_step_s)
    assert priced


def test_count_layouts_are_the_benchmarks_expert_layouts():
    sys.path.insert(0, ROOT)
    from benchmarks.bench_scale import layouts

    for blocks, k in [(32, 8), (40, 8), (80, 16), (126, 16), (8, 4), (3, 3)]:
        assert sorted(count_layouts(blocks, k)) == sorted(layouts(blocks, k).values())
    assert count_layouts(6, 2) == [[3, 3], [2, 4], [1, 5]] and count_layouts(3, 4) == []
