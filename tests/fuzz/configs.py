"""Random configurations (stages, schedule, microbatches, planner and runtime options) and the
KNOWN table: feature combinations the drawing avoids until their defects are fixed."""

from __future__ import annotations

import re
from typing import Any, Callable

from pipesplit.errors import ScheduleError
from pipesplit.schedules import list_schedules, resolve_schedule

from tests.fuzz.models import LAYOUT_DIM, T, ModelSpec, model_features

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
                combos: list[tuple[str, int, int]] = COMBOS, local: bool = True,
                force: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A configuration; ``force`` (tests/fuzz/coverage.py) may name its schedule ("schedule=zb_h1") and
    turn on "compile", "fiw" (compiled stages under a schedule that splits the backward, or CUDA graphs),
    "graphs" (CUDA graph slots, emulated on CPU) and "checkpoint"."""
    names = tuple(dict.fromkeys(c[0] for c in combos))
    forced = [f.split("=", 1)[1] for f in force if f.startswith("schedule=")]
    name = forced[0] if forced else pick(names)  # each schedule equally often, then its sizes
    schedule, stages, m = pick([c for c in combos if c[0] == name])
    mb = integer(1, 3)  # rare options are the high draws: shrinking goes back to the plain defaults
    recapture, batch_change = integer(0, 3) == 3, integer(0, 3) == 3
    example = (2 if mb != 2 else 3) if recapture else mb
    mb2 = mb % 3 + 1 if batch_change else mb
    if example == 1 and mb2 != 1:
        example = 2  # an example batch of 1 pins the batch size (a clear InputError): capture at 2
    opt = "sgd0" if spec.tokens and spec.sparse else pick(("sgd", "adamw"))
    # under torchrun (local=False) only where forced: tests/fuzz/dist.py forces them in turn
    compiled = ("compile" in force or "fiw" in force or "graphs" in force
                or (local and integer(1, COMPILE_SHARE) == COMPILE_SHARE))
    graphs = compiled and ("graphs" in force or ("fiw" in force and schedule not in SPLIT_BACKWARD)
                           or integer(0, 1) == 1)
    return {
        "seed": integer(0, 2**16), "stages": stages, "schedule": schedule, "m": m, "mb": mb,
        "example_batch": example, "mb2": mb2,
        "order": pick(("auto", "program")), "recompute": pick(("auto", "auto", "never")),
        "cost": pick(("flops", "params", "uniform")),
        "transport": pick(("auto", "rendezvous")) if local else "auto",
        # checkpointing a stage that updates buffers must be refused (they would update twice): drawn, asserted
        "checkpoint": "checkpoint" in force or integer(0, 3) == 3, "no_zero_grad": integer(0, 3) == 3, "opt": opt,
        "eval": pick(("none", "train_forward", "pipe", "prog")), "eval_pipe": integer(0, 4) == 4,
        "freeze_mid": integer(0, 9) == 9,
        "loss_param": integer(0, 4) == 4,  # the loss function trains a scale of its own (not the model's)
        # compiled stages (AOT autograd's graphs, no code generation): zero-bubble stages as F/I/W graphs
        "compile": compiled,
        "graphs": graphs,  # with compile: CUDA graph slots, emulated (mode="reduce-overhead")
        "reduction": pick(("sum", "mean")),  # loss_reduction: "mean" scales each microbatch's loss by 1/m
        # with checkpoint: half the time the plan names the stages (compile(checkpoint=[...]), drawn as a
        # bit mask) and the Pipeline checkpoints what was planned, exactly those
        "checkpoint_plan": integer(0, 1) == 1, "checkpoint_mask": integer(1, 2**stages - 1),
        # planned, half the time those stages recompute only their first block (compile(checkpoint={s: 1})),
        # three times in four under compile= (the head and the tail then run as two compiled graphs)
        "checkpoint_partial": integer(0, 3) >= (1 if compiled else 2),
    }


# Refusals the generator knows are due: (features that must all be present, words the PipesplitError says).
MUST_REFUSE: list[tuple[frozenset[str], str]] = [
    (frozenset({"checkpoint", "buffer_write"}), "updates buffers in place"),
    (frozenset({"checkpoint", "clamp_w"}), "updates buffers in place"),  # a parameter clamped in forward
    # time-major rows flattened: the microbatches' outputs cannot be joined into the batch's (pipe(x))
    (frozenset({"layout_tflat", "joins_outputs"}), "cannot be joined"),
]


# Refusals a case may end in, by what it has: (words of the PipesplitError, features of which one must be
# present, why). A refusal that matches no entry the case's features allow is a failure: a regression that
# starts refusing working cases is caught. Each entry is a limit by design (docs name them).
ALLOWED: list[tuple[str, frozenset[str], str]] = [
    (r"places to cut|more than this model can balance", frozenset({"multi_stage"}),
     "a model with fewer places to cut than stages asked for"),
    (r"pins the batch dimension|was captured for sizes", frozenset({"recapture", "batch_change", "batch1", "branch"}),
     "a batch size other than the example's where the model specialises on it (an example of 1 pins it; a "
     "branch on the batch size pins it, and pipe(x) then cannot ask a second capture where a joined output's "
     "batch is)"),
    (r"one tensor in the model .*in place", frozenset({"inplace"}),
     "views of one tensor sent over a cut to a stage that writes one of them in place"),
    (r"cannot split into each microbatch's part, so on a mesh", frozenset({"clamp_w", "buffer_write"}),
     "state written in place by an op pipesplit cannot split per microbatch, on a mesh with dp > 1: the replicas "
     "could not agree on it (refused on every rank alike)"),
    (r"is written in place and used by stages", frozenset({"state_read"}),
     "a norm's running statistics read again after the write, where the cut falls between the write and the "
     "read: with several microbatches in flight the reader would see a later microbatch's write, so the split is "
     "refused, naming the fix (no_split=); the planner does not yet keep them in one stage by itself (a limit)"),
    (r"not in a dimension of its own", frozenset({"layout_tflat"}),
     "time-major rows flattened: pipe(x) refuses them even where one microbatch has nothing to join (eval_pipe)"),
    (r"looks up a sparse embedding", frozenset({"sparse_mesh"}),
     "a sparse embedding's gradient is not summed over data-parallel replicas"),
    (r"which run on ranks", frozenset({"state_write", "buffer_write"}),
     "under torchrun, a buffer written in place by a stage and used by a stage on another rank (each rank holds "
     "its own copy; the reader would not see the write)"),
    (r"written in place inside the forward", frozenset({"clamp_w"}),
     "a trainable weight written in place in forward, under a schedule with microbatches interleaved"),
]


def allowed_refusal(feats: set[str], message: str) -> bool:
    """Whether a case with these features may be refused with this message (ALLOWED)."""
    return any(re.search(words, message) and need & feats for words, need, _ in ALLOWED)


def expected_refusal(feats: set[str]) -> str | None:
    """The words of the refusal this case must end in (None: it must not be refused for these)."""
    return next((words for need, words in MUST_REFUSE if need <= feats), None)


def target_dim(spec: ModelSpec) -> int:
    """The dimension of the outputs (and so of the target) that carries the batch."""
    return LAYOUT_DIM[spec.layout]


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
             "checkpoint_partial": cfg["checkpoint"] and cfg.get("checkpoint_plan", False)
             and cfg.get("checkpoint_partial", False),
             "recapture": cfg["example_batch"] != cfg["mb"], "batch_change": cfg["mb2"] != cfg["mb"],
             "no_zero_grad": cfg["no_zero_grad"], "eval_pipe": cfg["eval_pipe"] and cfg["eval"] == "pipe",
             "freeze_mid": cfg["freeze_mid"], "loss_param": cfg.get("loss_param", False),
             "compile": cfg.get("compile", False), "graphs": cfg.get("compile", False) and cfg.get("graphs", False),
             "length_change": cfg.get("seq2", T) != T, "m>1": cfg["m"] > 1, "batch1": cfg["example_batch"] == 1,
             # pipe(x) joins microbatches' outputs (train mode: not with dropout, see harness.check_outputs)
             # (more than one microbatch; one has nothing to join)
             "joins_outputs": cfg["m"] > 1 and ((cfg["eval"] == "pipe" and not cfg["eval_pipe"]) or (
                 cfg["eval"] == "train_forward" and not any(x.op == "dropout" and x.flag for x in spec.layers))),
             "sparse_mesh": spec.tokens and spec.sparse and dist == "mesh", "multi_stage": cfg["stages"] > 1, "dist": dist is not None, "mesh": dist == "mesh"}
    return out | {name for name, on in flags.items() if on}
