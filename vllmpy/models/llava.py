"""LLaVA: a CLIP or SigLIP tower read at `vision_feature_layer` (one layer, or several concatenated), the
class token dropped under the "default" select strategy, a two-layer MLP projector, and any causal LM we
serve (text_config.model_type). `<image>` becomes one token per selected patch state."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.activation import get_activation
from vllmpy.layers.linear import Linear
from vllmpy.models.base import CausalLM
from vllmpy.models.clip import CLIP_DEFAULTS, CLIPVisionModel
from vllmpy.models.siglip import SiglipVisionModel, vision_config
from vllmpy.models.vision_language import VLM_CHECKPOINT_RENAMES, ImageInputs
from vllmpy.multimodal.placeholders import PlaceholderLayout

# text_config.model_type -> the architecture that serves it.
LANGUAGE_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                   "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
_TOWERS = {"clip_vision_model": (CLIPVisionModel, CLIP_DEFAULTS, 1),  # (class, defaults, extra tokens: CLS)
           "siglip_vision_model": (SiglipVisionModel, None, 0)}


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = Linear(vision_hidden, text_hidden, bias=bias)
        self.act = get_activation(act)
        self.linear_2 = Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(ImageInputs, CausalLM):
    """The LM's own modules sit at `model.` / `lm_head.` (its forward, logits and checkpoint names are its
    family's); the tower is built only up to the deepest layer read."""

    def __init__(self, config: dict) -> None:
        from vllmpy.models.registry import resolve_model_class

        text = dict(config.get("text_config") or {})
        kind = text.get("model_type", "llama")
        if kind not in LANGUAGE_MODELS:
            raise UnsupportedCheckpointError(f"LLaVA text_config.model_type {kind!r} is not supported; supported: "
                                             f"{', '.join(sorted(LANGUAGE_MODELS))}")
        super().__init__(text)
        language_model = resolve_model_class({"architectures": [LANGUAGE_MODELS[kind]]})(text)
        self.model, self.lm_head = language_model.model, language_model.lm_head
        object.__setattr__(self, "_language_model", language_model)  # its logits; not a second module tree
        self.packed_modules_mapping = language_model.packed_modules_mapping
        self.checkpoint_renames = VLM_CHECKPOINT_RENAMES + tuple(language_model.checkpoint_renames)

        vision = config.get("vision_config") or {}
        tower_kind = vision.get("model_type", "clip_vision_model")
        if tower_kind not in _TOWERS:
            raise UnsupportedCheckpointError(f"LLaVA vision_config.model_type {tower_kind!r} is not supported; "
                                             f"supported: {', '.join(_TOWERS)}")
        tower_cls, defaults, extra = _TOWERS[tower_kind]
        vision = vision_config(vision, defaults) if defaults else vision_config(vision)
        layers = config.get("vision_feature_layer", -2)
        layers = [layers] if isinstance(layers, int) else list(layers)
        total = vision["num_hidden_layers"]
        self.feature_layers = [k if k >= 0 else total + 1 + k for k in layers]  # indices into hidden_states
        if not all(0 <= k <= total for k in self.feature_layers):
            raise UnsupportedCheckpointError(f"vision_feature_layer {layers} is outside the tower's {total} layers")
        self.num_tower_layers = max(self.feature_layers)
        self.vision_tower = tower_cls(vision, self.num_tower_layers) if tower_cls is CLIPVisionModel else \
            tower_cls(vision, self.num_tower_layers, post_layernorm=False)
        strategy = config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise UnsupportedCheckpointError(f"vision_feature_select_strategy {strategy!r} is not supported; "
                                             f"supported: default, full")
        self.drop_first = strategy == "default"
        self.tokens_per_image = (vision["image_size"] // vision["patch_size"]) ** 2 + extra - int(self.drop_first)
        bias = config.get("multimodal_projector_bias", True)
        self.multi_modal_projector = LlavaProjector(vision["hidden_size"] * len(layers), text["hidden_size"],
                                                    config.get("projector_hidden_act", "gelu"), bias)
        self.image_token_id = int(config.get("image_token_index", 32000))

    def placeholder_layout(self, token_to_text) -> PlaceholderLayout:
        image = token_to_text(self.image_token_id)
        return PlaceholderLayout(marker=image, expansion=image * self.tokens_per_image,
                                 image_token_id=self.image_token_id, tokens_per_image=self.tokens_per_image)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower.hidden_states(pixel_values)
        picked = [states[k][:, 1:] if self.drop_first else states[k] for k in self.feature_layers]
        return self.multi_modal_projector(torch.cat(picked, dim=-1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._language_model.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tower tensors past the deepest layer read (and its post-norm) are skipped, not refused."""
        super().load_weights((name, tensor) for name, tensor in weights if not self._unread(name))

    def _unread(self, name: str) -> bool:
        if "vision_tower." not in name:
            return False
        if "post_layernorm." in name or ".head." in name:
            return True
        marker = "encoder.layers."
        return marker in name and int(name.split(marker, 1)[1].split(".", 1)[0]) >= self.num_tower_layers
