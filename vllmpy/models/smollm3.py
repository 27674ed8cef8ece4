"""SmolLM3: the Llama block with NoPE layers: `no_rope_layers[i] == 0` (every 4th layer by default)
attends without rotary. A sliding window, when `use_sliding_window` turns it on, applies only to the
layers `layer_types` marks sliding (transformers marks the NoPE ones)."""
from __future__ import annotations

from vllmpy.models.llama import LlamaForCausalLM


def rope_layers(config: dict) -> list[bool]:
    """Per layer: does it apply rotary? `no_rope_layers` is 1 for rope layers, despite its name; without
    it every `no_rope_layer_interval`-th layer is NoPE (SmolLM3, Llama 4)."""
    flags = config.get("no_rope_layers")
    if not flags:
        interval = config.get("no_rope_layer_interval", 4)
        return [(i + 1) % interval != 0 for i in range(config["num_hidden_layers"])]
    return [bool(flag) for flag in flags]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: dict) -> None:
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        super().__init__({**config, "sliding_window": window})
        for layer, rope in zip(self.model.layers, rope_layers(config)):
            layer.self_attn.rope = rope
