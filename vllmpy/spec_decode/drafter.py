"""The scheduler's side of speculation: how many drafts each running request gets this step, and the
acceptance counts (vLLM's spec_decode metrics) once the runner has verified them.

Drafting is adaptive, so text the proposer cannot predict costs little: each request keeps an exponential
moving average of its acceptance rate and drafts ceil(k x average) tokens (every draft adds a query row and
a logits row to verify); when the average falls below LOW_ACCEPTANCE the request stops drafting for a pause
that doubles each time it happens again (up to MAX_PAUSE steps), then probes with one draft.
Above `disable_by_batch_size` running requests nobody drafts: the step is then compute-bound and the
extra query tokens cost more than the forwards they save.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec
from vllmpy.spec_decode.config import SpeculativeConfig
from vllmpy.spec_decode.proposer import BatchProposer, DraftRequest, Proposer, SampledProposer

# Chosen, not tuned. Measured on the (heavily shared) 2-core host, default model, batch 1: a verification
# step with 5 drafts cost 2.5-2.9 plain decode steps (its 6 logits rows over a 262k vocabulary weigh), so a
# request must keep about 1 draft in 3 to gain; with these settings all-wrong drafts cost 0.96x spec-off.
EMA_WEIGHT = 0.5  # weight of the latest step in the acceptance average
LOW_ACCEPTANCE = 0.2
FIRST_PAUSE = 4  # steps
MAX_PAUSE = 64

logger = logging.getLogger("vllmpy")


@dataclass
class SpecDecodeStats:
    """Totals since start, vLLM's definitions: a draft is one (request, step) that carried draft tokens;
    accepted tokens exclude the bonus token, so 1 + accepted / drafts is the mean acceptance length."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class _RequestSpec:
    ema: float = 1.0  # optimistic: a new request drafts
    pause: int = 0  # steps left without drafting
    next_pause: int = FIRST_PAUSE


class Drafter:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._requests: dict[str, _RequestSpec] = {}
        # A batching proposer drafts for the whole step in begin_step; propose() then hands those out.
        self._batching = isinstance(proposer, BatchProposer)
        self._step_drafts: dict[str, list[int]] = {}
        # draft_sample_method probabilistic: each step's q rows, handed to the verifier with the drafts.
        self._sampled = config.draft_sample_method != "greedy" and isinstance(proposer, SampledProposer)
        self._step_probs: dict[str, torch.Tensor] = {}

    def enabled_for(self, num_running: int) -> bool:
        return num_running <= self.config.disable_by_batch_size

    def begin_step(self, candidates: Sequence[DraftRequest]) -> None:
        """Once per step before propose(): every running decode and the most drafts it may take. A
        BatchProposer drafts for all of them in one call (a draft model's forwards serve the batch)."""
        if not self._batching:
            return
        batch = [replace(c, k=k, sampling_params=c.sampling_params if self._sampled else None)
                 for c in candidates if (k := self._num_drafts(c.req_id, c.k)) > 0]
        drafts = self.proposer.propose_batch(batch) if batch else []
        self._step_drafts = {c.req_id: list(d)[:c.k] for c, d in zip(batch, drafts, strict=True)}
        if self._sampled:
            self._step_probs = {c.req_id: q for c in batch if (q := self.proposer.draft_probs(c.req_id)) is not None}

    def propose(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow the request's verified `token_ids`."""
        if self._batching:
            return self._step_drafts.pop(req_id, [])[:max_drafts]
        k = self._num_drafts(req_id, max_drafts)
        if k <= 0:
            return []
        return list(self.proposer.propose(req_id, token_ids, num_prompt_tokens, k))[:k]

    def draft_probs(self, req_id: str, num_drafts: int) -> torch.Tensor | None:
        """q of the request's first `num_drafts` drafts this step, when they were sampled (None: one-hot)."""
        q = self._step_probs.pop(req_id, None)
        return None if q is None else q[:num_drafts]

    def _num_drafts(self, req_id: str, max_drafts: int) -> int:
        """How many drafts the request asks for this step: 0 while paused, else ceil(k x its EMA)."""
        state = self._requests.setdefault(req_id, _RequestSpec())
        if state.pause > 0:
            state.pause -= 1
            return 0
        return min(math.ceil(self.config.num_speculative_tokens * state.ema), max_drafts)

    def record(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """The verifier kept `num_accepted` of the request's `num_drafted` drafts this step."""
        if num_drafted == 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafted
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1
        state = self._requests.setdefault(req_id, _RequestSpec())
        state.ema = (1 - EMA_WEIGHT) * state.ema + EMA_WEIGHT * num_accepted / num_drafted
        if state.ema < LOW_ACCEPTANCE:
            state.pause, state.next_pause = state.next_pause, min(2 * state.next_pause, MAX_PAUSE)
            state.ema = LOW_ACCEPTANCE  # the probe after the pause starts at the threshold: one bad step pauses again

    def finish(self, req_id: str, token_ids: list[int], num_prompt_tokens: int) -> None:
        self._requests.pop(req_id, None)
        self.proposer.on_request_finished(req_id, token_ids, num_prompt_tokens)

    def preempt(self, req_id: str) -> None:
        """The request lost its KV blocks: a draft model frees its own for it too."""
        if self._batching:
            self.proposer.on_request_preempted(req_id)


def build_drafter(config: SpeculativeConfig | None, layout: KVCacheLayout, task: str,
                  proposer: Proposer | None = None) -> Drafter | None:
    """The engine's drafter, or None with speculation off; refuses models whose state cannot roll back
    (recurrent layers can: the runner commits the state at the last accepted draft, runner/recurrent_steps.py).
    `proposer`: one the engine built (a draft model's needs the engine's device and KV budget)."""
    if config is None:
        return None
    if task != "generate":
        raise ValueError(f"--speculative-config: this engine's task is {task!r}; speculation only applies to "
                         f"text generation (task 'generate')")
    other = sorted({type(group.spec).__name__ for group in layout.groups
                    if not isinstance(group.spec, (FullAttentionSpec, SlidingWindowSpec))})
    if other:
        raise ValueError(f"--speculative-config: KV cache kind {other[0]} is not verified under speculation yet "
                         f"(full and sliding-window attention are); start it without speculation")
    drafter = Drafter(config, proposer or make_proposer(config))
    logger.info("speculative decoding: %s", config.describe())
    return drafter


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer the config names (imported on use: a method's code loads only when chosen)."""
    if config.method in ("draft_model", "mtp"):  # needs the loaded draft and its KV budget: engine/core.py passes it
        raise ValueError(f"--speculative-config: method {config.method!r} needs the engine's draft model proposer")
    if config.method == "ngram":
        from vllmpy.spec_decode.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    from vllmpy.spec_decode.suffix import SuffixProposer

    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
