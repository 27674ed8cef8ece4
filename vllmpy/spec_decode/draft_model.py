"""vLLM's `draft_model` speculation: a second checkpoint drafts, batched across requests, on its own KV cache
(its own pool and block tables, sized out of the target's budget by runner/memory.py).

Drafts are the draft's argmax, or with draft_sample_method probabilistic (a request handed over with its
sampling params) samples from the draft's distribution q at the request's temperature / top-k / top-p /
min-p; q of every draft is kept (`draft_probs`) for the verifier's min(1, p/q) test. A seeded request's
draft draws from its own generator, seeded apart from the target's so the two noise streams are unrelated.

The draft runs on a second ModelRunner. Each step the drafter hands `propose_batch` every running decode
with the drafts it may take. A request's draft cache holds a prefix of its tokens; what follows it is fed
first -- the whole prompt the first time, afterwards the tokens the target accepted plus its bonus token --
in forwards of at most max_num_batched_tokens tokens (one, unless a long prompt arrives), whose last
positions give the first drafts; then one forward per further draft position, all requests together: k
forwards per step whatever the batch size. The positions of drafts the target rejected are simply
overwritten next step: a request's computed count falls back to the longest prefix where what its draft
cache holds equals its tokens (accepted drafts keep their KV). Prefix caching is off for the draft: its
blocks are never shared. Finishing, aborting or preempting a request frees its draft blocks; a request the
draft pool cannot hold this step drafts nothing (speculation never preempts anyone).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vllmpy.engine.kv_cache_coordinator import KVCacheCoordinator
from vllmpy.engine.kv_cache_spec import KVCacheConfig
from vllmpy.engine.schedule_types import NewRequestData, ScheduledChunk, SchedulerOutput
from vllmpy.runner.model_runner import ModelRunner
from vllmpy.sampling.metadata import SamplingMetadata
from vllmpy.sampling.sampler import Sampler, SamplerOutput, categorical, random_probs, row_logprobs
from vllmpy.sampling_params import SamplingParams
from vllmpy.spec_decode.draft_checkpoint import DraftModel
from vllmpy.spec_decode.proposer import DraftRequest
from vllmpy.structured_output.manager import StructuredOutputManager

GREEDY = SamplingParams(temperature=0.0)  # draft_sample_method greedy: the draft's argmax
DRAFT_SEED_SALT = 0x5DEECE66D  # a seeded request's draft generator: seed ^ salt, never the target's own seed


def draft_params(params: SamplingParams | None) -> SamplingParams:
    """What the draft samples with: the request's temperature and truncation (penalties, biases and grammars
    stay the target's: q only has to be the distribution the draft really sampled from)."""
    if params is None or params.greedy:
        return GREEDY
    seed = None if params.seed is None else params.seed ^ DRAFT_SEED_SALT
    return SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                          min_p=params.min_p, seed=seed)


class _RecordingSampler(Sampler):
    """The draft runner's sampler: samples as the plain one and keeps each random row's distribution (q)."""

    def __init__(self) -> None:
        super().__init__()
        self.probs: dict[int, torch.Tensor] = {}  # row of the last call -> its q
        self.num_rows = 0

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw, processed, sampled = self.process(logits, meta)
        self.probs, self.num_rows, rnd = {}, meta.num_rows, meta.random
        if rnd is not None:
            index = torch.arange(meta.num_rows, device=logits.device) if rnd.rows is None else rnd.rows
            probs = random_probs(processed.index_select(0, index), rnd)
            sampled = sampled.index_copy(0, index, categorical(probs, rnd.generators))
            self.probs = dict(zip(index.tolist(), probs, strict=True))
        return SamplerOutput(sampled=sampled, logprobs=row_logprobs(raw, sampled, meta))


@dataclass
class _Sequence:
    """One request in the draft cache. The coordinator reads request_id and num_computed_tokens only (with
    prefix caching off it never looks at tokens), so this stands in for the scheduler's Request there."""

    request_id: str
    num_computed_tokens: int = 0
    tokens: list[int] = field(default_factory=list)  # what the cache holds at positions 0..num_computed - 1
    num_verified: int = 0  # leading entries of `tokens` that were the request's own (the rest: its drafts)
    num_prompt_tokens: int = 0
    in_runner: bool = False  # the runner has its state (sent once in new_requests)
    params: SamplingParams = field(default_factory=lambda: GREEDY)  # what its drafts sample with (draft_params)


