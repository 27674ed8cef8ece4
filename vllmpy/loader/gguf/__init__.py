"""GGUF checkpoints: an HF config, the file's metadata, and HF-named dequantized weights."""
from vllmpy.loader.gguf.reader import GGUFCheckpoint

__all__ = ["GGUFCheckpoint"]
