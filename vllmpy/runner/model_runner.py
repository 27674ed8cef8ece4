"""SchedulerOutput → input tensors + AttentionMetadata → model → sampler → plain lists.

The runner keeps per-request sampling state (params, generator, tokens so far) between steps; the
scheduler sends it once per (re)start in `new_requests` and tells it when to forget.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllmpy.attention.backends import BACKEND_ENV, select_backend
from vllmpy.attention.base import AttentionMetadata, GroupInputs, StepLayout
from vllmpy.attention.kv_storage import PagedKVCache
from vllmpy.attention.layer import PagedAttention
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.request import RequestKind
from vllmpy.engine.schedule_types import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from vllmpy.layers.decode_replay import DecodeReplay
from vllmpy.layers.pooler import Pooler, token_type_inputs
from vllmpy.layers.recurrent_state import RecurrentMetadata, RecurrentState
from vllmpy.lora.manager import LoRAManager
from vllmpy.models.base import CausalLM
from vllmpy.multimodal.encoder_cache import EncoderCache
from vllmpy.multimodal.inputs import ImageFeature
from vllmpy.multimodal.mrope import mrope_inputs
from vllmpy.runner.block_table import BlockTables
from vllmpy.runner.recurrent_steps import RecurrentSteps
from vllmpy.sampling import RowState, Sampler, SamplingRowError, prompt_logprobs_for_chunk
from vllmpy.sampling.logits_processors import LogitsProcessor
from vllmpy.spec_decode.rejection import verify
from vllmpy.structured_output.manager import StructuredOutputManager

logger = logging.getLogger("vllmpy")


def allocate_kv_caches(config: KVCacheConfig,
                       device: torch.device) -> tuple[list[torch.Tensor], list[PagedKVCache | RecurrentState]]:
    """Zeroed shared byte buffers (one per layer slot of a group, num_blocks pages each) and every
    layer's cache viewed over its slot in its spec's layout: layer i of each group uses buffer i.
    A recurrent layer gets its own state tensors, one row per seat, then one per prefix-cache snapshot
    slot (also listed in the buffers).

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
        caches[layer] = spec.allocate(config.num_seats + config.num_snapshots, device)
        buffers.extend(caches[layer])
    return buffers, caches


@dataclass
class ForwardedStep:
    """A step between its forward and its sampling: the final hidden states (none when nothing ran)."""

    so: SchedulerOutput
    out: ModelRunnerOutput
    hidden: torch.Tensor | None = None


