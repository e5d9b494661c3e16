"""pipesplit: split PyTorch models into balanced pipeline stages."""

import importlib.util as _importlib_util
import os as _os

# In a source checkout `passes/` sits beside `pipesplit/`; an install maps it to pipesplit.passes.
# Python run from the checkout's root finds this folder before an installed (non-editable)
# pipesplit, and the folder alone has no `passes`: look for it beside, as the install would.
if _importlib_util.find_spec("pipesplit.passes") is None:
    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    if _os.path.isfile(_os.path.join(_root, "passes", "__init__.py")):
        __path__.append(_root)

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
