"""The built wheel ships ``passes/`` as ``pipesplit.passes`` and nothing named ``passes``.

Builds the wheel from a copy of the checkout, installs it into a fresh venv and imports
it from outside the repository, so the editable install cannot hide a packaging mistake.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", ".venv*", "demo_out",
                                 ".pytest_cache", ".hypothesis", "*.whl", "*.pyc")

pytestmark = pytest.mark.slow


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _package_dirs() -> dict[str, Path]:
    """Each package pyproject.toml lists -> the source folder it is built from."""
    tool = _pyproject()["tool"]["setuptools"]
    mapping = tool.get("package-dir", {})
    out = {}
    for pkg in tool["packages"]:
        if pkg in mapping:
            out[pkg] = REPO / mapping[pkg]
        else:
            parent = next((p for p in sorted(mapping, key=len, reverse=True) if pkg.startswith(p + ".")), None)
            if parent is None:
                out[pkg] = REPO / pkg.replace(".", "/")
            else:
                out[pkg] = REPO / mapping[parent] / pkg[len(parent) + 1:].replace(".", "/")
    return out


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _outer_site_dirs() -> list[str]:
    """The running interpreter's site-packages (and user site, when enabled), in order."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=IGNORED)  # a stale build/ in the checkout must not leak in
    done = _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                 "-w", str(tmp / "dist")], src)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = (tmp / "dist").glob("pipesplit-*.whl")
    return found


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv") / "env"
    # Not --system-site-packages: that exposes the *base* interpreter's site-packages, not
    # those of a virtualenv pytest may be running in. Instead a .pth file lists the running
    # interpreter's own site-packages, so torch and pip (hence --without-pip) come from
    # whatever environment the tests run in, behind the venv's own site-packages. Plain path
    # lines: the outer .pth files (an editable pipesplit's among them) are not run.
    done = _run([sys.executable, "-m", "venv", "--without-pip", str(root)], root.parent)
    assert done.returncode == 0, done.stderr
    python = root / "bin" / "python"
    done = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], root.parent)
    assert done.returncode == 0, done.stderr
    own_site = Path(done.stdout.strip())
    assert root.resolve() in own_site.resolve().parents, own_site
    (own_site / "_outer_env.pth").write_text("".join(f"{d}\n" for d in _outer_site_dirs()))
    done = _run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], root.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    return root


def test_every_listed_package_has_files_and_every_package_is_listed():
    dirs = _package_dirs()
    for pkg, path in dirs.items():
        assert (path / "__init__.py").is_file(), f"pyproject.toml lists {pkg} but {path} holds no __init__.py"
    on_disk = {p.parent for top in ("pipesplit", "passes") for p in (REPO / top).rglob("__init__.py")}
    unlisted = sorted(str(d.relative_to(REPO)) for d in on_disk - set(dirs.values()))
    assert not unlisted, f"packages missing from pyproject.toml's [tool.setuptools] packages: {unlisted}"


