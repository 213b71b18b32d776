"""A tiny name -> function registry shared by advantages, losses and KL estimators."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from novarl.errors import ConfigError

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str, config_key: str) -> None:
        self.kind = kind
        self.config_key = config_key
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            self._items[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        if name not in self._items:
            raise ConfigError(f"{self.config_key}='{name}' is not a known {self.kind}; "
                              f"known: {', '.join(sorted(self._items))}.")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)
