"""Batched token sampling and logprobs with vLLM v1 semantics."""
from vllmpy.sampling.logprobs import compute_logprobs, prompt_logprobs_for_chunk
from vllmpy.sampling.metadata import RowState, SamplingMetadata, SamplingRowError
from vllmpy.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "RowState",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingRowError",
    "compute_logprobs",
    "prompt_logprobs_for_chunk",
]
