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
    return exponential_race(random_probs(logits, rnd), rnd.generators)


def random_probs(logits: torch.Tensor, rnd: RandomRows) -> torch.Tensor:
    """The distribution a random row samples from: processed logits / temperature, min_p, top-k/top-p."""
    logits = logits / rnd.temperature
    if rnd.min_p is not None:
        logits = _apply_min_p(logits, rnd.min_p)
    if rnd.top_k is not None or rnd.top_p is not None:
        logits = _apply_top_k_top_p(logits, rnd.top_k, rnd.top_p)
    return logits.softmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """One ascending sort serves both filters; the most likely token always survives.

    top_k keeps every token tied with the k-th largest; top_p drops the low tail whose mass is <= 1 - p.
    """
    sorted_logits, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        tail_mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = tail_mass <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return logits.scatter(1, order, sorted_logits)  # order is a permutation: every entry is rewritten


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / E) with E ~ Exponential(1) picks token i with probability p_i (p need not sum to 1).

    A seeded row draws its whole noise row from its own generator, so its tokens do not depend on the
    batch around it; the other rows share one call on the default generator.
    """
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
