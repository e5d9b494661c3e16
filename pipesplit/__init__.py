"""pipesplit: split PyTorch models into balanced pipeline stages."""

import importlib.util as _importlib_util
import os as _os
import sys as _sys

# In a source checkout `passes/` sits beside `pipesplit/`; an install maps it to pipesplit.passes.
_beside = _os.path.join(_os.path.dirname(_os.path.dirname(_os.path.realpath(__file__))), "passes")
if _os.path.isfile(_os.path.join(_beside, "__init__.py")):  # imported from a source checkout
    _found = _importlib_util.find_spec("pipesplit.passes")
    if _found is None:
        # Python run from the checkout's root finds this folder before an installed (non-editable)
        # pipesplit, and the folder holds no passes/: take the checkout's own, as the install would.
        _spec = _importlib_util.spec_from_file_location(
            "pipesplit.passes", _os.path.join(_beside, "__init__.py"), submodule_search_locations=[_beside])
        assert _spec is not None and _spec.loader is not None
        passes = _importlib_util.module_from_spec(_spec)
        _sys.modules["pipesplit.passes"] = passes
        _spec.loader.exec_module(passes)
    elif _found.origin and not _os.path.realpath(_found.origin).startswith(_beside + _os.sep):
        raise ImportError(
            f"pipesplit was imported from {_os.path.dirname(_beside)} but pipesplit.passes would come from "
            f"{_os.path.dirname(_os.path.dirname(_found.origin))}: another checkout is installed in editable mode. "
            "Run Python outside this checkout, or `pip install -e .` here.")

from pipesplit.api import compile as compile  # re-exported for type checkers; see __all__
from pipesplit.bench import BenchmarkResult, BenchRow
from pipesplit.bench.run import benchmark
from pipesplit.errors import (
    CaptureError,
    CostError,
    InputError,
    PipesplitError,
    PlanError,
    RuntimeCommError,
    ScheduleError,
)
from pipesplit.options import PlannerOptions
from pipesplit.passes.plan.objective import CommModel, MemoryModel
from pipesplit.plan import Plan
from pipesplit.passes.split.program import SplitProgram, Stage
from pipesplit.runtime import Pipeline

# `compile` is left out of __all__: `from pipesplit import *` must not shadow the builtin
# compile(). Call it as pipesplit.compile(...), as torch.compile is called.
__all__ = [
    "benchmark",
    "BenchmarkResult",
    "BenchRow",
    "Pipeline",
    "Plan",
    "PlannerOptions",
    "CommModel",
    "MemoryModel",
    "SplitProgram",
    "Stage",
    "PipesplitError",
    "CaptureError",
    "CostError",
    "InputError",
    "PlanError",
    "ScheduleError",
    "RuntimeCommError",
]
__version__ = "0.2.0.dev0"