def test_wheel_holds_every_module_under_pipesplit(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pipesplit"}, f"the wheel installs top-level {sorted(tops)}; only pipesplit belongs there"
    for pkg, path in _package_dirs().items():
        for py in path.glob("*.py"):
            inside = pkg.replace(".", "/") + "/" + py.name
            assert inside in names, f"{py.relative_to(REPO)} is missing from the wheel (expected at {inside})"
    assert "pipesplit/py.typed" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "pipesplit = pipesplit.cli:main" in entry_points


_PROBE = """
import importlib, json
import pipesplit, pipesplit.passes, pipesplit.passes.plan.partition, pipesplit.schedules
result = {"pipesplit": pipesplit.__file__, "passes": pipesplit.passes.__file__,
          "partition": pipesplit.passes.plan.partition.__file__, "schedules": pipesplit.schedules.__file__}
try:
    importlib.import_module("passes")
    result["top_level_passes"] = "imported"
except ImportError as e:
    result["top_level_passes"] = type(e).__name__
print(json.dumps(result))
"""


def test_installed_wheel_imports_from_outside_the_repo(venv, tmp_path):
    done = _run([str(venv / "bin" / "python"), "-c", _PROBE], tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    site = (venv / "lib").resolve()
    for key in ("pipesplit", "passes", "partition", "schedules"):
        path = Path(found[key]).resolve()
        assert site in path.parents, f"{key} imported from {path}, not from the venv"
        assert REPO not in path.parents, f"{key} imported from the checkout"
    assert Path(found["passes"]).parent.name == "passes" and Path(found["passes"]).parent.parent.name == "pipesplit"
    assert found["top_level_passes"] == "ModuleNotFoundError", "the wheel must not install a top-level `passes`"


def test_console_script_in_the_venv(venv, tmp_path):
    script = venv / "bin" / "pipesplit"
    assert script.is_file() and os.access(script, os.X_OK)
    assert str(venv / "bin" / "python") in script.read_text(), "the script should run the venv's python"
    done = _run([str(script), "--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "demo" in done.stdout


def test_top_level_passes_is_refused_in_a_checkout():
    done = _run([sys.executable, "-c", "import passes"], REPO)
    assert done.returncode != 0
    assert "ImportError: import this package as `pipesplit.passes`" in done.stderr, done.stderr


# ------------------------------------------------------------------ CI = the README


def _readme_test_command() -> str:
    """The one command in the fenced block under the README's "Run the tests:"."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "Run the tests:")
    fence = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
    body = [line for line in lines[fence + 1:end] if line.strip()]
    assert len(body) == 1, f"the README's test block should hold one command line, not {body}"
    return body[0].strip()


def test_ci_runs_the_readme_test_command_in_a_fresh_virtualenv():
    command = _readme_test_command()
    assert "pytest" in command
    script = (REPO / ".ci" / "run").read_text().splitlines()
    code = [line.strip() for line in script if line.strip() and not line.strip().startswith("#")]
    assert "set -euo pipefail" in code
    assert command in code, f".ci/run must run the README's test command exactly:\n{command}"
    assert code[-1] == command, ".ci/run should end with the README's test command, so its status is CI's"
    venv = next((i for i, line in enumerate(code) if line.startswith("python3 -m venv ")), None)
    assert venv is not None, ".ci/run must make a virtualenv"
    target = code[venv].split()[-1]  # a path or "$VAR"
    assert any(line.startswith("rm -rf ") and target in line for line in code[:venv]), \
        ".ci/run must remove the virtualenv before making it, so each run starts from nothing"
    activate = next(i for i, line in enumerate(code) if line.startswith(". ") and target.strip('"') in line)
    assert code[activate].endswith('/bin/activate"') or code[activate].endswith("/bin/activate")
    assert venv < activate < code.index(command), "the test command must run inside the new virtualenv"


def test_test_dependencies_are_bounded_and_torch_is_not_pinned():
    project = _pyproject()["project"]
    for spec in project["optional-dependencies"]["test"]:
        assert ">=" in spec and "<" in spec.replace("<=", "<"), f"{spec}: give the test dependency a range"
    (torch_spec,) = [d for d in project["dependencies"] if d.startswith("torch")]
    assert torch_spec.startswith("torch>=") and not any(op in torch_spec for op in ("==", "<", "~=")), torch_spec


def test_the_checkout_shadowing_an_installed_wheel_still_imports(venv):
    """``pip install .`` then ``python -c 'import pipesplit'`` from the checkout's root: Python finds
    the checkout's pipesplit/ first, which holds no passes/; it must find passes/ beside it."""
    probe = "import pipesplit, pipesplit.passes.plan.partition as p; print(pipesplit.__file__); print(p.__file__)"
    done = _run([str(venv / "bin" / "python"), "-c", probe], REPO)
    assert done.returncode == 0, done.stderr
    package, partition = (Path(line).resolve() for line in done.stdout.strip().splitlines()[-2:])
    assert package == REPO / "pipesplit" / "__init__.py" and partition == REPO / "passes" / "plan" / "partition.py"


def test_a_checkout_next_to_another_editable_install_says_so(tmp_path):
    """Python run from the root of checkout B, while checkout A is installed in editable mode, would
    take B's pipesplit and A's passes: a clear ImportError instead of a silent mix."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(REPO / "pipesplit", other / "pipesplit")
    shutil.copytree(REPO / "passes", other / "passes")
    done = _run([sys.executable, "-c", "import pipesplit"], other)
    editable = done.returncode != 0 or "Traceback" in done.stderr
    if not editable:  # this interpreter has no editable pipesplit (a wheel, or none): the checkout is used whole
        probe = "import pipesplit.passes as p; print(p.__file__)"
        again = _run([sys.executable, "-c", probe], other)
        assert again.returncode == 0 and Path(again.stdout.strip()).resolve().parent == (other / "passes").resolve()
        return
    assert "another checkout is installed in editable mode" in done.stderr, done.stderr
