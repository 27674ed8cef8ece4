"""What a request carries per image: its pixels, where its embeddings go in the prompt, its content hash."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass(frozen=True, eq=False)
class ImageFeature:
    """One image of a prompt. The scheduler reads the span and hash; only the runner reads the pixels."""

    pixel_values: np.ndarray  # what the family's encode_images takes per image, float32 ([3, H, W] mostly)
    offset: int  # prompt position of the first placeholder token
    length: int  # the span's tokens (= embedding rows the encoder produces, unless embed_mask says fewer)
    content_hash: str  # sha256 of the decoded image: the prefix cache's extra key for blocks it covers
    # Per span position, whether it takes an encoder row: None = all do. Idefics3's tile tags and Pixtral's
    # [IMG_BREAK] sit inside the span as text tokens (vLLM's is_embed).
    embed_mask: np.ndarray | None = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    def embedding_rows(self, lo: int, hi: int) -> tuple[np.ndarray, slice]:
        """For prompt positions [lo, hi) inside the span: the positions that take encoder rows, and which
        rows of the image's encoder output (in order) they take."""
        if self.embed_mask is None:
            return np.arange(lo, hi), slice(lo - self.offset, hi - self.offset)
        before = int(np.count_nonzero(self.embed_mask[:lo - self.offset]))
        positions = lo + np.flatnonzero(self.embed_mask[lo - self.offset:hi - self.offset])
        return positions, slice(before, before + len(positions))

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


def image_hash(image: Image.Image) -> str:
    """sha256 of mode, size and pixel bytes: equal images hit the prefix cache, any changed pixel misses
    (vLLM hashes the decoded image the same way, so two encodings of one picture share an entry)."""
    digest = hashlib.sha256(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def image_hashes(features: list[ImageFeature], start: int, end: int) -> tuple[str, ...]:
    """Hashes of the images whose spans overlap positions [start, end): a KV block's extra hash keys."""
    return tuple(f.content_hash for f in features if f.overlaps(start, end))
