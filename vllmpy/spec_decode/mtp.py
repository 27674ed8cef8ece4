"""vLLM's `mtp` speculation: the target checkpoint's own multi-token-prediction block (DeepSeek-V3,
GLM-4.5, GLM-4.7-Flash; models/mtp.py) drafts, on a second ModelRunner over its own one-layer KV cache
(sized out of the target's budget as a draft model's is, runner/memory.py).

The block at position t reads the target's final hidden state at t and token t + 1, so it must see
every position the target verifies: the target runner hands each finished step's hidden states to
`observe` (its `hidden_observer` hook), which feeds the block the verified rows of every request in that
step -- a prompt's rows (chunk by chunk), a decode's last token and its accepted drafts, each paired with
the token after it (the next prompt token, the accepted draft, the bonus token) -- in one forward. Its
output at the last verified position is the request's first draft and the hidden state to chain on;
`propose_batch` then runs one forward per further draft position for all requests together, each
feeding the block its own previous output (vLLM reuses its first MTP block this way for k > 1). Chained
positions are overwritten by the next `observe`. A request whose first positions the target never
computed (its prompt hit the target's prefix cache) drafts nothing: the block has no hidden states there.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllmpy.attention.kv_dtype import resolve_kv_cache_dtype
from vllmpy.config import EngineConfig
from vllmpy.engine.kv_cache_spec import KVCacheLayout
from vllmpy.engine.request import RequestKind
from vllmpy.engine.schedule_types import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from vllmpy.loader.model_loader import Checkpoint, _empty_on
from vllmpy.models.base import CausalLM
from vllmpy.models.mtp import MultiTokenPredictor, mtp_tensor_names, num_mtp_layers
from vllmpy.models.registry import resolve_model_class
from vllmpy.runner.model_runner import query_start_loc
from vllmpy.spec_decode.draft_checkpoint import DraftModel
from vllmpy.spec_decode.draft_model import DraftModelProposer, _Sequence
from vllmpy.spec_decode.proposer import DraftRequest

logger = logging.getLogger("vllmpy")


def check_mtp_target(config: EngineConfig, checkpoint: Checkpoint) -> bool:
    """True when the config asks for MTP speculation; refuses, before any weight loads, a checkpoint or
    setup the MTP block cannot draft for."""
    spec = config.model.speculative_config
    if spec is None or spec.method != "mtp":
        return False
    arch = (checkpoint.config.get("architectures") or ["?"])[0]
    if not hasattr(resolve_model_class(checkpoint.config, "generate"), "make_mtp_layer"):
        raise ValueError(f"--speculative-config: method 'mtp' needs an architecture with MTP heads (DeepSeek-V3, "
                         f"GLM-4.5, GLM-4.7-Flash); {arch} has none")
    if num_mtp_layers(checkpoint.config) < 1:
        hint = ("; llama.cpp's converter drops DeepSeek-V2/V3's MTP layers (GLM-4.5 and GLM-4.7-Flash files keep "
                "them, blocks past the decoder with nextn.* tensors)" if checkpoint.format == "gguf" else "")
        raise ValueError(f"--speculative-config: method 'mtp': this checkpoint has no MTP layers "
                         f"(num_nextn_predict_layers is {checkpoint.config.get('num_nextn_predict_layers')!r}, "
                         f"must be >= 1){hint}")
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError(f"--speculative-config: method 'mtp' with --tensor-parallel-size "
                         f"{config.parallel.tensor_parallel_size}: the MTP block runs unsharded in the engine's "
                         f"process; use --tensor-parallel-size 1")
    return True


def load_mtp_draft(config: EngineConfig, checkpoint: Checkpoint, target: CausalLM, device: torch.device,
                   dtype: torch.dtype, max_model_len: int) -> DraftModel:
    """The MTP block from the tensors the target's loader set aside (build_model(keep_mtp=True))."""
    aside, target.mtp_weights = target.mtp_weights or [], None
    num_layers = checkpoint.config["num_hidden_layers"]
    tensors = list(mtp_tensor_names(aside, num_layers))
    if not tensors:
        raise ValueError(f"--speculative-config: method 'mtp': this checkpoint has no MTP layers (no tensor named "
                         f"model.layers.{num_layers}.*, though num_nextn_predict_layers is "
                         f"{num_mtp_layers(checkpoint.config)})")
    names = {name for name, _ in tensors}
    with torch.device("meta"):
        model = MultiTokenPredictor(target.config, target, "embed_tokens.weight" in names,
                                    "shared_head.head.weight" in names)
    model = _empty_on(model, device).to(dtype)
    model.load_weights(tensors)
    model.share_target(target)
    kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, checkpoint.path, checkpoint.config)
    layout = KVCacheLayout.from_specs(model.kv_cache_specs(config.cache.block_size, kv_dtype.dtype), max_model_len)
    logger.info("MTP draft: layer %d of %s (own embedding: %s, own head: %s)", num_layers,
                checkpoint.path, model.embed_tokens is not None, hasattr(model.shared_head, "head"))
    return DraftModel(checkpoint, model.eval(), layout, max_model_len)