class DraftModelProposer:
    """A BatchProposer over a draft model's runner and block pool."""

    def __init__(self, runner: ModelRunner, kv: KVCacheCoordinator, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self._seqs: dict[str, _Sequence] = {}
        self._forgotten: set[str] = set()  # freed since the runner's last step: it drops their state then
        self.sampler = runner.sampler = _RecordingSampler()
        self._probs: dict[str, list[torch.Tensor | None]] = {}  # this step's q per draft (None: one-hot)

    @classmethod
    def build(cls, draft: DraftModel, num_blocks: int, device: torch.device, dtype: torch.dtype,
              max_num_batched_tokens: int) -> DraftModelProposer:
        config = KVCacheConfig(num_blocks, draft.layout)
        ckpt = draft.checkpoint
        runner = ModelRunner(draft.model, device, dtype, config, draft.vocab_size, ckpt.eos_token_ids,
                             StructuredOutputManager(ckpt.tokenizer, draft.vocab_size, ckpt.eos_token_ids))
        return cls(runner, KVCacheCoordinator(config, enable_caching=False), draft.max_model_len,
                   max_num_batched_tokens)

    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        return self.propose_batch([DraftRequest(req_id, token_ids, num_prompt_tokens, k)])[0]

    def propose_batch(self, batch: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {request.req_id: [] for request in batch}
        self._probs = {request.req_id: [] for request in batch}
        wanted: dict[str, int] = {}
        feeds: list[tuple[_Sequence, Sequence[int]]] = []
        for request in batch:
            # Feeding drafts 1..k-1 writes positions up to len + k - 2, inside the draft's context.
            k = min(request.k, self.max_model_len - len(request.token_ids) + 1)
            seq = self._seqs.get(request.req_id) or _Sequence(
                request.req_id, num_prompt_tokens=request.num_prompt_tokens,
                params=draft_params(request.sampling_params))
            start = _reusable(seq, request.token_ids)
            seq.num_computed_tokens = start
            # Allocated at the verified count, so a sliding window never drops what a rollback needs again.
            if k <= 0 or not self.kv.allocate_slots(seq, len(request.token_ids) - start + k - 1):
                continue
            self._seqs[request.req_id] = seq
            del seq.tokens[start:]
            seq.tokens.extend(request.token_ids[start:])
            seq.num_verified = len(request.token_ids)
            wanted[request.req_id] = k
            feeds.append((seq, request.token_ids[start:]))
        self._catch_up(feeds, drafts)
        for _ in range(max(wanted.values(), default=0) - 1):
            chunks = [ScheduledChunk(req_id, [tokens[-1]], self._seqs[req_id].num_computed_tokens,
                                     self.kv.new_block_ids(req_id), sample=True) for req_id, tokens in drafts.items()
                      if tokens and len(tokens) < wanted[req_id]]
            if not chunks:
                break
            self._step(chunks, drafts)
        for seq, _ in feeds:  # the cache now also holds every draft but the last
            seq.tokens.extend(drafts[seq.request_id][:-1])
            seq.num_computed_tokens = len(seq.tokens)
        return [self._verifiable(request.req_id, drafts[request.req_id]) for request in batch]

    def _verifiable(self, req_id: str, drafts: list[int]) -> list[int]:
        """The drafts up to the first sampled one whose q is unknown (a row failed mid-sampling: the
        sampler's rows shifted); the verifier cannot test a sampled draft without its q."""
        seq, probs = self._seqs.get(req_id), self._probs[req_id]
        if seq is None or seq.params.greedy:
            probs[:] = [None] * len(probs)
            return drafts
        cut = next((i for i, q in enumerate(probs) if q is None), len(probs))
        del probs[cut:]
        return drafts[:cut]

    def _catch_up(self, feeds: list[tuple[_Sequence, Sequence[int]]], drafts: dict[str, list[int]]) -> None:
        """Feed each request's tokens past its cached prefix, max_num_batched_tokens per forward; the
        forward holding a request's last token gives its first draft."""
        while feeds:
            budget = self.max_num_batched_tokens
            chunks, rest = [], []
            for seq, feed in feeds:
                n = min(len(feed), budget)
                if n < len(feed):
                    rest.append((seq, feed[n:]))
                if n == 0:
                    continue
                chunks.append(ScheduledChunk(seq.request_id, list(feed[:n]), seq.num_computed_tokens,
                                             self.kv.new_block_ids(seq.request_id), sample=n == len(feed)))
                budget -= n
            self._step(chunks, drafts)
            feeds = rest

    def _step(self, chunks: list[ScheduledChunk], drafts: dict[str, list[int]]) -> None:
        """One draft forward; each chunk's sampled token joins its request's drafts."""
        out = self.runner.execute(self._scheduler_output(chunks))
        rows = [c.req_id for c in chunks if c.sample and c.req_id not in out.errors]  # the sampler's rows
        known = len(rows) == self.sampler.num_rows  # else a row failed mid-sampling: rows shifted
        q = {req_id: self.sampler.probs.get(row) for row, req_id in enumerate(rows)} if known else {}
        for chunk, sampled in zip(chunks, out.sampled_token_ids, strict=True):
            self._seqs[chunk.req_id].num_computed_tokens += len(chunk.token_ids)
            if chunk.sample and sampled and chunk.req_id not in out.errors:
                drafts[chunk.req_id].append(sampled[0])
                self._probs[chunk.req_id].append(q.get(chunk.req_id))

    def _scheduler_output(self, chunks: list[ScheduledChunk]) -> SchedulerOutput:
        """The draft runner's step: the chunks, requests it sees for the first time, those freed since."""
        new = []
        for chunk in chunks:
            seq = self._seqs[chunk.req_id]
            if not seq.in_runner:
                new.append(NewRequestData(seq.request_id, seq.tokens[:seq.num_prompt_tokens], [], seq.params))
                seq.in_runner = True
        forgotten, self._forgotten = self._forgotten, set()
        return SchedulerOutput(chunks=chunks, new_requests=new, finished_req_ids=forgotten)

    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        rows = self._probs.get(req_id)
        return torch.stack(rows) if rows and rows[0] is not None else None  # _verifiable: all rows or none

    def on_request_finished(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._free(req_id)

    def on_request_preempted(self, req_id: str) -> None:
        self._free(req_id)

    def _free(self, req_id: str) -> None:
        seq = self._seqs.pop(req_id, None)
        if seq is None:
            return
        self.kv.free(seq)
        if seq.in_runner:
            self._forgotten.add(req_id)


def _reusable(seq: _Sequence, token_ids: Sequence[int]) -> int:
    """How many leading positions of the draft cache already hold `token_ids` (never the last token: its
    forward gives the first draft). Only positions past the verified ones can differ."""
    limit = min(len(seq.tokens), len(token_ids) - 1)
    n = min(seq.num_verified, limit)
    while n < limit and seq.tokens[n] == token_ids[n]:
        n += 1
    return n
