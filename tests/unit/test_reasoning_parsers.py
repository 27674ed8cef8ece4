"""Reasoning parsers on recorded model outputs: whole, cut in two at every character position, and one
character at a time must give the same (reasoning_content, content); then reasoning and tool parsing chained."""
from __future__ import annotations

import pytest

from vllmpy.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStream,
)

# (parser, chat_template_kwargs, model output, expected reasoning, expected content)
RECORDED = [
    ("deepseek_r1", {}, "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
     "The user wants 2+2. That is 4.", "The answer is **4**."),
    ("deepseek_r1", {}, "Okay, so 2+2=4. Is </thinking> a tag? No.\n</think>\n\n4",
     "Okay, so 2+2=4. Is </thinking> a tag? No.", "4"),  # the template opened <think>
    ("deepseek_r1", {}, "<think>\nLet me think about </thi", "Let me think about </thi", ""),  # cut off by max_tokens
    ("qwen3", {}, "<think>\nOkay, the user said hello. I should greet them back.\n</think>\n\nHello! How can I help?",
     "Okay, the user said hello. I should greet them back.", "Hello! How can I help?"),
    ("qwen3", {"enable_thinking": True}, "The user asks for a joke.\n</think>\n\nWhy did the GPU cross the road?",
     "The user asks for a joke.", "Why did the GPU cross the road?"),
    ("qwen3", {"enable_thinking": False}, "Hello! The <think> tag is literal here.", "",
     "Hello! The <think> tag is literal here."),
    ("qwen3", {"enable_thinking": False}, "<think>\nStill thinking.\n</think>\n\nDone.", "Still thinking.", "Done."),
    ("qwen3", {}, "<think>\n\n</think>\n\nNo thoughts, just content.", "", "No thoughts, just content."),
    ("granite", {"thinking": True}, ("Here is my thought process:\nThe user wants a haiku about autumn. 5-7-5.\n"
     "Here is my response:\nLeaves drift on cold wind\nthe maple lets go of red\nearth keeps what falls down"),
     "The user wants a haiku about autumn. 5-7-5.",
     "Leaves drift on cold wind\nthe maple lets go of red\nearth keeps what falls down"),
    ("granite", {"thinking": True}, "Here's my thought process: Here is a plan.\nHere's my response: ok",
     "Here is a plan.", "ok"),
    ("granite", {}, "Here is the answer: 42", "", "Here is the answer: 42"),
    ("granite", {"thinking": True}, "Here is my thought process: cut off", "cut off", ""),
]


def _stream(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        split = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning += split.reasoning
        content += split.content
    return reasoning, content


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", RECORDED)
def test_recorded_outputs_whole_and_cut_everywhere(name, kwargs, text, reasoning, content):
    cls = REASONING_PARSERS.get(name)
    whole = _stream(cls(kwargs), [text])
    assert whole == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _stream(cls(kwargs), [text[:cut], text[cut:]]) == whole, f"cut at {cut}: {text[:cut]!r}"
    assert _stream(cls(kwargs), list(text)) == whole


def test_content_streams_before_the_end():
    """Reasoning and content go out as they are written, not at the final flush."""
    stream = ReasoningStream(REASONING_PARSERS.get("deepseek_r1")({}))
    text = "<think>\nabc def\n</think>\n\nxyz"
    splits = [stream.feed(ch) for ch in text]
    assert "".join(s.reasoning for s in splits) == "abc def"
    assert "".join(s.content for s in splits) == "xyz"


def test_registry_lists_the_parsers():
    assert {"deepseek_r1", "qwen3", "granite"} <= set(REASONING_PARSERS.names())
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'; choose one of: deepseek_r1"):
        REASONING_PARSERS.get("r2")


def test_reasoning_then_tool_calls_cut_everywhere():
    """Qwen 3 thinks, then calls a tool: the chat route chains the reasoning parser into the tool parser."""
    from vllmpy.entrypoints.openai.serving_chat import ChatOutputParser
    from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS

    text = ('<think>\nI need the weather. Call get_weather.\n</think>\n\nLet me check.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')

    def run(pieces: list[str]) -> tuple[str, str, list]:
        parser = ChatOutputParser(REASONING_PARSERS.get("qwen3")({}), TOOL_PARSERS.get("hermes")())
        reasoning, content, calls = "", "", {}
        for i, piece in enumerate(pieces):
            delta = parser.feed(piece, final=i == len(pieces) - 1)
            reasoning += delta.reasoning_content or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
        return reasoning, content, sorted(calls.items())

    whole = run([text])
    assert whole == ("I need the weather. Call get_weather.", "Let me check.",
                     [(0, ["get_weather", '{"city": "Paris"}'])])
    for cut in range(len(text) + 1):
        assert run([text[:cut], text[cut:]]) == whole
