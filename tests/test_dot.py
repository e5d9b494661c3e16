"""DOT views and the per-stage report: readable, complete, and no graphviz binary needed for the text."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

import pipesplit
from pipesplit.models import gpt
from pipesplit.units import format_cost, human_bytes
from tests.zoo import CASE_BY_NAME

HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="graphviz's `dot` binary is not installed")
COMPUTE = ("call_function", "call_module", "call_method")

_NODE = re.compile(r'^\s+("(?:[^"\\]|\\.)*"|[^\s"\[]+) \[label=', re.M)
_EDGE = re.compile(r'^\s+("(?:[^"\\]|\\.)*"|[^\s"\[]+) -> ("(?:[^"\\]|\\.)*"|[^\s"\[]+)(?: \[(.*)\])?$', re.M)


def boxes(src: str) -> list[str]:
    """Ids of the node statements inside stage clusters (not the inputs/outputs ovals)."""
    return [n.strip('"') for n in _NODE.findall(src) if n not in ("inputs", "outputs")]


def edge_labels(src: str) -> list[str]:
    labels = []
    for _, _, attrs in _EDGE.findall(src):
        m = re.search(r'label="((?:[^"\\]|\\.)*)"', attrs or "")
        if m:
            labels.append(m.group(1))
    return labels


@pytest.fixture(scope="module")
def gpt12():
    torch.manual_seed(0)
    model = gpt(layers=12, dim=64)
    return pipesplit.compile(model, torch.randint(0, 512, (2, 64)), num_stages=4)


def _zoo(name: str, k: int):
    torch.manual_seed(0)
    case = CASE_BY_NAME[name]
    args, kwargs = case.inputs(4)
    return pipesplit.compile(case.build(), args, example_kwargs=kwargs, num_stages=k)


@pytest.fixture(scope="module")
def small_progs(gpt12):
    # dict_tuple_out returns early activations as they are: boundaries no compute node uses
    return {"gpt12": gpt12, "long_skip_4": _zoo("long_skip", 4), "dict_tuple_out_2": _zoo("dict_tuple_out", 2),
            "dict_tuple_out_5": _zoo("dict_tuple_out", 5)}


def test_to_dot_needs_no_graphviz_binary(gpt12, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "")
    assert shutil.which("dot") is None
    src = gpt12.to_dot()
    assert src.startswith("digraph")
    assert gpt12.to_dot(detail="node").startswith("digraph")
    out = gpt12.render(tmp_path / "x.dot")
    assert (tmp_path / "x.dot").read_text() == src
    assert out == str(tmp_path / "x.dot")
    with pytest.raises(pipesplit.PipesplitError, match=r"graphviz.*to_dot\(\)"):
        gpt12.render(tmp_path / "x.svg")


@pytest.mark.parametrize("detail", ["module", "node"])
def test_one_cluster_per_stage(gpt12, detail):
    src = gpt12.to_dot(detail=detail)
    clusters = re.findall(r"subgraph cluster_(\d+) \{", src)
    assert clusters == [str(i) for i in range(gpt12.num_stages)]
    for stage in gpt12.stages:
        assert f"stage {stage.index} · {stage.device}" in src


@pytest.mark.parametrize("name", ["gpt12", "long_skip_4", "dict_tuple_out_2", "dict_tuple_out_5"])
@pytest.mark.parametrize("detail", ["module", "node"])
def test_every_boundary_is_a_labelled_edge(small_progs, name, detail):
    prog = small_progs[name]
    assert prog.boundaries
    labels = edge_labels(prog.to_dot(detail=detail))
    for b in prog.boundaries:
        mine = [lab for lab in labels if lab.split("\\n")[0] == b.name]
        assert mine, f"boundary {b.name} ({b.src}->{b.dst}) has no edge"
        if b.kind == "tensor":
            shape = "×".join("B" if d is None else str(d) for d in b.shape)
            dtype = str(b.dtype).replace("torch.", "")
            assert any(f"[{shape}] {dtype}" in lab and human_bytes(b.nbytes) in lab for lab in mine), mine


def test_sizes_sent_between_stages_are_drawn_lightly():
    torch.manual_seed(0)  # a dynamic batch: the batch size is a value the later stages need
    gpt12 = pipesplit.compile(gpt(layers=12, dim=64), torch.randint(0, 512, (2, 64)), num_stages=4, dynamic_batch=True)
    sizes = {f"{b.name}\\n{b.kind}" for b in gpt12.boundaries if b.kind != "tensor"}
    assert sizes == {"sym_size_int_1\\nint"}, "the GPT sends its batch size to the later stages"
    edges = [(m.group(1), attrs) for _, _, attrs in _EDGE.findall(gpt12.to_dot())
             if (m := re.search(r'label="((?:[^"\\]|\\.)*)"', attrs or ""))]
    light = [attrs for label, attrs in edges if label in sizes]
    assert len(light) == sum(b.kind != "tensor" for b in gpt12.boundaries) == 3
    for attrs in light:
        assert "style=dashed" in attrs and "penwidth=1" in attrs and "#d62728" not in attrs, attrs
    heavy = [attrs for label, attrs in edges if "penwidth=2" in attrs]
    assert len(heavy) == sum(b.kind == "tensor" for b in gpt12.boundaries)


def test_the_report_counts_the_edges_the_picture_draws():
    """The report said "3 send/recv edges" where the SVG drew 6 (3 dashed sym_size_int integers too)."""
    torch.manual_seed(0)
    prog = pipesplit.compile(gpt(layers=12, dim=64), torch.randint(0, 512, (2, 64)), num_stages=4, dynamic_batch=True)
    src = prog.to_dot()
    drawn = [attrs for _, _, attrs in _EDGE.findall(src) if "penwidth" in (attrs or "")]  # stage-to-stage edges
    dashed = [a for a in drawn if "style=dashed" in a]
    line = next(x for x in prog.report().splitlines() if x.startswith("boundaries:"))
    assert line == (f"boundaries: {len(drawn)} send/recv edges ({len(drawn) - len(dashed)} tensors, "
                    f"{human_bytes(sum(b.nbytes for b in prog.boundaries if b.kind == 'tensor'))} per example batch; "
                    f"{len(dashed)} integers: sizes)"), line
    assert len(drawn) == len(prog.boundaries) and len(dashed) == 3
    assert line in src  # the picture's key says the same


def test_box_flops_say_forward_and_backward_as_the_report_does(gpt12):
    """A box gave forward + backward FLOPs as "FLOPs" beside a report whose column is forward FLOPs."""
    src = gpt12.to_dot(detail="module")
    labels = re.findall(r'label="([^"]*\\n\d+ ops: [^"]*)"', src)
    assert len(labels) == len(boxes(src)), labels
    for label in labels:
        assert re.search(r"\\nfwd \S+, bwd \S+ FLOPs$", label), label
    assert "the forward and the backward FLOPs" in src  # and the key says so


def test_module_view_is_compact_and_node_view_is_complete(gpt12):
    module_boxes = boxes(gpt12.to_dot(detail="module"))
    assert 12 <= len(module_boxes) <= 60, len(module_boxes)
    assert all(any(b.endswith(f"_blocks.{i}") for b in module_boxes) for i in range(12))
    node_boxes = boxes(gpt12.to_dot(detail="node"))
    want = [f"s{s.index}_{n.name}" for s in gpt12.stages for n in s.module.graph.nodes if n.op in COMPUTE]
    assert sorted(node_boxes) == sorted(want)
    assert len(want) == sum(len(s.nodes) for s in gpt12.stages)


def test_no_torch_internal_names_in_the_module_view(gpt12):
    assert "_empty_nn_module_stack" not in gpt12.to_dot()


def test_bad_detail(gpt12, tmp_path):
    with pytest.raises(pipesplit.PipesplitError, match=r"'module' or 'node', got 'layers'"):
        gpt12.to_dot(detail="layers")
    with pytest.raises(pipesplit.PipesplitError):
        gpt12.render(tmp_path / "x.dot", detail="ops")
    assert not (tmp_path / "x.dot").exists()


@needs_dot
@pytest.mark.parametrize("detail", ["module", "node"])
def test_dot_binary_parses_it(small_progs, detail):
    prog = small_progs["dict_tuple_out_5"] if detail == "node" else small_progs["gpt12"]
    done = subprocess.run(["dot", "-Tsvg"], input=prog.to_dot(detail=detail), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    svg = done.stdout
    assert "<svg" in svg and len(svg) > 2000
    assert svg.count('class="cluster"') == prog.num_stages
    assert "stage 0" in svg


@needs_dot
def test_render_svg(gpt12, tmp_path):
    path = tmp_path / "x.svg"
    assert gpt12.render(path) == str(path)
    text = path.read_text()
    assert "<svg" in text and text.count('class="cluster"') == gpt12.num_stages
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.svg"], "the DOT source should be cleaned up"


def test_report(gpt12):
    text = gpt12.report()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "nodes"]
    rows = [line for line in lines if re.match(r"^\s*\d+( \*)?\s+cpu\s", line)]
    assert [int(r.split()[0]) for r in rows] == list(range(gpt12.num_stages))
    marked = [r for r in rows if re.match(r"^\s*\d+ \*", r)]
    assert len(marked) == 1 and int(marked[0].split()[0]) == gpt12.plan.bottleneck_stage
    summary = next(line for line in lines if line.startswith("bottleneck:"))
    assert f"stage {gpt12.plan.bottleneck_stage}" in summary
    assert re.search(r"lower bound \S+ FLOPs, gap \d+\.\d%", summary), summary
    assert "cost balance" in summary and "the mean stage cost (forward + backward FLOPs)" in summary, summary
    assert f"boundaries: {len(gpt12.boundaries)} send/recv edges" in text
    nodes = [int(r.split()[3 if " *" in r else 2]) for r in rows]
    assert nodes == [len(s.nodes) for s in gpt12.stages]


def test_report_single_stage_has_no_mark():
    prog = _zoo("mlp", 1)
    rows = [line for line in prog.report().splitlines() if re.match(r"^\s*\d+( \*)?\s+cpu\s", line)]
    assert len(rows) == 1 and "*" not in rows[0]


@pytest.mark.parametrize("name, value, text", [
    ("profile", 0.000494, "494 µs"), ("hybrid", 0.0123, "12.3 ms"), ("profile", 2.5, "2.5 s"),
    ("flops", 1.5e9, "1.50G FLOPs"), ("flops", 812, "812 FLOPs"), ("params", 3 * 1024 ** 2, "3.0 MiB"),
    ("uniform", 17.0, "17"), ("my_cost", 0.25, "0.25"),
])
def test_costs_are_shown_in_their_units(name, value, text):
    assert format_cost(value, name) == text


def test_report_of_a_profiled_plan_shows_seconds_not_zero():
    torch.manual_seed(0)
    case = CASE_BY_NAME["mlp"]
    args, kwargs = case.inputs(4)
    prog = pipesplit.compile(case.build(), args, example_kwargs=kwargs, num_stages=2, cost="profile", progress=False)
    text = prog.report()
    rows = [line for line in text.splitlines() if re.match(r"^\s*\d+( \*)?\s+cpu\s", line)]
    assert all(re.search(r"\d (s|ms|µs|ns)\s", r) for r in rows), text
    summary = next(line for line in text.splitlines() if line.startswith("bottleneck:"))
    assert re.search(r"stage \d \(\S+ (s|ms|µs|ns)\),.*lower bound \S+ (s|ms|µs|ns), gap", summary), summary
    assert "(0)" not in summary and "lower bound 0," not in summary
