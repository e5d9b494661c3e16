"""pipesplit.benchmark on a tiny model: the table's shape and invariants, exports and pictures."""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import pipesplit
from pipesplit.bench.predict import predict, stage_seconds, weight_ops
from pipesplit.runtime.engine.weight_grads import split_overhead_s
from pipesplit.schedules import StageCost
from pipesplit.schedules import schedule_info
from tests.zoo import MLP
from tests.training import mse

STAGES, SCHEDULES, MICRO, COSTS = [2, 3], ["gpipe", "1f1b", "zb_h1", "zb_v"], [2, 4], ["flops", "uniform"]
BATCH = 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MLP()


@pytest.fixture(scope="module")
def res(model):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 16, generator=gen), torch.randn(BATCH, 4, generator=gen)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = pipesplit.benchmark(model, x, loss_fn=mse, target=y, num_stages=STAGES, schedules=SCHEDULES,
                              num_microbatches=MICRO, cost=COSTS, warmup=1, repeats=3, progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the model must not change"
    return out


def test_one_row_per_runnable_configuration(res):
    ran = {(r.num_stages, r.cost, r.schedule, r.num_microbatches) for r in res.rows}
    assert len(ran) == len(res.rows)
    every = set(itertools.product(STAGES, COSTS, SCHEDULES, MICRO))
    skipped = {c for c in every if c[2] == "zb_v" and c[0] % 2}  # zb_v needs two stages per rank
    assert ran == every - skipped
    assert len(res.skipped) == len(skipped) and all("zb_v" in what for what, _ in res.skipped)
    assert len(res) == len(res.rows) and list(res) == res.rows


def test_rows_are_consistent(res):
    for r in res.rows:
        k = r.num_stages
        for per_stage in (r.predicted_fwd_s, r.predicted_bwd_s, r.measured_fwd_s, r.measured_bwd_s,
                          r.peak_memory_bytes):
            assert len(per_stage) == k
        assert all(v > 0 for v in r.measured_fwd_s + r.measured_bwd_s + r.predicted_fwd_s + r.predicted_bwd_s)
        measured = r.measured_stage_s
        assert all(measured[r.bottleneck_stage] >= t for t in measured)
        assert r.balance == pytest.approx(max(measured) / (sum(measured) / k))
        assert r.predicted_balance == pytest.approx(max(r.predicted_stage_s) / (sum(r.predicted_stage_s) / k))
        assert r.balance >= 1.0 and r.predicted_balance >= 1.0
        assert r.step_ratio == pytest.approx(r.measured_step_s / r.predicted_step_s)
        assert r.throughput == pytest.approx(BATCH / r.measured_step_s)
        assert 0.0 <= r.predicted_bubble < 1.0 and 0.0 <= r.measured_bubble < 1.0
        assert r.measured_step_spread_s >= 0 and r.repeats == 3 and r.batch == BATCH
        assert r.memory_source == "estimated" and all(m > 0 for m in r.peak_memory_bytes)
        assert r.num_ranks == k // (schedule_info(r.schedule).constraints.stages_per_rank or 2)
        if schedule_info(r.schedule).constraints.stages_per_rank == 1:  # the busiest rank works all the time
            assert r.predicted_step_s >= r.num_microbatches * max(r.predicted_stage_s) * (1 - 1e-9)
    assert res.best().measured_step_s == min(r.measured_step_s for r in res.rows)


def test_boundary_bytes_count_activations_and_gradients(res):
    for r in res.rows:
        # MLP width 16, float32: each cut carries a [batch, 16] activation forward and its gradient back
        assert r.boundary_bytes == (r.num_stages - 1) * BATCH * 16 * 4 * 2


def test_prediction_scales_with_the_microbatch(res):
    """User units scale in proportion to the microbatch; seconds keep each op's fixed per-op
    overhead and scale the rest (a microbatch half as large does not launch ops in half the time)."""
    by = {(r.num_stages, r.cost, r.schedule, r.num_microbatches): d for r, d in zip(res.rows, res.details)}
    for k, c in itertools.product(STAGES, COSTS):
        two, four = by[(k, c, "gpipe", 2)].prediction.costs, by[(k, c, "gpipe", 4)].prediction.costs
        fixed = stage_seconds(by[(k, c, "gpipe", 4)].program, c, 0.0)
        for a, b, f in zip((x.forward for x in two), (x.forward for x in four), fixed):
            if c == "uniform":
                assert a == pytest.approx(2 * b) and f.forward == 0
            else:
                assert 0 < f.forward < b < a < 2 * b
                assert 2 * b - a == pytest.approx(f.forward)
    detail = res.details[0]
    again = predict(detail.program, detail.trace.schedule, res.rows[0].cost, BATCH)
    assert again.timeline.step_time == pytest.approx(res.rows[0].predicted_step_s)


def test_split_backward_pays_its_fixed_cost_per_weight_op(res):
    """zb_h1 runs I, then W through every weight op again: its W is priced at the fused one's plus
    the split's measured fixed cost per weight op; 1f1b's full backward is not."""
    by = {(r.num_stages, r.cost, r.schedule, r.num_microbatches): d for r, d in zip(res.rows, res.details)}
    for k, c, m in itertools.product(STAGES, COSTS, MICRO):
        fused, split = by[(k, c, "1f1b", m)].prediction.costs, by[(k, c, "zb_h1", m)].prediction.costs
        prog = by[(k, c, "zb_h1", m)].program
        for stage, f, s in zip(prog.stages, fused, split):
            extra = weight_ops(stage.module) * split_overhead_s(stage.device)
            assert weight_ops(stage.module) > 0 and extra > 0
            assert s.forward == f.forward and s.backward_input == f.backward_input
            assert s.backward_weight == pytest.approx(f.backward_weight + extra)


def test_text_markdown_and_csv(res, tmp_path):
    text = str(res)
    assert text.splitlines()[0].split()[:3] == ["stages", "schedule", "m"]
    assert "fastest:" in text and "skipped" in text
    md = res.to_markdown().splitlines()
    assert len(md) == len(res.rows) + 2
    assert len({line.count("|") for line in md}) == 1
    assert len(res.to_markdown(per_stage=False).splitlines()[0]) < len(md[0])
    path = tmp_path / "bench.csv"
    res.to_csv(path)
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    assert len(rows) == len(res.rows)
    for got, r in zip(rows, res.rows):
        assert int(got["num_stages"]) == r.num_stages and got["schedule"] == r.schedule
        assert float(got["measured_step_s"]) == r.measured_step_s
        fwd = [float(v) for v in got["measured_fwd_s"].split(";")]
        assert fwd == list(r.measured_fwd_s)


def _png(path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 200 and img.shape[1] > 400
    assert img[..., :3].std() > 0.05, "the picture is blank"


def test_pictures(res, tmp_path):
    for name, draw in [("overview.png", res.plot), ("balance.png", res.plot_balance),
                       ("timeline.png", res.plot_timeline)]:
        draw(tmp_path / name)
        _png(tmp_path / name)
    res.plot_timeline(tmp_path / "first.png", row=0)
    _png(tmp_path / "first.png")


def test_chrome_trace_of_the_fastest(res, tmp_path):
    res.to_chrome_trace(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    best = res.best()
    steps = [e for e in events if e.get("cat") == "step"]
    assert len(steps) == best.repeats
    assert {e["tid"] for e in events if e["ph"] == "X" and e.get("cat") not in ("step", "wait")} == set(
        range(best.num_stages))


def test_split_graph_shaded_by_measured_time(res, tmp_path):
    row = res.rows[-1]
    path = res.render_split(tmp_path / "split.dot", row=row)
    src = Path(path).read_text()
    assert src.startswith("digraph") and src.count("subgraph cluster_") == row.num_stages
    assert src.count(" ms\"") >= row.num_stages or src.count(" ms") >= row.num_stages
    if shutil.which("dot"):
        done = subprocess.run(["dot", "-Tsvg", path], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "<svg" in done.stdout, done.stderr


def test_a_compiled_program_is_benchmarked_as_it_is(model):
    prog = pipesplit.compile(model, torch.randn(4, 16), num_stages=2)
    out = pipesplit.benchmark(prog, torch.randn(BATCH, 16), schedules=["1f1b"], num_microbatches=[2, 4],
                              warmup=0, repeats=1, progress=False)
    assert [(r.num_stages, r.num_microbatches, r.cost) for r in out.rows] == [(2, 2, "flops"), (2, 4, "flops")]
    assert all(math.isfinite(r.measured_step_s) for r in out.rows)
    assert out.details[0].program is prog
    with pytest.raises(pipesplit.PipesplitError, match="fixes num_stages"):
        pipesplit.benchmark(prog, torch.randn(BATCH, 16), num_stages=3, progress=False)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"schedules": ["1f1c"]}, pipesplit.ScheduleError, "Did you mean '1f1b'"),
    ({"cost": ["flopz"]}, pipesplit.CostError, "Did you mean 'flops'"),
    ({"num_microbatches": [3]}, pipesplit.InputError, "does not split into"),
    ({"num_stages": [0]}, pipesplit.PipesplitError, "integers >= 1"),
    ({"repeats": 0}, pipesplit.PipesplitError, "repeats >= 1"),
])
def test_bad_options_fail_before_compiling(model, monkeypatch, kwargs, error, match):
    def no_compile(*a, **k):
        raise AssertionError("compiled before checking the options")

    monkeypatch.setattr("pipesplit.bench.run.compile_model", no_compile)
    with pytest.raises(error, match=match):
        pipesplit.benchmark(model, torch.randn(BATCH, 16), progress=False, **kwargs)


