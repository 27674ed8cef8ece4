"""GLM-4.5 / 4.6: `<think>` ... `</think>` content, the model writing `<think>` itself (with
enable_thinking=false the template closes an empty block in the prompt): output that does not open
with `<think>` is all content."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.base import ReasoningParser


@REASONING_PARSERS.register("glm45")
class Glm45ReasoningParser(ReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)
