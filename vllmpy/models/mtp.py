"""Multi-token-prediction (MTP) heads of DeepSeek-V3 and GLM-4.5, run as a speculative draft model.

A checkpoint with `num_nextn_predict_layers` = n stores n MTP blocks after its last decoder layer, as
`model.layers.{num_hidden_layers + i}.*`: enorm, hnorm, eh_proj, one full decoder layer of the family,
shared_head.norm and shared_head.head (and sometimes its own embed_tokens). For position t the block reads
the target's final hidden state h_t (after the final norm: what vLLM's model runner hands its MTP
proposer) and the embedding of token t + 1:

    x = decoder_layer(eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t))))    -> logits = head(norm(x))

and predicts token t + 2; its output x stands in for h at the next draft position (vLLM chains its
first MTP block this way for k > 1). The embedding at position 0 is zeroed, as vLLM does. Where the
checkpoint has no embed_tokens / shared_head.head of the block's own, the target's are shared.

The target's loader sets its MTP tensors aside instead of dropping them (`split_mtp_layers`) when the
engine asks for MTP speculation, so the checkpoint is read once. A GGUF's nextn blocks (`blk.{n}.nextn.eh_proj`
...) arrive under these HF names (loader/gguf/archs.py, `ArchSpec.mtp_names`), packed like the target's.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from vllmpy.layers.embedding import VocabEmbedding
from vllmpy.layers.linear import Linear
from vllmpy.layers.moe import ExpertWeights
from vllmpy.layers.norm import RMSNorm
from vllmpy.models.base import CausalLM
from vllmpy.models.llama import norm_eps

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# The block's own modules; everything else under the layer prefix is its decoder layer.
_BLOCK_MODULES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")

Weights = Iterable[tuple[str, torch.Tensor]]


def split_mtp_layers(weights: Weights, num_layers: int,
                     aside: list | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less its MTP blocks (layers num_layers.. after the last one); those go to
    `aside` when given (MTP speculation), else are dropped."""
    for name, tensor in weights:
        match = _LAYER.match(name)
        if match is None or int(match[1]) < num_layers:
            yield name, tensor
        elif aside is not None:
            aside.append((name, tensor))


def num_mtp_layers(config: dict) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        if own_head:
            self.head = Linear(hidden, vocab)


class MultiTokenPredictor(ExpertWeights, CausalLM):
    """The checkpoint's first MTP block as a one-layer CausalLM; forward takes `previous_hidden` [T, hidden]
    (the target's, or this block's own output when chaining), one row per input token."""

    def __init__(self, config: dict, target: CausalLM, own_embed: bool, own_head: bool) -> None:
        super().__init__(config)
        self.tie_word_embeddings = False  # its head is shared_head.head or the target's, never its embedding
        hidden, eps = config["hidden_size"], norm_eps(config)
        self.packed_modules_mapping = target.packed_modules_mapping
        self.checkpoint_renames = target.checkpoint_renames
        self.embed_tokens = VocabEmbedding(config["vocab_size"], hidden) if own_embed else None
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.mtp_block = target.make_mtp_layer(config)
        self.shared_head = SharedHead(hidden, config["vocab_size"], eps, own_head)
        # The target's rotary and, where the block has none of its own, embedding and head: shared after
        # loading (share_target), never registered here, so this module's state stays its own layer's.
        self._position_inputs: Callable[[torch.Tensor, torch.dtype], dict] | None = None
        self._embed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def share_target(self, target: CausalLM) -> None:
        self._position_inputs = target.model.position_inputs
        self._embed = self.embed_tokens if self.embed_tokens is not None else target.model.embed_tokens
        self._head = self.shared_head.head if hasattr(self.shared_head, "head") else target.lm_head

    def forward(self, input_ids, positions, kv_caches, meta, previous_hidden: torch.Tensor):
        embeds = self._embed(input_ids)
        embeds[positions == 0] = 0  # vLLM: position 0 has no previous token for the block to read
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden.to(embeds.dtype))], dim=-1))
        cos_sin = self._position_inputs(positions, x.dtype)
        return self.mtp_block(x, cos_sin.get(self.mtp_block.self_attn.layer_type), kv_caches[0], meta[0])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._head(self.shared_head.norm(hidden)).float()


def mtp_tensor_names(aside: Weights, num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The first MTP block's tensors under this module's names: its own modules at the top, the rest
    (the decoder layer) under mtp_block. Later blocks are unused (vLLM chains the first)."""
    prefix = f"model.layers.{num_layers}."
    for name, tensor in aside:
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        yield (rest if rest.startswith(_BLOCK_MODULES) else f"mtp_block.{rest}"), tensor
