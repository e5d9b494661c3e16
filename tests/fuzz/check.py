"""A case = (model spec, config): run it, count it, and turn a failure into a standalone repro."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import pprint
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from hypothesis import assume, strategies as st

from tests.fuzz import conditioning, harness
from tests.fuzz.configs import COMBOS, allowed_refusal, draw_config, draw_length, expected_refusal, features, known
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
    refused_as_expected: int = 0  # refusals the generator expected (configs.MUST_REFUSE), with its words
    skipped_known: int = 0
    # failed comparisons within conditioning.SLACK of the plain model's own movement under rounding
    # (tests/fuzz/conditioning.py): not judged; the first one's description is kept
    ill_conditioned: int = 0
    ill_example: str = ""
    refused: collections.Counter = field(default_factory=collections.Counter)
    by_feature: collections.Counter = field(default_factory=collections.Counter)
    by_schedule: collections.Counter = field(default_factory=collections.Counter)
    failures: dict[str, str] = field(default_factory=dict)  # first line of a shrunk failure -> repro
    # the case with the largest relative error that passed: (error, which case and tensor, its repro script)
    largest: tuple[float, str, str] = (0.0, "", "")
    started: float = field(default_factory=time.monotonic)

    def summary(self) -> str:
        mins = (time.monotonic() - self.started) / 60
        refused = sum(self.refused.values())
        drawn = self.ran + self.invalid
        lines = [f"{self.ran} cases checked in {mins:.1f} min ({self.ran / max(mins, 1e-9):.1f}/min); "
                 f"{self.invalid} drawn models the plain model itself rejects, {self.skipped_known} draws "
                 f"steered off KNOWN defects, {refused} refused by pipesplit (allowed), "
                 f"{self.refused_as_expected} refused as the generator expects, "
                 f"{len(self.failures)} distinct failures",
                 f"of {drawn} drawn: {self.invalid / max(drawn, 1):.0%} rejected by the plain model, "
                 f"{refused / max(drawn, 1):.0%} refused (allowed), "
                 f"{self.refused_as_expected / max(drawn, 1):.0%} refused as expected, "
                 f"{(self.ran - refused - self.refused_as_expected) / max(drawn, 1):.0%} compared; largest "
                 f"relative error that passed {harness.MAX_ERR[0]:.2g} (RTOL {harness.RTOL:g})",
                 f"largest passing error {self.largest[0]:.2g} in {self.largest[1] or '-'}",
                 "by schedule: " + ", ".join(f"{k}={v}" for k, v in sorted(self.by_schedule.items())),
                 "by feature: " + ", ".join(f"{k}={v}" for k, v in sorted(self.by_feature.items()))]
        if self.ill_conditioned:
            lines.append(f"{self.ill_conditioned} ill-conditioned (a difference within {conditioning.SLACK:g}x of "
                         f"the plain model's own movement when each of its results is rounded once more ({conditioning.UNIT:.2g}; not "
                         f"judged), e.g. {self.ill_example}")
        lines += [f"refused x{n}: {msg}" for msg, n in self.refused.most_common(8)]
        return "\n".join(lines)


def repro(spec: ModelSpec, cfg: dict[str, Any], runner: str = "run_case(Model, IO, CFG)") -> str:
    """A standalone script: the harness, the model's class, the config; it asserts what failed."""
    return "\n".join([
        inspect.getsource(harness).rstrip(), "", "", "# ---- the model (tests/fuzz/models.py wrote it from:",
        *[f"# {line}" for line in pprint.pformat(spec, width=110).splitlines()], "# )",
        source(spec),
        f"IO = {io(spec)!r}", f"CFG = {pprint.pformat(cfg, width=110, sort_dicts=False)}", "",
        'if __name__ == "__main__":', "    torch.set_default_dtype(torch.float64)  # as the fuzzer ran it",
        f"    {runner}", '    print("ok: pipesplit matches plain PyTorch")', ""])


