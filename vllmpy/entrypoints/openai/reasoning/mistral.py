"""Magistral (Mistral tokenizer v13+): `[THINK]` ... `[/THINK]` content, both control tokens; output
that does not open with `[THINK]` is all content."""
from __future__ import annotations

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS
from vllmpy.entrypoints.openai.reasoning.base import ReasoningParser


@REASONING_PARSERS.register("mistral")
class MistralReasoningParser(ReasoningParser):
    start_markers = ("[THINK]",)
    end_markers = ("[/THINK]",)
    keeps_special_tokens = True
