"""Moved: the split program lives beside the pass that makes it, in
:mod:`pipesplit.passes.split.program`. Import ``SplitProgram`` and ``Stage`` from ``pipesplit``;
this path keeps working, with a DeprecationWarning, until 0.3."""

import warnings

from pipesplit.passes.split.program import SplitProgram, Stage

__all__ = ["SplitProgram", "Stage"]

warnings.warn(
    "pipesplit.program moved to pipesplit.passes.split.program; import SplitProgram and Stage from pipesplit.",
    DeprecationWarning, stacklevel=2)
