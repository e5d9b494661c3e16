"""A case = (model spec, config): run it, count it, and turn a failure into a standalone repro."""

from __future__ import annotations

import collections
import inspect
import pprint
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from hypothesis import assume, strategies as st

from tests.fuzz import harness
from tests.fuzz.configs import COMBOS, draw_config, draw_length, features, known
from tests.fuzz.models import OPS, ModelSpec, build, draw_model, io, source

ALL_OPS = tuple(OPS)
STEERED: collections.Counter = collections.Counter()  # hypothesis draws refused by KNOWN entry (this process)


class FuzzFailure(AssertionError):
    """pipesplit differs from plain PyTorch (or crashed with a raw error); the message holds a repro."""


@dataclass
class Stats:
    """What ran: cases by outcome, by feature and by schedule; refusals by message."""

    ran: int = 0
    invalid: int = 0
    rounding: int = 0  # float32 differences past RTOL that the float64 rerun showed to be rounding
    skipped_known: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)
    by_feature: collections.Counter = field(default_factory=collections.Counter)
    by_schedule: collections.Counter = field(default_factory=collections.Counter)
    failures: dict[str, str] = field(default_factory=dict)  # first line of a shrunk failure -> repro
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> str:
        mins = (time.monotonic() - self.started) / 60
        lines = [f"{self.ran} cases checked in {mins:.1f} min ({self.ran / max(mins, 1e-9):.1f}/min); "
                 f"{self.invalid} drawn models the plain model itself rejects, {self.skipped_known} draws "
                 f"steered off KNOWN defects, {sum(self.refused.values())} refused by pipesplit, "
                 f"{self.rounding} float32 differences that float64 showed to be rounding, "
                 f"{len(self.failures)} distinct failures",
                 "by schedule: " + ", ".join(f"{k}={v}" for k, v in sorted(self.by_schedule.items())),
                 "by feature: " + ", ".join(f"{k}={v}" for k, v in sorted(self.by_feature.items()))]
        lines += [f"refused x{n}: {msg}" for msg, n in self.refused.most_common(8)]
        return "\n".join(lines)


def repro(spec: ModelSpec, cfg: dict[str, Any], runner: str = "run_case(Model, IO, CFG)") -> str:
    """A standalone script: the harness, the model's class, the config; it asserts what failed."""
    return "\n".join([
        inspect.getsource(harness).rstrip(), "", "", "# ---- the model (tests/fuzz/models.py wrote it from:",
        *[f"# {line}" for line in pprint.pformat(spec, width=110).splitlines()], "# )",
        source(spec),
        f"IO = {io(spec)!r}", f"CFG = {pprint.pformat(cfg, width=110, sort_dicts=False)}", "",
        'if __name__ == "__main__":', f"    {runner}", '    print("ok: pipesplit matches plain PyTorch")', ""])


def run(spec: ModelSpec, cfg: dict[str, Any], stats: Stats | None = None, include_known: bool = False,
        mesh: Any = None, dist: str | None = None) -> str:
    """Run one case; "ok", "invalid", "known", "refused" or raises FuzzFailure (with a repro)."""
    feats = features(spec, cfg, dist)
    if known(feats) and not include_known:
        if stats:
            stats.skipped_known += 1
        return "known"
    replays = harness.GRAPH_REPLAYS
    try:
        harness.run_case(lambda: build(spec), io(spec), cfg, mesh=mesh)
        if harness.GRAPH_REPLAYS > replays:  # the case ran CUDA graph slots, not only asked for them
            feats = feats | {"graphs_replayed"}
    except harness.Invalid:
        if stats:
            stats.invalid += 1
        return "invalid"
    except harness.Refused as e:
        if stats:
            stats.refused[str(e).split("\n")[0][:160]] += 1
            _count(stats, feats, cfg)
        return f"refused: {str(e)[:300]}"
    except Exception as e:  # a difference, or a raw error where a PipesplitError or a result was due
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if "relative error" in first and rounding(spec, cfg, mesh):
            if stats:
                stats.rounding += 1
                _count(stats, feats, cfg)
            return "rounding"
        text = repro(spec, cfg)
        raise FuzzFailure(f"{first}\nfeatures: {sorted(feats)}\nknown: {known(feats)}\n"
                          f"---- repro (python repro.py) ----\n{text}") from e
    if stats:
        _count(stats, feats, cfg)
    return "ok"


F64_RTOL = 1e-8  # float64 rounding, amplified as much as float32's was, stays below this by ~1e4


def rounding(spec: ModelSpec, cfg: dict[str, Any], mesh: Any = None) -> bool:
    """A float32 difference is rounding if the same case in float64 agrees to ``F64_RTOL``.

    A logic error (a gradient counted twice, a statistic from the wrong microbatch) is as large
    in float64 as in float32; rounding shrinks by ~1e-9. There gradients compare against at least
    the loss's magnitude: a gradient that is zero up to rounding (a LayerNorm weight whose output
    a BatchNorm normalises again) is noise in both runs, and two noises differ by ~100%. Models whose normalisations divide by
    a tiny variance amplify float32 rounding past ``harness.RTOL``: this tells the two apart.
    """
    before, rtol, loss_floor = torch.get_default_dtype(), harness.RTOL, harness.LOSS_FLOOR
    if before == torch.float64:  # the case ran in float64 already (under torchrun, tests/fuzz/dist.py)
        return False
    torch.set_default_dtype(torch.float64)
    harness.RTOL = F64_RTOL
    harness.LOSS_FLOOR = 1.0  # a gradient that is zero up to rounding everywhere is noise against the loss
    try:
        harness.run_case(lambda: build(spec), io(spec), cfg, mesh=mesh)
        return True
    except (harness.Refused, harness.Invalid):  # past the point float32 failed at (it ran to there unrefused):
        return True  # a later refusal (a batch the model pins) is no difference
    except Exception:
        return False
    finally:
        torch.set_default_dtype(before)
        harness.RTOL, harness.LOSS_FLOOR = rtol, loss_floor


def _count(stats: Stats, feats: set[str], cfg: dict[str, Any]) -> None:
    stats.ran += 1
    stats.by_schedule[cfg["schedule"]] += 1
    stats.by_feature.update(f for f in feats if not f.startswith("schedule="))


@st.composite
def cases(draw: Callable[[Any], Any], combos: list = COMBOS, max_layers: int = 8, local: bool = True,
          include_known: bool = False, dist: str | None = None) -> tuple[ModelSpec, dict[str, Any]]:
    """A (model, config) pair that hypothesis draws and shrinks (fewer layers, simpler options)."""
    def pick(seq: Any) -> Any:
        return draw(st.sampled_from(seq))

    def integer(lo: int, hi: int) -> int:
        return draw(st.integers(lo, hi))

    spec = draw_model(pick, integer, ALL_OPS, max_layers)
    cfg = draw_length(draw_config(pick, integer, spec, combos, local), spec)
    hits = [] if include_known else known(features(spec, cfg, dist))
    STEERED.update(hits)
    assume(not hits)
    return spec, cfg
