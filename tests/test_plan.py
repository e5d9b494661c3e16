"""Plans as data: JSON round trips, hand edits, invalid plans, split points, plan figures."""

from __future__ import annotations

import copy
import itertools
import json
import math

import pytest
import torch
from torch import nn

import pipesplit
from pipesplit import Plan, PlanError
from pipesplit.capture import capture
from pipesplit.meta import node_cost
from pipesplit.models import gpt
from pipesplit.passes.annotate.costs import annotate_costs
from pipesplit.passes.plan.planner import check_plan, plan_from_split_points, plan_partition
from pipesplit.passes.split import split_graph
from tests.close import assert_close, assert_grads_close
from tests.zoo import CASE_BY_NAME, weighted_loss

COMPUTE = ("call_function", "call_module", "call_method")


def assert_exact(model, prog, x):
    """Outputs and every parameter gradient of the program equal the model's."""
    ref = copy.deepcopy(model)
    want, got = ref(x), prog(x)
    assert_close(got, want, name="output")
    weighted_loss(want).backward()
    weighted_loss(got).backward()
    assert any(p.grad is not None for p in ref.parameters())
    assert_grads_close(prog.named_parameters(), ref)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    case = CASE_BY_NAME["mlp"]
    (x,), _ = case.inputs(4)
    model = case.build()
    return model, x, pipesplit.compile(model, x, num_stages=3, progress=False)


# ------------------------------------------------------------------------- round trips
def test_plan_json_round_trip(mlp, tmp_path):
    model, x, prog = mlp
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    data = json.loads(path.read_text())
    assert data["stages"] == prog.plan.stages and all(isinstance(n, str) for s in data["stages"] for n in s)

    loaded = Plan.load(path)
    assert loaded.stages == prog.plan.stages
    assert loaded.stage_costs == prog.plan.stage_costs and loaded.bottleneck == prog.plan.bottleneck
    assert loaded.source == "loaded"

    again = pipesplit.compile(model, x, plan=path, progress=False)
    assert again.plan.stages == prog.plan.stages
    assert [s.nodes for s in again.stages] == [s.nodes for s in prog.stages]
    assert again.plan.source == "loaded"
    assert again.plan.stage_costs == prog.plan.stage_costs  # re-evaluated on the graph, same figures
    assert_exact(model, again, torch.randn(5, 16))

    as_object = pipesplit.compile(model, x, plan=loaded, progress=False)
    assert as_object.plan.stages == prog.plan.stages


def test_repr_is_a_summary_not_the_node_lists(mlp):
    _, _, prog = mlp
    plan = prog.plan
    text = repr(plan)
    assert str(plan) == text and len(text) < 200, text
    assert not any(name in text for names in plan.stages for name in names), "node names in the repr"
    sizes = [len(s) for s in plan.stages]
    assert text.startswith(f"Plan(3 stages, nodes per stage {sizes}, bottleneck stage {plan.bottleneck_stage} (")
    assert "FLOPs, gap" in text and "cost 'flops'" in text and f"order {plan.order!r}" in text
    assert repr(Plan([["a"], ["b", "c"]])) == (
        "Plan(2 stages, nodes per stage [1, 2], cost 'flops', order 'program', source 'planner')")


def test_hand_edited_plan_is_honoured(mlp, tmp_path):
    model, x, prog = mlp
    data = json.loads(prog.plan.to_json())
    moved = data["stages"][1].pop(0)
    data["stages"][0].append(moved)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))

    edited = pipesplit.compile(model, x, plan=path, progress=False)
    assert edited.plan.stages == data["stages"]
    assert edited.stages[0].nodes[-1] == moved and moved not in edited.stages[1].nodes
    assert edited.plan.stage_costs[0] > prog.plan.stage_costs[0]
    assert edited.plan.stage_costs[1] < prog.plan.stage_costs[1]
    assert sum(edited.plan.stage_costs) == sum(prog.plan.stage_costs)
    assert_exact(model, edited, torch.randn(3, 16))


def test_plan_stage_count_must_match_num_stages(mlp, tmp_path):
    model, x, prog = mlp
    path = tmp_path / "plan.json"
    prog.plan.save(path)
    with pytest.raises(PlanError, match="num_stages=2 but the plan has 3 stages"):
        pipesplit.compile(model, x, plan=path, num_stages=2, progress=False)
    with pytest.raises(PlanError, match="either plan= or split_points="):
        pipesplit.compile(model, x, plan=path, split_points=["layers.2"], progress=False)


def test_plan_for_another_model_is_rejected(mlp, tmp_path):
    _, _, prog = mlp
    path = tmp_path / "mlp.json"
    prog.plan.save(path)
    torch.manual_seed(0)
    other = CASE_BY_NAME["conv_bn"]
    (x,), _ = other.inputs(2)
    with pytest.raises(PlanError, match="another model"):
        pipesplit.compile(other.build(), x, plan=path, progress=False)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ('{"stages": "linear"}', '"stages" list'),
        ('[["linear"]]', '"stages" list'),
        ('{"stages": [["linear"]], "version": 99}', "version 99"),
        ('{"stages": [["linear"]], "stagse": []}', "unknown plan fields \\['stagse'\\]"),
    ],
)
def test_malformed_plan_files(tmp_path, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=message):
        Plan.load(path)


