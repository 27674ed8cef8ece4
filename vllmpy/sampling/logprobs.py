"""Logprobs of chosen tokens plus the top-k, from raw logits (vLLM's default `raw_logprobs` mode)."""
from __future__ import annotations

import torch

from vllmpy.engine.schedule_types import SampledLogprobs


def compute_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int]) -> list[SampledLogprobs]:
    """Row i: token_ids[i] with its logprob and rank, then the top num_logprobs[i] (-1 = whole vocabulary).

    The top-k is taken once for the largest k; the result crosses to the host in one copy per tensor.
    """
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    vocab_size = logprobs.shape[1]
    ks = [vocab_size if k == -1 else min(k, vocab_size) for k in num_logprobs]
    token_ids = token_ids.to(device=logprobs.device, dtype=torch.int64).view(-1, 1)
    chosen = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # ties share the better rank
    ids, values = token_ids, chosen
    if max(ks, default=0) > 0:
        top_values, top_ids = logprobs.topk(max(ks), dim=-1)
        ids = torch.cat([token_ids, top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    ids_l, values_l, ranks_l = ids.tolist(), values.tolist(), ranks.tolist()
    return [
        SampledLogprobs(token_ids=ids_l[i][: k + 1], logprobs=values_l[i][: k + 1], chosen_rank=ranks_l[i])
        for i, k in enumerate(ks)
    ]


def prompt_logprobs_for_chunk(logits: torch.Tensor, target_ids: list[int], k: int) -> list[SampledLogprobs]:
    """Row t of `logits` scores target_ids[t], the prompt token that follows position t."""
    if logits.shape[0] != len(target_ids):
        raise ValueError(f"{logits.shape[0]} logit rows but {len(target_ids)} target ids")
    targets = torch.tensor(target_ids, dtype=torch.int64, device=logits.device)
    return compute_logprobs(logits, targets, [k] * len(target_ids))
