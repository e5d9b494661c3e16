"""Pairs of features the fuzzer must reach, and the draws that reach them: each case is forced to
have the pair least reached so far (then more features that add unreached pairs), so that every
pair is met within a budget rather than by luck. ``python -m tests.fuzz`` prints the pairs reached.

A pair counts as reached when a case that has both features was compared with the plain model and
agreed, or was refused exactly as the generator expects (MUST_REFUSE in configs.py)."""

from __future__ import annotations

import collections
import itertools
import random

from tests.fuzz.configs import SCHEDULES

# feature (as the pairs name it) -> the name in a case's measured features (check.run)
MEASURED = {
    "compile": "compile",  # compile={"backend": "aot_eager"}
    "fiw": "fiw",  # a stage ran as compiled explicit F/I/W graphs (not eager)
    "graphs": "graphs_replayed",  # CUDA graph slots replayed (EmulatedCapture on CPU)
    "checkpoint": "checkpoint",
    "dropout": "dropout_p",  # a Dropout with p > 0 in training
    "buffer_write": "buffer_write",  # running statistics, an EMA buffer written in forward
    "shared": "shared",  # a tied head, a module called twice, F.linear on a linear's weight, w1 + w2
    "input_grad": "input_grad",
    "non_batch_first": "non_batch_first",  # sequence-first (T, B, .) or flattened (B * T, .) outputs
}
FEATURES = tuple(MEASURED)
SCHEDULE_FEATURES = tuple(f"schedule={s}" for s in SCHEDULES)

# What forcing a feature asks of the draw (models.draw_model, configs.draw_config).
FORCE = {"compile": {"compile"}, "fiw": {"fiw", "graphed"}, "graphs": {"graphs", "graphed"},
         "checkpoint": {"checkpoint"}, "dropout": {"dropout"}, "buffer_write": {"buffer_write"},
         "shared": {"shared"}, "input_grad": {"input_grad"}, "non_batch_first": {"non_batch_first"}}

_GRAPH_LIMITS = "compile_limits.unsupported: such a stage runs eager (or compiled without graphs)"
# Pairs impossible by design, with the reason (the test holds that every other pair is reached).
IMPOSSIBLE: dict[frozenset[str], str] = {
    frozenset({"graphs", "dropout"}): f"random ops keep a stage off CUDA graphs, and the slots are per stage only "
                                      f"where no stage of this size has them ({_GRAPH_LIMITS})",
    frozenset({"graphs", "checkpoint"}): f"checkpoint=True checkpoints every stage; a checkpointed stage replays "
                                         f"its forward, which graphs cannot ({_GRAPH_LIMITS})",
    frozenset({"fiw", "checkpoint"}): f"checkpoint=True checkpoints every stage, and a checkpointed stage runs its "
                                      f"split backward eager ({_GRAPH_LIMITS})",
}


# Pairs whose cases must be refused (configs.MUST_REFUSE): tried first among equals, as they cost
# nothing to run (refused at construction) and assert the refusal.
ASSERTED = {frozenset({"checkpoint", "buffer_write"})}


def all_pairs() -> list[frozenset[str]]:
    pairs = [frozenset(p) for p in itertools.combinations(FEATURES, 2)]
    pairs += [frozenset({s, f}) for s in SCHEDULE_FEATURES for f in FEATURES]
    return [p for p in pairs if p not in IMPOSSIBLE]


PAIRS = all_pairs()


def measured(feats: set[str]) -> set[str]:
    """A case's measured features under the pairs' names."""
    return {f for f, name in MEASURED.items() if name in feats} | {f for f in feats if f.startswith("schedule=")}


class Coverage:
    """Counts of the pairs reached; :meth:`next_force` picks what the next case must have."""

    def __init__(self, seed: int = 0, max_features: int = 4, free_share: int = 4):
        self.count: collections.Counter = collections.Counter()
        self.tries: collections.Counter = collections.Counter()
        self.rng = random.Random(seed)
        self.max_features, self.free_share, self.cases = max_features, free_share, 0

    def next_force(self) -> frozenset[str]:
        """The features (in the draws' terms) the next case must have: the pair least reached (and least
        tried), then features that add pairs not reached yet; every ``free_share``-th case once all pairs
        are reached is drawn freely (the draws' own distribution)."""
        self.cases += 1
        if not self.unreached() and self.cases % self.free_share == 0:
            return frozenset()
        first = min(PAIRS, key=lambda p: (self.count[p], self.tries[p], p not in ASSERTED, self.rng.random()))
        chosen = set(first)
        extra = [f for f in (*FEATURES, *SCHEDULE_FEATURES) if f not in chosen]
        self.rng.shuffle(extra)
        for f in extra:
            if sum(1 for c in chosen if not c.startswith("schedule=")) >= self.max_features:
                break
            if f.startswith("schedule=") and any(c.startswith("schedule=") for c in chosen):
                continue
            if any(frozenset({f, c}) in IMPOSSIBLE for c in chosen):
                continue
            if any(not self.count[frozenset({f, c})] for c in chosen):
                chosen.add(f)
        for p in PAIRS:
            if p <= chosen:
                self.tries[p] += 1
        return frozenset().union(*(FORCE.get(f, {f}) for f in chosen))

    def reached(self, feats: set[str]) -> None:
        got = measured(feats)
        for p in PAIRS:
            if p <= got:
                self.count[p] += 1

    def unreached(self) -> list[frozenset[str]]:
        return [p for p in PAIRS if not self.count[p]]

    def summary(self) -> str:
        n = len(PAIRS)
        lines = [f"pairs reached: {n - len(self.unreached())} of {n} ({len(IMPOSSIBLE)} impossible by design)"]
        for f in FEATURES:
            row = [f"{g}:{self.count[frozenset({f, g})]}" for g in (*FEATURES, *SCHEDULE_FEATURES)
                   if g != f and frozenset({f, g}) in PAIRS]
            lines.append(f"  {f}: " + " ".join(row))
        lines += [f"  UNREACHED {' x '.join(sorted(p))} (tried {self.tries[p]}x)" for p in self.unreached()]
        lines += [f"  impossible {' x '.join(sorted(p))}: {why}" for p, why in IMPOSSIBLE.items()]
        return "\n".join(lines)
