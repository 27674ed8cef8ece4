"""Nemotron-H: every layer is x + mixer(norm(x)) with one mixer per layer, from `layers_block_type` (or the
legacy `hybrid_override_pattern`: M Mamba2, * attention, - MLP): Mamba2 mixers, NoPE attention, and
ungated relu^2 MLPs that keep no cache. The MoE blocks of Nemotron 3 ("moe" / E) are refused by name.
Blocks run in the shared hybrid decoder (NoPE); only Mamba2 and attention blocks hold a cache."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.activation import get_activation
from vllmpy.layers.linear import Linear
from vllmpy.layers.mamba2 import Mamba2Mixer
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import CosSin
from vllmpy.models.base import CausalLM
from vllmpy.models.hybrid import Cache, HybridModel, Meta
from vllmpy.models.llama import Attention, norm_eps

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def block_types(config: dict) -> list[str]:
    kinds = config.get("layers_block_type") or config.get("layer_types")
    if not kinds:
        pattern = config.get("hybrid_override_pattern", "")
        kinds = [_PATTERN.get(ch, ch) for ch in pattern]
    bad = sorted(set(kinds) - {"linear_attention", "full_attention", "mlp"})
    if bad:
        raise UnsupportedCheckpointError(
            f"Nemotron-H layers_block_type {bad} is not served (supported: linear_attention / M, full_attention / *, "
            f"mlp / -; the MoE blocks of Nemotron 3 are not yet)")
    return kinds


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class UngatedMLP(nn.Module):
    """down(act(up(x))); Nemotron-H's act is relu^2."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = _relu2 if act == "relu2" else get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHBlock(nn.Module):
    def __init__(self, config: dict, kind: str) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], norm_eps(config, 1e-5)
        self.norm = RMSNorm(hidden, eps)
        self.kind = kind
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(
                hidden, config["mamba_num_heads"], config["mamba_head_dim"], config.get("n_groups", 8),
                config.get("ssm_state_size", 128), config.get("conv_kernel", 4), config.get("chunk_size", 256), eps,
                bias=bool(config.get("use_bias", False)), conv_bias=bool(config.get("use_conv_bias", True)),
                act=config.get("mamba_hidden_act", "silu"),
                time_step_limit=(config.get("time_step_min", 0.001), float("inf")))  # transformers' mixer: no cap
        elif kind == "full_attention":
            self.mixer = Attention(config, "full_attention", qkv_bias=bool(config.get("attention_bias", False)),
                                   o_bias=bool(config.get("attention_bias", False)), rope=False)
        else:
            self.mixer = UngatedMLP(hidden, config["intermediate_size"], config.get("mlp_hidden_act", "relu2"),
                                    bool(config.get("mlp_bias", False)))

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, caches: list[Cache], metas: list[Meta]) -> torch.Tensor:
        h = self.norm(x)
        if self.kind == "linear_attention":
            return x + self.mixer(h, caches[0], metas[0])
        if self.kind == "full_attention":
            return x + self.mixer(h, cos_sin, caches[0], metas[0])
        return x + self.mixer(h)


class NemotronHForCausalLM(CausalLM):
    # Only q/k/v fuse: the MLP's up_proj stays its own (ungated) projection.
    packed_modules_mapping = {name: CausalLM.packed_modules_mapping[name] for name in ("q_proj", "k_proj", "v_proj")}
    checkpoint_renames = (
        (r"^backbone\.", "model."),  # NVIDIA's original checkpoints
        (r"^model\.embeddings\.", "model.embed_tokens."),
        (r"^model\.norm_f\.", "model.norm."),
    )

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.model = HybridModel(config, [NemotronHBlock(config, kind) for kind in block_types(config)], rope=False,
                                 eps=norm_eps(config, 1e-5))
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)
