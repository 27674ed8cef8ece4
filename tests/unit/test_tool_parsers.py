"""Tool-call parsers on recorded model outputs: the whole-text parse, and the same output streamed in two
pieces cut at every character position and one character at a time, which must reassemble to it."""
from __future__ import annotations

import json

import pytest

from vllmpy.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCallStream,
    ToolParser,
)
from vllmpy.entrypoints.openai.tool_parsers.forced import (
    NamedToolParser,
    RequiredToolParser,
    named_schema,
    required_schema,
)

# (parser, model output, expected content, expected [(name, arguments)])
RECORDED = [
    # Qwen 2.5 / Qwen 3 / Hermes 2 Pro
    ("hermes", ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
               '"unit": "fahrenheit"}}\n</tool_call>'),
     "", [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
    ("hermes", ('I\'ll check both cities.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tōkyō", "note": '
               '"braces } ] and \\"quotes\\" <tool_call> inside"}}\n</tool_call>'),
     "I'll check both cities.",
     [("get_weather", {"city": "Paris"}),
      ("get_weather", {"city": "Tōkyō", "note": 'braces } ] and "quotes" <tool_call> inside'})]),
    ("hermes", '<tool_call>\n{"arguments": {"query": "vllm", "top_k": 10}, "name": "search"}\n</tool_call>',
     "", [("search", {"query": "vllm", "top_k": 10})]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"n": -1.5e3, "ok": true, "x": null}}', "",
     [("f", {"n": -1.5e3, "ok": True, "x": None})]),  # stopped before </tool_call>
    ("hermes", "The capital of France is Paris. <b>Bold</b> and a < b < c.\n", ("The capital of France is Paris. "
               "<b>Bold</b> and a < b < c.\n"), []),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n</tool_call>", []),
    # Llama 3.1 / 3.2 JSON
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris, France"}}', "",
     [("get_weather", {"location": "Paris, France"})]),
    ("llama3_json", ('{"name": "get_weather", "parameters": {"location": "Paris"}}; {"name": "get_time", '
                    '"parameters": {"timezone": "Europe/Paris"}}'), "",
     [("get_weather", {"location": "Paris"}), ("get_time", {"timezone": "Europe/Paris"})]),
    ("llama3_json", "Sure! The weather in Paris is {unknown} today.", "Sure! The weather in Paris is {unknown} today.",
     []),
    ("llama3_json", '{"answer": 42, "reason": "not a call"}', '{"answer": 42, "reason": "not a call"}', []),
    # Mistral: pre-v11 JSON array, v11 name{args}, v13 name[ARGS]{args}
    ("mistral", ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "multiply", '
                '"arguments": {"a": 2, "b": 7}}]'), "",
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 2, "b": 7})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "CET"}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("mistral", 'Let me look that up.[TOOL_CALLS]search[ARGS]{"query": "vLLM [ARGS] syntax"}',
     "Let me look that up.", [("search", {"query": "vLLM [ARGS] syntax"})]),
    ("mistral", "Bonjour ! [Note] il n'y a rien à appeler.", "Bonjour ! [Note] il n'y a rien à appeler.", []),
    # Pythonic (Llama 3.2 / Llama 4)
    ("pythonic", "[get_weather(city='San Francisco', metric='celsius'), get_time(timezone=\"America/Los_Angeles\")]",
     "", [("get_weather", {"city": "San Francisco", "metric": "celsius"}),
          ("get_time", {"timezone": "America/Los_Angeles"})]),
    ("pythonic", ('<|python_start|>[search(query="a (nested) ]string[", limit=5, filters={"lang": ["en", "fr"]}, '
                 'exact=True, offset=None)]<|python_end|>'), "",
     [("search", {"query": "a (nested) ]string[", "limit": 5, "filters": {"lang": ["en", "fr"]}, "exact": True,
                  "offset": None})]),
    ("pythonic", "[get_time()]", "", [("get_time", {})]),
    ("pythonic", "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    ("pythonic", 'The call would be [get_weather(city="x")].', 'The call would be [get_weather(city="x")].', []),
    # Granite 3.0 (<|tool_call|>) and 3.1+ (<tool_call>)
    ("granite", '<|tool_call|>[{"name": "get_current_weather", "arguments": {"city": "Boston"}}]', "",
     [("get_current_weather", {"city": "Boston"})]),
    ("granite", ' <tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, {"y": "}"}]}}]',
     "", [("a", {}), ("b", {"x": [1, {"y": "}"}]})]),
    ("granite", "I cannot call a tool for that.", "I cannot call a tool for that.", []),
    # DeepSeek V3
    ("deepseek_v3", ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"location": "Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'), "",
     [("get_weather", {"location": "Tokyo"})]),
    ("deepseek_v3", ("Checking both.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
                    '```json\n{"location": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
                    '<｜tool▁sep｜>get_time\n```json\n{"tz": "Asia/Tokyo", "fmt": "```"}\n```<｜tool▁call▁end｜>'
                    "<｜tool▁calls▁end｜>"), "Checking both.",
     [("get_weather", {"location": "Tokyo"}), ("get_time", {"tz": "Asia/Tokyo", "fmt": "```"})]),
    ("deepseek_v3", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
]

FORCED = [
    (RequiredToolParser, '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]',
     "", [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (lambda: NamedToolParser("get_weather"), ' {"city": "Paris", "days": 3}\n', "",
     [("get_weather", {"city": "Paris", "days": 3})]),
]


def _stream(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Feed pieces (the last one final) and reassemble the deltas as an OpenAI client does."""
    stream = ToolCallStream(parser)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(calls) and call.name
                calls[call.index] = [call.name, call.arguments]
            else:
                assert call.name is None
                calls[call.index][1] += call.arguments
    assert stream.called == bool(calls)
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _check(make_parser, text: str, content: str, expected: list) -> None:
    whole = _stream(make_parser(), [text])
    assert whole[0] == content
    assert [(name, json.loads(arguments)) for name, arguments in whole[1]] == expected
    for cut in range(len(text) + 1):
        assert _stream(make_parser(), [text[:cut], text[cut:]]) == whole, f"cut at {cut}: {text[:cut]!r}"
    assert _stream(make_parser(), list(text)) == whole


@pytest.mark.parametrize("name,text,content,expected", RECORDED)
def test_recorded_outputs_whole_and_cut_everywhere(name, text, content, expected):
    _check(TOOL_PARSERS.get(name), text, content, expected)


@pytest.mark.parametrize("make_parser,text,content,expected", FORCED)
def test_forced_outputs_whole_and_cut_everywhere(make_parser, text, content, expected):
    _check(make_parser, text, content, expected)


def test_every_required_parser_is_registered():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "granite", "deepseek_v3"} <= set(TOOL_PARSERS.names())
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose one of: deepseek_v3, granite"):
        TOOL_PARSERS.get("nope")


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',  # the object is never closed
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments must be an object
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',
])
def test_malformed_call_is_content(text):
    assert _stream(TOOL_PARSERS.get("hermes")(), [text]) == (text, [])


def test_streamed_call_opens_with_id_and_name_then_argument_fragments():
    parser = TOOL_PARSERS.get("hermes")()
    stream = ToolCallStream(parser)
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    deltas = [stream.feed(ch) for ch in text] + [stream.feed("", final=True)]
    pieces = [call for delta in deltas for call in delta.tool_calls]
    assert pieces[0].id.startswith("chatcmpl-tool-") and pieces[0].name == "get_weather"
    assert len(pieces) > 5 and all(p.id is None and p.name is None for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == '{"city": "Paris"}'
    assert all(delta.content == "" for delta in deltas)


def test_mistral_ids_fit_its_template_and_parallel_calls_can_be_capped():
    parser = TOOL_PARSERS.get("mistral")()
    delta = ToolCallStream(parser, max_calls=1).feed('[TOOL_CALLS]a{"x": 1}[TOOL_CALLS]b{}', final=True)
    assert [c.name for c in delta.tool_calls] == ["a"]
    assert len(delta.tool_calls[0].id) == 9 and delta.tool_calls[0].id.isalnum()


def test_forced_schemas():
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "$defs": {"City": {"type": "string"}}}}}
    bare = {"type": "function", "function": {"name": "get_time"}}
    schema = required_schema([weather, bare], parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and schema["$defs"] == {"City": {"type": "string"}}
    names = [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    assert "$defs" in weather["function"]["parameters"]  # the request's tools are left as sent
    assert named_schema(bare) == {"type": "object", "properties": {}}
    clash = {"type": "function", "function": {"name": "x", "parameters": {"$defs": {"City": {"type": "integer"}}}}}
    with pytest.raises(ValueError, match=r"\$defs.City"):
        required_schema([weather, clash], parallel=True)
