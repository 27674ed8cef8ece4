"""SchedulerOutput → input tensors + AttentionMetadata → model → sampler → plain lists.

The runner keeps per-request sampling state (params, generator, tokens so far) between steps; the
scheduler sends it once per (re)start in `new_requests` and tells it when to forget.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllmpy.attention.backends import BACKEND_ENV, select_backend
from vllmpy.attention.base import AttentionMetadata
from vllmpy.attention.kv_storage import PagedKVCache
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.request import RequestKind
from vllmpy.engine.schedule_types import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from vllmpy.layers.pooler import Pooler, token_type_inputs
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentState
from vllmpy.lora.manager import LoRAManager
from vllmpy.models.base import CausalLM
from vllmpy.multimodal.encoder_cache import EncoderCache
from vllmpy.multimodal.inputs import ImageFeature
from vllmpy.runner.block_table import BlockTables
from vllmpy.sampling import RowState, Sampler, SamplingRowError, prompt_logprobs_for_chunk
from vllmpy.sampling.logits_processors import LogitsProcessor
from vllmpy.spec_decode.rejection import verify
from vllmpy.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("vllmpy")


def allocate_kv_caches(config: KVCacheConfig,
                       device: torch.device) -> tuple[list[torch.Tensor], list[PagedKVCache | RecurrentState]]:
    """Zeroed shared byte buffers (one per layer slot of a group, num_blocks pages each) and every
    layer's cache viewed over its slot in its spec's layout: layer i of each group uses buffer i.
    A recurrent layer gets its own state tensors, one row per seat (also listed in the buffers).

    On the CPU the buffers live in one anonymous mmap: the kernel hands out zero pages on first touch,
    so a large pool costs nothing until blocks are used (torch.zeros would write every byte up front:
    ~8 s for 4 GiB here)."""
    layout = config.layout
    size = config.num_blocks * layout.page_bytes
    total = layout.layers_per_group * size
    if total == 0:  # no attention layers: no blocks
        flat = torch.empty(0, dtype=torch.uint8, device=device)
    elif device.type == "cpu":
        flat = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8, count=total)
    else:
        flat = torch.zeros(total, dtype=torch.uint8, device=device)
    buffers = [flat[i * size:(i + 1) * size] for i in range(layout.layers_per_group)]
    caches: list[PagedKVCache | None] = [None] * layout.num_layers
    for group in layout.groups:
        for slot, layer in enumerate(group.layers):
            caches[layer] = group.spec.view(buffers[slot], config.num_blocks)
    for layer, spec in layout.recurrent:
        caches[layer] = spec.allocate(config.num_seats, device)
        buffers.extend(caches[layer])
    return buffers, caches


@dataclass
class RequestState:
    data: NewRequestData
    row: RowState | None  # None for a pooling request
    error: str | None = None  # its grammar failed to start: it is reported failed and never sampled


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, kv_cache_config: KVCacheConfig,
                 vocab_size: int, eos_token_ids: set[int],
                 structured_output: StructuredOutputManager, logits_processors: Sequence[LogitsProcessor] = (),
                 pooler: Pooler | None = None, lora: LoRAManager | None = None) -> None:
        self.model = model
        self.lora = lora  # --enable-lora: maps each step's rows to adapter slots
        self.device = device
        self.dtype = dtype
        self.block_size = kv_cache_config.block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.attn_backend = select_backend(device)
        logger.info("attention backend: %s (%s overrides)", self.attn_backend.name, BACKEND_ENV)
        self.kv_buffers, self.kv_caches = allocate_kv_caches(kv_cache_config, device)
        paged = [cache for cache in self.kv_caches if isinstance(cache, PagedKVCache)]
        for cache, layer in zip(paged, model.attention_layers()):  # an fp8 cache's per-layer scales
            cache.k_scale, cache.v_scale = layer.k_scale, layer.v_scale
        # Each layer's KV cache group: its attention reads that group's block table. Recurrent layers
        # read the step's RecurrentMetadata, after the groups' (a chunk's block_ids end with its seat).
        self.num_groups = len(kv_cache_config.groups)
        self.recurrent_states = [self.kv_caches[layer] for layer, _ in kv_cache_config.layout.recurrent]
        self.layer_groups = [self.num_groups] * len(self.kv_caches)
        for index, group in enumerate(kv_cache_config.groups):
            for layer in group.layers:
                self.layer_groups[layer] = index
        self.sampler = Sampler(logits_processors)
        self.structured_output = structured_output
        self.requests: dict[str, RequestState] = {}
        self.block_tables = BlockTables(len(kv_cache_config.groups), device)
        self.pooler = pooler  # set for an embedding model: finished prompts are pooled, nothing is sampled
        # A model that takes images: its encoder outputs between the step that encodes and the span's prefill.
        self.encoder_cache = EncoderCache(model, device) if hasattr(model, "encode_images") else None

    @property
    def kv_cache_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.kv_buffers)  # layers' views share these bytes

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.encoder_cache is not None:
                self.encoder_cache.forget(req_id)
            self.block_tables.remove(req_id)
        for data in so.new_requests:
            self.block_tables.remove(data.req_id)  # a resumed request's table starts over
            if data.kind is RequestKind.POOL:
                self.requests[data.req_id] = RequestState(data, None)
                continue
            params = data.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            row = RowState(params, data.prompt_token_ids, list(data.output_token_ids), generator,
                           self.eos_token_ids)
            state = self.requests[data.req_id] = RequestState(data, row)
            if params.structured_outputs is not None:  # a resumed request replays its output so far
                try:
                    row.grammar = self.structured_output.new_grammar(params.structured_outputs, row.output_token_ids)
                except Exception as exc:  # fails this request only (the step's errors path)
                    logger.exception("starting the grammar of request %s failed", data.req_id)
                    state.error = f"structured output: starting its grammar raised {type(exc).__name__}: {exc}"
        for req_id, num_blocks in so.trimmed_blocks.items():
            self.block_tables.truncate(req_id, num_blocks)
        for chunk in so.chunks:
            self.block_tables.update(chunk.req_id, chunk.block_ids[:self.num_groups])

    def _prepare(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                     list[AttentionMetadata | RecurrentMetadata]]:
        """Inputs and one AttentionMetadata per layer (its group's: slots and block tables differ per
        group, the batch layout is shared); recurrent layers share one RecurrentMetadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for chunk in so.chunks:
            n = len(chunk.token_ids)
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(chunk.start_pos + n)
        req_ids = [c.req_id for c in so.chunks]
        # A verification chunk (the last token + drafts) decodes each of its tokens in the batched call.
        decode_rows = [i for i, c in enumerate(so.chunks) if len(c.token_ids) == 1 or c.num_draft_tokens]
        prefill_rows = [i for i, c in enumerate(so.chunks) if len(c.token_ids) > 1 and not c.num_draft_tokens]
        shared: dict = {}  # per-step memo of group-independent tensors, one for every group
        spans = None if self.encoder_cache is None else self.encoder_cache.attention_spans(so, self._features)
        metas = [self.attn_backend.build_metadata(
            slot_mapping=torch.tensor(self._slots(so.chunks, group), dtype=torch.int64, device=self.device),
            block_tables=self.block_tables.gather(req_ids, group), query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_size=self.block_size, decode_rows=decode_rows, prefill_rows=prefill_rows, shared=shared,
            bidirectional_spans=spans) for group in range(self.num_groups)]
        if self.recurrent_states:
            metas.append(self._recurrent_metadata(so.chunks))
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device),
                [metas[group] for group in self.layer_groups])

    def _recurrent_metadata(self, chunks: list[ScheduledChunk]) -> RecurrentMetadata:
        """The step's seats; a chunk that starts its sequence gets its seat zeroed in every recurrent
        layer first (the seat may hold a finished or preempted request's state)."""
        meta = RecurrentMetadata.build([c.block_ids[self.num_groups][0] for c in chunks],
                                       [c.start_pos for c in chunks], [len(c.token_ids) for c in chunks],
                                       self.device)
        fresh = [seat for seat, chunk in zip(meta.seats, chunks) if chunk.start_pos == 0]
        if fresh:
            index = torch.tensor(fresh, dtype=torch.int64, device=self.device)
            for state in self.recurrent_states:
                for tensor in state:
                    tensor.index_fill_(0, index, 0)
        return meta

    def _slots(self, chunks: list[ScheduledChunk], group: int) -> list[int]:
        """Flat cache slot of every new token in this group: one range per block the chunk touches."""
        bs = self.block_size
        slots: list[int] = []
        for chunk in chunks:
            ids, pos, end = chunk.block_ids[group], chunk.start_pos, chunk.start_pos + len(chunk.token_ids)
            while pos < end:
                stop = min(end, (pos // bs + 1) * bs)
                first = ids[pos // bs] * bs + pos % bs
                slots.extend(range(first, first + stop - pos))
                pos = stop
        return slots

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = [c.req_id for c in so.chunks]
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in so.chunks],
                                logprobs=[None] * len(so.chunks))
        out.errors.update({r: state.error for r in req_ids if (state := self.requests[r]).error is not None})
        if not so.chunks:
            return out
        input_ids, positions, layer_meta = self._prepare(so)
        extra = {} if self.pooler is None else token_type_inputs(  # only encoders read token types
            self.model, [len(c.token_ids) for c in so.chunks],
            [self.requests[c.req_id].data.pooling_params for c in so.chunks], self.device)
        if self.encoder_cache is not None:  # images: encode what the scheduler named, splice their rows
            extra.update(self.encoder_cache.model_inputs(so, self._features))
        with self._lora_step(so):
            hidden = self.model(input_ids, positions, self.kv_caches, layer_meta, **extra)
        meta = layer_meta[0]  # the batch layout, the same in every group
        if self.pooler is not None:
            self._pool(so, hidden, meta, out)
            return out

        # Rows whose logits we need: the last token of each sampling chunk and its drafts' positions,
        # plus prompt positions of requests that asked for prompt_logprobs.
        sample_rows = [i for i, c in enumerate(so.chunks) if c.sample and c.req_id not in out.errors]
        prompt_spans = self._prompt_logprob_spans(so, meta)
        wanted = [pos for i in sample_rows for pos in range(
            meta.query_start_loc[i + 1] - 1 - so.chunks[i].num_draft_tokens, meta.query_start_loc[i + 1])]
        num_sampled = len(wanted)
        for _, (first, count, _) in prompt_spans.items():
            wanted.extend(range(first, first + count))
        if not wanted:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(wanted, device=self.device)])
        if logits is None:  # a tensor-parallel worker: its logits went to the driver, which samples
            return out
        if sample_rows:
            self._sample(so, sample_rows, logits[:num_sampled], out)
        offset = num_sampled
        for req_id, (_, count, targets) in prompt_spans.items():
            state = self.requests[req_id]
            entries = prompt_logprobs_for_chunk(logits[offset:offset + count], targets,
                                                self._num_logprobs(state.data.sampling_params.prompt_logprobs))
            offset += count
            chunk = so.chunks[req_ids.index(req_id)]
            out.prompt_logprobs[req_id] = ([None] if chunk.start_pos == 0 else []) + list(entries)
        return out

    def _features(self, req_id: str) -> list[ImageFeature]:
        return self.requests[req_id].data.mm_features

    def _lora_step(self, so: SchedulerOutput) -> contextlib.AbstractContextManager:
        """The forward's rows on their requests' adapters (per token: a chunk's rows share its adapter)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.running([self.requests[c.req_id].data.lora_request for c in so.chunks],
                                 [len(c.token_ids) for c in so.chunks])

    def _pool(self, so: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata,
              out: ModelRunnerOutput) -> None:
        """Pool each prompt whose last token was computed this step (the scheduler sends CLS/MEAN
        prompts whole; a LAST-pooled one may arrive in chunks, only its final row matters)."""
        rows = [i for i, c in enumerate(so.chunks) if c.sample]
        if not rows:
            return
        spans = [(meta.query_start_loc[i], meta.query_start_loc[i + 1]) for i in rows]
        params = [self.requests[so.chunks[i].req_id].data.pooling_params for i in rows]
        for i, vector in zip(rows, self.pooler(hidden, spans, params)):
            out.pooled[so.chunks[i].req_id] = vector

    def _num_logprobs(self, k: int) -> int:
        return self.vocab_size if k == -1 else k

    def _prompt_logprob_spans(self, so: SchedulerOutput, meta: AttentionMetadata) -> dict[str, tuple[int, int, list[int]]]:
        """req_id → (first flat row, row count, target ids) for prompt positions this step covers."""
        spans = {}
        for i, chunk in enumerate(so.chunks):
            state = self.requests[chunk.req_id]
            if state.data.sampling_params.prompt_logprobs is None:
                continue
            prompt = state.data.prompt_token_ids
            end = min(chunk.start_pos + len(chunk.token_ids), len(prompt) - 1)
            if end <= chunk.start_pos:
                if chunk.start_pos == 0:  # a one-token prompt: only the leading None
                    spans[chunk.req_id] = (meta.query_start_loc[i], 0, [])
                continue
            spans[chunk.req_id] = (meta.query_start_loc[i], end - chunk.start_pos, prompt[chunk.start_pos + 1:end + 1])
        return spans

    def _sample(self, so: SchedulerOutput, rows: list[int], logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Sample (and verify the drafts of) every row; rows the sampler refuses fail alone and the rest are
        sampled again. `logits` holds num_draft_tokens + 1 rows per chunk."""
        states = [self.requests[so.chunks[i].req_id] for i in rows]
        drafts = [so.chunks[i].token_ids[len(so.chunks[i].token_ids) - so.chunks[i].num_draft_tokens:] for i in rows]
        first = [0]
        for d in drafts:
            first.append(first[-1] + len(d) + 1)
        keep = list(range(len(rows)))
        while keep:
            try:
                # indexing copies the logits: only when a failed row was dropped
                picked = logits if len(keep) == len(rows) else logits[[p for j in keep for p in range(first[j], first[j + 1])]]
                result = verify(self.sampler, picked, [states[j].row for j in keep], [drafts[j] for j in keep],
                                self.vocab_size, self.device)
                break
            except SamplingRowError as exc:
                bad = {keep[r] for r in exc.rows}
                for j in bad:
                    out.errors[so.chunks[rows[j]].req_id] = f"sampling failed: {exc}"
                keep = [j for j in keep if j not in bad]
        else:
            return
        for j, verified in zip(keep, result):
            row, req_id = states[j].row, so.chunks[rows[j]].req_id
            tokens = verified.token_ids
            if row.grammar is not None:
                tokens = self._advance_grammar(row, req_id, tokens, out)
            row.output_token_ids.extend(tokens)
            out.sampled_token_ids[rows[j]] = tokens
            out.logprobs[rows[j]] = None if verified.logprobs is None else verified.logprobs[:len(tokens)]

    @staticmethod
    def _advance_grammar(row: RowState, req_id: str, token_ids: list[int], out: ModelRunnerOutput) -> list[int]:
        """Feed the kept tokens to the request's grammar, one by one up to the one that completes it (the
        tokens after it are dropped); a rejection or a raise fails that request."""
        for count, token_id in enumerate(token_ids, start=1):
            try:
                accepted = row.grammar.accept([token_id])
            except Exception as exc:
                logger.exception("the grammar of request %s failed to advance", req_id)
                out.errors[req_id] = f"structured output: advancing its grammar raised {type(exc).__name__}: {exc}"
                return token_ids[:count]
            if not accepted:
                out.errors[req_id] = f"structured output: sampled token {token_id} rejected ({row.grammar.error})"
                return token_ids[:count]
            if row.grammar.is_terminated:
                out.grammar_terminated.add(req_id)
                return token_ids[:count]
        return token_ids
