"""Reasoning parser behaviour beyond the format conformance suite (test_parser_conformance.py): when
deltas go out, the registry, template switches, harmony tool messages."""
from __future__ import annotations

import pytest

from vllmpy.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
)


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        split = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning += split.reasoning
        content += split.content
    return reasoning, content


def test_content_streams_before_the_end():
    """Reasoning and content go out as they are written, not at the final flush."""
    stream = ReasoningStream(REASONING_PARSERS.get("deepseek_r1")({}))
    text = "<think>\nabc def\n</think>\n\nxyz"
    splits = [stream.feed(ch) for ch in text]
    assert "".join(s.reasoning for s in splits) == "abc def"
    assert "".join(s.content for s in splits) == "xyz"


def test_registry_lists_the_parsers():
    assert {"deepseek_r1", "deepseek_v3", "qwen3", "granite", "glm45", "openai", "openai_gptoss", "mistral",
            "hunyuan_a13b", "ernie45", "minimax_m2", "seed_oss", "step3"} <= set(REASONING_PARSERS.names())
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose one of: deepseek_r1"):
        REASONING_PARSERS.get("r2")


@pytest.mark.parametrize("kwargs,expected", [
    ({}, ("", "Thinking?</think>Answer.")),
    ({"thinking": True}, ("Thinking?", "Answer.")),
    ({"enable_thinking": True}, ("Thinking?", "Answer.")),
])
def test_deepseek_v3_thinks_only_when_the_template_was_told_to(kwargs, expected):
    assert _stream(REASONING_PARSERS.get("deepseek_v3")(kwargs), ["Thinking?</think>Answer."]) == expected


def test_harmony_tool_messages_pass_on_as_written_and_special_tokens_are_kept():
    call = '<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1}<|call|>'
    text = "<|channel|>analysis<|message|>Call f.<|end|>" + call
    assert _stream(REASONING_PARSERS.get("openai")({}), [text]) == ("Call f.", call)
    from vllmpy.entrypoints.openai.serving_chat import _OutputPlan
    from vllmpy.sampling_params import SamplingParams

    plan = _OutputPlan(reasoning=REASONING_PARSERS.get("openai")({}))
    assert plan.adjust(SamplingParams()).skip_special_tokens is False
    assert _OutputPlan(reasoning=REASONING_PARSERS.get("qwen3")({})).adjust(SamplingParams()).skip_special_tokens
