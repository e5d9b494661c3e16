"""The communication ops a split program's root graph holds: send, recv and input feeds.

In the reference (one-process) program they move values between devices; runtimes
read them off the root graph to learn what crosses which stage boundary.
"""

from __future__ import annotations

from typing import Any

import torch


def send(value: Any, *, src: int, dst: int, name: str) -> Any:
    """Stage ``src`` hands ``value`` (graph value ``name``) to stage ``dst``."""
    return value


def recv(value: Any, *, src: int, dst: int, name: str, device: str) -> Any:
    """Stage ``dst`` receives ``value`` from stage ``src`` onto its device (differentiable)."""
    if isinstance(value, torch.Tensor) and value.device != torch.device(device):
        return value.to(device, non_blocking=True)
    return value


def feed(value: Any, *, index: int, dst: int, device: str) -> Any:
    """Program input ``index`` delivered to stage ``dst``'s device."""
    if isinstance(value, torch.Tensor) and value.device != torch.device(device):
        return value.to(device, non_blocking=True)
    return value
