"""Constrained decoding: constraint params (plain data), llguidance grammars, token bitmasks.

Only the params are imported here, so `SamplingParams` does not pull in the grammar engine.
"""
from vllmpy.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputsParams"]