@pytest.mark.cuda
def test_on_cuda_peak_memory_is_measured(model):
    out = pipesplit.benchmark(model, torch.randn(BATCH, 16), devices=["cuda"], schedules=["1f1b", "zb_h1"],
                              warmup=1, repeats=2, progress=False)
    for r in out.rows:
        assert r.devices.startswith("cuda") and r.memory_source == "measured"
        assert all(m > 0 for m in r.peak_memory_bytes)
        assert all(t > 0 for t in r.measured_fwd_s + r.measured_bwd_s)
        assert 0.0 <= r.measured_bubble < 1.0


def test_predicted_and_measured_timelines_share_one_time_axis():
    from pipesplit.plots import timelines_figure
    from pipesplit.schedules import get_schedule, simulate

    sched = get_schedule("1f1b", num_stages=2, num_microbatches=4)
    predicted, measured = simulate(sched, 0.001), simulate(sched, 0.005)  # measured 5x slower
    fig = timelines_figure(predicted, measured, "2 stages")
    top, bottom = fig.axes[:2]
    assert top.get_shared_x_axes().joined(top, bottom)
    assert top.get_xlim() == bottom.get_xlim() == pytest.approx((0.0, measured.step_time * 1e3))
    assert fig.get_suptitle() == "measured / predicted step time: 5.00x"
    assert "predicted step" in top.get_title() and "measured step" in bottom.get_title()


