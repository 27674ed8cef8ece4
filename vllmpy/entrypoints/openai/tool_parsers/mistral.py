"""Mistral: optional content, then `[TOOL_CALLS]` (a control token) and either a JSON array of
{"name", "arguments"} (tokenizer v3-v7) or, from tokenizer v11 (Mistral Small 3.2, Magistral, Devstral),
`name[ARGS]{...}` per call behind its own `[TOOL_CALLS]`, with `name[CALL_ID]id[ARGS]{...}` when the
model writes the id, and `name{...}` as older fine-tunes write it. Mistral templates only accept
9-character alphanumeric call ids."""
from __future__ import annotations

import random
import re
import string

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.base import CallDraft, SectionToolParser, ToolSyntaxError
from vllmpy.entrypoints.openai.tool_parsers.json_text import calls_in_array, skip_ws, value_end

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_ID_CHARS = string.ascii_letters + string.digits


@TOOL_PARSERS.register("mistral")
class MistralToolParser(SectionToolParser):
    markers = (TOOL_CALLS,)
    keeps_special_tokens = True

    def new_call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        calls: list[CallDraft] = []
        while True:
            j = skip_ws(text, at + len(TOOL_CALLS))
            if j >= len(text):
                return calls
            if text[j] == "[":
                return calls + calls_in_array(text, j, ("arguments",))
            name = _NAME.match(text, j)
            if name is None:
                raise ToolSyntaxError(f"expected a function name after {TOOL_CALLS}")
            k = name.end()
            if k == len(text):  # the name may still grow
                return calls + [CallDraft(None)]
            call_id = None
            if text.startswith(CALL_ID, k):
                args_at = text.find(ARGS, k)
                if args_at < 0:
                    return calls + [CallDraft(None)]  # the id is still being written
                call_id, k = text[k + len(CALL_ID):args_at].strip(), args_at
            if text.startswith(ARGS, k):
                k += len(ARGS)
            elif ARGS.startswith(text[k:]) or CALL_ID.startswith(text[k:]):
                return calls + [CallDraft(None)]
            k = skip_ws(text, k)
            if k >= len(text):
                return calls + [CallDraft(name.group(), id=call_id)]
            if text[k] != "{":
                raise ToolSyntaxError(f"expected JSON arguments after {name.group()!r}")
            end = value_end(text, k)
            calls.append(CallDraft(name.group(), text[k:end], complete=end is not None, id=call_id))
            if end is None:
                return calls
            at = skip_ws(text, end)
            if not text.startswith(TOOL_CALLS, at):
                return calls
