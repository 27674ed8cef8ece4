"""Mamba2 (state-spaces/mamba2-*, Codestral Mamba): every layer is x + mixer(norm(x)), no attention and
no MLP, so a sequence's whole cache is one fixed-size seat. Checkpoints name the trunk `backbone`
(`embeddings`, `layers.N.mixer`, `norm_f`), renamed onto the shared `model.embed_tokens` / `model.norm`
names (the base class ties the head to them); `residual_in_fp32` keeps the residual stream in float32.
The blocks run in the shared hybrid decoder (no rope)."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.layers.linear import Linear
from vllmpy.layers.mamba2 import Mamba2Mixer, time_step_limit
from vllmpy.layers.norm import RMSNorm
from vllmpy.layers.rotary import CosSin
from vllmpy.models.base import CausalLM
from vllmpy.models.hybrid import Cache, HybridModel, Meta
from vllmpy.models.llama import norm_eps


class Mamba2Block(nn.Module):
    """x + mixer(norm(x)), the residual kept in float32 when `residual_in_fp32` (the mixer sees the
    model dtype)."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], norm_eps(config, 1e-5)
        self.norm = RMSNorm(hidden, eps)
        self.mixer = Mamba2Mixer(
            hidden, config["num_heads"], config["head_dim"], config.get("n_groups", 8), config["state_size"],
            config.get("conv_kernel", 4), config.get("chunk_size", 256), eps, bias=bool(config.get("use_bias", False)),
            conv_bias=bool(config.get("use_conv_bias", True)), act=config.get("hidden_act", "silu"),
            time_step_limit=time_step_limit(config))
        self.residual_in_fp32 = bool(config.get("residual_in_fp32", True))

    def forward(self, x: torch.Tensor, cos_sin: CosSin | None, caches: list[Cache], metas: list[Meta]) -> torch.Tensor:
        residual = x.float() if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.to(self.norm.weight.dtype)), caches[0], metas[0])


class Mamba2ForCausalLM(CausalLM):
    checkpoint_renames = (
        (r"^backbone\.embeddings?\.", "model.embed_tokens."),  # `embedding.`: the original mamba_ssm name
        (r"^backbone\.norm_f\.", "model.norm."),
        (r"^backbone\.", "model."),
    )

    def __init__(self, config: dict) -> None:
        super().__init__(config)
        self.model = HybridModel(config, [Mamba2Block(config) for _ in range(config["num_hidden_layers"])], rope=False,
                                 eps=norm_eps(config, 1e-5))
        self.lm_head = Linear(config["hidden_size"], config["vocab_size"])
        self.tie_weights()

    def forward(self, input_ids, positions, kv_caches, meta):
        return self.model(input_ids, positions, kv_caches, meta).to(self.model.norm.weight.dtype)
