"""The exceptions pipesplit raises: one hierarchy rooted in PipesplitError."""

from __future__ import annotations


class PipesplitError(Exception):
    """Base class of every error pipesplit raises on purpose.

    Messages state the constraint that failed, show the numbers involved and
    suggest a fix.
    """


class CaptureError(PipesplitError):
    """The model could not be captured with ``torch.export``."""


class CostError(PipesplitError):
    """A cost model is misconfigured or produced unusable costs."""


class PlanError(PipesplitError):
    """No valid partition exists, or a given plan / split is invalid."""


class InputError(PipesplitError):
    """A split program or pipeline was called with inputs it cannot accept."""


class ScheduleError(PipesplitError):
    """A pipeline schedule is unknown, malformed, or can never complete."""


class RuntimeCommError(PipesplitError):
    """A peer did not answer in time or died while others waited on it."""
