"""Devices as pipesplit holds them: parsed once where they enter, an accelerator always with its index."""

from __future__ import annotations

from typing import Any, Callable

import torch


def concrete_device(device: str | torch.device, current: Callable[[str], int | None] | None = None) -> torch.device:
    """``device`` parsed, with an accelerator named without an index (``"cuda"``) pinned to the one
    that is current now (``cuda:<torch.cuda.current_device()>``): ``torch.cuda`` calls (memory
    statistics, streams, events) refuse a device without an index. ``"cpu"`` and ``"meta"`` stay as
    they are, and so does an accelerator that is not available here (placing a stage on it fails
    later, with its own error). ``current(type)`` gives the current index of a device type (None: not
    available); by default torch's, replaceable so that this is testable without the device.

    >>> concrete_device("cuda", current=lambda kind: 2), concrete_device("cpu"), concrete_device("cuda:1")
    (device(type='cuda', index=2), device(type='cpu'), device(type='cuda', index=1))
    """
    dev = device if isinstance(device, torch.device) else torch.device(device)
    if dev.index is not None or dev.type in ("cpu", "meta"):
        return dev
    index = (current or current_index)(dev.type)
    return dev if index is None else torch.device(dev.type, index)


def device_name(device: str | torch.device, current: Callable[[str], int | None] | None = None) -> str:
    """:func:`concrete_device` as a string (``"cuda:0"``, ``"cpu"``)."""
    return str(concrete_device(device, current))


def current_index(kind: str) -> int | None:
    """The current device index of accelerator type ``kind`` (``"cuda"``, ``"xpu"``...), or None when
    torch has no such module, it is not available here, or it keeps no current device."""
    module: Any = getattr(torch, kind, None)
    if module is None or not hasattr(module, "current_device"):
        return None
    available = getattr(module, "is_available", None)
    if available is None or not available():
        return None
    return int(module.current_device())


def machine_devices() -> list[str]:
    """The devices this machine has, by name: ``cpu``, then each available accelerator's
    (``cuda:0``, ``cuda:1``..., ``mps:0``), for an error that says what to use instead."""
    names = ["cpu"]
    for kind in ("cuda", "xpu", "mps"):
        module: Any = getattr(torch, kind, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            continue
        count = getattr(module, "device_count", lambda: 1)()
        names += [f"{kind}:{i}" for i in range(int(count))]
    return names
