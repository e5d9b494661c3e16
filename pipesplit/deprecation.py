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
import warnings
from typing import Any, Callable, TypeVar, cast

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
