"""Pipeline runtime: executes split programs under schedules, in one process or under torchrun."""

from pipesplit.runtime.pipeline import Pipeline

__all__ = ["Pipeline"]
