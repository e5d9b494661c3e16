"""Models too big for one host: a program compiled from a model on the ``meta`` device holds no
storage; each process gives real storage to its own stages only, then initialises it with the
model's own ``reset_parameters`` or loads it from a checkpoint by the original names.

    with torch.device("meta"):
        model = build()                        # no memory anywhere
    prog = pipesplit.compile(model, x, num_stages=8, devices=[...])
    pipe = pipesplit.Pipeline(prog, ...)       # under torchrun: this rank's stages get storage
    pipe.init_weights(model)                   # or: pipe.load("ckpt")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from pipesplit.capture import rebind
from pipesplit.errors import PipesplitError
from pipesplit.state import Placement

if TYPE_CHECKING:
    from pipesplit.passes.split.program import SplitProgram


def materialize(prog: "SplitProgram", stages: set[int] | None = None) -> list[str]:
    """Replace the meta tensors of ``stages`` by empty ones on their devices (tied weights stay one
    parameter); returns the original names of the entries that now need values."""
    kept = [s for s in prog.stages if s.module is not None and (stages is None or s.index in stages)]
    placement = Placement(prog.num_state_entries)
    fresh: set[int] = set()
    for stage in kept:
        entries = prog.stage_entries[stage.index]
        for idx, t in list(entries.items()):
            if not t.is_meta:
                continue
            new = placement.take(idx, t, stage.device)
            entries[idx] = new
            fresh.add(idx)
        # where each fresh entry sits in the stage's modules: its get_attr targets, or for state no
        # op uses (kept by stage 0) its own name
        sites = [(t, prog.target_to_entry[t]) for t in stage.attr_targets if prog.target_to_entry.get(t) in fresh]
        used = set(prog.target_to_entry.values())
        sites += [(prog.state_entry(i).name, i) for i in entries if i in fresh and i not in used]
        for module in stage.modes.values():
            for target, idx in sites:
                rebind(module, target, entries[idx])
        stage.place_graphs(stage.device)  # arange(..., device=meta) now makes its tensor where the stage runs
    prog.rebuild_holders({s.index for s in kept})
    prog.uninitialised |= fresh
    return sorted(prog.state_entry(i).name for i in prog.uninitialised)


def init_weights(prog: "SplitProgram", model: nn.Module,
                 init_fn: Callable[[str, torch.Tensor], None] | None = None,
                 share: Callable[[], None] | None = None) -> None:
    """Initialise what this process holds as ``model``'s own ``reset_parameters`` would.

    ``model`` is the (meta) model the program was compiled from; each of its modules whose
    direct parameters and buffers are all held here runs ``reset_parameters()`` on this
    process's tensors, and what it actually writes counts as initialised. ``init_fn(name,
    tensor)`` initialises the rest (a bare ``nn.Parameter``, a buffer computed in ``__init__``,
    which no ``reset_parameters`` sets); anything left raises, naming it. ``share()`` then runs
    (a distributed pipeline makes every copy of a tensor agree) before that check.
    """
    held = {name: (idx, t) for idx, t in prog.held_items() for name in prog.state_entry(idx).aliases}
    done: set[int] = set()
    with torch.no_grad():
        for path, mod in model.named_modules():
            reset = getattr(mod, "reset_parameters", None)
            own = [(n, f"{path}.{n}" if path else n) for n, _ in
                   list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))]
            if not callable(reset) or not own or not all(full in held for _, full in own):
                continue
            done |= _reset(mod, reset, {n: held[full] for n, full in own})
        for name, (idx, t) in held.items():
            if idx in prog.uninitialised and idx not in done and init_fn is not None:
                init_fn(name, t)
                done.add(idx)
    prog.uninitialised -= done
    prog.refresh_tied()
    if share is not None:
        share()
    check_initialised(prog)


def _reset(mod: nn.Module, reset: Callable[[], None], own: dict[str, tuple[int, torch.Tensor]]) -> set[int]:
    """Run ``mod``'s ``reset_parameters`` on the held tensors ``own`` (its attribute -> (entry, tensor));
    return the entries it wrote: in place (the tensor's version moved) or by assigning a new tensor,
    whose values are copied in. What it leaves alone (a buffer computed in ``__init__``) has no values."""
    originals = {n: getattr(mod, n) for n in own}
    before = {n: (t._version, t.data_ptr()) for n, (_, t) in own.items()}
    raw = {n: t.detach().reshape(-1).view(torch.uint8).clone() for n, (_, t) in own.items()}  # .data writes move no version
    written: set[int] = set()
    try:
        for n, (_, t) in own.items():
            rebind(mod, n, t)
        reset()
        for n, (idx, t) in own.items():
            now = getattr(mod, n)
            if now is not t and isinstance(now, torch.Tensor) and not now.is_meta:  # reset assigned a new tensor
                t.copy_(now)
                written.add(idx)
            elif now is t and ((t._version, t.data_ptr()) != before[n]
                               or not torch.equal(t.detach().reshape(-1).view(torch.uint8), raw[n])):
                written.add(idx)
    finally:
        for n, t in originals.items():
            rebind(mod, n, t)
    return written


def check_initialised(prog: "SplitProgram", why: str = "") -> None:
    """Refuse to go on while some tensor of this process has storage but no values; ``why`` says what
    would have used them (a step by default)."""
    if prog.uninitialised:
        names = sorted(prog.state_entry(i).name for i in prog.uninitialised)
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        raise PipesplitError(
            f"{len(names)} tensor(s) of this process have storage but no values yet: {shown}{why}. No module's "
            "reset_parameters() sets them (a buffer computed in __init__, such as a causal mask, or a bare "
            "parameter), so pipesplit cannot know their values: pass pipe.init_weights(model, init_fn=fn), where "
            "fn(name, tensor) fills each of them in place, or load them from a checkpoint (pipe.load(path))."
        )
