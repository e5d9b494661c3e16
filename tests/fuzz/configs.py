"""Random configurations (stages, schedule, microbatches, planner and runtime options) and the
KNOWN table: feature combinations the drawing avoids until their defects are fixed."""

from __future__ import annotations

from typing import Any, Callable

from pipesplit.errors import ScheduleError
from pipesplit.schedules import list_schedules, resolve_schedule

from tests.fuzz.models import T, ModelSpec, model_features

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "zb_h1", "zb_v", "dualpipe_v")
SPLIT_BACKWARD = ("zb_h1", "zb_v", "dualpipe_v")

# One entry per defect the drawing steers around: a set of features -> why. A case whose features
# include every feature of an entry is not drawn (``--include-known`` draws it anyway). Delete an
# entry when its fix merges; a NEW finding goes here as "new: ..." only with a repro in the report.
KNOWN: dict[frozenset[str], str] = {
}


def known(features: set[str]) -> list[str]:
    """The KNOWN entries this case falls under."""
    return [why for combo, why in KNOWN.items() if combo <= features]


def valid_combos(max_stages: int = 4, max_m: int = 4, ranks: int | None = None) -> list[tuple[str, int, int]]:
    """(schedule, stages, microbatches) that the Pipeline accepts (num_ranks left to its default, or
    ``ranks`` under torchrun): the registry's own constraints decide, not a copy of them here."""
    out = []
    for name in SCHEDULES:
        assert name in list_schedules(), name
        for stages in range(1, max_stages + 1):
            for m in range(1, max_m + 1):
                try:
                    s = resolve_schedule(name, stages, ranks, m)
                except ScheduleError:
                    continue
                if ranks is None or s.num_ranks == ranks:
                    out.append((name, stages, m))
    return out


COMBOS = valid_combos()
COMPILE_SHARE = 10  # one case in this many runs compiled stages (python -m tests.fuzz --compile-share)


def draw_config(pick: Callable[[Any], Any], integer: Callable[[int, int], int], spec: ModelSpec,
                combos: list[tuple[str, int, int]] = COMBOS, local: bool = True) -> dict[str, Any]:
    name = pick(tuple(dict.fromkeys(c[0] for c in combos)))  # each schedule equally often, then its sizes
    schedule, stages, m = pick([c for c in combos if c[0] == name])
    mb = integer(1, 3)  # rare options are the high draws: shrinking goes back to the plain defaults
    recapture, batch_change = integer(0, 3) == 3, integer(0, 3) == 3
    example = (2 if mb != 2 else 3) if recapture else mb
    mb2 = mb % 3 + 1 if batch_change else mb
    if example == 1 and mb2 != 1:
        example = 2  # an example batch of 1 pins the batch size (a clear InputError): capture at 2
    opt = "sgd0" if spec.tokens and spec.sparse else pick(("sgd", "adamw"))
    writes_buffers = any(x.op == "ema" or (x.op == "batchnorm" and x.arg % 2 == 0)
                         or (x.op == "instancenorm" and x.arg % 2) for x in spec.layers)
    return {
        "seed": integer(0, 2**16), "stages": stages, "schedule": schedule, "m": m, "mb": mb,
        "example_batch": example, "mb2": mb2,
        "order": pick(("auto", "program")), "recompute": pick(("auto", "never")),
        "cost": pick(("flops", "params", "uniform")),
        "transport": pick(("auto", "rendezvous")) if local else "auto",
        # checkpointing a stage that updates buffers is refused clearly (they would update twice)
        "checkpoint": not writes_buffers and integer(0, 3) == 3, "no_zero_grad": integer(0, 3) == 3, "opt": opt,
        "eval": pick(("none", "train_forward", "pipe", "prog")), "eval_pipe": integer(0, 4) == 4,
        "freeze_mid": integer(0, 9) == 9,
        "loss_param": integer(0, 4) == 4,  # the loss function trains a scale of its own (not the model's)
        # compiled stages (AOT autograd's graphs, no code generation): zero-bubble stages as F/I/W graphs
        "compile": local and integer(1, COMPILE_SHARE) == COMPILE_SHARE,
        "graphs": integer(0, 1) == 1,  # with compile: CUDA graph slots, emulated (mode="reduce-overhead")
        "reduction": pick(("sum", "mean")),  # loss_reduction: "mean" scales each microbatch's loss by 1/m
        # with checkpoint: half the time the plan names the stages (compile(checkpoint=[...]), drawn as a
        # bit mask) and the Pipeline checkpoints what was planned, exactly those
        "checkpoint_plan": integer(0, 1) == 1, "checkpoint_mask": integer(1, 2**stages - 1),
    }


def draw_length(cfg: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """``cfg`` with ``seq2``: the sequence length of the second step and of the eval pass, another than
    the example's in one case in four (issue 34: a length that changes is captured dynamic, once).
    Derived from the case's seed, so no other draw moves and recorded seeds replay as before; a model
    that fixes its length (sdpa's reshape to T, a (T, D) table input) keeps it."""
    fixed = spec.table or any(x.op == "sdpa" for x in spec.layers)
    change = not fixed and (cfg["seed"] >> 4) % 4 == 3
    return {**cfg, "seq2": T + 1 + cfg["seed"] % 5 if change else T}


def features(spec: ModelSpec, cfg: dict[str, Any], dist: str | None = None) -> set[str]:
    out = model_features(spec)
    out |= {f"schedule={cfg['schedule']}", f"stages={cfg['stages']}", f"opt={cfg['opt']}", f"eval={cfg['eval']}",
            f"cost={cfg['cost']}", f"order={cfg['order']}", f"recompute={cfg['recompute']}",
            f"reduction={cfg.get('reduction', 'sum')}"}
    flags = {"rendezvous": cfg["transport"] == "rendezvous", "checkpoint": cfg["checkpoint"],
             "checkpoint_planned": cfg["checkpoint"] and cfg.get("checkpoint_plan", False),
             "recapture": cfg["example_batch"] != cfg["mb"], "batch_change": cfg["mb2"] != cfg["mb"],
             "no_zero_grad": cfg["no_zero_grad"], "eval_pipe": cfg["eval_pipe"] and cfg["eval"] == "pipe",
             "freeze_mid": cfg["freeze_mid"], "loss_param": cfg.get("loss_param", False),
             "compile": cfg.get("compile", False), "graphs": cfg.get("compile", False) and cfg.get("graphs", False),
             "length_change": cfg.get("seq2", T) != T,
             "m>1": cfg["m"] > 1, "multi_stage": cfg["stages"] > 1, "dist": dist is not None, "mesh": dist == "mesh"}
    return out | {name for name, on in flags.items() if on}
