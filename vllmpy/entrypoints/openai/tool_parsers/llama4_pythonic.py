"""Llama 4: pythonic calls, `[get_weather(city="Paris")]`, which Llama 4 wraps in the special tokens
<|python_start|> ... <|python_end|>, so they must reach the parser."""
from __future__ import annotations

from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllmpy.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser


@TOOL_PARSERS.register("llama4_pythonic")
class Llama4PythonicToolParser(PythonicToolParser):
    keeps_special_tokens = True
