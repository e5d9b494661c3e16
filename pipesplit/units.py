"""Numbers as people read them: bytes, counts, seconds, and a plan's cost in its own unit."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_count(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    return f"{n:.2f}P"


def human_seconds(t: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(t) >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t * 1e9:.3g} ns" if t else "0 s"


COMPILE_PHASES = ("capture", "annotate", "plan", "split")


def phase_times(timings: dict[str, float]) -> str:
    """The compile phases with their times, as the log names them: ``capture 1.57 s, annotate 12 ms, ...``."""
    return ", ".join(f"{name} {human_seconds(timings[name])}" for name in COMPILE_PHASES if name in timings)


def format_cost(value: float, cost_name: str) -> str:
    """A plan cost in its unit: seconds for profiled times, FLOPs, bytes for params; plain otherwise."""
    if cost_name in ("profile", "hybrid"):
        return human_seconds(value)
    if cost_name == "flops":
        return f"{human_count(value)} FLOPs"
    if cost_name == "params":
        return human_bytes(value)
    return f"{value:.4g}"  # uniform (node counts) and custom costs, in the user's own units
