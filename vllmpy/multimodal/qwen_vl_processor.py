"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL images at their own resolution (Qwen2VLImageProcessor): smart_resize
to sides that are whole merged patches (patch_size x merge_size pixels) with the pixel count inside
[min_pixels, max_pixels], one BICUBIC resize on the uint8 image, rescale and normalize, then the frame
repeated temporal_patch_size times inside each patch vector. The prompt's `<|image_pad|>` becomes one
`<|image_pad|>` per merged patch (t * h * w / merge_size^2), as the processor writes it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vllmpy.errors import UnsupportedCheckpointError
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
_MAX_ASPECT = 200  # the processor refuses images more elongated than this


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): each a multiple of `factor`, the area within [min_pixels, max_pixels], the aspect
    ratio kept as closely as rounding allows (Qwen2VLImageProcessor's rule, so token counts agree)."""
    if max(height, width) / min(height, width) > _MAX_ASPECT:
        raise ValueError(f"multi_modal_data: an image of {width}x{height} has an aspect ratio over {_MAX_ASPECT}; "
                         f"the model accepts at most {_MAX_ASPECT}:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenVLImageProcessor:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: int
    normalize: ImageProcessor

    @classmethod
    def from_dict(cls, config: dict) -> QwenVLImageProcessor:
        """min_pixels / max_pixels, or transformers 5's size.shortest_edge / size.longest_edge (pixel counts)."""
        processor_kind(config, ("Qwen2VLImageProcessor",))
        require_resize(config, "Qwen-VL (each side must be whole merged patches)")
        size = config.get("size") or {}
        lo = config.get("min_pixels", size.get("shortest_edge", 56 * 56))
        hi = config.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
        if not 0 < int(lo) <= int(hi):
            raise UnsupportedCheckpointError(f"preprocessor_config.json min_pixels {lo} must be > 0 and <= "
                                             f"max_pixels {hi}")
        return cls(patch_size=int(config.get("patch_size", 14)), merge_size=int(config.get("merge_size", 2)),
                   temporal_patch_size=int(config.get("temporal_patch_size", 2)), min_pixels=int(lo),
                   max_pixels=int(hi), resample=int(config.get("resample", Image.Resampling.BICUBIC)),
                   normalize=ImageProcessor.rescale_normalize(config, _CLIP_MEAN, _CLIP_STD))

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of patches (before merging) an image of this size becomes."""
        h, w = smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)
        return h // self.patch_size, w // self.patch_size

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[1, rows, cols, 3 * temporal_patch_size * patch^2] float32, patches in spatial (row-major)
        order; each vector is (channel, frame, y, x) as the Conv3d patch embedding reads it."""
        rows, cols = self.grid(*image.size)
        p, t = self.patch_size, self.temporal_patch_size
        pixels = self.normalize(to_rgb(image).resize((cols * p, rows * p), resample=self.resample))
        patches = pixels.reshape(3, rows, p, cols, p).transpose(1, 3, 0, 2, 4)  # rows, cols, C, y, x
        patches = np.broadcast_to(patches[:, :, :, None], (rows, cols, 3, t, p, p))
        return np.ascontiguousarray(patches.reshape(1, rows, cols, 3 * t * p * p), dtype=np.float32)


def merge_block_order(pixels: np.ndarray, merge: int) -> np.ndarray:
    """[t, rows, cols, D] -> [t * rows * cols, D] with each merge x merge block's patches adjacent, blocks
    row-major: the processor's flat `pixel_values` order, which the tower's patch merger reads."""
    t, rows, cols, dim = pixels.shape
    blocks = pixels.reshape(t, rows // merge, merge, cols // merge, merge, dim).transpose(0, 1, 3, 2, 4, 5)
    return blocks.reshape(-1, dim)


class QwenVLMultiModalProcessor(MultiModalProcessor):
    """The marker is `<|image_pad|>` (the chat template writes it between <|vision_start|> and
    <|vision_end|>); each image's run length depends on its size."""

    @classmethod
    def load_image_processor(cls, checkpoint_path: str, model: object) -> QwenVLImageProcessor:
        processor = QwenVLImageProcessor.from_dict(preprocessor_config(checkpoint_path))
        ours = (processor.patch_size, processor.merge_size, processor.temporal_patch_size)
        theirs = (model.patch_size, model.spatial_merge_size, model.temporal_patch_size)
        if ours != theirs:
            raise UnsupportedCheckpointError(
                f"preprocessor_config.json patch_size / merge_size / temporal_patch_size {ours} must equal the "
                f"vision_config's patch_size / spatial_merge_size / temporal_patch_size {theirs}")
        return processor

    def expansion(self, image: Image.Image) -> str:
        rows, cols = self.image_processor.grid(*image.size)
        return self.image_token * (rows * cols // self.image_processor.merge_size ** 2)
