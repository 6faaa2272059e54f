"""One small registry pattern for everything a user may add by name: training algorithms,
accountants, per-unit strategies, noise mechanisms and samplers (Opacus' model: a name chosen in
a config or on the command line finds its implementation in one place).

A registry maps names to implementations. ``register`` adds one (refusing a name already taken
unless ``replace=True``); ``lookup`` returns one or raises a one-line :class:`~userdp.errors.UserError`
listing the names with a did-you-mean; ``names()`` is what the config schema's choices and the
CLI's ``choices`` read, so a plugin (``userdp.plugins``) that registers a name is accepted
everywhere without an edit to userdp.

A registry is a mutable mapping too (``REG[name] = obj``, ``REG.pop(name)``), so tests may add
and remove entries with ``monkeypatch.setitem``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Generic, TypeVar

from userdp.errors import UserError
from userdp.validation import close_names

T = TypeVar("T")


class Registry(MutableMapping[str, T], Generic[T]):
    """Names -> implementations of one ``kind`` (its config or CLI name, e.g. ``"accountant"``)."""

    def __init__(self, kind: str, items: dict[str, T] | None = None):
        self.kind = kind
        self._items: dict[str, T] = dict(items or {})

    # ------------------------------------------------------------------ registering
    def register(self, obj: T | None = None, *, name: str | None = None, replace: bool = False):
        """Register ``obj`` under ``name`` (default: its ``name`` attribute); usable as a decorator.

        Raises:
            UserError: the name is taken (and ``replace`` is False), or ``obj`` has no name."""

        def add(o: T) -> T:
            key = name if name is not None else getattr(o, "name", None)
            if not isinstance(key, str) or not key:
                raise UserError(f"a {self.kind} needs a non-empty string name to be registered, got {key!r}")
            if key in self._items and not replace and self._items[key] is not o:
                raise UserError(f"a {self.kind} named {key!r} is already registered")
            self._items[key] = o
            return o

        return add if obj is None else add(obj)

    # ------------------------------------------------------------------ looking up
    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order."""
        return tuple(self._items)

    def lookup(self, name) -> T:
        """The implementation called ``name``.

        Raises:
            UserError: no such name: one line listing the registered ones, with a did-you-mean."""
        if isinstance(name, str) and name in self._items:
            return self._items[name]
        raise UserError(f"{self.kind} must be one of {', '.join(self._items)}{self.hint(name)} (got {name!r})")

    def hint(self, name) -> str:
        close = close_names(name, self._items)
        return f"; did you mean {' or '.join(close)}?" if close else ""

    def choices(self, *extra: str) -> Callable[[], tuple[str, ...]]:
        """A zero-argument callable giving ``extra`` + the names at the time it is called."""
        return lambda: (*extra, *self._items)

    # ------------------------------------------------------------------ the mapping
    def __getitem__(self, name: str) -> T:
        return self._items[name]

    def __setitem__(self, name: str, obj: T) -> None:
        self._items[name] = obj

    def __delitem__(self, name: str) -> None:
        del self._items[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._items)})"