@dataclass
class _MTPSequence(_Sequence):
    """`tokens`: the request's verified tokens; num_computed_tokens: positions the block has read the
    target's hidden states for (0..n-1)."""

    first_draft: int | None = None  # the block's prediction after the last verified token
    last_hidden: torch.Tensor | None = None  # its output there: the input of the next draft position


class MTPProposer(DraftModelProposer):
    """A BatchProposer over the MTP block's runner and block pool, fed by the target runner's hook."""

    @torch.inference_mode()
    def observe(self, so: SchedulerOutput, hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """The target's step is done: feed the block every verified row it computed (one forward)."""
        for req_id in so.finished_req_ids | so.preempted_req_ids:  # also those that ran with no drafter
            self._free(req_id)
        for data in so.new_requests:  # a resumed request starts over
            if data.kind is RequestKind.POOL:
                continue
            self._free(data.req_id)
            tokens = list(data.prompt_token_ids) + list(data.output_token_ids)
            self._seqs[data.req_id] = _MTPSequence(data.req_id, tokens=tokens,
                                                   num_prompt_tokens=len(data.prompt_token_ids))
        starts = query_start_loc(so.chunks)
        chunks, rows = [], []
        for i, chunk in enumerate(so.chunks):
            seq = self._seqs.get(chunk.req_id)
            if seq is None or chunk.req_id in out.errors:
                continue
            sampled = out.sampled_token_ids[i] if chunk.sample else []
            seq.tokens.extend(sampled)
            seq.first_draft = seq.last_hidden = None
            if chunk.start_pos > seq.num_computed_tokens:  # positions the target took from its prefix cache
                self._free(chunk.req_id)
                continue
            # Rows whose input tokens are all verified: the chunk's own, then its accepted drafts; each row
            # is paired with the token after it, so the last verified token waits for its successor.
            verified = len(chunk.token_ids) - chunk.num_draft_tokens + max(len(sampled) - 1, 0)
            count = min(chunk.start_pos + verified, len(seq.tokens) - 1) - chunk.start_pos
            seq.num_computed_tokens = chunk.start_pos
            if count <= 0:
                continue
            if not self.kv.allocate_slots(seq, count):  # the pool is short: this request drafts no more
                self._free(chunk.req_id)
                continue
            first = chunk.start_pos + 1
            chunks.append(ScheduledChunk(chunk.req_id, seq.tokens[first:first + count], chunk.start_pos,
                                         self.kv.new_block_ids(chunk.req_id), sample=chunk.sample))
            rows.append(hidden[starts[i]:starts[i] + count])
        if not chunks:
            return
        for chunk, result in zip(chunks, self._forward(chunks, torch.cat(rows)), strict=True):
            seq = self._seqs[chunk.req_id]
            seq.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            if result is not None:
                seq.first_draft, seq.last_hidden = result

    def propose_batch(self, batch: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {request.req_id: [] for request in batch}
        chain: list[tuple[_MTPSequence, int, torch.Tensor]] = []  # (sequence, drafts wanted, hidden to chain on)
        for request in batch:
            seq = self._seqs.get(request.req_id)
            # The block must have read every position but the last token's, for exactly these tokens.
            if (seq is None or seq.first_draft is None or len(seq.tokens) != len(request.token_ids)
                    or seq.num_computed_tokens != len(request.token_ids) - 1):
                continue
            k = min(request.k, self.max_model_len - len(request.token_ids) + 1)
            if k <= 0:
                continue
            drafts[request.req_id].append(seq.first_draft)
            if k > 1 and self.kv.allocate_slots(seq, k - 1):
                chain.append((seq, k, seq.last_hidden))
        while chain:  # one forward per further draft position; the verified position's state stays as it is
            chunks = [ScheduledChunk(seq.request_id, [drafts[seq.request_id][-1]],
                                     seq.num_computed_tokens + len(drafts[seq.request_id]) - 1,
                                     self.kv.new_block_ids(seq.request_id), sample=True) for seq, _, _ in chain]
            results = self._forward(chunks, torch.stack([previous for _, _, previous in chain]))
            following = []
            for (seq, k, _), result in zip(chain, results, strict=True):
                if result is not None:
                    drafts[seq.request_id].append(result[0])
                    if len(drafts[seq.request_id]) < k:
                        following.append((seq, k, result[1]))
            chain = following
        return [drafts[request.req_id] for request in batch]

    @torch.inference_mode()
    def _forward(self, chunks: list[ScheduledChunk],
                 previous_hidden: torch.Tensor) -> list[tuple[int, torch.Tensor] | None]:
        """One forward of the block: per chunk, for a sampling one, its prediction after its last token and
        its output hidden state there (None otherwise)."""
        step = self.runner.forward_step(self._scheduler_output(chunks), {"previous_hidden": previous_hidden})
        out = self.runner.finish_step(step)
        ends = query_start_loc(chunks)[1:]
        return [(sampled[0], step.hidden[end - 1].clone()) if sampled and chunk.req_id not in out.errors else None
                for chunk, sampled, end in zip(chunks, out.sampled_token_ids, ends, strict=True)]
