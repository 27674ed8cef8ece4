"""The checkpoint's image preprocessing from preprocessor_config.json, in Pillow and numpy (transformers is
only the tests' oracle): convert to RGB, resize, [center crop], rescale, normalize -> [3, H, W] float32.

The steps and their dtypes follow transformers' PIL backend so pixel values are bit-identical: resize on
the uint8 image, rescale in float64 then cast to float32, normalize in float32.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vllmpy.errors import UnsupportedCheckpointError

_IMAGENET_STANDARD = (0.5, 0.5, 0.5)
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Per processor type: (resample, mean, std, default size) when the config leaves them out.
_DEFAULTS = {
    "Gemma3ImageProcessor": (Image.Resampling.BILINEAR, _IMAGENET_STANDARD, _IMAGENET_STANDARD,
                             {"height": 224, "width": 224}),
    "SiglipImageProcessor": (Image.Resampling.BICUBIC, _IMAGENET_STANDARD, _IMAGENET_STANDARD,
                             {"height": 224, "width": 224}),
    "CLIPImageProcessor": (Image.Resampling.BICUBIC, _CLIP_MEAN, _CLIP_STD, {"shortest_edge": 224}),
}


@dataclass(frozen=True)
class ImageProcessor:
    size: dict  # {"height", "width"}: resize to that; {"shortest_edge"}: keep the aspect ratio
    resample: int
    rescale_factor: float
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    crop_size: dict | None = None  # {"height", "width"} when the processor center-crops (CLIP)

    @classmethod
    def from_pretrained(cls, path: str) -> ImageProcessor:
        return cls.from_dict(preprocessor_config(path))

    @classmethod
    def from_dict(cls, config: dict) -> ImageProcessor:
        """Refuses a processor type or option it does not implement, naming the key."""
        kind = processor_kind(config, _DEFAULTS)
        if config.get("do_pan_and_scan"):
            raise UnsupportedCheckpointError("preprocessor_config.json do_pan_and_scan=true is not supported; "
                                             "set it to false (each image is then one 896x896 view)")
        resample, mean, std, size = _DEFAULTS[kind]
        crop = config.get("crop_size") if config.get("do_center_crop", kind == "CLIPImageProcessor") else None
        return cls(size=_size(config.get("size") or size), resample=int(config.get("resample", resample)),
                   rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                   image_mean=_per_channel(config.get("image_mean", mean)),
                   image_std=_per_channel(config.get("image_std", std)),
                   do_resize=config.get("do_resize") is not False, do_rescale=config.get("do_rescale") is not False,
                   do_normalize=config.get("do_normalize") is not False,
                   do_convert_rgb=config.get("do_convert_rgb") is not False,
                   crop_size=_size(crop) if crop else None)

    @classmethod
    def rescale_normalize(cls, config: dict, mean: tuple[float, ...] = _IMAGENET_STANDARD,
                          std: tuple[float, ...] = _IMAGENET_STANDARD) -> ImageProcessor:
        """Only the config's rescale and normalize steps, for a family that resizes (tiles, patch-aligned
        sizes) itself and calls this on each resized RGB image."""
        return cls(size={}, resample=0, rescale_factor=float(config.get("rescale_factor", 1 / 255)),
                   image_mean=_per_channel(config.get("image_mean", mean)),
                   image_std=_per_channel(config.get("image_std", std)), do_resize=False,
                   do_rescale=config.get("do_rescale") is not False,
                   do_normalize=config.get("do_normalize") is not False, do_convert_rgb=False)

    def __call__(self, image: Image.Image) -> np.ndarray:
        image = to_rgb(image) if self.do_convert_rgb else image
        if self.do_resize:
            image = image.resize(self._target_size(*image.size), resample=self.resample)
        pixels = np.asarray(image)
        pixels = pixels[:, :, None] if pixels.ndim == 2 else pixels
        if self.crop_size is not None:
            pixels = _center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            pixels = pixels.astype(np.float32, copy=False)
            pixels = (pixels - np.array(self.image_mean, np.float32)) / np.array(self.image_std, np.float32)
        return np.ascontiguousarray(pixels.transpose(2, 0, 1), dtype=np.float32)

    def _target_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) for PIL's resize."""
        if "shortest_edge" in self.size:
            edge = self.size["shortest_edge"]
            short, long = (width, height) if width <= height else (height, width)
            long = int(edge * long / short)
            return (edge, long) if width <= height else (long, edge)
        return self.size["width"], self.size["height"]


def processor_kind(config: dict, supported) -> str:
    """The config's image_processor_type without its backend suffix (Fast / Pil); refused unless supported."""
    kind = str(config.get("image_processor_type", "")).removesuffix("Fast").removesuffix("Pil")
    if kind not in supported:
        raise UnsupportedCheckpointError(
            f"preprocessor_config.json image_processor_type {config.get('image_processor_type')!r} is not "
            f"supported by this model; supported: {', '.join(sorted(supported))}")
    return kind


def require_resize(config: dict, family: str) -> None:
    if config.get("do_resize") is False:
        raise UnsupportedCheckpointError(f"preprocessor_config.json do_resize=false is not supported for {family}; "
                                         f"set it to true")


def preprocessor_config(path: str) -> dict:
    """preprocessor_config.json, or the "image_processor" entry of processor_config.json (transformers 5)."""
    file = os.path.join(path, "preprocessor_config.json")
    if os.path.exists(file):
        with open(file) as f:
            return json.load(f)
    file = os.path.join(path, "processor_config.json")
    if os.path.exists(file):
        with open(file) as f:
            nested = json.load(f).get("image_processor")
        if isinstance(nested, dict):
            return nested
    raise UnsupportedCheckpointError(f"{path}: no preprocessor_config.json (nor an image_processor entry in "
                                     f"processor_config.json), so images cannot be preprocessed as the "
                                     f"checkpoint expects")


def to_rgb(image: Image.Image) -> Image.Image:
    """Transparent pixels over white (transformers' convert_to_rgb), everything else converted."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' center_crop on an image at least the crop's size (the resize made it so)."""
    h, w = pixels.shape[:2]
    if h < height or w < width:
        raise ValueError(f"image {w}x{h} is smaller than the crop {width}x{height}")
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[top:top + height, left:left + width]


def _size(size: dict | int) -> dict:
    if isinstance(size, int):
        return {"height": size, "width": size}
    if "height" in size and "width" in size:
        return {"height": int(size["height"]), "width": int(size["width"])}
    if "shortest_edge" in size:
        return {"shortest_edge": int(size["shortest_edge"])}
    raise UnsupportedCheckpointError(f"preprocessor_config.json size {size!r} is not supported; give height and "
                                     f"width, or shortest_edge")


def _per_channel(value: float | list[float]) -> tuple[float, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3
