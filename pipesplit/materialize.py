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
                 init_fn: Callable[[str, torch.Tensor], None] | None = None) -> None:
    """Initialise what this process holds as ``model``'s own ``reset_parameters`` would.

    ``model`` is the (meta) model the program was compiled from; each of its modules whose
    direct parameters and buffers are all held here runs ``reset_parameters()`` on this
    process's tensors. ``init_fn(name, tensor)`` initialises what no module resets (a bare
    ``nn.Parameter``, a buffer computed in ``__init__``); anything left raises, naming it.
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
            originals = {n: getattr(mod, n) for n, _ in own}
            try:
                for n, full in own:
                    rebind(mod, n, held[full][1])
                reset()
            finally:
                for n, t in originals.items():
                    rebind(mod, n, t)
            done |= {held[full][0] for _, full in own}
        for name, (idx, t) in held.items():
            if idx in prog.uninitialised and idx not in done and init_fn is not None:
                init_fn(name, t)
                done.add(idx)
    prog.uninitialised -= done
    prog.refresh_tied()
    check_initialised(prog)


def check_initialised(prog: "SplitProgram") -> None:
    if prog.uninitialised:
        names = sorted(prog.state_entry(i).name for i in prog.uninitialised)
        raise PipesplitError(
            f"{len(names)} tensor(s) of this process have storage but no values yet: {names[:6]}. Load them "
            "(pipe.load(checkpoint)) or initialise them (pipe.init_weights(model, init_fn=...)); no module of the "
            "model resets them by itself."
        )

