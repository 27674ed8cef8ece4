"""GGUF key/values as python values, and typed access to one architecture's `{arch}.*` keys.

Every lookup that fails raises `UnsupportedCheckpointError` naming the key, so a file missing a
hyperparameter is refused at open rather than producing a model with a guessed shape.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllmpy.errors import UnsupportedCheckpointError

_MISSING: Any = object()


class ArchMetadata:
    """Typed reads of `{arch}.<suffix>` keys (and of global keys by full name)."""

    def __init__(self, metadata: Mapping[str, Any], arch: str) -> None:
        self.metadata = metadata
        self.arch = arch

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def has(self, suffix: str) -> bool:
        return self.key(suffix) in self.metadata

    def with_prefix(self, prefix: str) -> dict[str, Any]:
        """The `{arch}.<prefix>*` keys, by the rest of their name (only those values are read: the others may
        be long arrays the file's metadata decodes on first read)."""
        full = self.key(prefix)
        return {k[len(full):]: self.metadata[k] for k in self.metadata if k.startswith(full)}

    def integer(self, suffix: str, default: Any = _MISSING) -> Any:
        return self._typed(self.key(suffix), default, (int,), "an integer")

    def number(self, suffix: str, default: Any = _MISSING) -> Any:
        value = self._typed(self.key(suffix), default, (int, float), "a number")
        return float(value) if value is not default else value

    def global_integer(self, key: str, default: Any = _MISSING) -> Any:
        return self._typed(key, default, (int,), "an integer")

    def raw(self, suffix: str, default: Any = None) -> Any:
        return self.metadata.get(self.key(suffix), default)

    def _typed(self, key: str, default: Any, types: tuple[type, ...], what: str) -> Any:
        if key not in self.metadata:
            if default is _MISSING:
                raise UnsupportedCheckpointError(f"GGUF metadata key {key!r} is required but missing")
            return default
        value = self.metadata[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise UnsupportedCheckpointError(f"GGUF metadata key {key!r} must be {what}, got {value!r}")
        return value
