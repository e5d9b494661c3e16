"""pipesplit: split PyTorch models into balanced pipeline stages."""

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
