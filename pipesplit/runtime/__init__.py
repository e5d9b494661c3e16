"""Pipeline runtime: executes split programs under schedules, in one process or under torchrun."""

from pipesplit.runtime.engine.pipeline import Pipeline
from pipesplit.runtime.engine.trace import ActionRecord, Trace

__all__ = ["ActionRecord", "Pipeline", "Trace"]
