"""Split: the planned graph cut into stage GraphModules with explicit send/recv boundaries
(``graph``), and the eval-mode twin of a stage (``modes``)."""

from pipesplit.passes.split.graph import Boundary, SplitGraph, StagePiece, check_devices, split_graph

__all__ = ["Boundary", "SplitGraph", "StagePiece", "check_devices", "split_graph"]
