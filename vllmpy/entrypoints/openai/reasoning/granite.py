"""IBM Granite 3.2+ with chat_template_kwargs {"thinking": true}: "Here is my thought process: ...
Here is my response: ...", with "Here's" accepted too (quantized models write it). Output that does not
open with the thought-process line is all content."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.base import ReasoningParser


@REASONING_PARSERS.register("granite")
class GraniteReasoningParser(ReasoningParser):
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