# ------------------------------------------------------------------------ invalid plans
class Tupled(nn.Module):
    """A chunk (a list value) whose pieces are used by different layers."""

    def __init__(self, d=8):
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        left, right = self.inp(x).chunk(2, dim=-1)
        return self.b(torch.relu(self.a(left)) + right)


@pytest.fixture(scope="module")
def tupled():
    torch.manual_seed(0)
    model, x = Tupled(), torch.randn(4, 8)
    gm = annotate_costs(capture(model, (x,)).gm)
    names = [n.name for n in gm.graph.nodes if n.op in COMPUTE]
    return model, x, gm, names


def _plan(*stages):
    return Plan(stages=[list(s) for s in stages])


def test_valid_hand_plan_passes(tupled):
    _, _, gm, names = tupled
    check_plan(gm, _plan(names[:4], names[4:]))


def test_unknown_node_name(tupled):
    _, _, gm, names = tupled
    typo = names[3] + "x"
    with pytest.raises(PlanError, match=rf"does not have.*'{typo}'.*close names: \['{names[3]}'"):
        check_plan(gm, _plan(names[:3] + [typo], names[4:]))


def test_missing_node(tupled):
    _, _, gm, names = tupled
    with pytest.raises(PlanError, match=rf"leaves 1 node\(s\) without a stage.*'{names[-1]}'"):
        check_plan(gm, _plan(names[:4], names[4:-1]))


def test_duplicated_node(tupled):
    _, _, gm, names = tupled
    with pytest.raises(PlanError, match=rf"'{names[4]}' is in stage 0 and again in stage 1"):
        check_plan(gm, _plan(names[:5], names[4:]))


def test_empty_stage(tupled):
    _, _, gm, names = tupled
    with pytest.raises(PlanError, match="stage 1 of the plan is empty"):
        check_plan(gm, _plan(names[:4], [], names[4:]))


def test_value_flowing_backwards(tupled):
    _, _, gm, names = tupled
    with pytest.raises(PlanError, match="from a later stage 1"):
        check_plan(gm, _plan(names[4:], names[:4]))


def test_tuple_separated_from_its_getitem(tupled):
    _, _, gm, names = tupled
    nodes = {n.name: n for n in gm.graph.nodes}
    (chunk,) = [n for n in names if isinstance(nodes[n].meta.get("val"), (tuple, list))]
    cut = names.index(chunk) + 1  # the chunk ends stage 0, its getitems start stage 1
    with pytest.raises(PlanError, match=rf"'{chunk}' \(stage 0\) is a (tuple|list).*cannot be sent"):
        check_plan(gm, _plan(names[:cut], names[cut:]))


def test_compile_rejects_an_invalid_plan_before_splitting(tupled):
    model, x, _, names = tupled
    with pytest.raises(PlanError, match="without a stage"):
        pipesplit.compile(model, x, plan=_plan(names[:-1]), progress=False)


# ------------------------------------------------------------------------- split points
@pytest.fixture(scope="module")
def gpt_split():
    torch.manual_seed(0)
    model = gpt(layers=8, dim=64)
    idx = torch.randint(0, 512, (2, 8))
    return model, pipesplit.compile(model, idx, split_points=["blocks.2", "blocks.5"], progress=False)


def _modules(node):
    return {path for path, _ in (node.meta.get("nn_module_stack") or {}).values()}


def test_split_points_on_gpt(gpt_split):
    model, prog = gpt_split
    assert prog.num_stages == 3 and prog.plan.source == "split_points"
    nodes = [[n for n in s.module.graph.nodes if n.op in COMPUTE] for s in prog.stages]
    for s, module in [(1, "blocks.2"), (2, "blocks.5")]:
        assert module in _modules(nodes[s][0]), f"stage {s} starts at {nodes[s][0].name}, outside {module}"
        assert module not in _modules(nodes[s - 1][-1])
    owner = {0: {"blocks.0", "blocks.1"}, 1: {"blocks.2", "blocks.3", "blocks.4"},
             2: {"blocks.5", "blocks.6", "blocks.7", "ln_f"}}
    for s, stage_nodes in enumerate(nodes):
        for node in stage_nodes:
            for other, mods in owner.items():
                if other != s:
                    assert not mods & _modules(node), f"{node.name} of {mods & _modules(node)} is in stage {s}"
    x = torch.randint(0, 512, (3, 8))
    assert_close(prog(x), model(x), name="output")


def test_split_point_plan_figures(gpt_split):
    _, prog = gpt_split
    plan = prog.plan
    costs = [node_cost(n).total_flops for s in prog.stages for n in s.module.graph.nodes if n.op in COMPUTE]
    assert sum(plan.stage_costs) == sum(costs)
    assert plan.lower_bound <= plan.bottleneck and plan.gap >= 0
    assert plan.lower_bound >= sum(costs) / 3