def test_warnings_say_when_rows_cannot_be_ranked():
    """A busy machine, wide spreads and overlapping fastest rows are said, not hidden."""
    import dataclasses

    from pipesplit.bench.load import load_summary, load_warning, machine_load

    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    res = pipesplit.benchmark(model, torch.randn(8, 16), num_stages=2, schedules=["gpipe", "1f1b"],
                              num_microbatches=2, warmup=1, repeats=2, progress=False)
    assert {"load_1min_before", "cores", "others_share", "busiest"} <= set(res.meta["load"])
    a, b = res.rows
    res.rows[:] = [dataclasses.replace(a, measured_step_s=1.0, measured_step_spread_s=0.3),
                   dataclasses.replace(b, measured_step_s=1.2, measured_step_spread_s=0.01)]
    quiet = {"load_1min": 0.1, "cores": 2, "time": 0.0, "ticks": {7: ("python", 100)}}
    res.meta["load"] = load_summary(quiet, {**quiet, "time": 10.0, "ticks": {7: ("python", 120)}})
    text = " ".join(res.warnings)
    assert "1 of 2 rows spread more than ±10%" in text and "±30%" in text
    assert "cannot rank them" in text and "warning: " in str(res)
    assert "ranks run as threads of one process on the CPU" in text  # 2 stages on the CPU
    res.rows[:] = [dataclasses.replace(r, devices="cuda:0,cuda:1") for r in res.rows]
    res.rows[0] = dataclasses.replace(res.rows[0], measured_step_s=1.0, measured_step_spread_s=0.05)
    assert res.warnings == []  # quiet, narrow, apart, a device per stage
    # 0.2 s of another process's CPU in 10 s on 2 cores is 1%: quiet; 8 s of it is 40%: busy
    assert load_warning(res.meta["load"]) is None
    text = load_warning(load_summary(quiet, {**quiet, "time": 10.0, "ticks": {7: ("python", 900)}, "load_1min": 1.5}))
    assert "other processes used 40% of its 2 core(s)" in text and "python (7): 80% of a core" in text
    snapshot = machine_load()
    assert snapshot["cores"] >= 1 and os.getpid() not in snapshot["ticks"]