def query_start_loc(chunks: Sequence[ScheduledChunk]) -> list[int]:
    """[S + 1] offsets of each chunk's tokens in the step's flat batch."""
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + len(chunk.token_ids))
    return starts


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
        if lora is not None:  # adapters attach as requests name them and follow each step's mapping: no replays
            for module in model.modules():
                if isinstance(getattr(module, "decode_replay", None), DecodeReplay):
                    module.decode_replay.enabled = False
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
        # read the step's RecurrentMetadata, after the groups' (a chunk's new_block_ids end with its seat).
        self.num_groups = len(kv_cache_config.groups)
        self.recurrent_states = [self.kv_caches[layer] for layer, _ in kv_cache_config.layout.recurrent]
        # seats zeroed / resumed from snapshots, states captured mid-chunk, verified drafts committed
        self.recurrent = RecurrentSteps(self.recurrent_states, kv_cache_config.num_seats, device) \
            if self.recurrent_states else None
        self.layer_groups = [self.num_groups] * len(self.kv_caches)
        for index, group in enumerate(kv_cache_config.groups):
            for layer in group.layers:
                self.layer_groups[layer] = index
        views = [set() for _ in range(self.num_groups)]  # each group's layers' decode views (build_metadata)
        for layer, module in enumerate(model.stateful_layers()):
            if isinstance(module, PagedAttention):
                views[self.layer_groups[layer]].add(module.spec.decode_view)
        self.group_views = [frozenset(group) for group in views]
        self.sampler = Sampler(logits_processors)
        self.structured_output = structured_output
        self.requests: dict[str, RequestState] = {}
        self.block_tables = BlockTables(len(kv_cache_config.groups), device)
        self.pooler = pooler  # set for an embedding model: finished prompts are pooled, nothing is sampled
        # A model that takes images: its encoder outputs between the step that encodes and the span's prefill.
        self.encoder_cache = EncoderCache(model, device) if hasattr(model, "encode_images") else None
        # MTP speculation (spec_decode/mtp.py): handed each finished step's final hidden states [T, hidden]
        # with its output, so the MTP block reads them before the next forward replaces them. None = off.
        self.hidden_observer: Callable[[SchedulerOutput, torch.Tensor, ModelRunnerOutput], None] | None = None

    @property
    def kv_cache_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.kv_buffers)  # layers' views share these bytes

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.requests.pop(req_id, None)
            if self.recurrent is not None:
                self.recurrent.forget(req_id)
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
            self.block_tables.append(chunk.req_id, chunk.new_block_ids[:self.num_groups])

    def _prepare(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                     list[AttentionMetadata | RecurrentMetadata]]:
        """Inputs and one AttentionMetadata per layer (its group's: slots and block tables differ per
        group, the batch layout is shared); recurrent layers share one RecurrentMetadata."""
        input_ids: list[int] = []
        positions: list[int] = []
        for chunk in so.chunks:
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids)))
        positions_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        req_ids = [c.req_id for c in so.chunks]
        spans = None if self.encoder_cache is None else self.encoder_cache.attention_spans(so, self._features)
        layout = StepLayout(query_start_loc(so.chunks), [c.start_pos + len(c.token_ids) for c in so.chunks],
                            [c.num_draft_tokens for c in so.chunks], self.block_size, spans)
        rows = self.block_tables.row_index(req_ids)
        token_rows = rows if len(positions) == len(rows) else rows.repeat_interleave(  # each token's row
            torch.tensor([len(c.token_ids) for c in so.chunks], device=self.device))
        groups = [GroupInputs(self.block_tables.slot_mapping(token_rows, positions_t, self.block_size, group),
                              self.block_tables.gather(req_ids, rows, group), self.group_views[group])
                  for group in range(self.num_groups)]
        metas: list[AttentionMetadata | RecurrentMetadata] = self.attn_backend.build_metadata(layout, groups)
        if self.recurrent_states:
            metas.append(self._recurrent_metadata(so.chunks))
        return (torch.tensor(input_ids, dtype=torch.int64, device=self.device), positions_t,
                [metas[group] for group in self.layer_groups])

    def _recurrent_metadata(self, chunks: list[ScheduledChunk]) -> RecurrentMetadata:
        """The step's seats, each ready to continue from (runner/recurrent_steps.py)."""
        return self.recurrent.metadata(chunks, [c.new_block_ids[self.num_groups][0] for c in chunks])

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.finish_step(self.forward_step(so))

    @torch.inference_mode()
    def forward_step(self, so: SchedulerOutput, model_inputs: dict | None = None) -> ForwardedStep:
        """The step's forward; finish_step pools or samples it. Apart so that under pipeline parallel the
        driver runs stage 0 of the next micro-batch before it samples this one (distributed/executor.py).
        model_inputs: extra keyword inputs of the model's forward (an MTP block's previous hidden states)."""
        self._update_states(so)
        req_ids = [c.req_id for c in so.chunks]
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in so.chunks],
                                logprobs=[None] * len(so.chunks))
        out.errors.update({r: state.error for r in req_ids if (state := self.requests[r]).error is not None})
        if not so.chunks:
            return ForwardedStep(so, out)
        input_ids, positions, layer_meta = self._prepare(so)
        extra = {} if self.pooler is None else token_type_inputs(  # only encoders read token types
            self.model, [len(c.token_ids) for c in so.chunks],
            [self.requests[c.req_id].data.pooling_params for c in so.chunks], self.device)
        if self.encoder_cache is not None:  # images: encode what the scheduler named, splice their rows
            extra.update(self.encoder_cache.model_inputs(so, self._features))
            extra.update(mrope_inputs(self.model, so, self._features, self.device))  # Qwen-VL's 3-D positions
        extra.update(model_inputs or {})
        with self._lora_step(so):
            hidden = self.model(input_ids, positions, self.kv_caches, layer_meta, **extra)
        if self.recurrent is not None:
            self.recurrent.after_forward()
        return ForwardedStep(so, out, hidden)

    def finish_step(self, step: ForwardedStep) -> ModelRunnerOutput:
        out = self._finish_step(step)
        if self.hidden_observer is not None and step.hidden is not None:
            self.hidden_observer(step.so, step.hidden, out)
        return out

    @torch.inference_mode()
    def _finish_step(self, step: ForwardedStep) -> ModelRunnerOutput:
        so, out, hidden = step.so, step.out, step.hidden
        if hidden is None:  # nothing was scheduled
            return out
        req_ids = out.req_ids
        starts = query_start_loc(so.chunks)
        if self.pooler is not None:
            self._pool(so, hidden, starts, out)
            return out

        # Rows whose logits we need: the last token of each sampling chunk and its drafts' positions,
        # plus prompt positions of requests that asked for prompt_logprobs.
        sample_rows = [i for i, c in enumerate(so.chunks) if c.sample and c.req_id not in out.errors]
        prompt_spans = self._prompt_logprob_spans(so, starts)
        wanted = [pos for i in sample_rows for pos in range(
            starts[i + 1] - 1 - so.chunks[i].num_draft_tokens, starts[i + 1])]
        num_sampled = len(wanted)
        for _, (first, count, _) in prompt_spans.items():
            wanted.extend(range(first, first + count))
        if not wanted:
            return out
        logits = self.model.compute_logits(hidden[torch.tensor(wanted, device=self.device)])
        if logits is None:  # a tensor-parallel worker or a later pipeline stage: the driver samples
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

    def _pool(self, so: SchedulerOutput, hidden: torch.Tensor, starts: list[int], out: ModelRunnerOutput) -> None:
        """Pool each prompt whose last token was computed this step (the scheduler sends CLS/MEAN
        prompts whole; a LAST-pooled one may arrive in chunks, only its final row matters)."""
        rows = [i for i, c in enumerate(so.chunks) if c.sample]
        if not rows:
            return
        spans = [(starts[i], starts[i + 1]) for i in rows]
        params = [self.requests[so.chunks[i].req_id].data.pooling_params for i in rows]
        for i, vector in zip(rows, self.pooler(hidden, spans, params)):
            out.pooled[so.chunks[i].req_id] = vector

    def _num_logprobs(self, k: int) -> int:
        return self.vocab_size if k == -1 else k

    def _prompt_logprob_spans(self, so: SchedulerOutput, starts: list[int]) -> dict[str, tuple[int, int, list[int]]]:
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
                    spans[chunk.req_id] = (starts[i], 0, [])
                continue
            spans[chunk.req_id] = (starts[i], end - chunk.start_pos, prompt[chunk.start_pos + 1:end + 1])
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
                                self.vocab_size, self.device, [so.chunks[rows[j]].draft_probs for j in keep])
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
