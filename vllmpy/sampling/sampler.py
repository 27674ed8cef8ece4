"""The batched sampler: vLLM v1 order of logit processing, greedy and random rows in one batch."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllmpy.engine.schedule_types import SampledLogprobs
from vllmpy.kernels import layer_kernels
from vllmpy.sampling.logits_processors import LogitsProcessor, apply_batch_processors, apply_request_processors
from vllmpy.sampling.logprobs import compute_logprobs
from vllmpy.sampling.metadata import RandomRows, SamplingMetadata, SamplingRowError
from vllmpy.sampling.penalties import apply_penalties
from vllmpy.structured_output.bitmask import apply_bitmask


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64, on the logits' device
    logprobs: list[SampledLogprobs | None]  # per row; None where the request asked for none


class Sampler:
    """custom processors (per request, then engine-level) -> grammar mask -> logit_bias -> min_tokens ->
    penalties -> greedy argmax | temperature -> min_p -> top_k/top_p -> sample.

    The grammar mask follows the custom processors so no processor can re-allow a banned token; min_p
    comes before top_k/top_p as in vLLM v1 (it is argmax-invariant and applied with temperature); the two
    orders differ only when top_p and min_p are both set.
    """

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = ()) -> None:
        self.logits_processors = list(logits_processors)  # engine-level, applied to every step

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw, processed, greedy = self.process(logits, meta)
        sampled = _sample(processed, meta, greedy)
        return SamplerOutput(sampled=sampled, logprobs=row_logprobs(raw, sampled, meta))

    def process(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(raw float32 logits, logits after every processor up to penalties, each row's greedy token):
        what sampling and speculative verification (spec_decode/rejection.py) both start from."""
        raw = logits.float()
        if raw.shape != (meta.num_rows, meta.vocab_size):
            raise ValueError(f"logits {tuple(raw.shape)} do not match metadata ({meta.num_rows}, {meta.vocab_size})")
        processed = _adjust(raw, meta, self.logits_processors) if meta.adjusts_logits or self.logits_processors else raw
        return raw, processed, _checked_argmax(processed)


def _adjust(logits: torch.Tensor, meta: SamplingMetadata, processors: Sequence[LogitsProcessor]) -> torch.Tensor:
    """Processors that can change the argmax; never writes into the caller's tensor."""
    logits = logits.clone()
    if meta.processor_rows:
        apply_request_processors(logits, meta.rows, meta.processor_rows)
    if processors:
        logits = apply_batch_processors(logits, meta.rows, processors)
    if meta.grammar_bitmask is not None:
        apply_bitmask(logits, *meta.grammar_bitmask)
    if meta.logit_bias is not None:
        rows, ids, values = meta.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if meta.min_tokens_block is not None:
        logits[meta.min_tokens_block] = float("-inf")
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def _checked_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token; a NaN or +inf anywhere, or no finite logit, would sample garbage, so those
    rows fail loudly. A row's max is NaN if any entry is, +inf if any is, -inf if none is finite."""
    best, greedy = _row_max(logits)
    ok = best.isfinite()
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten().tolist()
        raise SamplingRowError(bad, "logits are NaN/+inf or all -inf after processing")
    return greedy


