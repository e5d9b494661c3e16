"""Checks of a public argument's value where it enters, each refusal naming the argument, the value and the fix."""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
from typing import Any, Callable, TypeVar

from pipesplit.errors import PipesplitError, did_you_mean

F = TypeVar("F", bound=Callable[..., Any])


def number(name: str, value: Any, *, minimum: float = 0.0, above: bool = False, integer: bool = False,
           none: bool = False, error: type[PipesplitError] = PipesplitError, example: str = "") -> None:
    """``value`` is a finite number ``>= minimum`` (``> minimum`` with ``above``), a whole one with
    ``integer``; None passes where ``none`` allows it. ``name`` is how the user wrote the argument.

    >>> number("CommModel(bandwidth=...)", 0, above=True, example="25e9")
    Traceback (most recent call last):
    ...
    pipesplit.errors.PipesplitError: CommModel(bandwidth=...) must be a number > 0, got 0; e.g. 25e9.
    """
    if value is None and none:
        return
    kind = "a whole number" if integer else "a number"
    bound = f"{'>' if above else '>='} {minimum:g}"
    fix = f"; e.g. {example}." if example else "."
    ok_type = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, ok_type):
        raise error(f"{name} must be {kind} {bound}{' or None' if none else ''}, got {value!r} "
                    f"({type(value).__name__}){fix}")
    if not math.isfinite(value) or value < minimum or (above and value == minimum):
        raise error(f"{name} must be {kind} {bound}, got {value!r}{fix}")


def name_list(name: str, value: Any, *, error: type[PipesplitError] = PipesplitError) -> tuple[str, ...]:
    """Module or argument names as a tuple: a bare string is one name (never its characters);
    anything else must be an iterable of non-empty strings."""
    if isinstance(value, str):
        return (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise error(f"{name} takes a list of names, got {value!r} ({type(value).__name__}); "
                    f"e.g. {name}=['layers.2'].") from None
    bad = [v for v in items if not isinstance(v, str) or not v]
    if bad:
        raise error(f"{name} takes names (non-empty strings), got {bad[0]!r} in {list(items)!r}; "
                    "module names are written as in model.named_modules(), e.g. 'layers.2'.")
    return items


def path_arg(name: str, value: Any, *, error: type[PipesplitError] = PipesplitError, takes: str = "a path") -> str:
    """A file-system path argument as a string (a str or an os.PathLike); refused otherwise."""
    if isinstance(value, (str, os.PathLike)) and os.fspath(value):
        path = os.fspath(value)
        if isinstance(path, str):
            return path
    raise error(f"{name} takes {takes} (a str or os.PathLike), got {value!r} ({type(value).__name__}).")


def folder_target(name: str, path: str) -> None:
    """``path`` may become a folder: it is none yet or already a folder, and no file sits on the way to it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise PipesplitError(f"{name} {path!r} is an existing file, not a folder; pipesplit writes a folder there "
                             "and will not move or overwrite the file. Pass another path, or remove the file.")
    _no_file_above(name, path)


def file_target(name: str, path: str) -> None:
    """``path`` may be written as a file: it is not a folder, and no file sits on the way to it."""
    if os.path.isdir(path):
        raise PipesplitError(f"{name} {path!r} is a folder; pass the path of a file to write.")
    _no_file_above(name, path)


def _no_file_above(name: str, path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise PipesplitError(f"{name} {path!r} lies under {parent!r}, which is a file, not a folder; pass a path "
                             "under a folder.")
    if parent and not os.access(parent, os.W_OK):
        raise PipesplitError(f"{name} {path!r}: cannot write under {parent!r} (no permission); pass a path "
                             "under a folder you can write to.")


def known_keywords(fn: F) -> F:
    """``fn`` refuses a keyword it does not take by name, with the nearest ones it takes
    (Python's TypeError names neither the fix nor, through a wrapper, the right function).
    A class's ``__init__`` is named as the class."""
    accepted = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    owner = fn.__qualname__.rsplit(".", 2)[-2] if fn.__name__ == "__init__" else fn.__name__
    return keywords_of(owner, accepted)(fn)


def keywords_of(owner: str, accepted: list[str], *, extra: Callable[[], list[str]] | None = None) -> Callable[[F], F]:
    """A decorator refusing keywords outside ``accepted`` (and ``extra()``, computed on demand)."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            unknown = [k for k in kwargs if k not in accepted]
            if unknown:
                known = accepted + (extra() if extra else [])
                unknown = [k for k in unknown if k not in known]
            if unknown:
                k = unknown[0]
                hint = did_you_mean(k, known, n=2, sentence=True) or f" It takes {', '.join(sorted(known))}."
                raise PipesplitError(f"{owner}() got an unknown keyword {k}={kwargs[k]!r}.{hint}")
            return fn(*args, **kwargs)

        return checked  # type: ignore[return-value]

    return wrap
