"""Gemma 3 with images: a SigLIP tower, an average-pool projector (patch grid -> mm_tokens_per_image soft
tokens, Gemma RMSNorm, one matmul into the LM's width), and the Gemma 3 LM, whose attention is
bidirectional inside each image's run of soft tokens (the scheduler keeps a run in one chunk)."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.norm import GemmaRMSNorm
from vllmpy.models.gemma3 import Gemma3ForCausalLM
from vllmpy.models.siglip import SiglipVisionModel, vision_config
from vllmpy.models.vision_language import VLM_CHECKPOINT_RENAMES, ImageInputs
from vllmpy.multimodal.placeholders import PlaceholderLayout

# Gemma3TextConfig's defaults for the keys the LM reads (hub configs list only what differs).
GEMMA3_TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
                        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6}


class Gemma3Projector(nn.Module):
    def __init__(self, vision: dict, text_hidden: int, tokens_per_image: int) -> None:
        super().__init__()
        self.patches_per_side = vision["image_size"] // vision["patch_size"]
        tokens_per_side = int(tokens_per_image ** 0.5)
        if tokens_per_side ** 2 != tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} must be a square whose side divides the "
                             f"{self.patches_per_side}x{self.patches_per_side} patch grid")
        self.kernel = self.patches_per_side // tokens_per_side
        self.mm_soft_emb_norm = GemmaRMSNorm(vision["hidden_size"], vision["layer_norm_eps"])
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision["hidden_size"], text_hidden),
                                                       requires_grad=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, patches, vision_hidden] -> [B, tokens_per_image, text_hidden]."""
        batch, _, hidden = patches.shape
        grid = patches.transpose(1, 2).reshape(batch, hidden, self.patches_per_side, self.patches_per_side)
        pooled = torch.nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(patches.dtype)


class Gemma3ForConditionalGeneration(ImageInputs, Gemma3ForCausalLM):
    """Parameters: the LM under `model.` / `lm_head.` (as Gemma3ForCausalLM), `vision_tower.`,
    `multi_modal_projector.`."""

    checkpoint_renames = VLM_CHECKPOINT_RENAMES
    bidirectional_image_spans = True  # transformers' token_type_ids mask: an image sees all of itself

    def __init__(self, config: dict) -> None:
        text = {**GEMMA3_TEXT_DEFAULTS, **{k: v for k, v in config.get("text_config", {}).items() if v is not None},
                "tie_word_embeddings": config.get("tie_word_embeddings", True)}
        super().__init__(text)
        vision = vision_config(config.get("vision_config", {}))
        self.vision_tower = SiglipVisionModel(vision)
        self.tokens_per_image = int(config.get("mm_tokens_per_image", 256))
        self.multi_modal_projector = Gemma3Projector(vision, text["hidden_size"], self.tokens_per_image)
        self.image_token_id = int(config.get("image_token_index", 262144))
        self.boi_token_id = int(config.get("boi_token_index", 255999))
        self.eoi_token_id = int(config.get("eoi_token_index", 256000))
        self.vocab_size = text["vocab_size"]

    def placeholder_layout(self, token_to_text) -> PlaceholderLayout:
        """What the prompt says per image (`<start_of_image>`) and what it becomes, as Gemma3Processor writes it."""
        boi, eoi, image = (token_to_text(i) for i in (self.boi_token_id, self.eoi_token_id, self.image_token_id))
        return PlaceholderLayout(marker=boi, expansion=f"\n\n{boi}{image * self.tokens_per_image}{eoi}\n\n",
                                 image_token_id=self.image_token_id, tokens_per_image=self.tokens_per_image)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixel_values))
