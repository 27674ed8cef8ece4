"""Placeholder expansion: each image's marker in the prompt becomes the run of placeholder tokens the
encoder's output replaces, as the checkpoint's own processor writes it (text is expanded before it is
tokenized, so token ids equal transformers'; a token-id prompt has each marker id replaced)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllmpy.multimodal.inputs import ImageFeature


@dataclass(frozen=True)
class PlaceholderLayout:
    """A family's placeholder text: `marker` (what prompts and chat templates write per image) becomes
    `expansion`, which holds `tokens_per_image` copies of the token `image_token_id`. `chat_marker`: what a
    chat template given string content gets per image when it differs from the marker (vLLM's placeholder
    string: Qwen-VL wraps its `<|image_pad|>` in `<|vision_start|>` / `<|vision_end|>`)."""

    marker: str
    expansion: str
    image_token_id: int
    tokens_per_image: int
    chat_marker: str | None = None


def expand_text(prompt: str, layout: PlaceholderLayout, expansions: list[str], field: str) -> str:
    """The prompt with its i-th marker replaced by expansions[i]; refuses a marker count that differs."""
    pieces = prompt.split(layout.marker)
    if len(pieces) - 1 != len(expansions):
        raise ValueError(f"{field}: the prompt has {len(pieces) - 1} image placeholder(s) {layout.marker!r} but "
                         f"{len(expansions)} image(s) were given; write one {layout.marker!r} per image")
    return pieces[0] + "".join(e + piece for e, piece in zip(expansions, pieces[1:]))


def expand_token_ids(token_ids: list[int], layout: PlaceholderLayout, marker_id: int,
                     expansions: list[list[int]], field: str) -> list[int]:
    """The token-id prompt with the i-th `marker_id` replaced by expansions[i]."""
    found = token_ids.count(marker_id)
    if found != len(expansions):
        raise ValueError(f"{field}: the prompt has {found} image placeholder token(s) {layout.marker!r} "
                         f"(id {marker_id}) but {len(expansions)} image(s) were given")
    out: list[int] = []
    pending = iter(expansions)
    for token in token_ids:
        out.extend(next(pending) if token == marker_id else [token])
    return out


def image_features(token_ids: list[int], layout: PlaceholderLayout, pixels: list[np.ndarray],
                   num_embeds: list[int], hashes: list[str], field: str) -> list[ImageFeature]:
    """One feature per image, in prompt order: image i takes the next num_embeds[i] image tokens; its span
    runs from the first to the last of them, and any other tokens inside (tile tags, row breaks) get an
    embed mask. The prompt must hold exactly the images' image tokens."""
    ids = np.asarray(token_ids)
    where = np.flatnonzero(ids == layout.image_token_id)
    if len(where) != sum(num_embeds):
        raise ValueError(f"{field}: the prompt has {len(where)} image tokens (id {layout.image_token_id}) but the "
                         f"{len(pixels)} image(s) given take {num_embeds}; do not write the image token "
                         f"yourself, write {layout.marker!r} once per image")
    features = []
    first = 0
    for p, n, h in zip(pixels, num_embeds, hashes):
        offset, end = int(where[first]), int(where[first + n - 1]) + 1
        mask = ids[offset:end] == layout.image_token_id
        features.append(ImageFeature(p, offset, end - offset, h, None if mask.all() else mask))
        first += n
    return features
