"""A stage that recomputes only its first blocks: the head runs under activation checkpointing, the tail as usual.

The plan names how many of the stage's first nodes recompute (``Plan.checkpoint_partial``);
the head is the stage graph's prefix up to the last of them, so every op runs in the
stage's own order and a random op draws what it draws without checkpointing. The head
runs once in the forward on the stage's random stream, which the tail goes on drawing
from; its recompute in the backward replays the stream from where the head began.

Under ``Pipeline(compile=...)`` the head and the tail run as two compiled graphs (``run``):
the recompute calls the same compiled head on the same stream, so its random draws (dropout
masks) are the forward's, bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import torch.fx as fx
from torch.utils.checkpoint import checkpoint

from pipesplit.errors import PipesplitError
from pipesplit.rng import resumed_stream, stream_copy

_SHARED = ("placeholder", "get_attr", "output")


class RecomputedHead:
    """Calls like the stage module; the nodes up to the last in ``head`` recompute in the backward."""

    def __init__(self, module: fx.GraphModule, head: Collection[str]):
        nodes = list(module.graph.nodes)
        found = [i for i, n in enumerate(nodes) if n.name in head]
        if not found:
            raise PipesplitError(f"the plan recomputes {len(head)} nodes of a stage (from {sorted(head)[:3]}), none of "
                                 "which its graph has now: compile again, or pass Pipeline(checkpoint=False).")
        last = max(found)
        inside = {n for n in nodes[: last + 1] if n.op not in _SHARED}
        self.attr_targets = sorted({str(a.target) for n in inside for a in n.all_input_nodes if a.op == "get_attr"})
        placeholders = [n for n in nodes if n.op == "placeholder"]
        # the head: its placeholders are the stage's, its outputs what the rest of the stage reads of it
        outputs = [n for n in nodes if n in inside and any(u not in inside for u in n.users)]
        g, env = fx.Graph(), {}
        for p in placeholders:
            env[p] = g.placeholder(p.name)
        for n in nodes:
            if n in inside or (n.op == "get_attr" and any(u in inside for u in n.users)):
                env[n] = g.node_copy(n, env.__getitem__)
        g.output(tuple(env[o] for o in outputs))
        self.head = fx.GraphModule(module, g)
        setattr(self.head, "pipesplit_part", "head")  # the compile log names the part
        # the tail: the stage's placeholders, then the head's outputs
        t, tenv = fx.Graph(), {}
        for p in placeholders:
            tenv[p] = t.placeholder(p.name)
        for o in outputs:
            tenv[o] = t.placeholder(f"{o.name}_head")
        for n in nodes:
            if n.op != "placeholder" and n not in inside:
                tenv[n] = t.node_copy(n, tenv.__getitem__)
        self.tail = fx.GraphModule(module, t)
        setattr(self.tail, "pipesplit_part", "tail")
        self.num_nodes = len(inside)

    def __call__(self, *xs: Any, run: Callable[..., Any] | None = None, own: Sequence[int] = (),
                 prepare: Callable[[Sequence[Any]], tuple[Any, ...]] | None = None) -> Any:
        """The stage on ``xs``; ``run(piece, *args)``, where given, runs the head and the tail (compiled).
        ``prepare`` clones the inputs at ``own``, which the stage writes in place: inside the recomputed
        part, so the recompute starts from the inputs as they came, and the tail reads the written clones."""
        call: Callable[..., Any] = run if run is not None else _eager
        start = stream_copy()  # the stage's random stream where the head begins
        ran: list[bool] = []

        def head(*args: Any) -> Any:
            if prepare is not None:
                args = prepare(args)
            if not ran:  # the forward: on the stage's stream, which the tail goes on drawing from
                ran.append(True)
                outs = call(self.head, *args)
            else:
                with resumed_stream(start):  # the recompute: the same draws again
                    outs = call(self.head, *args)
            return (*outs, *(args[i] for i in own))

        outs = checkpoint(head, *xs, use_reentrant=False, preserve_rng_state=False)
        if own:
            written = dict(zip(own, outs[len(outs) - len(own):]))
            outs, xs = outs[:len(outs) - len(own)], tuple(written.get(i, x) for i, x in enumerate(xs))
        return call(self.tail, *xs, *outs)


def _eager(piece: fx.GraphModule, *args: Any) -> Any:
    return piece(*args)
