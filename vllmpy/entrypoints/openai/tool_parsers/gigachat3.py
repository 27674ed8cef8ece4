"""GigaChat 3: optional content, `<|message_sep|>`, then the call as its own message:
`function call<|role_sep|>\\n{"name": "f", "arguments": {...}}` (the separators are special tokens)."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import MarkedJsonToolParser, skip_ws

MESSAGE_SEP = "<|message_sep|>"
FUNCTION_CALL = "function call<|role_sep|>"


@TOOL_PARSERS.register("gigachat3")
class GigaChat3ToolParser(MarkedJsonToolParser):
    markers = (MESSAGE_SEP, FUNCTION_CALL)
    keeps_special_tokens = True

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        if text.startswith(MESSAGE_SEP, at):
            at = skip_ws(text, at + len(MESSAGE_SEP))
            if FUNCTION_CALL.startswith(text[at:]):
                return []  # the call header is still being written
            if not text.startswith(FUNCTION_CALL, at):
                raise ToolSyntaxError(f"expected {FUNCTION_CALL!r} after {MESSAGE_SEP}")
        return super().parse_calls(text, at)