def run(spec: ModelSpec, cfg: dict[str, Any], stats: Stats | None = None, include_known: bool = False,
        mesh: Any = None, dist: str | None = None, coverage: Any = None, label: str = "") -> str:
    """Run one case in float64; "ok", "invalid", "known", "refused", "refused as expected" or raises
    FuzzFailure (with a repro): on a difference, a raw error, a refusal the case's features do not
    allow (configs.allowed_refusal), or no refusal (or another one) where configs.MUST_REFUSE expects it.
    A case whose comparisons raise the largest passing error so far is kept in ``stats.largest``, named by
    ``label`` (the draw that made it), the tensor and the case's features."""
    if cfg.get("checkpoint") and cfg.get("checkpoint_plan") and expected_refusal(features(spec, cfg, dist)):
        # a planned set of stages may leave out the one that writes state: a refusal is expected, so all of them
        cfg = {**cfg, "checkpoint_plan": False}
    feats = features(spec, cfg, dist)
    if known(feats) and not include_known:
        if stats:
            stats.skipped_known += 1
        return "known"
    must = expected_refusal(feats)
    replays, built, largest = harness.GRAPH_REPLAYS, harness.FIW_BUILT, harness.MAX_ERR[0]
    harness.FAILED[:] = [0.0, ""]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # these models are tiny: every case in float64, at a tight RTOL
    try:
        try:
            harness.run_case(lambda: build(spec), io(spec), cfg, mesh=mesh)
        finally:
            torch.set_default_dtype(before)
            if stats and harness.MAX_ERR[0] > largest:  # a refusal after some comparisons keeps them too
                stats.largest = (harness.MAX_ERR[0], f"{label or 'a case'}, {harness.MAX_AT[0]}; features "
                                 f"{sorted(f for f in feats if '=' not in f or f.startswith('schedule='))}",
                                 repro(spec, cfg, "run_case(Model, IO, CFG); print('largest relative error', "
                                                  "MAX_ERR[0], 'in', MAX_AT[0])"))
        feats = feats | ({"graphs_replayed"} if harness.GRAPH_REPLAYS > replays else set()) | (
            {"fiw"} if harness.FIW_BUILT > built else set())
        assert must is None, f"not refused: the generator expects a PipesplitError saying {must!r} here"
    except harness.Invalid:
        if stats:
            stats.invalid += 1
        return "invalid"
    except harness.Refused as e:
        msg = str(e)
        if must is not None and must in msg:
            if stats:
                stats.refused_as_expected += 1
                _count(stats, feats, cfg)
            if coverage is not None:
                coverage.reached(feats)
            return "refused as expected"
        # a refusal another feature allows may come first; what the generator expects is never a result
        why = None if allowed_refusal(feats, msg) else (
            f"refused, but not as the generator expects ({must!r})" if must is not None else
            "refused, and no feature of this case allows that refusal")
        if why is not None:
            raise FuzzFailure(f"{why}: {msg.splitlines()[0][:300]}\nfeatures: {sorted(feats)}\nknown: {known(feats)}\n"
                              f"---- repro (python repro.py) ----\n{repro(spec, cfg)}") from e
        if stats:
            stats.refused[msg.split("\n")[0][:160]] += 1
            _count(stats, feats, cfg)
        return f"refused: {msg[:300]}"
    except Exception as e:  # a difference, or a raw error where a PipesplitError or a result was due
        first = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        error, failed = harness.FAILED
        moved = conditioning.ill_conditioned(lambda: build(spec), io(spec), cfg, error, failed) \
            if isinstance(e, AssertionError) and error > 0 and mesh is None and dist is None else None
        if moved is not None and cfg.get("compile") and not _passes_eager(spec, cfg):
            moved = None  # wrong with compiled stages off too: not other kernels' rounding
        if moved is not None:  # the plain model's own answer is not determined to RTOL: rounding, not judged
            if stats:
                stats.ill_conditioned += 1
                stats.ill_example = stats.ill_example or (
                    f"{label or 'a case'}: {first[:160]}; the plain model moves {moved:.2g}")
            return "ill-conditioned"
        text = repro(spec, cfg)
        raise FuzzFailure(f"{first}\nfeatures: {sorted(feats)}\nknown: {known(feats)}\n"
                          f"---- repro (python repro.py) ----\n{text}") from e
    if stats:
        _count(stats, feats, cfg)
    if coverage is not None:
        coverage.reached(feats)
    return "ok"


