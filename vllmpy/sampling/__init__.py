"""Batched token sampling and logprobs with vLLM v1 semantics."""
from vllmpy.sampling.logprobs import compute_logprobs, prompt_logprobs_for_chunk
from vllmpy.sampling.metadata import RowState, RowView, SamplingMetadata, SamplingRowError, TokenIdsView
from vllmpy.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "RowState",
    "RowView",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRowError",
    "TokenIdsView",
    "compute_logprobs",
    "prompt_logprobs_for_chunk",
]
