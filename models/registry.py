"""Name -> function registries for the estimators and losses that params.yaml selects by string."""
from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


class Registry:
    """A mapping from names to functions that share one signature.

    ``builtin`` declares, per module, the names that module registers when it is imported, so a name can be checked
    (``in``, ``names()``) before those modules and their torch are imported: params.yaml is validated that way
    (models/config.py). Looking a function up needs its module imported; tests/tasks/test_config.py checks that
    each module registers exactly the names declared for it.

    >>> SQUARES = Registry("square")
    >>> @SQUARES.register("plain")
    ... def plain(x): return x * x
    >>> SQUARES["plain"](3)
    9
    """

    def __init__(self, kind: str, builtin: dict[str, tuple[str, ...]] | None = None):
        self.kind = kind
        self.builtin: dict[str, str] = {name: module for module, names in (builtin or {}).items() for name in names}
        """Declared name -> the module that registers it."""
        self._entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator that registers a function under `name`; a name already taken raises ValueError."""

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by {self._entries[name].__qualname__}); "
                    f"pick another name. Registered: {', '.join(self.names())}"
                )
            self._entries[name] = fn
            return fn

        return decorator

    def unregister(self, name: str) -> Callable:
        """Remove and return ``name``'s function (tests that register a temporary entry clean up with it)."""
        return self._entries.pop(name)

    def __getitem__(self, name: str) -> Callable:
        try:
            return self._entries[name]
        except KeyError:
            if name in self.builtin:
                raise KeyError(f"{self.kind} {name!r} is registered by {self.builtin[name]}: import it before looking "
                               "the name up") from None
            raise KeyError(f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names()) or '(none)'}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self.builtin

    def names(self) -> list[str]:
        """Registered and declared names, sorted."""
        return sorted(self._entries.keys() | self.builtin.keys())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
