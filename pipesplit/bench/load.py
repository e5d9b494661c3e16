"""How busy the machine is while a benchmark runs: load average and the other processes on the CPU."""

from __future__ import annotations

import os


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_processes(limit: int = 5) -> list[str]:
    """Names of other processes running or runnable right now (Linux ``/proc``; empty elsewhere)."""
    me, out = os.getpid(), []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:]
        if rest.startswith("R"):
            out.append(f"{name} ({pid})")
    return out[:limit]


def machine_load() -> dict[str, object]:
    """The 1-minute load average, the usable cores and the other running processes."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return {"load_1min": load, "cores": usable_cores(), "busy": busy_processes()}


def load_warning(before: dict[str, object], after: dict[str, object]) -> str | None:
    """A sentence when other work competed for the CPU during the run (load above half the cores
    before it started, or other processes running at either end); None on a quiet machine."""
    cores = int(before["cores"])  # type: ignore[call-overload]
    load = before.get("load_1min")
    busy = sorted(set(before["busy"]) | set(after["busy"]))  # type: ignore[call-overload]
    if (load is None or float(load) <= cores / 2) and not busy:  # type: ignore[arg-type]
        return None
    parts = []
    if load is not None and float(load) > cores / 2:  # type: ignore[arg-type]
        parts.append(f"load average {float(load):.2f} on {cores} cores before the run")  # type: ignore[arg-type]
    if busy:
        parts.append("other processes running: " + ", ".join(busy))
    return ("the machine was busy (" + "; ".join(parts) + "): measured times include waiting for the CPU, so "
            "compare rows with care and re-run on a quiet machine for figures to keep.")
