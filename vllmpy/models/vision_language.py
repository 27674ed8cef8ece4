"""What every vision-language family shares: checkpoint names onto `model.` / `lm_head.` /
`vision_tower.vision_model.` / `multi_modal_projector.` (transformers 4 and 5 layouts), and the forward
that splices the encoder's rows in at the placeholder tokens."""
from __future__ import annotations

import torch

VLM_CHECKPOINT_RENAMES = (
    (r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
    (r"^language_model\.lm_head\.", "lm_head."),
    (r"^(model\.)?vision_tower\.(vision_model\.)?", "vision_tower.vision_model."),
    (r"^model\.multi_modal_projector\.", "multi_modal_projector."))


class ImageInputs:
    """Mixin before a CausalLM whose `model` is a DecoderModel; the family defines encode_images and
    placeholder_layout."""

    def forward(self, input_ids, positions, kv_caches, meta, mm_embeds=None):
        """mm_embeds: (flat rows, [rows, hidden]) that replace the placeholder tokens' embeddings."""
        x = self.model.embed(input_ids)
        if mm_embeds is not None:
            rows, embeds = mm_embeds
            x = x.index_copy(0, rows, embeds.to(x.dtype))
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds=x)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> one embedding row per placeholder token [B, tokens, hidden]."""
        raise NotImplementedError
