"""Hunyuan-A13B: `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`; the content is the answer
inside its tags. Output that does not open with `<think>` is all content."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.base import ReasoningParser


@REASONING_PARSERS.register("hunyuan_a13b")
class HunyuanA13BReasoningParser(ReasoningParser):
    start_markers = ("<think>",)
    end_markers = ("</think>",)
    answer_tags = ("<answer>", "</answer>")