def _passes_eager(spec: ModelSpec, cfg: dict[str, Any]) -> bool:
    """Whether the case passes with compiled stages (and CUDA graph slots) off."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        harness.run_case(lambda: build(spec), io(spec), {**cfg, "compile": False, "graphs": False})
        return True
    except Exception:
        return False
    finally:
        torch.set_default_dtype(before)


def _count(stats: Stats, feats: set[str], cfg: dict[str, Any]) -> None:
    stats.ran += 1
    stats.by_schedule[cfg["schedule"]] += 1
    stats.by_feature.update(f for f in feats if not f.startswith("schedule="))


@st.composite
def cases(draw: Callable[[Any], Any], combos: list = COMBOS, max_layers: int = 8, local: bool = True,
          include_known: bool = False, dist: str | None = None,
          force: frozenset[str] = frozenset()) -> tuple[ModelSpec, dict[str, Any]]:
    """A (model, config) pair that hypothesis draws and shrinks (fewer layers, simpler options)."""
    def pick(seq: Any) -> Any:
        return draw(st.sampled_from(seq))

    def integer(lo: int, hi: int) -> int:
        return draw(st.integers(lo, hi))

    spec = draw_model(pick, integer, ALL_OPS, max_layers, force)
    cfg = draw_length(draw_config(pick, integer, spec, combos, local, force), spec)
    hits = [] if include_known else known(features(spec, cfg, dist))
    STEERED.update(hits)
    assume(not hits)
    return spec, cfg


def draw_case(case_seed: int, force: frozenset[str] = frozenset(), max_layers: int = 8,
              combos: list = COMBOS, local: bool = True) -> tuple[ModelSpec, dict[str, Any]]:
    """A (model, config) pair from a seeded random, with the features ``force`` names (coverage.py)."""
    rng = random.Random(case_seed)
    spec = draw_model(rng.choice, rng.randint, ALL_OPS, max_layers, force)
    return spec, draw_config(rng.choice, rng.randint, spec, combos, local, force)


# The plain options a failing case is shrunk toward, one at a time.
_PLAIN = {"eval": "none", "eval_pipe": False, "checkpoint": False, "no_zero_grad": False, "freeze_mid": False,
          "loss_param": False, "transport": "auto", "order": "auto", "recompute": "auto", "cost": "flops",
          "opt": "sgd", "reduction": "sum", "graphs": False, "compile": False}


def shrink(spec: ModelSpec, cfg: dict[str, Any], first: str, budget_s: float = 120.0,
           mesh: Any = None, dist: str | None = None) -> tuple[ModelSpec, dict[str, Any]]:
    """A smaller case that fails with the same first line: layers dropped, model flags and options
    set plain, one at a time, greedily, within ``budget_s``."""
    end = time.monotonic() + budget_s

    def fails(sp: ModelSpec, cf: dict[str, Any]) -> bool:
        try:
            run(sp, cf, mesh=mesh, dist=dist)
            return False
        except FuzzFailure as e:
            return str(e).partition("\n")[0] == first
        except Exception:
            return False

    changed = True
    while changed and time.monotonic() < end:
        changed = False
        candidates: list[tuple[ModelSpec, dict[str, Any]]] = []
        for i in range(len(spec.layers)):
            if len(spec.layers) > 1:
                candidates.append((dataclasses.replace(spec, layers=spec.layers[:i] + spec.layers[i + 1:]), cfg))
        for name, plain in (("kwarg", False), ("table", False), ("aux", False), ("outputs", "tensor"),
                            ("sparse", False), ("padding_idx", False), ("layout", "bt"), ("input_grad", False)):
            if getattr(spec, name) != plain:
                candidates.append((dataclasses.replace(spec, **{name: plain}), cfg))
        for key, plain in _PLAIN.items():
            if cfg.get(key, plain) != plain:
                candidates.append((spec, {**cfg, key: plain}))
        for sp, cf in candidates:
            if time.monotonic() >= end:
                break
            if fails(sp, cf):
                spec, cfg, changed = sp, cf, True
                break
    return spec, cfg
