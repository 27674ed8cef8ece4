"""Tool-call parsers, chosen with --tool-call-parser: one module per model family registers itself here."""
from vllmpy.entrypoints.openai.tool_parsers.base import ToolCallDelta, ToolCallStream, ToolParser
from vllmpy.entrypoints.openai.tool_parsers.registry import Registry

TOOL_PARSERS: Registry[ToolParser] = Registry("tool call parser", __name__)

__all__ = ["TOOL_PARSERS", "ToolCallDelta", "ToolCallStream", "ToolParser"]
