"""An optimizer's state under the original model's parameter names, flat, for a checkpoint.

The keys are those of torch's flattened optimizer state dict (``StateDictOptions(
flatten_optimizer_state_dict=True)``): ``state.<name>.<key>`` (nested dicts joined with dots) and
``param_groups.<name>.<key>``, so a pipeline of another layout finds its parameters' share by name.

pipesplit reads and writes them itself rather than through torch's ``get_optimizer_state_dict`` /
``set_optimizer_state_dict``, which (torch 2.10-2.15) initialise an optimizer without state by
stepping it with a zero learning rate (AdamW's ``step`` becomes 1, SGD's momentum takes the weight
decay), skip frozen parameters, load nothing when any parameter has a gradient, and fail on an
empty parameter group. Here saving never changes the optimizer, and loading gives each parameter
exactly the state the checkpoint holds for it (none where it held none, as a parameter not yet
stepped has none).
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Mapping

import torch

from pipesplit.errors import InputError

STATE, GROUPS = "state", "param_groups"


def parameter_names(optimizer: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The name of each parameter of ``optimizer``, in its ``state_dict`` order (group by group)."""
    by_id = {id(p): name for name, p in named}
    names, foreign = [], []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in by_id:
                names.append(by_id[id(p)])
            else:
                foreign.append(f"group {g}: {tuple(p.shape)}")
    if foreign:
        raise InputError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not this pipeline's ({', '.join(foreign[:5])}): "
            "a checkpoint names each parameter by the model's name, and these have none. Build the optimizer on "
            "pipe.parameters() (a rank's own share under torchrun), and keep other tensors (a loss function's own "
            "parameters) in an optimizer of their own, saved with torch.save."
        )
    return names


def _flatten(prefix: str, tree: Mapping[str, Any], out: dict[str, Any]) -> None:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _flatten(f"{prefix}.{key}", value, out)
        elif isinstance(value, (list, tuple, set)):  # a dict would come back where the optimizer kept a list
            raise InputError(
                f"save: optimizer state {prefix}.{key} is a {type(value).__name__}; a checkpoint holds tensors, numbers "
                "and dicts of them per parameter (as torch's flattened optimizer state does). Keep that state as "
                "tensors, or save this optimizer with torch.save."
            )
        else:
            out[f"{prefix}.{key}"] = value


_NOT_HYPER = ("params", "param_names")  # a group's members, not its settings: each layout has its own


def flat_state(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, Any]:
    """The optimizer's state and hyperparameters keyed by parameter name; the optimizer is not changed."""
    sd = optimizer.state_dict()  # state keyed by position, in names' order
    out: dict[str, Any] = {}
    position = 0
    for group in sd[GROUPS]:
        for index in group["params"]:
            name = names[position]
            position += 1
            for key, value in group.items():
                if key not in _NOT_HYPER:
                    out[f"{GROUPS}.{name}.{key}"] = value
            if index in sd[STATE]:
                _flatten(f"{STATE}.{name}", sd[STATE][index], out)
    return out


def by_name(keys: Iterable[str], names: Collection[str], prefix: str = "") -> dict[str, tuple[str, str, str]]:
    """Each key ``<prefix><state|param_groups>.<name>.<rest>`` whose name is one of ``names`` (names hold
    dots too: the longest that matches) -> (kind, name, rest); one pass over the keys."""
    out = {}
    for key in keys:
        if not key.startswith(prefix):
            continue
        kind, _, tail = key[len(prefix):].partition(".")
        if kind not in (STATE, GROUPS):
            continue
        parts = tail.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            name = ".".join(parts[:cut])
            if name in names:
                out[key] = (kind, name, ".".join(parts[cut:]))
                break
    return out


def wanted(names: list[str], saved: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """The checkpoint's entries (``saved``: full key -> storage metadata) for ``names``, with values to
    load them into: an empty tensor of the saved size and dtype, or a placeholder for a Python value."""
    out: dict[str, Any] = {}
    for key in by_name(saved, set(names), prefix):
        meta = saved[key]
        size, props = getattr(meta, "size", None), getattr(meta, "properties", None)
        if size is not None and props is not None:
            out[key[len(prefix):]] = torch.empty(tuple(size), dtype=props.dtype)
        else:  # a Python value (a step count, a learning rate), saved as bytes
            out[key[len(prefix):]] = 0
    return out


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def load_flat_state(optimizer: torch.optim.Optimizer, names: list[str], flat: Mapping[str, Any]) -> None:
    """Give ``optimizer`` the state ``flat`` holds for each of its parameters (a parameter it holds
    none for starts without state) and each group the hyperparameters saved for its parameters, which
    must agree within the group (a checkpoint that grouped them otherwise, with other settings, is
    refused: which setting was meant is not known)."""
    sd = optimizer.state_dict()
    index = by_name(flat, set(names))
    mine: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, (kind, name, rest) in index.items():
        (mine if kind == STATE else hyper).setdefault(name, {})[rest] = flat[key]
    state: dict[int, Any] = {}
    position = 0
    for g, group in enumerate(sd[GROUPS]):
        settings: dict[str, tuple[str, Any]] = {}  # key -> (the first parameter that set it, value)
        for idx in group["params"]:
            name = names[position]
            position += 1
            if name in mine:
                state[idx] = _nest(mine[name])
            for key, value in hyper.get(name, {}).items():
                if key in _NOT_HYPER:
                    continue
                first = settings.setdefault(key, (name, value))
                if not _same(first[1], value):
                    raise InputError(
                        f"load: the checkpoint holds {key}={first[1]!r} for {first[0]!r} and {key}={value!r} for "
                        f"{name!r}, which this optimizer's group {g} holds together: it was saved with other "
                        "parameter groups. Build the optimizer's groups as they were saved, or load without the "
                        "optimizer and set its state yourself."
                    )
        group.update({key: value for key, (_, value) in settings.items()})  # an LR scheduler's initial_lr too
    optimizer.load_state_dict({STATE: state, GROUPS: sd[GROUPS]})
