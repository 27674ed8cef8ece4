"""Lossless verification of draft tokens: each position's logits go through the request's whole sampling
pipeline, then rejection sampling decides how many drafts to keep.

A request with d drafts has d + 1 logits rows; row j is processed as if the first j drafts were already
output (penalties, min_tokens, custom processors, grammar mask), with the request's own generator.
Greedy rows keep drafts while each equals the argmax, then the argmax. Random rows follow Leviathan et
al.: draft x, sampled from the proposer's q, is kept with probability min(1, p(x) / q(x)); on the first
reject the token is sampled from max(p - q, 0) (renormalised); if all are kept the bonus is sampled from the
last row. A deterministic proposer's q is one-hot at x: keep with p(x), else sample p with x removed. Either
way the output has exactly the distribution of sampling one token at a time. Logprobs are the
target's raw logprobs of the kept tokens, as without speculation.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from vllmpy.engine.schedule_types import SampledLogprobs
from vllmpy.sampling.metadata import RowState, SamplingMetadata, SamplingRowError
from vllmpy.sampling.penalties import TokenCounts
from vllmpy.sampling.sampler import Sampler, categorical, random_probs, row_logprobs
from vllmpy.structured_output.bitmask import allocate_bitmask


@dataclass
class Verified:
    token_ids: list[int]  # the kept drafts, then the bonus or corrected token: 1..d + 1 tokens
    logprobs: list[SampledLogprobs] | None  # one per kept token, when the request asked for them


class _MaskAt:
    """Stands in for a grammar at one draft position: its bitmask row was computed by walking the real
    matcher through the drafts (then rolled back), so the sampler reads the state after the prefix."""

    error = None

    def __init__(self, mask: torch.Tensor, vocab_size: int) -> None:
        self._mask = mask
        self.vocab_size = vocab_size

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self._mask)


def verify(sampler: Sampler, logits: torch.Tensor, rows: Sequence[RowState], drafts: Sequence[list[int]],
           vocab_size: int, device: torch.device,
           draft_probs: Sequence[torch.Tensor | None] | None = None) -> list[Verified]:
    """`logits`: len(drafts[i]) + 1 rows per request i, in order; `draft_probs[i]`: q of request i's drafts
    ([len(drafts[i]), vocab]) when they were sampled, None when one-hot. A request whose grammar refuses a
    draft verifies only the drafts before it (that draft could never be kept).

    Raises SamplingRowError naming requests (indices into `rows`) that cannot be sampled."""
    masks = [_grammar_masks(row, d) if row.grammar is not None and d else None for row, d in zip(rows, drafts)]
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    drafts = [list(d) if m is None else list(d[:len(m) - 1]) for d, m in zip(drafts, masks)]
    if starts[-1] != sum(len(d) + 1 for d in drafts):  # a grammar cut some drafts: drop their rows
        logits = logits[[starts[i] + j for i, d in enumerate(drafts) for j in range(len(d) + 1)]]
    owner: list[int] = []  # virtual row -> request
    virtual: list[RowState] = []
    q_rows: list[torch.Tensor | None] = []  # virtual row -> q of its draft (None: one-hot, or a bonus row)
    for i, (row, d) in enumerate(zip(rows, drafts)):
        virtual += _position_rows(row, d, masks[i], vocab_size, device)
        owner += [i] * (len(d) + 1)
        q = None if draft_probs is None else draft_probs[i]
        q_rows += [None if q is None else q[j] for j in range(len(d))] + [None]
    try:
        meta = SamplingMetadata.build(virtual, vocab_size, device)
        if any(drafts):
            raw, processed, greedy = sampler.process(logits, meta)
            candidate, accepted = _decide(processed, greedy, meta, drafts, q_rows, device)
            logprobs = row_logprobs(raw, candidate, meta)
        else:  # nothing to verify: the plain sampler, token for token as without speculation
            result = sampler(logits, meta)
            candidate, logprobs = result.sampled, result.logprobs
            accepted = torch.zeros_like(candidate, dtype=torch.bool)
    except SamplingRowError as exc:
        raise SamplingRowError(sorted({owner[r] for r in exc.rows}), str(exc)) from None
    out: list[Verified] = []
    flat = 0
    candidate_ids, accepted_ids = candidate.tolist(), accepted.tolist()
    for i, d in enumerate(drafts):
        kept = 0
        while kept < len(d) and accepted_ids[flat + kept]:
            kept += 1
        positions = range(flat, flat + kept + 1)
        entries = [logprobs[p] for p in positions]
        out.append(Verified([candidate_ids[p] for p in positions],
                            None if entries[0] is None else entries))
        flat += len(d) + 1
    return out


def _position_rows(row: RowState, drafts: list[int], masks: list[torch.Tensor] | None, vocab_size: int,
                   device: torch.device) -> list[RowState]:
    """One RowState per position: the output as if drafts[:j] were already sampled (penalty counts are
    forks of the request's, each folding in its own draft prefix)."""
    if not drafts:
        return [row]
    params = row.params
    penalized = params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
    if penalized:
        row.counts = row.counts or TokenCounts(row.prompt_token_ids, vocab_size, device)
        row.counts.update(row.output_token_ids)
    out = []
    for j in range(len(drafts) + 1):
        grammar = None if masks is None else _MaskAt(masks[j], row.grammar.vocab_size)
        out.append(replace(row, output_token_ids=row.output_token_ids + drafts[:j], grammar=grammar,
                           counts=row.counts.fork() if penalized else None))
    return out


def _grammar_masks(row: RowState, drafts: list[int]) -> list[torch.Tensor]:
    """Bitmask rows at positions 0..n, n = the drafts the grammar allows in a row (stopping before one that
    completes it: nothing may be sampled after a completed grammar). The matcher ends where it began."""
    grammar = row.grammar
    masks = []
    consumed = 0
    while True:
        mask = allocate_bitmask(1, grammar.vocab_size)
        grammar.fill_bitmask(mask, 0)
        masks.append(mask[0])
        if consumed == len(drafts):
            break
        token = drafts[consumed]
        if not _allowed(mask[0], token, grammar.vocab_size) or not grammar.accept([token]):
            break
        if grammar.is_terminated:
            grammar.rollback(1)
            break
        consumed += 1
    grammar.rollback(consumed)
    return masks


def _allowed(mask: torch.Tensor, token: int, vocab_size: int) -> bool:
    return 0 <= token < vocab_size and bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _decide(processed: torch.Tensor, greedy: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]],
            q_rows: list[torch.Tensor | None], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per virtual row: the token kept there if verification reaches it, and whether its draft is accepted
    (False on bonus rows)."""
    draft_at = torch.tensor([t for d in drafts for t in d + [-1]], dtype=torch.int64, device=device)
    has_draft = draft_at >= 0
    accepted = has_draft & (draft_at == greedy)
    candidate = greedy.clone()
    rnd = meta.random
    if rnd is None:
        return candidate, accepted
    index = torch.arange(meta.num_rows, device=device) if rnd.rows is None else rnd.rows
    probs = random_probs(processed.index_select(0, index), rnd)
    x, with_draft = draft_at.index_select(0, index), has_draft.index_select(0, index)
    p_x = probs.gather(1, x.clamp(min=0).unsqueeze(1)).squeeze(1)
    q_x = torch.ones_like(p_x)  # one-hot drafts
    residual = probs.clone()
    picked = with_draft.nonzero().squeeze(1)
    residual[picked, x[picked]] = 0.0  # p with the draft removed; categorical needs no renormalising
    sampled = [(pos, q) for pos, virtual in enumerate(index.tolist()) if (q := q_rows[virtual]) is not None] \
        if any(q is not None for q in q_rows) else []
    for pos, q in sampled:  # a sampled draft: keep with min(1, p(x) / q(x)), else sample max(p - q, 0)
        q_x[pos] = q[x[pos]]
        excess = (probs[pos] - q).clamp_(min=0.0)
        residual[pos] = excess if bool(excess.any()) else probs[pos]  # p == q: no reject can happen anyway
    keep = with_draft & (_uniform(with_draft, rnd.generators, device) * q_x < p_x)
    token = torch.where(keep, x, categorical(residual, rnd.generators))
    candidate.index_copy_(0, index, token)
    accepted.index_copy_(0, index, keep)
    return candidate, accepted


def _uniform(with_draft: torch.Tensor, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """U[0, 1) for each row holding a draft (1.0 elsewhere); a seeded row draws from its own generator, as
    the sampler's noise does, so rows without drafts consume their streams exactly as without speculation."""
    u = torch.ones(with_draft.shape[0], device=device)
    rows = with_draft.nonzero().squeeze(1).tolist()
    shared = [r for r in rows if r not in generators]
    if shared:
        u[shared] = torch.rand(len(shared), device=device)
    for row in rows:
        if row in generators:
            u[row] = torch.rand(1, device=device, generator=generators[row])[0]
    return u
