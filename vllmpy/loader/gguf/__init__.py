"""GGUF checkpoints: an HF config, the file's metadata, and HF-named dequantized weights."""
from __future__ import annotations

__all__ = ["GGUFCheckpoint"]


def __getattr__(name: str):
    # The checkpoint reader imports torch; `loader.gguf.file` alone must not, so a tokenizer can be read from a
    # GGUF while torch imports (vllm-cli's start).
    if name == "GGUFCheckpoint":
        from vllmpy.loader.gguf.reader import GGUFCheckpoint
        return GGUFCheckpoint
    raise AttributeError(name)