@pytest.mark.parametrize("which", [None, 0])
def test_the_timeline_picture_shows_the_tables_figures_and_says_which_step(res, which):
    """Issue 26: the picture said "measured step 130 ms, 1.12x" beside a table saying 164 ms, 1.42x."""
    row = res.best() if which is None else res.rows[which]
    i = res.rows.index(row)
    line = next(line for line in res.to_markdown().splitlines()[2:] if line.startswith(
        f"| {row.num_stages} | {row.schedule} | {row.num_microbatches} | {row.cost} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    pred_ms, meas_ms, ratio, bubbles = cells[4], cells[5].split(" ± ")[0], cells[6], cells[7]
    fig = res.timeline_figure(which)
    title = fig.get_suptitle()
    assert f"measured step {meas_ms} ms (median of {row.repeats})" in title, title
    assert f"predicted {pred_ms} ms = {ratio}x" in title, title
    measured_title = fig.axes[1].get_title()
    k = res.details[i].median_step
    assert f"measured: step {k + 1} of {row.repeats}" in measured_title, measured_title
    # issue 36: "211 ms (median of 2)" above a panel of step 1 of 2, 195 ms: the title says which step is drawn
    drawn = res.details[i].trace.timeline(k).step_time * 1e3
    assert f"drawn below: the prediction, and measured step {k + 1} of {row.repeats} ({drawn:.3g} ms)" in title, title
    assert "time balance pred/meas" in res.to_markdown().splitlines()[0]  # not the report's cost balance
    assert measured_title.endswith(f"bubble {bubbles.split(' / ')[1]}"), (measured_title, bubbles)
    assert fig.axes[0].get_title().endswith(f"bubble {bubbles.split(' / ')[0]}"), bubbles


def test_log_lines_go_above_the_progress_bar_not_into_it(monkeypatch):
    """While the bar is drawn, the root logger's console handler is swapped for one that prints
    through tqdm.write (issue 26: the bar and the log lines interleaved); after it, the plain one."""
    import logging
    import sys

    import tqdm.std

    written = []
    monkeypatch.setattr(tqdm.std.tqdm, "write", classmethod(lambda cls, s, file=None, end="\n", nolock=False:
                                                           written.append(s)))
    handler = logging.StreamHandler(sys.stderr)  # a console handler, as the CLI's basicConfig makes
    plain = []
    handler.emit = lambda record: plain.append(record.getMessage())  # type: ignore[method-assign]
    root, ours = logging.getLogger(), logging.getLogger("pipesplit")
    level = ours.level
    root.addHandler(handler)
    ours.setLevel(logging.INFO)
    try:
        torch.manual_seed(0)
        pipesplit.benchmark(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)),
                            torch.randn(8, 8), num_stages=2, schedules="gpipe", num_microbatches=2, warmup=1,
                            repeats=1, progress=True)
        logging.getLogger("pipesplit.bench.run").info("after the bar")
    finally:
        root.removeHandler(handler)
        ours.setLevel(level)
    assert any("per step" in w for w in written), written
    assert not any("per step" in p for p in plain) and "after the bar" in plain, plain