def _row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first index of it) per row: the C kernel on CPU float32 (torch's argmax alone costs ~5x
    its amax on a 262k vocabulary), else torch.max, which returns the same."""
    lib = layer_kernels()
    if lib is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return logits.max(dim=-1)
    logits = logits.contiguous()
    rows, n = logits.shape
    best = torch.empty(rows, dtype=torch.float32)
    index = torch.empty(rows, dtype=torch.int64)
    lib.vq_row_max(logits.data_ptr(), rows, n, best.data_ptr(), index.data_ptr(), torch.get_num_threads())
    return best, index


def _sample(logits: torch.Tensor, meta: SamplingMetadata, greedy: torch.Tensor) -> torch.Tensor:
    rnd = meta.random
    if rnd is None:
        return greedy
    if rnd.rows is None:
        return _sample_random(logits, rnd)
    return greedy.index_copy(0, rnd.rows, _sample_random(logits.index_select(0, rnd.rows), rnd))


def _sample_random(logits: torch.Tensor, rnd: RandomRows) -> torch.Tensor:
    return categorical(random_probs(logits, rnd), rnd.generators)


def random_probs(logits: torch.Tensor, rnd: RandomRows) -> torch.Tensor:
    """The distribution a random row samples from: processed logits / temperature, min_p, top-k/top-p.
    The division makes the one copy; every filter after it masks that copy in place."""
    logits = logits / rnd.temperature
    if rnd.min_p is not None:
        _apply_min_p(logits, rnd.min_p)
    if rnd.top_k is not None:
        _apply_top_k(logits, rnd.top_k)
    if rnd.top_p is not None:
        _apply_top_p(logits, rnd.top_p)
    return logits.softmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Keep each row's k largest logits and every token tied with the k-th; rows holding vocab_size keep all.
    torch.topk of the batch's largest k, not a sort of the vocabulary (17 ms at 262k)."""
    vocab = logits.shape[1]
    enabled = top_k < vocab
    k = int(top_k.masked_fill(~enabled, 1).max())
    values = logits.topk(k, dim=-1).values
    kth = values.gather(1, (top_k.clamp(max=k) - 1).unsqueeze(1)).masked_fill_(~enabled.unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


# top_p looks for its cut among the most likely tokens: this many first, then more for the rows it did not
# reach (a flat distribution), and the whole vocabulary last.
_TOP_P_CANDIDATES = (256, 4096)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the most likely tokens while the mass ranked above each is below p (the top token always
    survives), and every token tied with the last one kept; rows holding 1.0 keep all. A topk of the
    candidates finds the cut where they hold at least p, not a sort of the vocabulary (17 ms at 262k)."""
    probs = logits.softmax(dim=-1)
    rows = (top_p < 1.0).nonzero().squeeze(1)
    vocab = logits.shape[1]
    for candidates in (*_TOP_P_CANDIDATES, vocab):
        if rows.numel() == 0:
            return
        every = rows.numel() == logits.shape[0]
        sub, p = (probs, top_p) if every else (probs.index_select(0, rows), top_p.index_select(0, rows))
        values = sub.topk(min(candidates, vocab), dim=-1).values
        mass = values.cumsum(dim=-1)
        # at least the top token: a p that float32 rounds to 0 (top_p=5e-324) keeps it alone
        kept = ((mass - values) < p.unsqueeze(1)).sum(dim=1, keepdim=True).clamp_(min=1)
        reached = (mass[:, -1] >= p) | (candidates >= vocab)  # the whole row: a total rounded below p keeps all
        cut = values.gather(1, kept - 1).masked_fill_(~reached.unsqueeze(1), 0.0)
        if every:
            logits.masked_fill_(sub < cut, float("-inf"))
        else:
            logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(sub < cut, float("-inf")))
        rows = rows[~reached]


def categorical(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row, token i with probability p_i / sum(p) (p need not sum to 1).

    Each row draws one uniform: a seeded row from its own generator, so its tokens do not depend on the batch
    around it; the other rows share one call on the default generator. On CPU float32 the C kernel inverts
    the row's cumulative sum; elsewhere the exponential race does the same job.
    """
    lib = layer_kernels()
    if lib is None or probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.dim() != 2:
        return exponential_race(probs, generators)
    probs = probs.contiguous()
    rows, n = probs.shape
    u = torch.rand(rows, dtype=torch.float64) if len(generators) < rows else torch.empty(rows, dtype=torch.float64)
    for row, generator in generators.items():
        u[row] = float(torch.rand(1, dtype=torch.float64, generator=generator))
    out = torch.empty(rows, dtype=torch.int64)
    lib.vq_sample_rows(probs.data_ptr(), rows, n, u.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exponential(1) picks token i with probability p_i (p need not sum to 1): the
    device-independent path of `categorical`, one Exp(1) per entry (the row's generator for a seeded row)."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return probs.div(noise).argmax(dim=-1)


def row_logprobs(raw: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata) -> list[SampledLogprobs | None]:
    out: list[SampledLogprobs | None] = [None] * meta.num_rows
    if meta.logprob_rows is None:
        return out
    wanted = [(i, k) for i, k in enumerate(meta.num_logprobs) if k is not None]
    if len(wanted) < meta.num_rows:
        raw, sampled = raw.index_select(0, meta.logprob_rows), sampled.index_select(0, meta.logprob_rows)
    entries = compute_logprobs(raw, sampled, [k for _, k in wanted])
    for (i, _), entry in zip(wanted, entries):
        out[i] = entry
    return out
