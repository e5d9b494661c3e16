"""Pipeline runtime: executes split programs under schedules, in one process or under torchrun."""

from pipesplit.runtime.pipeline import Pipeline
from pipesplit.runtime.trace import ActionRecord, Trace

__all__ = ["ActionRecord", "Pipeline", "Trace"]
