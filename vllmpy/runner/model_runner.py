"""SchedulerOutput → input tensors + AttentionMetadata → model → sampler → plain lists.

The runner keeps per-request sampling state (params, generator, tokens so far) between steps; the
scheduler sends it once per (re)start in `new_requests` and tells it when to forget.
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllmpy.attention.base import AttentionMetadata
from vllmpy.engine.schedule_types import ModelRunnerOutput, NewRequestData, SchedulerOutput
from vllmpy.layers.pooler import Pooler
from vllmpy.models.base import CausalLM
from vllmpy.sampling import RowState, Sampler, SamplingMetadata, SamplingRowError, prompt_logprobs_for_chunk
from vllmpy.sampling.logits_processors import LogitsProcessor
from vllmpy.structured_output.manager import StructuredOutputManager


def allocate_kv_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> list[torch.Tensor]:
    """Zeroed per-layer caches. On the CPU they live in one anonymous mmap: the kernel hands out
    zero pages on first touch, so a large pool costs nothing until blocks are used (torch.zeros
    would write every byte up front: ~8 s for 4 GiB here)."""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    per_layer = math.prod(shape)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(1, num_layers * per_layer * itemsize))
    flat = torch.frombuffer(buffer, dtype=dtype, count=num_layers * per_layer)
    return [flat[i * per_layer:(i + 1) * per_layer].view(shape) for i in range(num_layers)]


@dataclass
class RequestState:
    data: NewRequestData
    row: RowState | None  # None for a pooling request


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, block_size: int,
                 num_blocks: int, vocab_size: int, eos_token_ids: set[int],
                 structured_output: StructuredOutputManager, logits_processors: Sequence[LogitsProcessor] = (),
                 pooler: Pooler | None = None) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        num_layers, kv_heads, head_dim = model.kv_cache_shape()
        self.kv_caches = allocate_kv_caches(num_layers, (2, num_blocks, block_size, kv_heads, head_dim), dtype, device)
        self.sampler = Sampler(logits_processors)
        self.structured_output = structured_output
        self.requests: dict[str, RequestState] = {}
        self.pooler = pooler  # set for an embedding model: finished prompts are pooled, nothing is sampled

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
        for data in so.new_requests:
            params = data.sampling_params
            if params is None:
                self.requests[data.req_id] = RequestState(data, None)
                continue
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            row = RowState(params, data.prompt_token_ids, list(data.output_token_ids), generator,
                           self.eos_token_ids)
            if params.structured_outputs is not None:  # a resumed request replays its output so far
                row.grammar = self.structured_output.new_grammar(params.structured_outputs, row.output_token_ids)
            self.requests[data.req_id] = RequestState(data, row)

    def _prepare(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        bs = self.block_size
        for chunk in so.chunks:
            n = len(chunk.token_ids)
            input_ids.extend(chunk.token_ids)
            pos = range(chunk.start_pos, chunk.start_pos + n)
            positions.extend(pos)
            slots.extend(chunk.block_ids[p // bs] * bs + p % bs for p in pos)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(chunk.start_pos + n)
        width = max(len(c.block_ids) for c in so.chunks)
        table = torch.zeros(len(so.chunks), width, dtype=torch.int64)
        for i, chunk in enumerate(so.chunks):
            table[i, :len(chunk.block_ids)] = torch.tensor(chunk.block_ids, dtype=torch.int64)
        decode_rows = [i for i, c in enumerate(so.chunks) if len(c.token_ids) == 1]
        prefill_rows = [i for i, c in enumerate(so.chunks) if len(c.token_ids) > 1]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            block_tables=table.to(self.device), query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_size=bs, decode_rows=decode_rows, prefill_rows=prefill_rows)
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(positions, dtype=torch.int64, device=self.device), meta)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        req_ids = [c.req_id for c in so.chunks]
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in so.chunks],
                                logprobs=[None] * len(so.chunks))
        if not so.chunks:
            return out
        input_ids, positions, meta = self._prepare(so)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if self.pooler is not None:
            self._pool(so, hidden, meta, out)
            return out

        # Rows whose logits we need: the last token of each sampling chunk, plus prompt positions
        # of requests that asked for prompt_logprobs.
        sample_rows = [i for i, c in enumerate(so.chunks) if c.sample]
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
                if not row.grammar.accept([token_id]):
                    out.errors[req_id] = f"structured output: sampled token {token_id} rejected ({row.grammar.error})"
                elif row.grammar.is_terminated:
                    out.grammar_terminated.add(req_id)
