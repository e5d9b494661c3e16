"""Hugging Face models return a KV-cache object by default; capture them asking for none."""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from typing import Any, Iterator

from torch import nn

log = logging.getLogger(__name__)

_DEPTH = 3  # config.text_config.use_cache is two levels down; nothing real goes deeper than three


def configs_asking_for_cache(config: Any, path: str = "config", depth: int = 0) -> list[tuple[str, Any]]:
    """``(path, config)`` of ``config`` and the configs nested in it (Llava's ``text_config``) whose
    ``use_cache`` is on.

    >>> from types import SimpleNamespace as NS
    >>> [p for p, _ in configs_asking_for_cache(NS(use_cache=False, text_config=NS(use_cache=True)))]
    ['config.text_config']
    """
    if config is None or depth > _DEPTH:
        return []
    found = [(path, config)] if getattr(config, "use_cache", False) is True else []
    for name, value in sorted(vars(config).items()) if hasattr(config, "__dict__") else ():
        if name.startswith("_") or isinstance(value, (nn.Module, type)):
            continue
        if hasattr(value, "use_cache") or type(value).__name__.endswith("Config"):
            found += configs_asking_for_cache(value, f"{path}.{name}", depth + 1)
    return found


def _names_use_cache(model: nn.Module) -> bool | None:
    """Whether ``forward`` names ``use_cache``; None where its signature cannot be read."""
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None


def no_cache_kwargs(model: nn.Module, kwargs: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """``kwargs`` with ``use_cache=False`` added where ``forward`` names it and a config asks for a
    cache (and the caller did not choose); the reason goes into ``notes``."""
    asking = configs_asking_for_cache(getattr(model, "config", None))
    if not _names_use_cache(model) or "use_cache" in kwargs or not asking:
        return kwargs
    _note(notes, "called forward with use_cache=False", asking)
    return {**kwargs, "use_cache": False}


@contextmanager
def nested_cache_off(model: nn.Module, kwargs: dict[str, Any], notes: list[str]) -> Iterator[None]:
    """While capturing, ``use_cache`` off in the configs that ask for one when ``forward`` cannot be
    told (Llava's takes it only through ``**kwargs`` and reads ``config.text_config.use_cache``);
    every flag is put back afterwards, so the user's config is unchanged once ``compile`` returns."""
    asking = _submodule_configs(model)
    if _names_use_cache(model) is not False or "use_cache" in kwargs or not asking:
        yield
        return
    _note(notes, "captured with use_cache off", asking)
    try:
        for _, config in asking:
            config.use_cache = False
        yield
    finally:
        for _, config in asking:
            config.use_cache = True


def _submodule_configs(model: nn.Module) -> list[tuple[str, Any]]:
    """The configs asking for a cache of ``model`` and of every Hugging Face model inside it (a
    wrapper's ``self.lm = AutoModelForCausalLM...``, whose ``forward`` the wrapper calls without
    ``use_cache``), each once."""
    found: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        if name and not any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__):
            continue  # below the root only Hugging Face models: another config's use_cache means something else
        where = f"{name}.config" if name else "config"
        for path, config in configs_asking_for_cache(getattr(module, "config", None), where):
            found.setdefault(id(config), (path, config))
    return list(found.values())


def _note(notes: list[str], what: str, asking: list[tuple[str, Any]]) -> None:
    paths = ", ".join(f"{p}.use_cache" for p, _ in asking)
    notes.append(f"{what}: {paths} asks for a KV cache, an object that cannot cross a pipeline stage; "
                 "pass use_cache= in example_kwargs to choose yourself")
    log.debug("pipesplit: %s", notes[-1])  # the report prints prog.notes: logging it too said it twice
