"""Plain data the scheduler hands the runner and the runner hands back (no tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllmpy.engine.request import RequestKind
from vllmpy.lora.request import LoRARequest
from vllmpy.multimodal.inputs import ImageFeature
from vllmpy.pooling_params import PoolingParams
from vllmpy.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled, and again when it resumes after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams | None  # None for a pooling request
    pooling_params: PoolingParams | None = None
    kind: RequestKind = RequestKind.GENERATE
    lora_request: LoRARequest | None = None  # the adapter its rows run on (None: the base model)
    mm_features: list[ImageFeature] = field(default_factory=list)  # its images: spans, pixels, hashes


@dataclass
class ScheduledChunk:
    """One request's slice of this step's flat batch."""

    req_id: str
    token_ids: list[int]  # tokens fed to the model this step
    start_pos: int  # position of token_ids[0] (= num_computed_tokens before the step)
    # Per KV cache group, the request's table entries added since its last chunk: the whole table on its
    # first schedule and on resuming after preemption (it is then in new_requests), else only the blocks
    # allocated since (most steps: none or one). The runner keeps the tables (runner/block_table.py).
    # A model with recurrent layers appends the request's seat, [seat], every step.
    new_block_ids: tuple[list[int], ...]
    sample: bool  # chunk ends at the request's last known token: sample the next one (or pool the prompt)
    # The last num_draft_tokens of token_ids are speculative drafts to verify (never before the last known
    # token); the runner then returns 1..num_draft_tokens + 1 tokens for this chunk.
    num_draft_tokens: int = 0
    # [num_draft_tokens, vocab]: the distribution q each draft was sampled from (draft_sample_method
    # probabilistic); None: the drafts are one-hot (lookups, argmaxes).
    draft_probs: torch.Tensor | None = None
    encoder_inputs: list[int] = field(default_factory=list)  # its images (mm_features indices) to encode now
    # Recurrent layers with prefix caching (engine/recurrent_snapshots.py): the snapshot slot a prefix hit's
    # seat is filled from before its first chunk, and (tokens into the chunk, slot) for every snapshot
    # boundary this prefill chunk crosses (its state there is written to that slot).
    resume_snapshot: int | None = None
    save_snapshots: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)  # the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests whose block tables lost their tail (blocks of rejected drafts) since the last step: the
    # number of blocks each group's table kept. Their chunks' new_block_ids continue from there.
    trimmed_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class SampledLogprobs:
    """Logprobs of one position: the chosen token first, then the top-k (ids may repeat)."""

    token_ids: list[int]
    logprobs: list[float]
    chosen_rank: int  # 1-based vocabulary rank of token_ids[0]


@dataclass
class ModelRunnerOutput:
    """Per scheduled chunk, in the same order as SchedulerOutput.chunks."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # [] for a chunk that did not sample; several after verified drafts
    logprobs: list[list[SampledLogprobs] | None]  # one per sampled token, when requested
    # Prompt logprobs computed this step: one entry per prompt position covered (None for position 0).
    prompt_logprobs: dict[str, list[SampledLogprobs | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # requests that failed alone this step
    grammar_terminated: set[str] = field(default_factory=set)  # structured output complete: stop these
    pooled: dict[str, list[float]] = field(default_factory=dict)  # finished embeddings of pooling requests
