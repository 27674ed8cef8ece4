"""SchedulerOutput → input tensors + AttentionMetadata → model → sampler → plain lists.

The runner keeps per-request sampling state (params, generator, tokens so far) between steps; the
scheduler sends it once per (re)start in `new_requests` and tells it when to forget.
"""
from __future__ import annotations

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
from vllmpy.models.base import CausalLM
from vllmpy.runner.block_table import BlockTables
from vllmpy.sampling import RowState, Sampler, SamplingMetadata, SamplingRowError, prompt_logprobs_for_chunk
from vllmpy.sampling.logits_processors import LogitsProcessor
from vllmpy.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("vllmpy")


def allocate_kv_caches(config: KVCacheConfig, device: torch.device) -> tuple[list[torch.Tensor], list[PagedKVCache]]:
    """Zeroed shared byte buffers (one per layer slot of a group, num_blocks pages each) and every
    layer's cache viewed over its slot in its spec's layout: layer i of each group uses buffer i.

    On the CPU the buffers live in one anonymous mmap: the kernel hands out zero pages on first touch,
    so a large pool costs nothing until blocks are used (torch.zeros would write every byte up front:
    ~8 s for 4 GiB here)."""
    layout = config.layout
    size = config.num_blocks * layout.page_bytes
    total = layout.layers_per_group * size
    if device.type == "cpu":
        flat = torch.frombuffer(mmap.mmap(-1, max(1, total)), dtype=torch.uint8, count=total)
    else:
        flat = torch.zeros(total, dtype=torch.uint8, device=device)
    buffers = [flat[i * size:(i + 1) * size] for i in range(layout.layers_per_group)]
    caches: list[PagedKVCache | None] = [None] * layout.num_layers
    for group in layout.groups:
        for slot, layer in enumerate(group.layers):
            caches[layer] = group.spec.view(buffers[slot], config.num_blocks)
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
                 pooler: Pooler | None = None) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = kv_cache_config.block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.attn_backend = select_backend(device)
        logger.info("attention backend: %s (%s overrides)", self.attn_backend.name, BACKEND_ENV)
        self.kv_buffers, self.kv_caches = allocate_kv_caches(kv_cache_config, device)
        for cache, layer in zip(self.kv_caches, model.attention_layers()):  # an fp8 cache's per-layer scales
            cache.k_scale, cache.v_scale = layer.k_scale, layer.v_scale
        # Each layer's KV cache group: its attention reads that group's block table.
        self.layer_groups = [0] * len(self.kv_caches)
        for index, group in enumerate(kv_cache_config.groups):
            for layer in group.layers:
                self.layer_groups[layer] = index
        self.sampler = Sampler(logits_processors)
        self.structured_output = structured_output
        self.requests: dict[str, RequestState] = {}
        self.block_tables = BlockTables(len(kv_cache_config.groups), device)
        self.pooler = pooler  # set for an embedding model: finished prompts are pooled, nothing is sampled

    @property
    def kv_cache_bytes(self) -> int:
        return sum(buffer.numel() for buffer in self.kv_buffers)  # layers' views share these bytes

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
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
        for chunk in so.chunks:
            self.block_tables.update(chunk.req_id, chunk.block_ids)

    def _prepare(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """Inputs and one AttentionMetadata per layer (its group's: slots and block tables differ per
        group, the batch layout is shared)."""
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
        decode_rows = [i for i, c in enumerate(so.chunks) if len(c.token_ids) == 1]
        prefill_rows = [i for i, c in enumerate(so.chunks) if len(c.token_ids) > 1]
        shared: dict = {}  # per-step memo of group-independent tensors, one for every group
        metas = [self.attn_backend.build_metadata(
            slot_mapping=torch.tensor(self._slots(so.chunks, group), dtype=torch.int64, device=self.device),
            block_tables=self.block_tables.gather(req_ids, group), query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_size=self.block_size, decode_rows=decode_rows, prefill_rows=prefill_rows, shared=shared)
            for group in range(len(so.chunks[0].block_ids))]
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device),
                [metas[group] for group in self.layer_groups])

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
        hidden = self.model(input_ids, positions, self.kv_caches, layer_meta, **extra)
        meta = layer_meta[0]  # the batch layout, the same in every group
        if self.pooler is not None:
            self._pool(so, hidden, meta, out)
            return out

        # Rows whose logits we need: the last token of each sampling chunk, plus prompt positions
        # of requests that asked for prompt_logprobs.
        sample_rows = [i for i, c in enumerate(so.chunks) if c.sample and c.req_id not in out.errors]
        prompt_spans = self._prompt_logprob_spans(so, meta)
        wanted = [meta.query_start_loc[i + 1] - 1 for i in sample_rows]
        for _, (first, count, _) in prompt_spans.items():
            wanted.extend(range(first, first + count))
        if not wanted:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(wanted, device=self.device)])
        if sample_rows:
            self._sample(so, sample_rows, logits[:len(sample_rows)], out)
        offset = len(sample_rows)
        for req_id, (_, count, targets) in prompt_spans.items():
            state = self.requests[req_id]
            entries = prompt_logprobs_for_chunk(logits[offset:offset + count], targets,
                                                self._num_logprobs(state.data.sampling_params.prompt_logprobs))
            offset += count
            chunk = so.chunks[req_ids.index(req_id)]
            out.prompt_logprobs[req_id] = ([None] if chunk.start_pos == 0 else []) + list(entries)
        return out

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
        """Sample every row; rows the sampler refuses fail alone and the rest are sampled again."""
        states = [self.requests[so.chunks[i].req_id] for i in rows]
        keep = list(range(len(rows)))
        while keep:
            try:
                meta = SamplingMetadata.build([states[j].row for j in keep], self.vocab_size, self.device)
                # indexing copies the [rows, vocab] logits: only when a failed row was dropped
                result = self.sampler(logits if len(keep) == len(rows) else logits[keep], meta)
                break
            except SamplingRowError as exc:
                bad = {keep[r] for r in exc.rows}
                for j in bad:
                    out.errors[so.chunks[rows[j]].req_id] = f"sampling failed: {exc}"
                keep = [j for j in keep if j not in bad]
        else:
            return
        for pos, (j, token_id) in enumerate(zip(keep, result.sampled.tolist())):
            row, req_id = states[j].row, so.chunks[rows[j]].req_id
            row.output_token_ids.append(token_id)
            out.sampled_token_ids[rows[j]] = [token_id]
            out.logprobs[rows[j]] = result.logprobs[pos]
            if row.grammar is not None:
                self._advance_grammar(row, req_id, token_id, out)

    @staticmethod
    def _advance_grammar(row: RowState, req_id: str, token_id: int, out: ModelRunnerOutput) -> None:
        """Feed the sampled token to the request's grammar; a rejection or a raise fails that request."""
        try:
            accepted = row.grammar.accept([token_id])
        except Exception as exc:
            logger.exception("the grammar of request %s failed to advance", req_id)
            out.errors[req_id] = f"structured output: advancing its grammar raised {type(exc).__name__}: {exc}"
            return
        if not accepted:
            out.errors[req_id] = f"structured output: sampled token {token_id} rejected ({row.grammar.error})"
        elif row.grammar.is_terminated:
            out.grammar_terminated.add(req_id)
