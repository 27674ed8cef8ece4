"""ERNIE-4.5 thinking models: the template opens `<think>`, so the output is reasoning up to `</think>`,
then the answer, inside `<response>` ... `</response>` when the model writes them."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser


@REASONING_PARSERS.register("ernie45")
class Ernie45ReasoningParser(DeepSeekR1ReasoningParser):
    answer_tags = ("<response>", "</response>")
