"""Every docstring example in the package runs and prints what it shows (the stdlib's doctest,
module by module under its package name: ``passes/`` is installed as ``pipesplit.passes``)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import pipesplit
import pipesplit.passes

# passes/ lives outside pipesplit/ and is mapped in as pipesplit.passes: walk both
MODULES = sorted({m.name for package in (pipesplit, pipesplit.passes)
                  for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")}
                 - {"pipesplit.__main__"})  # running the CLI is not an example


def test_the_walk_finds_every_part_of_the_package():
    for part in ("pipesplit.passes.plan.planner", "pipesplit.schedules.issue", "pipesplit.runtime.engine.pipeline"):
        assert part in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (output above)"
