"""Every llama.cpp architecture we read, by `general.architecture`."""
from __future__ import annotations

from typing import Any

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.archs import ARCHS, ArchSpec
from vllmpy.loader.gguf.recurrent_archs import RECURRENT_ARCHS

ALL_ARCHS: dict[str, ArchSpec] = {**ARCHS, **RECURRENT_ARCHS}


def arch_spec(arch: Any) -> ArchSpec:
    if arch is None:
        raise UnsupportedCheckpointError("GGUF metadata key 'general.architecture' is required but missing")
    if arch not in ALL_ARCHS:
        raise UnsupportedCheckpointError(
            f"GGUF architecture {arch!r} (general.architecture) is not supported; "
            f"supported: {', '.join(sorted(ALL_ARCHS))}")
    return ALL_ARCHS[arch]