@pytest.fixture(scope="module")
def mlp_graph(mlp):
    model, x, _ = mlp
    cap = capture(model, (x,))
    return annotate_costs(cap.gm), cap.module_paths


def test_split_point_typo_suggests_close_names(mlp_graph):
    gm, paths = mlp_graph
    with pytest.raises(PlanError, match=r"'layers\.44' names no module.*did you mean .*'layers\.4'"):
        plan_from_split_points(gm, ["layers.44"], paths)
    with pytest.raises(PlanError, match=r"names no module of the model; the model's modules include 'layers', 'out', "
                                         r"'layers\.0'.* and \d+ more\."):  # nothing close: the shallowest ones
        plan_from_split_points(gm, ["zzzzzz"], paths)


def test_split_points_out_of_order(mlp_graph):
    gm, paths = mlp_graph
    with pytest.raises(PlanError, match=r"order.*'layers\.2'"):
        plan_from_split_points(gm, ["layers.5", "layers.2"], paths)
    with pytest.raises(PlanError, match="order"):
        plan_from_split_points(gm, ["layers.2", "layers.2"], paths)
    assert plan_from_split_points(gm, ["layers.2", "layers.5"], paths).num_stages == 3


def test_split_points_disagreeing_with_num_stages(mlp):
    model, x, _ = mlp
    with pytest.raises(PlanError, match=r"num_stages=3 but 1 split points make 2 stages"):
        pipesplit.compile(model, x, split_points=["layers.4"], num_stages=3, progress=False)
    prog = pipesplit.compile(model, x, split_points=["layers.4"], num_stages=2, progress=False)
    assert prog.num_stages == 2
    assert prog.stages[1].nodes[0] == "linear_4"  # layers.4 is the fifth Linear


def test_split_point_module_that_never_runs():
    class Unused(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(PlanError, match="'spare' is a module that runs no operation"):
        pipesplit.compile(Unused(), torch.randn(2, 4), split_points=["spare"], progress=False)


# ------------------------------------------------------------------------- plan figures
def exact_bottleneck(costs, k):
    """The optimal contiguous split of ``costs`` into k stages, by brute force over cuts."""
    prefix = [0.0, *itertools.accumulate(costs)]
    n = len(costs)
    return min(
        max(prefix[b] - prefix[a] for a, b in zip((0, *cuts), (*cuts, n)))
        for cuts in itertools.combinations(range(1, n), k - 1)
    )


PER_NODE = {
    "flops": lambda n: float(node_cost(n).total_flops),
    "uniform": lambda n: 1.0,
    "params": lambda n: float(sum(node_cost(a).param_bytes for a in n.all_input_nodes if a.op == "get_attr")),
}


@pytest.fixture(scope="module")
def long_skip():
    torch.manual_seed(0)
    case = CASE_BY_NAME["long_skip"]
    model = case.build()
    (x,), _ = case.inputs(4)
    return model, x, annotate_costs(capture(model, (x,)).gm)


@pytest.mark.parametrize("cost", ["flops", "uniform", "params"])
@pytest.mark.parametrize("k", [1, 3])
def test_plan_figures(long_skip, cost, k):
    _, _, gm = long_skip
    nodes = [n for n in gm.graph.nodes if n.op in COMPUTE]
    per_node = [PER_NODE[cost](n) for n in nodes]
    plan = plan_partition(gm, k, cost)
    assert plan.cost_name == cost and len(plan.stage_costs) == k
    assert math.isclose(sum(plan.stage_costs), sum(per_node), rel_tol=1e-12)
    assert plan.bottleneck == max(plan.stage_costs)
    assert plan.stage_costs[plan.bottleneck_stage] == plan.bottleneck
    optimum = exact_bottleneck(per_node, k)  # no tuples in this graph: every cut is allowed
    assert plan.lower_bound <= optimum <= plan.bottleneck
    assert plan.gap >= 0
    assert math.isclose(plan.gap, plan.bottleneck / plan.lower_bound - 1)
    if k == 1:
        assert plan.gap == 0
    boundaries = split_graph(gm, plan.stages, ["cpu"] * k).boundaries
    assert sum(plan.sent_bytes) == sum(b.nbytes for b in boundaries)
    assert len(plan.stage_memory) == k and all(m > 0 for m in plan.stage_memory)


def test_loaded_plan_figures(mlp, tmp_path):
    model, x, prog = mlp
    prog.plan.save(tmp_path / "plan.json")
    again = pipesplit.compile(model, x, plan=tmp_path / "plan.json", cost="uniform", progress=False)
    plan = again.plan
    assert plan.cost_name == "uniform" and plan.stage_costs == [float(len(s)) for s in prog.plan.stages]
    assert plan.lower_bound <= plan.bottleneck and plan.gap >= 0


