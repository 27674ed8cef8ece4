"""Falcon-H1: every layer runs a Mamba2 mixer and attention side by side on the same normed input and adds
both (x + m_ssm * mamba(h) + m_out * attn(m_in * h)), then a gated MLP. The muP multipliers: embeddings,
the mixer's input and its projection per section (`ssm_multipliers` over gate / x / B / C / dt), the
key (folded into the attention scale: q . (m k) = m (q . k)), the MLP's gate and down, the LM head. The
mixer's gated RMSNorm is optional (`mamba_rms_norm`) and may normalize before gating. Each layer keeps a
seat's state and KV blocks, in that order (the mixer is registered first); the layers run in the shared
hybrid decoder."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from vllmpy.layers.activation import get_activation
from vllmpy.layers.linear import Linear, MergedLinear
from vllmpy.layers.mamba2 import GatedGroupRMSNorm, Mamba2Mixer, time_step_limit
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import CosSin
from vllmpy.models.base import CausalLM
from vllmpy.models.hybrid import Cache, HybridModel, Meta
from vllmpy.models.llama import Attention, norm_eps


class SiluGate(nn.Module):
    """y * silu(gate): the mixer's output gate when the config has no gated RMSNorm."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return y * F.silu(gate.float())


class FalconH1Mixer(Mamba2Mixer):
    def __init__(self, config: dict) -> None:
        hidden = config["hidden_size"]
        intermediate = config.get("mamba_d_ssm") or config.get("mamba_expand", 2) * hidden
        heads = config["mamba_n_heads"]
        head_dim = config.get("mamba_d_head", "auto")
        head_dim = intermediate // heads if head_dim in (None, "auto") else head_dim
        groups, state = config.get("mamba_n_groups", 1), config.get("mamba_d_state", 256)
        eps = norm_eps(config)
        super().__init__(hidden, heads, head_dim, groups, state, config.get("mamba_d_conv", 4),
                         config.get("mamba_chunk_size", 256), eps, bias=bool(config.get("mamba_proj_bias", False)),
                         conv_bias=bool(config.get("mamba_conv_bias", True)), act=config.get("hidden_act", "silu"),
                         time_step_limit=time_step_limit(config), out_bias=bool(config.get("projectors_bias", False)))
        if config.get("mamba_rms_norm", False):
            self.norm = GatedGroupRMSNorm(self.intermediate, self.intermediate // groups, eps,
                                          norm_before_gate=bool(config.get("mamba_norm_before_gate", True)))
        else:
            self.norm = SiluGate()
        self.in_multiplier = config.get("ssm_in_multiplier", 1.0)
        # per output channel of in_proj: [gate I | x I | B G*N | C G*N | dt H]
        sections = (self.intermediate, self.intermediate, groups * state, groups * state, heads)
        self.section_multipliers = list(zip(sections, config.get("ssm_multipliers") or [1.0] * 5))
        self.proj_scale: torch.Tensor | None = None  # built once the weights are on their device

    def finish_loading(self) -> None:
        self.proj_scale = torch.cat([torch.full((size,), float(m)) for size, m in self.section_multipliers]).to(
            device=self.D.device, dtype=self.D.dtype)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.in_proj(hidden * self.in_multiplier) * self.proj_scale


class FalconH1MLP(nn.Module):
    """down(up(x) * act(gate(x) * m_gate)) * m_down."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, inter, bias = config["hidden_size"], config["intermediate_size"], bool(config.get("mlp_bias", False))
        self.gate_up_proj = MergedLinear(hidden, {0: inter, 1: inter}, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.act = get_activation(config.get("hidden_act", "silu"))
        self.gate_multiplier, self.down_multiplier = config.get("mlp_multipliers") or (1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(up * self.act(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1Layer(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], norm_eps(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.mamba = FalconH1Mixer(config)
        head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
        bias = bool(config.get("attention_bias", False))
        self.self_attn = Attention(config, "full_attention", qkv_bias=bias, o_bias=bias,
                                   scale=head_dim ** -0.5 * config.get("key_multiplier", 1.0))
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = FalconH1MLP(config)
        self.ssm_out = config.get("ssm_out_multiplier", 1.0)
        self.attn_in = config.get("attention_in_multiplier", 1.0)
        self.attn_out = config.get("attention_out_multiplier", 1.0)

    def forward(self, x: torch.Tensor, cos_sin: CosSin, caches: list[Cache], metas: list[Meta]) -> torch.Tensor:
        (state, kv_cache), (state_meta, attn_meta) = caches, metas
        h = self.input_layernorm(x)
        mixed = self.mamba(h, state, state_meta) * self.ssm_out
        x = x + mixed + self.self_attn(h * self.attn_in, cos_sin, kv_cache, attn_meta) * self.attn_out
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1ForCausalLM(CausalLM):
    checkpoint_renames = ((r"^model\.final_layernorm\.", "model.norm."),)

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.model = HybridModel(config, [FalconH1Layer(config) for _ in range(config["num_hidden_layers"])],
                                 embedding_multiplier=config.get("embedding_multiplier", 1.0))
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.lm_head_multiplier = config.get("lm_head_multiplier", 1.0)
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.lm_head_multiplier
