"""A prompt with images -> prompt token ids with each image's placeholder run, and one ImageFeature per
image (pixels, span, content hash). Built once per engine for a model that takes images."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from vllmpy.multimodal.image_processor import ImageProcessor
from vllmpy.multimodal.inputs import ImageFeature, image_hash
from vllmpy.multimodal.placeholders import PlaceholderLayout, expand_text, expand_token_ids, image_features
from vllmpy.tokenizer import Tokenizer


class MultiModalProcessor:
    def __init__(self, layout: PlaceholderLayout, image_processor: ImageProcessor, tokenizer: Tokenizer,
                 limits: dict[str, int]) -> None:
        self.layout = layout
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.limits = limits
        marker = tokenizer.encode(layout.marker, add_special_tokens=False)
        self.marker_id = marker[0] if len(marker) == 1 else None  # a token-id prompt's marker, when one token
        self.image_token = tokenizer.id_to_token(layout.image_token_id)

    @classmethod
    def for_model(cls, model, checkpoint_path: str, tokenizer: Tokenizer,
                  limits: dict[str, int]) -> MultiModalProcessor | None:
        """None for a text-only model; else refuses a checkpoint without a usable preprocessor config."""
        if not hasattr(model, "encode_images"):
            return None
        family = getattr(model, "mm_processor_class", cls)  # a family whose placeholders depend on the image
        return family(model.placeholder_layout(tokenizer.id_to_token),
                      family.load_image_processor(checkpoint_path, model), tokenizer, limits)

    @classmethod
    def load_image_processor(cls, checkpoint_path: str, model: object):
        """The checkpoint's preprocessing (a family that needs the model's patch geometry reads it)."""
        return ImageProcessor.from_pretrained(checkpoint_path)

    def expansion(self, image: Image.Image) -> str:
        """The text one image's marker becomes (a family whose layout depends on the image size overrides)."""
        return self.layout.expansion

    def pixels(self, image: Image.Image) -> np.ndarray:
        """What the model's encode_images takes for one image."""
        return self.image_processor(image)

    def expand_prompt(self, text: str, images: list[Image.Image], field: str) -> str:
        """A rendered chat prompt with each image marker expanded (tokenize it as the route does)."""
        return expand_text(text, self.layout, [self.expansion(image) for image in images], field)

    def check_count(self, count: int, field: str) -> None:
        limit = self.limits.get("image")
        if limit is not None and count > limit:
            raise ValueError(f"{field}: {count} images exceed the limit of {limit} per prompt "
                             f"(--limit-mm-per-prompt '{{\"image\": {limit}}}')")

    def process(self, prompt: dict,
                field: str = "multi_modal_data") -> tuple[str | None, list[int], list[ImageFeature]]:
        """vLLM's prompt dict: "prompt" text (markers expanded, then tokenized as a plain prompt) or
        "prompt_token_ids" (marker ids expanded, or image runs already expanded), and "multi_modal_data"."""
        images = _images(prompt["multi_modal_data"], field)
        self.check_count(len(images), field)
        pixels = [self.pixels(image) for image in images]
        expansions = [self.expansion(image) for image in images]
        hashes = [image_hash(image) for image in images]
        text = prompt.get("prompt")
        if "prompt_token_ids" in prompt:
            token_ids = list(prompt["prompt_token_ids"])
            if self.layout.image_token_id not in token_ids:
                if self.marker_id is None:
                    raise ValueError(f"{field}: the image marker {self.layout.marker!r} is not one token, so a "
                                     f"token-id prompt cannot place images; send the prompt as text")
                token_ids = expand_token_ids(
                    token_ids, self.layout, self.marker_id,
                    [self.tokenizer.encode(e, add_special_tokens=False) for e in expansions], field)
        else:
            if not isinstance(text, str):
                raise ValueError(f"{field}: a prompt with images needs 'prompt' text or 'prompt_token_ids'")
            text = expand_text(text, self.layout, expansions, field)
            token_ids = self.tokenizer.encode(text)
        num_embeds = [e.count(self.image_token) for e in expansions]
        return text, token_ids, image_features(token_ids, self.layout, pixels, num_embeds, hashes, field)


def _images(data: object, field: str) -> list[Image.Image]:
    if not isinstance(data, dict) or set(data) - {"image"}:
        kinds = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{field} must be {{'image': PIL.Image | [PIL.Image, ...]}}; got {kinds}")
    images = data.get("image")
    images = list(images) if isinstance(images, Sequence) and not isinstance(images, (str, bytes)) else [images]
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise ValueError(f"{field}['image'][{i}] must be a PIL.Image.Image, got {type(image).__name__}")
    return images


def text_only_refusal(architecture: str, field: str) -> ValueError:
    return ValueError(f"{field}: model {architecture} takes text only; images need a vision-language model "
                      f"such as Gemma3ForConditionalGeneration")
