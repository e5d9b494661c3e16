"""Old names that keep working for a while, each with a DeprecationWarning that says the new one.

Counts are ``num_*`` across the API (``num_stages``, ``num_microbatches``, ``num_ranks``), as
``compile(..., num_stages=...)`` always had them; the ``n_*`` spellings earlier releases took
are still accepted until 0.3.

>>> import warnings
>>> @renamed_keywords(n_items="num_items")
... def count(*, num_items: int) -> int:
...     return num_items
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     count(n_items=3), str(caught[0].message)
(3, 'count(n_items=...) is deprecated; call it num_items=.')
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Sequence, TypeVar, cast

F = TypeVar("F", bound=Callable[..., Any])

NUM_RENAMES = {"n_stages": "num_stages", "n_ranks": "num_ranks", "n_microbatches": "num_microbatches"}
"""The counts renamed to ``num_*``: old keyword -> new keyword."""


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Accept each old keyword (``old="new"``) as its new name, with a DeprecationWarning; passing
    both is a TypeError, as passing any keyword twice is."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            used = [(old, renames[old]) for old in kwargs if old in renames]  # in the caller's order
            if used:
                name = fn.__qualname__.replace(".__init__", "")
                for old, new in used:
                    if new in kwargs:
                        raise TypeError(f"{name}() got both {old}= and {new}=; {old} is the old name of {new}: "
                                        f"pass {new}= only.")
                    kwargs[new] = kwargs.pop(old)
                olds = ", ".join(f"{old}=..." for old, _ in used)
                news = ", ".join(f"{new}=" for _, new in used)
                warnings.warn(f"{name}({olds}) is deprecated; call it {news}.", DeprecationWarning, stacklevel=2)
            return fn(*args, **kwargs)

        return cast(F, inner)

    return wrap


def num_keywords(fn: F) -> F:
    """:func:`renamed_keywords` for the ``n_*`` counts of :data:`NUM_RENAMES` that ``fn`` takes."""
    import inspect

    params = inspect.signature(fn).parameters
    return renamed_keywords(**{old: new for old, new in NUM_RENAMES.items() if new in params})(fn)


def renamed_attribute(old: str, new: str) -> Any:
    """A read-only property ``old`` that warns and returns ``self.<new>``."""

    def get(self: Any) -> Any:
        warnings.warn(f"{type(self).__name__}.{old} is deprecated; read .{new}.", DeprecationWarning, stacklevel=2)
        return getattr(self, new)

    return property(get, doc=f"Deprecated name of :attr:`{new}`.")


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports each old module path as the module now at its new path (see :func:`moved_modules`)."""

    def __init__(self, moves: dict[str, str]):
        self.moves = dict(moves)
        self.specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.moves else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = self.moves[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path works until 0.3).",
                      DeprecationWarning, stacklevel=2)  # the import machinery's frames are skipped
        module = importlib.import_module(new)
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the alias's spec on the module: give it back its own
        module.__spec__ = self.specs.pop(cast(Any, module.__spec__).name)


def moved_modules(moves: dict[str, str]) -> None:
    """Keep each old module path (a key of ``moves``) importable as the module now at its new path
    (its value), with a DeprecationWarning naming the new path, once per process. The old path
    gives the very module object, so a name read, patched or pickled through either is the same;
    nothing is left at the old path on disk.

    >>> import sys, warnings
    >>> moved_modules({"pipesplit.old_units_doctest": "pipesplit.units"})
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     import pipesplit.old_units_doctest as old
    >>> old is sys.modules["pipesplit.units"], old.__name__, str(caught[0].message)[:53]
    (True, 'pipesplit.units', 'pipesplit.old_units_doctest moved to pipesplit.units;')
    """
    sys.meta_path.append(_MovedModules(moves))
