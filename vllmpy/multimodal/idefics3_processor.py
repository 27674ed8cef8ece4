"""Idefics3 / SmolVLM images: resize the longest edge to `size`, round both sides up to whole tiles of
`max_image_size`, cut the grid of tiles row by row and add the whole image shrunk to one tile (the
global image). Each tile is encoded on its own; the prompt gets, per tile, `<fake_token_around_image>`
`<row_r_col_c>` and its image tokens, then the global image's `<global-img>` run, as Idefics3Processor
writes it. The resizes run on the uint8 image in the order transformers' PIL backend runs them, so pixel
values are bit-identical.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vllmpy.multimodal.image_processor import (
    ImageProcessor,
    preprocessor_config,
    processor_kind,
    require_resize,
    to_rgb,
)
from vllmpy.multimodal.processor import MultiModalProcessor

_FAKE, _GLOBAL = "<fake_token_around_image>", "<global-img>"
_MAX_SIDE = 4096  # transformers' absolute cap on the resized image
# Per processor type: (size, max_image_size) longest edges when the config leaves them out.
_DEFAULTS = {"Idefics3ImageProcessor": (4 * 364, 364), "SmolVLMImageProcessor": (4 * 364, 364)}


@dataclass(frozen=True)
class TileSplitter:
    longest_edge: int  # size.longest_edge: the first resize
    tile: int  # max_image_size.longest_edge: each tile's side (and the global image's)
    split: bool  # do_image_splitting
    resample: int
    normalize: ImageProcessor  # rescale + normalize only (do_resize off)

    @classmethod
    def from_dict(cls, config: dict) -> TileSplitter:
        size, tile = _DEFAULTS[processor_kind(config, _DEFAULTS)]
        require_resize(config, "Idefics3 (tiles are cut from the resized image)")
        resample = int(config.get("resample", Image.Resampling.LANCZOS))
        normalize = ImageProcessor.rescale_normalize(config)
        return cls(longest_edge=int((config.get("size") or {}).get("longest_edge", size)),
                   tile=int((config.get("max_image_size") or {}).get("longest_edge", tile)),
                   split=config.get("do_image_splitting") is not False, resample=resample, normalize=normalize)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of this size; (0, 0): the image is one tile, no global copy."""
        return self._plan(width, height)[2:]

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[tiles, 3, tile, tile] float32: the grid's tiles row by row, then the global image."""
        first, second, rows, cols = self._plan(*image.size)
        image = to_rgb(image).resize(first, resample=self.resample).resize(second, resample=self.resample)
        t = self.tile
        tiles = [image.crop((c * t, r * t, c * t + t, r * t + t)) for r in range(rows) for c in range(cols)]
        tiles.append(image.resize((t, t), resample=self.resample) if tiles else image)
        return np.stack([self.normalize(tile) for tile in tiles])

    def _plan(self, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int], int, int]:
        """(first resize, second resize) as (width, height), then (rows, cols)."""
        first = _fit_longest(width, height, self.longest_edge)
        if not self.split:
            return first, (self.tile, self.tile), 0, 0
        w, h = second = _whole_tiles(*first, self.tile)
        if h <= self.tile and w <= self.tile:
            return first, second, 0, 0
        return first, second, (h - self.tile) // self.tile + 1, (w - self.tile) // self.tile + 1


def _fit_longest(width: int, height: int, longest: int) -> tuple[int, int]:
    """The longest side becomes `longest` (up or down), the other follows the aspect ratio rounded up to
    even, then both are capped at 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        width, height = int(longest * aspect), longest
        width += width % 2
    width, height = max(width, 1), max(height, 1)
    aspect = width / height
    if width >= height and width > _MAX_SIDE:
        width, height = _MAX_SIDE, int(_MAX_SIDE / aspect)
    elif height > width and height > _MAX_SIDE:
        width, height = int(_MAX_SIDE * aspect), _MAX_SIDE
    return max(width, 1), max(height, 1)


def _whole_tiles(width: int, height: int, tile: int) -> tuple[int, int]:
    """Both sides rounded up to whole tiles, the shorter one from the aspect ratio first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return width, height


class Idefics3MultiModalProcessor(MultiModalProcessor):
    """The marker is `<image>` itself; each image's expansion depends on its tile grid."""

    @classmethod
    def load_image_processor(cls, checkpoint_path: str, model: object) -> TileSplitter:
        return TileSplitter.from_dict(preprocessor_config(checkpoint_path))

    def expansion(self, image: Image.Image) -> str:
        rows, cols = self.image_processor.grid(*image.size)
        run = self.image_token * self.layout.tokens_per_image
        single = f"{_FAKE}{_GLOBAL}{run}{_FAKE}"
        if rows == 0:
            return single
        grid = "".join("".join(f"{_FAKE}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{single}"
