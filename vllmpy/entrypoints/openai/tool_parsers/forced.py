"""tool_choice "required" and named functions: the JSON schema that forces a call, and the parser that
reads the forced output. vLLM's shapes: required is an array of {"name", "parameters"} objects, one
schema branch per tool; a named function's output is its arguments object alone. The grammar is compiled
closed (serving_chat's _tool_grammar), so the arguments hold only declared properties."""
from __future__ import annotations

from typing import Any

from vllmpy.entrypoints.openai.tool_parsers.base import (
    CallDraft,
    Extraction,
    SectionToolParser,
    ToolParser,
    valid_calls,
)
from vllmpy.entrypoints.openai.tool_parsers.json_text import calls_in_array

# A function without `parameters`: OpenAI's empty parameter list, so the closed grammar allows only {}.
_NO_PARAMETERS = {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """One or more calls of any tool; each tool's `$defs` move to the root, where its `$ref`s point."""
    branches, defs = [], {}
    for tool in tools:
        function = tool["function"]
        parameters = dict(function.get("parameters") or _NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise ValueError(f"tools define $defs.{name} differently; tool_choice \"required\" needs "
                                 f"one definition per name")
        branches.append({"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                         "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                        "parameters": parameters}})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _NO_PARAMETERS


class RequiredToolParser(SectionToolParser):
    markers = ("[",)
    leading_only = True

    def parse_calls(self, text: str, at: int) -> list[CallDraft]:
        return calls_in_array(text, at, ("parameters",))


class NamedToolParser(ToolParser):
    """The whole output is the named function's arguments."""

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def extract(self, text: str, final: bool) -> Extraction:
        call = CallDraft(self.function, text.strip(), complete=final)
        if final and not valid_calls([call]):
            return Extraction(text)
        return Extraction("", [call])

