"""The ``pipesplit`` command line, run as a user would: in a subprocess, outside the repository."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipesplit
from pipesplit.cli import main


def _console_script() -> str:
    here = Path(sys.executable).parent / "pipesplit"
    found = str(here) if here.exists() else shutil.which("pipesplit")
    assert found, "the `pipesplit` console script is not installed (pip install -e . creates it)"
    return found


def run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    out = cwd / "out"
    done = run([sys.executable, "-m", "pipesplit", "demo", "--layers", "2", "--dim", "32", "--stages", "2",
                "--out", str(out)], cwd)
    return done, out


def test_demo_succeeds_and_prints_the_report(demo):
    done, _ = demo
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "device", "nodes"])
    rows = [line for line in lines[header + 2:header + 4]]
    assert [int(r.split()[0]) for r in rows] == [0, 1]
    assert sum(" * " in f" {r} " for r in rows) == 1, "one bottleneck mark"
    assert any(line.startswith("bottleneck: stage") and "lower bound" in line for line in lines)
    diff = re.search(r"max \|split - original\| on a batch of 3[^:]*: (\S+)", done.stdout)
    assert diff and float(diff.group(1)) == 0.0


def test_demo_writes_dot_and_plan(demo):
    done, out = demo
    assert done.returncode == 0, done.stderr
    dot = (out / "split.dot").read_text()
    assert dot.startswith("digraph") and "cluster_0" in dot and "cluster_1" in dot
    boundaries = next(line for line in done.stdout.splitlines() if line.startswith("boundaries:"))
    assert boundaries in dot, "the picture shows the program the report describes (issue 36: 3 edges vs 6)"
    plan = pipesplit.Plan.load(out / "plan.json")
    assert plan.num_stages == 2 and all(plan.stages)
    assert plan.source == "loaded" and len(plan.stage_costs) == 2
    svg = out / "split.svg"
    if shutil.which("dot"):
        assert svg.stat().st_size > 0 and "<svg" in svg.read_text()
    else:
        assert not svg.exists() and "skipped split.svg" in done.stdout


def test_help(tmp_path, capsys):
    top = run([_console_script(), "--help"], tmp_path)  # the installed console script
    assert top.returncode == 0, top.stderr
    assert "demo" in top.stdout and "--debug" in top.stdout
    with pytest.raises(SystemExit) as info:  # the same entry point, in-process (no second torch import)
        main(["demo", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--stages", "--layers", "--dim", "--out", "--debug"):
        assert flag in text


def test_bad_argument_is_one_readable_line(tmp_path):
    done = run([sys.executable, "-m", "pipesplit", "demo", "--stages", "0", "--out", str(tmp_path / "o")], tmp_path)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["pipesplit: error: num_stages must be at least 1, got 0."], done.stderr
    assert "--debug" not in done.stderr, "a usage error's message says it all: no traceback to point at"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(tmp_path, capsys, where):
    args = ["demo", "--stages", "0", "--out", str(tmp_path / "o")]
    args = ["--debug", *args] if where == "before" else [*args, "--debug"]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "PlanError: num_stages must be at least 1, got 0." in err
    assert main(args[1:] if where == "before" else args[:-1]) != 0
    assert "Traceback" not in capsys.readouterr().err


def test_malformed_option_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--stages", "two"])
    assert info.value.code == 2
    assert "invalid int value: 'two'" in capsys.readouterr().err


def test_the_demo_names_each_compile_phase_once_with_one_time(demo):
    """Issue 26: stdout said "export 1.37s" where the log said "capture took 1.574s"."""
    done, _ = demo
    assert done.returncode == 0, done.stderr
    summary = re.search(r"^compile: (.*)$", done.stdout, re.M)
    assert summary, done.stdout
    printed = dict(re.findall(r"(\w+) ([\d.]+ (?:s|ms|µs|ns))", summary.group(1)))
    assert list(printed) == ["capture", "annotate", "plan", "split"], summary.group(0)
    logged: dict[str, str] = {}
    for name, took in re.findall(r"^pipesplit: (\w+) took (.+)$", done.stderr, re.M):
        logged.setdefault(name, took)  # the benchmark compiles again later; the first is the demo's compile
    assert logged == printed, (done.stderr, summary.group(0))


# ------------------------------------------------------------------ demo: training and benchmark
def test_demo_trains_and_benchmarks(demo):
    done, out = demo
    assert done.returncode == 0, done.stderr
    trained = re.search(r"pipeline training \(1f1b, 4 microbatches of 2\): loss (\S+) -> (\S+) over 3 steps",
                        done.stdout)
    assert trained and float(trained.group(2)) < float(trained.group(1))
    # issue 36: "766 ms/step" beside a table of 211 ms: the first step (warm-up) is apart, and each says what it is
    assert re.search(r"over 3 steps; step 1 \(warm-up: first run of every stage\) [\d.]+ m?s, "
                     r"steps 2-3 median [\d.]+ m?s, optimizer included", done.stdout), done.stdout
    assert "each row times 2 steps after 1 untimed warm-up step, without the optimizer" in done.stdout
    for schedule in ("gpipe", "1f1b", "zb_h1"):
        assert re.search(rf"^\| 2 \| {schedule} \| 4 \| flops \|", done.stdout, re.M), done.stdout
    assert "fastest:" in done.stdout
    assert (out / "bench.csv").read_text().count("\n") == 4
    assert (out / "timeline.png").stat().st_size > 10_000
    assert '"traceEvents"' in (out / "trace.json").read_text()


# ------------------------------------------------------------------ split, bench, schedule
FACTORY = '''
import torch
from torch import nn


def build(depth=4, width=32):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])


def broken():
    raise ValueError("no weights here")


class Tokens(nn.Module):
    """Two vocabularies: the token ids must stay below the smaller one."""

    seen = []

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(300, 32)
        self.pos = nn.Embedding(50, 32)

    def forward(self, idx):
        if not torch.compiler.is_exporting():  # the eager run that checks the shape sees the real ids
            Tokens.seen.append(int(idx.max()))
        return self.pos(idx) + self.emb(idx)
'''


@pytest.fixture
def factory_dir(tmp_path):
    (tmp_path / "mynet.py").write_text(FACTORY)
    return tmp_path


def _dot_parses(path: Path) -> None:
    src = path.read_text()
    assert src.startswith("digraph") and src.count("{") == src.count("}")
    if shutil.which("dot"):
        done = subprocess.run(["dot", "-Tsvg", str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "<svg" in done.stdout, done.stderr


def test_split_end_to_end(factory_dir):
    # the console script, run where the user's module lives (it is not on sys.path otherwise)
    done = run([_console_script(), "split", "mynet:build", "--kwarg", "depth=6", "--input-shape", "8x32",
                "--stages", "3", "--dot", "out/s.dot", "--plan-out", "out/plan.json"]
               + (["--svg", "out/s.svg"] if shutil.which("dot") else []), factory_dir)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "device", "nodes"])
    assert [int(line.split()[0]) for line in lines[header + 2:header + 5]] == [0, 1, 2]
    _dot_parses(factory_dir / "out" / "s.dot")
    plan = pipesplit.Plan.load(factory_dir / "out" / "plan.json")
    assert plan.num_stages == 3 and all(plan.stages)
    if shutil.which("dot"):
        assert "<svg" in (factory_dir / "out" / "s.svg").read_text()


def test_bench_end_to_end(tmp_path):
    done = run([sys.executable, "-m", "pipesplit", "bench", "pipesplit.models:gpt", "--input-shape", "4x16:int64",
                "--int-high", "64", "--kwarg", "layers=2", "--kwarg", "dim=32", "--kwarg", "vocab=64",
                "--kwarg", "seq=16", "--stages", "2", "--schedules", "gpipe,zb_h1", "--microbatches", "2",
                "--warmup", "1", "--repeats", "2", "--out", "res", "--no-progress"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout.splitlines()[0].split()[:3] == ["stages", "schedule", "m"]
    assert "fastest:" in done.stdout
    out = tmp_path / "res"
    csv_lines = (out / "bench.csv").read_text().splitlines()
    assert len(csv_lines) == 3 and csv_lines[0].startswith("num_stages,schedule,num_microbatches,cost")
    assert len((out / "bench.md").read_text().splitlines()) == 4
    for png in ("bench.png", "balance.png", "timeline.png"):
        data = (out / png).read_bytes()
        assert data[:4] == b"\x89PNG" and len(data) > 10_000, png
    assert '"traceEvents"' in (out / "trace.json").read_text()
    _dot_parses(out / "split.dot")


def test_schedule_end_to_end(tmp_path):
    done = run([_console_script(), "schedule", "zb_h1", "--stages", "4", "--microbatches", "8", "--png", "z.png"],
               tmp_path)
    assert done.returncode == 0, done.stderr
    sim = pipesplit.schedules.simulate(pipesplit.schedules.get_schedule("zb_h1", num_stages=4, num_microbatches=8), 1.0)
    assert sim.to_text() in done.stdout
    assert f"simulated bubble: {100 * sim.bubble_fraction:.1f}%" in done.stdout
    assert (tmp_path / "z.png").read_bytes()[:4] == b"\x89PNG"


def test_schedule_without_a_name_lists_them(capsys):
    assert main(["schedule"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == list(pipesplit.schedules.list_schedules())


@pytest.mark.parametrize("command, flags", [
    ("split", ["--input-shape", "--stages", "--cost", "--dot", "--svg", "--plan-out", "--kwarg", "--debug"]),
    ("bench", ["--input-shape", "--stages", "--schedules", "--microbatches", "--cost", "--out", "--repeats"]),
    ("schedule", ["--stages", "--microbatches", "--png", "--ranks"]),
])
def test_every_command_has_help(capsys, command, flags):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in flags:
        assert flag in text, flag


# ------------------------------------------------------------------ bad input: one line, non-zero exit
def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("pipesplit: error: "), err
    return errors[0]


@pytest.mark.parametrize("args, expected", [
    (["schedule", "1f1c", "--stages", "4"], "Unknown schedule '1f1c'. Did you mean '1f1b'?"),
    (["bench", "{f}:build", "--input-shape", "8x32", "--schedules", "gpipe,1f1c"], "Unknown schedule '1f1c'"),
    (["split", "{f}:build", "--input-shape", "8x32", "--cost", "flopz"], "unknown cost 'flopz'"),
    (["bench", "{f}:build", "--input-shape", "8x32", "--cost", "flops,flopz"], "unknown cost 'flopz'"),
    (["split", "no_such_module_xyz:build", "--input-shape", "8x32"],
     "cannot import module 'no_such_module_xyz' (ModuleNotFoundError"),
    (["split", "{f}:buidl", "--input-shape", "8x32"], "has no attribute 'buidl'"),
    (["split", "{f}:broken", "--input-shape", "8x32"], "failed: ValueError: no weights here"),
    (["split", "{f}", "--input-shape", "8x32"], "expected MODULE:FACTORY"),
    (["split", "{f}:build", "--input-shape", "8x31"], "input shape 8x31 does not fit Sequential"),
    (["bench", "{f}:build", "--input-shape", "8x32", "--microbatches", "3"], "does not split into [3]"),
    (["split", "{f}:build", "--input-shape", "8xx"], "is not a shape"),
    (["split", "{f}:build", "--input-shape", "8x32:int64"],
     "--input-shape 8x32:int64 is an integer input, but Sequential has no nn.Embedding to take its range from"),
])
def test_bad_input_is_one_line_and_a_hint(factory_dir, capsys, args, expected):
    args = [a.replace("{f}", str(factory_dir / "mynet.py")) for a in args]
    assert main(args) != 0
    line = _one_error_line(capsys.readouterr().err)
    assert expected in line, line


@pytest.mark.parametrize("given, high", [([], 50), (["--int-high", "7"], 7)])
def test_token_ids_default_to_the_models_vocabulary(factory_dir, capsys, given, high):
    assert main(["split", str(factory_dir / "mynet.py") + ":Tokens", "--input-shape", "64x16:int64", *given]) == 0
    capsys.readouterr()
    import mynet  # the module the CLI loaded from the file

    assert mynet.Tokens.seen and max(mynet.Tokens.seen) == high - 1, mynet.Tokens.seen  # 1024 draws cover the range


def test_a_shape_that_does_not_fit_is_quiet_in_a_subprocess(factory_dir):
    done = run([_console_script(), "split", "mynet:build", "--input-shape", "8x31", "--stages", "2"], factory_dir)
    assert done.returncode == 2
    line = _one_error_line(done.stderr)
    assert "mat1 and mat2 shapes cannot be multiplied (8x31 and 32x32)" in line
    assert len(done.stderr.splitlines()) <= 3, done.stderr
    assert done.stdout == ""


# ------------------------------------------------------------------ progress and torch's noise
BRANCHY = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            return h * 2
        return h
'''


def test_compile_logs_each_phase_with_its_time(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with caplog.at_level(logging.INFO, logger="pipesplit"):
        pipesplit.compile(model, torch.randn(2, 8), num_stages=2, progress=False)
    phases = re.findall(r"pipesplit: (\w+) took [\d.]+ (?:s|ms|µs|ns)\n", caplog.text)
    assert phases == ["capture", "annotate", "plan", "split"], caplog.text
    assert all(r.name.startswith("pipesplit") and r.levelno == logging.INFO for r in caplog.records)


@pytest.mark.parametrize("quiet", [False, True])
def test_the_cli_shows_the_compile_phases_unless_quiet(factory_dir, caplog, quiet):
    level = logging.getLogger("pipesplit").level
    args = ["split", str(factory_dir / "mynet.py") + ":build", "--input-shape", "8x32"] + (["--quiet"] if quiet else [])
    with caplog.at_level(logging.INFO):  # what a user's INFO handler would get; the CLI's level decides the rest
        assert main(args) == 0
    phases = re.findall(r"pipesplit: (\w+) took", caplog.text)
    assert phases == ([] if quiet else ["capture", "annotate", "plan", "split"]), caplog.text
    assert logging.getLogger("pipesplit").level == level, "main() must leave the logger as it found it"


def test_a_capture_failure_is_pipesplits_message_alone(tmp_path, capsys, caplog):
    (tmp_path / "branchy.py").write_text(BRANCHY)
    args = ["split", str(tmp_path / "branchy.py") + ":Branchy", "--input-shape", "2x4"]
    with caplog.at_level(logging.DEBUG):
        assert main(args) == 2
    err = capsys.readouterr().err
    assert "def forward" not in err + caplog.text, "torch's partial graph leaked"
    assert _one_error_line(err).startswith("pipesplit: error: torch.export could not capture Branchy")
    assert "if h.sum() > 0" in err
    caplog.clear()
    with caplog.at_level(logging.DEBUG):  # --debug: the traceback, and the graph torch printed
        assert main(["--debug", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "GuardOnDataDependentSymNode" in err
    assert "def forward" in caplog.text


# ------------------------------------------------------------------ errors in pipesplit's words (issue 26)
_TORCH_BOILERPLATE = re.compile(r"TORCH_LOGS|TORCHDYNAMO_|https?://|guard_or_false|for more information", re.IGNORECASE)


def test_a_capture_failure_leads_with_the_line_and_one_hint(tmp_path, capsys):
    (tmp_path / "branchy.py").write_text(BRANCHY)
    line = next(i for i, text in enumerate(BRANCHY.splitlines(), 1) if "if h.sum() > 0" in text)
    assert main(["split", str(tmp_path / "branchy.py") + ":Branchy", "--input-shape", "2x4"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"pipesplit: error: torch.export could not capture Branchy at {tmp_path / 'branchy.py'}:{line} " \
                     "in forward:", err
    assert err[1].strip().startswith("if h.sum() > 0:"), err
    hints = [text for text in err if text.startswith("hint:")]
    assert len(hints) == 2 and "torch.where" in hints[0] and "torch.cond" in hints[0], err
    assert hints[1] == "hint: run with --debug for the full traceback", err  # a traceback shows torch's account
    assert not [text for text in err if _TORCH_BOILERPLATE.search(text)], err
    assert len(err) <= 6, err


@pytest.mark.parametrize("args, says", [
    (["demo", "--stages", "0"], "num_stages must be at least 1, got 0."),
    (["split", "{d}/missing.py:build", "--input-shape", "8x32"], "no such file"),
    (["split", "{d}/mynet.py:build", "--input-shape", "8x32", "--plan", "{d}/nope.json"],
     "plan file '{d}/nope.json' does not exist"),
    (["schedule", "1f1c", "--stages", "4"], "Unknown schedule '1f1c'"),
    (["split", "{d}/mynet.py:build", "--input-shape", "8x32", "--cost", "flopz"], "unknown cost 'flopz'"),
])
def test_a_usage_error_does_not_point_at_a_traceback(factory_dir, capsys, args, says):
    args = [a.replace("{d}", str(factory_dir)) for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert says.replace("{d}", str(factory_dir)) in _one_error_line(err)
    assert "--debug" not in err, err


@pytest.mark.parametrize("factory", ["broken", "build"])
def test_an_error_from_the_users_code_points_at_debug(factory_dir, capsys, factory):
    shape = "8x32" if factory == "broken" else "8x31"  # the factory raises / the model's forward does
    assert main(["split", f"{factory_dir / 'mynet.py'}:{factory}", "--input-shape", shape]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "hint: run with --debug for the full traceback", err


def test_devices_that_are_not_devices_name_this_machines(factory_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["split", f"{factory_dir / 'mynet.py'}:build", "--input-shape", "8x32", "--devices", "cpu,gpu"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    here = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert f"argument --devices: 'gpu' is not a device; this machine has {', '.join(here)}" in err, err
    assert "mkldnn" not in err and "privateuseone" not in err, "torch's list of every device type it knows"


def test_a_stage_count_the_model_cannot_balance_is_warned(capsys, caplog):
    args = ["split", "pipesplit.models:gpt", "--kwarg", "layers=2", "--kwarg", "dim=32", "--kwarg", "seq=16",
            "--input-shape", "4x16:int64", "--quiet"]
    with caplog.at_level(logging.WARNING, logger="pipesplit"):
        assert main([*args, "--stages", "2"]) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    capsys.readouterr()
    assert main([*args, "--stages", "12"]) == 0
    out, err = capsys.readouterr()  # once, among the report's notes (issue 36: logged and printed, it came twice)
    warned = [line for line in (out + err).splitlines() if "num_stages=12 is more than this model can balance" in line]
    assert len(warned) == 1 and warned[0].startswith("note: ") and "in head" in warned[0], out + err


def test_the_text_chart_explains_its_letters(capsys):
    """Issue 26: the chart alternates upper and lower case by microbatch; its legend says so."""
    assert main(["schedule", "zb_h1", "--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    chart = [line for line in out if line.startswith("rank ")]
    letters = set("".join(chart)) - set("rank 0123456789|.")
    assert letters == set("FIWfiw"), letters
    legend = out[out.index(chart[-1]) + 1]
    for letter, meaning in (("F", "forward"), ("I", "input grad"), ("W", "weight grad"), (".", "idle")):
        assert f"{letter} {meaning}" in legend, legend
    assert "lower case: odd microbatches" in legend, legend
    with pytest.raises(SystemExit):
        main(["schedule", "--help"])
    assert "lower case: odd microbatches" in " ".join(capsys.readouterr().out.split())


# ------------------------------------------------------------------ --version, each command's own options
def test_version(tmp_path):
    done = run([_console_script(), "--version"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"pipesplit {pipesplit.__version__} (torch {torch.__version__})"


def _subparsers() -> dict[str, "argparse.ArgumentParser"]:
    import argparse

    from pipesplit.cli import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_quiet_is_offered_only_where_a_model_is_compiled(capsys):
    """`--quiet` hides the compile phases: `schedule` compiles nothing, so its help must not offer it."""
    commands = _subparsers()
    assert set(commands) == {"demo", "split", "bench", "schedule"}
    for name in commands:
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        assert ("--quiet" in text) == (name != "schedule"), (name, text)
        assert "--debug" in text, name
    with pytest.raises(SystemExit) as info:
        main(["schedule", "gpipe", "--stages", "2", "--quiet"])
    assert info.value.code == 2 and "unrecognized arguments: --quiet" in capsys.readouterr().err


def test_required_options_say_so_in_help():
    found = 0
    for name, parser in _subparsers().items():
        for action in parser._actions:
            if action.required and action.option_strings:
                found += 1
                assert "(required)" in (action.help or ""), (name, action.option_strings)
    assert found >= 2, "split and bench require --input-shape"
    stages = next(a for a in _subparsers()["schedule"]._actions if "--stages" in a.option_strings)
    assert "(required with NAME)" in stages.help  # checked in run_schedule, not by argparse
