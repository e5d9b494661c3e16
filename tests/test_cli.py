"""The ``pipesplit`` command line, run as a user would: in a subprocess, outside the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    diff = re.search(r"max \|split - original\| on a batch of 3: (\S+)", done.stdout)
    assert diff and float(diff.group(1)) == 0.0


def test_demo_writes_dot_and_plan(demo):
    done, out = demo
    assert done.returncode == 0, done.stderr
    dot = (out / "split.dot").read_text()
    assert dot.startswith("digraph") and "cluster_0" in dot and "cluster_1" in dot
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
    assert "--debug" in done.stderr
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
