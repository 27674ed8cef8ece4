"""Pixtral / Mistral 3 images at their own resolution: shrink to fit `size.longest_edge` (floor), round
each side up to whole merged patches (patch_size x spatial_merge_size pixels, from the model), resize
once on the uint8 image, rescale and normalize. The prompt gets one `[IMG]` per merged patch, row by row,
each row closed by `[IMG_BREAK]` and the last by `[IMG_END]`, as PixtralProcessor writes it."""
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

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BREAK, _END = "[IMG_BREAK]", "[IMG_END]"


@dataclass(frozen=True)
class PatchAlignedResize:
    longest_edge: int
    unit: int  # pixels per merged patch: each side becomes a multiple of it
    resample: int
    normalize: ImageProcessor

    @classmethod
    def from_dict(cls, config: dict, unit: int) -> PatchAlignedResize:
        processor_kind(config, ("PixtralImageProcessor",))
        require_resize(config, "Pixtral (each side must be whole patches)")
        size = config.get("size") or {}
        longest = size.get("longest_edge", max(size.get("height", 1024), size.get("width", 1024)))
        return cls(longest_edge=int(longest), unit=unit,
                   resample=int(config.get("resample", Image.Resampling.BICUBIC)),
                   normalize=ImageProcessor.rescale_normalize(config, _CLIP_MEAN, _CLIP_STD))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of merged patches an image of this size becomes."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        return (height - 1) // self.unit + 1, (width - 1) // self.unit + 1

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[3, rows * unit, cols * unit] float32."""
        rows, cols = self.grid(*image.size)
        image = to_rgb(image).resize((cols * self.unit, rows * self.unit), resample=self.resample)
        return self.normalize(image)


class PixtralMultiModalProcessor(MultiModalProcessor):
    """The marker is `[IMG]` itself; each image's expansion depends on its patch grid."""

    @classmethod
    def load_image_processor(cls, checkpoint_path: str, model: object) -> PatchAlignedResize:
        return PatchAlignedResize.from_dict(preprocessor_config(checkpoint_path),
                                            model.patch_size * model.spatial_merge_size)

    def expansion(self, image: Image.Image) -> str:
        rows, cols = self.image_processor.grid(*image.size)
        return (self.image_token * cols + _BREAK) * (rows - 1) + self.image_token * cols + _END
