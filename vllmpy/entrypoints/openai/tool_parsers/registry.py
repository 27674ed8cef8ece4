"""Name → parser class, filled by a decorator in each parser's own module, so adding a parser is one file.

Shared by the tool-call and reasoning parser packages: both look parsers up by a CLI flag's value.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, package: str) -> None:
        self.kind = kind  # "tool call parser", named in errors
        self._package = package
        self._classes: dict[str, type[T]] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def add(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._classes[name] = cls
            return cls
        return add

    def names(self) -> list[str]:
        self._load_all()
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as `name`; ValueError lists the valid names otherwise."""
        self._load_all()
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of: {', '.join(self.names())}")
        return self._classes[name]

    def _load_all(self) -> None:
        """Import every module of the package once; their decorators fill the table."""
        if self._loaded:
            return
        package = importlib.import_module(self._package)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self._package}.{module.name}")
        self._loaded = True
