"""Running torch.export quietly, and turning its failures into a CaptureError that says what matters.

torch.export logs (and prints the partial graph, twice) its own account of a failure before
raising; the CaptureError names the failing line of the user's code and a hint, and its
``__cause__`` keeps torch's whole story.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
import traceback
from typing import Any, Iterator

import torch

from pipesplit.errors import CaptureError

log = logging.getLogger(__name__)

_TORCH_DIR = os.path.dirname(torch.__file__)


def export_quietly(model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> tuple[Any, float]:
    """``torch.export.export`` (non-strict) and the seconds it took; a failure raises CaptureError."""
    start = time.perf_counter()
    printed = io.StringIO()
    try:
        with _quiet_export(printed):
            ep = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many unrelated types
        if printed.getvalue():
            log.debug("pipesplit: torch.export printed before failing:\n%s", printed.getvalue())
        where = _user_frame(e)
        first = "\n".join(str(e).strip().splitlines()[:8])
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {first}\n"
            + (f"  failing code: {where}\n" if where else "")
            + f"  hint: {_export_hint(str(e))}"
        ) from e
    seconds = time.perf_counter() - start
    sys.stderr.write(printed.getvalue())  # what a successful export printed (the model's warnings) is the user's
    return ep, seconds


def _user_frame(exc: BaseException) -> str | None:
    """The innermost traceback frame outside torch: where the user's code failed."""
    frames = traceback.extract_tb(exc.__traceback__)
    cause = exc.__cause__ or exc.__context__
    while cause is not None:
        frames += traceback.extract_tb(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    user = [
        f for f in frames
        if not f.filename.startswith((_TORCH_DIR, "<")) and os.sep + "pipesplit" + os.sep not in f.filename
    ]
    if not user:
        return None
    f = user[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"


def _export_hint(message: str) -> str:
    low = message.lower()
    if "data-dependent" in low or "data dependent" in low or "guardondatadependent" in low:
        return (
            "the model branches or sizes a tensor on tensor *values*; torch.export needs "
            "control flow that depends only on shapes. Rewrite the branch with torch.where "
            "or torch.cond, or move it out of forward()."
        )
    if "cache" in low and ("dynamiccache" in low or "past_key_values" in low):
        return "pass use_cache=False (or config.use_cache=False) so the model returns no KV-cache object."
    if "constraint" in low or "specializ" in low:
        return "the model fixes a dimension the example marks dynamic; pass an example with the real shape."
    return "see the torch.export message above; models must be traceable by torch.export (non-strict)."


_NOISY_LOGGERS = (
    "torch._dynamo", "torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes",
    "torch._subclasses.fake_tensor", "torch._functorch",
)


@contextlib.contextmanager
def _quiet_export(printed: io.StringIO) -> Iterator[None]:
    """Silence torch's export loggers and collect what it prints to stderr, for this block only."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(printed):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
