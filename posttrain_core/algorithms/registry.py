"""Registries: name -> function, one signature per registry, so that a config names a piece of an algorithm.

Adding an advantage estimator, a policy loss, a KL estimator or an aggregation mode is one decorated function; the
update code only looks names up (docs/algorithms.md, "Adding an algorithm").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from posttrain_core.plugins import is_reference, load

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one kind by name: `@REG.register("name")` adds one, `REG["name"]` finds it.

    Args:
        kind: what the functions are ("advantage estimator", ...), for error messages.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register the function under `name` (a name may be taken once)."""

        def add(fn: F) -> F:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered ({self._items[name].__qualname__})")
            self._items[name] = fn
            return fn

        return add

    def __getitem__(self, name: str) -> F:
        """The function registered as `name`, or the user's function a reference names ("pkg.module:fn",
        "path/file.py:fn"; `plugins`)."""
        if is_reference(name):
            return load(name, self.kind)
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}, or your own function as "
                "'package.module:function' or 'path/to/file.py:function'"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._items))
