"""The draft model of `draft_model` speculation: its checkpoint (HF directory, .gguf file or org/repo) through
the target's loader, checked at startup before any of its weights load.

Its vocabulary must be the target's: the verifier reads a draft token id as the target's token, so a draft
whose ids mean other tokens would only waste steps (vLLM checks the vocabulary size; the tokenizers'
token -> id maps are compared as well). Its state must be plain attention: the draft cache is rolled back
by overwriting the positions of rejected drafts, which a recurrent state cannot do.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vllmpy.attention.kv_dtype import resolve_kv_cache_dtype
from vllmpy.config import EngineConfig, ModelConfig
from vllmpy.engine.kv_cache_spec import KVCacheLayout
from vllmpy.engine.recurrent_config import ssm_cache_dtype
from vllmpy.loader.model_loader import Checkpoint, build_model, open_checkpoint
from vllmpy.models.base import CausalLM
from vllmpy.tokenizer import Tokenizer

logger = logging.getLogger("vllmpy")


@dataclass
class DraftModel:
    checkpoint: Checkpoint
    model: CausalLM
    layout: KVCacheLayout  # its own KV cache's, sized out of the target's budget (runner/memory.py)
    max_model_len: int  # the target's, or the draft's own context when shorter (longer requests draft less)

    @property
    def vocab_size(self) -> int:
        return self.checkpoint.config["vocab_size"]


def load_draft_model(config: EngineConfig, target: Checkpoint, device: torch.device, dtype: torch.dtype,
                     max_model_len: int) -> DraftModel | None:
    """The draft model a `draft_model` speculative config names, on the target's device and dtype; None
    for any other config. Refuses a vocabulary or a KV cache kind it cannot draft with, naming it."""
    spec = config.model.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    try:
        checkpoint = open_checkpoint(ModelConfig(model=spec.model, revision=spec.revision,
                                                 download_dir=config.model.download_dir))
    except (OSError, ValueError) as exc:  # the loader's messages name --model; this is the draft's
        raise ValueError(f"--speculative-config: draft model {spec.model!r}: {exc}") from exc
    check_vocabulary(checkpoint, target)
    length = min(max_model_len, checkpoint.max_model_len)
    model = build_model(checkpoint, dtype, device, "generate", length)
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, checkpoint.path, checkpoint.config)
    layout = KVCacheLayout.from_specs(model.kv_cache_specs(
        config.cache.block_size, kv_dtype.dtype, ssm_cache_dtype(config.cache.mamba_ssm_cache_dtype)), length)
    _check_layout(layout)
    arch = (checkpoint.config.get("architectures") or ["?"])[0]
    logger.info("draft model: %s (%s, %d layers, context %d)", spec.model, arch, layout.num_layers, length)
    return DraftModel(checkpoint, model, layout, length)


def check_vocabulary(draft: Checkpoint, target: Checkpoint) -> None:
    """Refuse a draft whose logits cover another vocabulary size, or whose tokenizer maps ids to other tokens."""
    theirs, ours = draft.config.get("vocab_size"), target.config.get("vocab_size")
    if theirs != ours:
        raise ValueError(f"--speculative-config: draft model vocabulary ({theirs}) differs from the target's "
                         f"({ours}); the draft must share the target's tokenizer")
    difference = _first_difference(draft.tokenizer, target.tokenizer)
    if difference is not None:
        token_id, draft_token, target_token = difference
        raise ValueError(f"--speculative-config: draft model vocabulary differs from the target's at token id "
                         f"{token_id} ({draft_token!r} in the draft, {target_token!r} in the target); the draft "
                         f"must share the target's tokenizer")


def _first_difference(draft: Tokenizer, target: Tokenizer) -> tuple[int, str | None, str | None] | None:
    """(id, draft token, target token) at the lowest id where the two vocabularies differ; None if equal."""
    theirs, ours = draft.backend.get_vocab(with_added_tokens=True), target.backend.get_vocab(with_added_tokens=True)
    if theirs == ours:
        return None
    by_id = [{i: t for t, i in vocab.items()} for vocab in (theirs, ours)]
    token_id = min(i for i in by_id[0].keys() | by_id[1].keys() if by_id[0].get(i) != by_id[1].get(i))
    return token_id, by_id[0].get(token_id), by_id[1].get(token_id)


def _check_layout(layout: KVCacheLayout) -> None:
    """Attention KV only: its rejected positions are overwritten, a recurrent state cannot be rewound."""
    if layout.recurrent:
        raise ValueError("--speculative-config: the draft model has recurrent (Mamba / delta-rule) layers, whose "
                         "state cannot be rewound past its rejected drafts; choose an attention-only draft model")
