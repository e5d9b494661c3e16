"""What a model is made of when it is compiled, to tell what changed before capturing it again."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

from torch import nn

from pipesplit.compat import forward_hooks, set_forward_hooks


@dataclass(frozen=True)
class Structure:
    """A model's submodules by name (the objects themselves), the forward hooks and pre-hooks on each
    (:func:`hooks_as_compiled` puts them back for a capture), a ``forward`` set on an instance, and its
    parameter and buffer names with their shapes and dtypes.

    Parametrizations (``torch.nn.utils.parametrize``) change a module's class and add submodules, so
    they show as a module changed. Weight *values* are not part of it: a program holds its own.
    """

    modules: dict[str, nn.Module]
    types: dict[str, type]  # parametrize swaps a module's class in place
    hooks: dict[str, tuple[Any, ...]]
    forwards: dict[str, Any]
    state: dict[str, tuple[tuple[int, ...], Any, tuple[str, ...]]]  # name -> (shape, dtype, every name of its tensor)

    @classmethod
    def of(cls, model: nn.Module) -> "Structure":
        modules = dict(model.named_modules(remove_duplicate=False))
        names: dict[int, list[str]] = {}
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, t in named:
            names.setdefault(id(t), []).append(name)
        state = {name: (tuple(t.shape), t.dtype, tuple(sorted(names[id(t)]))) for name, t in named}
        return cls(
            modules=modules,
            types={name: type(m) for name, m in modules.items()},
            hooks={name: forward_hooks(m) for name, m in modules.items()},
            forwards={name: m.__dict__.get("forward") for name, m in modules.items()},
            state=state,
        )

    def changes(self, now: "Structure", limit: int = 4) -> list[str]:
        """What differs in ``now`` from this structure, in words (at most ``limit`` items, then a count)."""
        out = []
        for name, module in self.modules.items():
            if name not in now.modules:
                out.append(f"{_shown(name)} was removed")
                continue
            other, was, is_ = now.modules[name], self.types[name].__name__, now.types[name].__name__
            if other is not module or was != is_:
                out.append(f"{_shown(name)} is another module ({is_}, was {was})" if was != is_ else
                           f"{_shown(name)} is another {is_} object")
            elif self.forwards[name] is not now.forwards[name]:
                out.append(f"{_shown(name)}'s forward was replaced")
        out += [f"{_shown(name)} was added ({type(m).__name__})" for name, m in now.modules.items()
                if name not in self.modules]
        if not out and self.state != now.state:
            moved = [n for n in self.state.keys() | now.state.keys() if self.state.get(n) != now.state.get(n)]
            out.append(f"its parameters or buffers changed in name, shape, dtype or tying ({', '.join(sorted(moved)[:3])})")
        return out[:limit] + ([f"{len(out) - limit} more"] if len(out) > limit else [])


@contextlib.contextmanager
def hooks_as_compiled(structure: Structure) -> Iterator[None]:
    """Every module of ``structure`` with the forward hooks and pre-hooks it had when compiled, for the
    block (those added since are left out, those removed put back); the model's own after it."""
    now = {name: forward_hooks(m) for name, m in structure.modules.items()}
    try:
        for name, m in structure.modules.items():
            set_forward_hooks(m, structure.hooks[name])
        yield
    finally:
        for name, m in structure.modules.items():
            set_forward_hooks(m, now[name])


def _shown(name: str) -> str:
    return repr(name) if name else "the model itself"
