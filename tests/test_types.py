"""``mypy --strict`` passes on the package as it is installed.

``passes/`` ships as ``pipesplit.passes``, a layout mypy cannot see from the source tree, so
the test copies the two folders into that layout and checks it with the configuration in
``pyproject.toml`` (``[tool.mypy]``: strict; third-party packages without stubs ignored).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api", reason="mypy is not installed (pip install -e \".[test]\")")

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_strict_passes_on_the_installed_layout(tmp_path):
    shutil.copytree(ROOT / "pipesplit", tmp_path / "pipesplit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "passes", tmp_path / "pipesplit" / "passes", ignore=shutil.ignore_patterns("__pycache__"))
    stdout, stderr, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / ".mypy_cache"),
        "--no-error-summary", str(tmp_path / "pipesplit"),
    ])
    report = (stdout + stderr).replace(str(tmp_path / "pipesplit" / "passes"), "passes").replace(str(tmp_path) + "/", "")
    assert status == 0, f"mypy --strict found problems:\n{report}"
