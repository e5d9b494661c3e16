"""The exceptions pipesplit raises: one hierarchy rooted in PipesplitError."""

from __future__ import annotations

import difflib
from typing import Iterable


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


def partial_program(held: list[int], num_stages: int) -> PipesplitError:
    """Why ``prog(x)`` cannot run on a process that holds only ``held`` of the program's stages."""
    return PipesplitError(
        f"this process holds only stage(s) {held} of the program's {num_stages}: a Pipeline under torchrun kept "
        "this rank's stages and dropped the others', so prog(x) cannot run the whole program here. Run the "
        "forward through the pipeline on every rank: pipe(x), or pipe.eval(x) in eval mode (the last stage's "
        "rank gets the outputs); or compile the model again to run it whole in one process."
    )


def did_you_mean(name: object, known: Iterable[str], *, n: int = 3, sentence: bool = False) -> str:
    """The close matches of ``name`` among ``known`` as an error message's hint, or ``""``.

    ``"; did you mean 'a', 'b'?"`` to end a clause, or ``" Did you mean 'a'?"`` (``sentence``)
    to follow a full stop.

    >>> did_you_mean("1fb1", ["gpipe", "1f1b"], n=1, sentence=True)
    " Did you mean '1f1b'?"
    >>> did_you_mean("layer.0", ["layers.0", "layers.1"], n=2)
    "; did you mean 'layers.0', 'layers.1'?"
    >>> did_you_mean("zzz", ["gpipe"])
    ''
    """
    close = difflib.get_close_matches(str(name), sorted(known), n=n)
    if not close:
        return ""
    return f"{' Did' if sentence else '; did'} you mean {', '.join(map(repr, close))}?"


def nearest_names(name: object, known: Iterable[str], what: str = "modules") -> str:
    """:func:`did_you_mean`, or where nothing is close, a few of ``known`` (the shallowest first) to
    end a clause: ``"; the model's modules include '0', '1', '2'"``."""
    known = list(known)
    close = did_you_mean(name, known)
    if close or not known:
        return close
    shown = sorted(known, key=lambda p: (p.count("."), p))[:6]
    return f"; the model's {what} include {', '.join(map(repr, shown))}{f' and {len(known) - 6} more' if len(known) > 6 else ''}."
