"""The interface every draft proposer implements (n-gram, suffix, draft model).

The engine asks a proposer for up to k draft tokens per running request once per step, from the
request's verified tokens (prompt + output so far); drafts are only hints: verification decides what
is kept, so a proposer never needs to be right, only cheap and often right.

A proposer whose work is cheaper batched (a draft model: one forward per draft position serves every
request) also implements BatchProposer: the drafter then calls `propose_batch` once per step with every
running decode instead of `propose` per request. One that samples its drafts (a draft model under
draft_sample_method probabilistic) also implements SampledProposer: the verifier needs the distribution q
each draft was drawn from.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from vllmpy.sampling_params import SamplingParams


class Proposer(Protocol):
    def propose(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int, k: int) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (the request's prompt then its verified output;
        the first `num_prompt_tokens` are the prompt). [] when there is nothing worth drafting."""

    def on_request_finished(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request is done (finished or aborted): forget its state; a proposer that learns across
        requests (suffix decoding) may keep its output."""


@dataclass(frozen=True)
class DraftRequest:
    """One running decode asking for drafts this step: propose()'s arguments."""

    req_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    k: int
    # The request's sampling controls, handed over only when drafts are sampled (None: draft greedily).
    sampling_params: SamplingParams | None = None


@runtime_checkable
class BatchProposer(Proposer, Protocol):
    def propose_batch(self, batch: Sequence[DraftRequest]) -> list[list[int]]:
        """propose() for every request of the step at once: up to request.k drafts each, in batch order."""

    def on_request_preempted(self, req_id: str) -> None:
        """The request was preempted (it recomputes from scratch later): drop what it holds."""


@runtime_checkable
class SampledProposer(BatchProposer, Protocol):
    def draft_probs(self, req_id: str) -> torch.Tensor | None:
        """[drafts, vocab]: the distribution each of the request's last drafts was sampled from (None: they
        were argmaxes, one-hot)."""
