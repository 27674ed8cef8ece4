"""Mistral 3 (Mistral-Small-3.x with images): the Pixtral tower read at `vision_feature_layer`, a
projector (RMSNorm, a patch merger folding each spatial_merge_size^2 block of patch states into one,
a two-layer MLP) and the Mistral LM. An image at its own resolution becomes one `[IMG]` per merged
patch; the `[IMG_BREAK]` row ends inside its span take no encoder row."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.linear import Linear
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.llama import MistralForCausalLM
from vllmpy.models.llava import LlavaProjector
from vllmpy.models.pixtral import PixtralVisionModel, pixtral_config
from vllmpy.models.vision_language import VLM_CHECKPOINT_RENAMES, ImageInputs
from vllmpy.multimodal.pixtral_processor import PixtralMultiModalProcessor
from vllmpy.multimodal.placeholders import PlaceholderLayout

MISTRAL3_RENAMES = VLM_CHECKPOINT_RENAMES[:3] + ((r"^model\.vision_tower\.", "vision_tower."),
                                                 (r"^model\.multi_modal_projector\.", "multi_modal_projector."))


class PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = Linear(hidden * merge * merge, hidden)

    def forward(self, states: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """[B, rows * cols, D] -> [B, rows * cols / merge^2, D]; a block's features ordered (channel, row,
        column) as torch's unfold lays them out."""
        batch, _, dim = states.shape
        grid = states.transpose(1, 2).reshape(batch, dim, rows, cols)
        blocks = torch.nn.functional.unfold(grid, kernel_size=self.merge, stride=self.merge)
        return self.merging_layer(blocks.transpose(1, 2))


class Mistral3Projector(LlavaProjector):
    """LLaVA's two-layer MLP after an RMSNorm and the patch merger (checkpoint names as transformers')."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, eps: float, act: str, bias: bool) -> None:
        super().__init__(vision_hidden, text_hidden, act, bias)
        self.norm = RMSNorm(vision_hidden, eps)
        self.patch_merger = PatchMerger(vision_hidden, merge)

    def forward(self, states: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        return super().forward(self.patch_merger(self.norm(states), rows, cols))


class Mistral3ForConditionalGeneration(ImageInputs, MistralForCausalLM):
    """Parameters: the LM under `model.` / `lm_head.`, `vision_tower.`, `multi_modal_projector.`."""

    mm_processor_class = PixtralMultiModalProcessor

    def __init__(self, config: dict) -> None:
        text = {"rms_norm_eps": 1e-5, **(config.get("text_config") or {})}
        text["tie_word_embeddings"] = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
        if text.get("model_type", "mistral") != "mistral":
            raise UnsupportedCheckpointError(f"Mistral 3 text_config.model_type {text['model_type']!r} is not "
                                             f"supported; supported: mistral")
        super().__init__(text)
        self.checkpoint_renames = MISTRAL3_RENAMES + tuple(MistralForCausalLM.checkpoint_renames)
        vision = pixtral_config(config.get("vision_config") or {})
        self.vision_tower = PixtralVisionModel(vision)
        layer, total = config.get("vision_feature_layer", -1), vision["num_hidden_layers"]
        if not isinstance(layer, int) or not -total - 1 <= layer <= total:  # the norm and merger take one layer
            raise UnsupportedCheckpointError(f"vision_feature_layer {layer!r} must be one layer index within the "
                                             f"tower's {total} layers")
        self.feature_layer = layer % (total + 1)  # an index into hidden_states (0: the patch embeddings)
        self.patch_size = vision["patch_size"]
        self.spatial_merge_size = int(config.get("spatial_merge_size", 2))
        self.multi_modal_projector = Mistral3Projector(
            vision["hidden_size"], text["hidden_size"], self.spatial_merge_size, text["rms_norm_eps"],
            config.get("projector_hidden_act", "gelu"), bool(config.get("multimodal_projector_bias", False)))
        self.image_token_id = int(config.get("image_token_index", 10))
        side = vision["image_size"] // (self.patch_size * self.spatial_merge_size)
        self.tokens_per_image = side * (side + 1)  # the largest image's span: rows of [IMG]s and their breaks

    def placeholder_layout(self, token_to_text) -> PlaceholderLayout:
        """The marker is `[IMG]`; the fixed expansion stands for a one-patch image."""
        image = token_to_text(self.image_token_id)
        return PlaceholderLayout(marker=image, expansion=image + "[IMG_END]", image_token_id=self.image_token_id,
                                 tokens_per_image=1)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] (one size) -> [B, (H / unit) * (W / unit), hidden]."""
        states = self.vision_tower.hidden_states(pixel_values)
        rows, cols = pixel_values.shape[2] // self.patch_size, pixel_values.shape[3] // self.patch_size
        return self.multi_modal_projector(states[self.feature_layer], rows, cols)
