"""Reasoning parsers, chosen with --reasoning-parser: one module per model family registers itself here."""
from vllmpy.entrypoints.openai.reasoning.base import ReasoningParser, ReasoningSplit, ReasoningStream
from vllmpy.entrypoints.openai.tool_parsers.registry import Registry

REASONING_PARSERS: Registry[ReasoningParser] = Registry("reasoning parser", __name__)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningStream"]