def test_a_model_is_captured_once_per_stage_count_not_again_at_the_microbatch_size(res):
    """Issue 36: `pipesplit bench` compiled at the full batch, then captured again at the microbatch size
    for every stage count (5.2 s + 3.1 s, then 1.5 s + 3.1 s for a 4-block GPT at 2 and 4 stages)."""
    assert {d.program.plan.capture for d in res.details} == {"dynamic"}
    again = [n for d in res.details for n in d.program.notes if "captured again" in n]
    assert again == [], again


def test_benchmark_predicts_and_measures_each_planned_length():
    """compile(plan_lengths=...) through benchmark: each row also steps at every length (the example cut or
    repeated along it), predicted and measured, and their weighted means."""
    import torch.nn.functional as F

    from pipesplit.models import gpt

    torch.manual_seed(0)
    model = gpt(layers=2, dim=16, heads=2, seq=64)
    tokens = torch.randint(0, 100, (4, 65))
    res = pipesplit.benchmark(model, tokens[:, :32], target=tokens[:, 1:33], num_stages=2, schedules=["1f1b"],
                              num_microbatches=2, warmup=0, repeats=1, progress=False, dynamic_dims={"idx": 1},
                              plan_lengths={16: 1, 64: 3},
                              loss_fn=lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten()))
    row = res.rows[0]
    assert row.lengths == (16, 64) and row.length_weights == (0.25, 0.75)
    assert row.predicted_length_s[0] < row.predicted_length_s[1]
    assert all(t > 0 for t in row.measured_length_s)
    assert row.expected_predicted_s == pytest.approx(0.25 * row.predicted_length_s[0] + 0.75 * row.predicted_length_s[1])
    assert "at each length {16:" in str(res)


def test_step_times_are_in_ms_everywhere_and_never_in_scientific_notation(caplog):
    """A new user's run: the table said "1.35e+03 ± 223" (ms) and the log line above it "1.3547s per step"."""
    import logging

    from pipesplit.bench.result import ms_text

    assert [ms_text(x) for x in (1.3547, 13.5, 0.1379, 0.0249, 0.00178)] == ["1355", "13500", "138", "24.9", "1.78"]
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="pipesplit"):
        res = pipesplit.benchmark(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8)),
                                  torch.randn(8, 8), num_stages=2, schedules="gpipe", num_microbatches=2, warmup=1,
                                  repeats=1, progress=False)
    lines = [r.getMessage() for r in caplog.records if "per step" in r.getMessage()]
    assert lines == [f"pipesplit benchmark: 2 stages, gpipe, m=2, cost flops: {ms_text(res.rows[0].measured_step_s)} ms "
                     "per step"], lines


def test_a_busy_machine_says_its_load_average_as_uptime_does():
    """It printed "load average 11.27001953125 before, 11.32861328125 after"."""
    from pipesplit.bench.load import load_summary, load_warning

    quiet = {"load_1min": 11.27001953125, "cores": 2, "time": 0.0, "ticks": {7: ("python", 100)}}
    text = load_warning(load_summary(quiet, {**quiet, "time": 10.0, "ticks": {7: ("python", 900)},
                                             "load_1min": 11.32861328125}))
    assert "load average 11.27 before, 11.33 after" in text, text
    unknown = load_warning(load_summary({**quiet, "load_1min": None},
                                        {**quiet, "time": 10.0, "ticks": {7: ("python", 900)}, "load_1min": None}))
    assert "load average unknown before, unknown after" in unknown, unknown
