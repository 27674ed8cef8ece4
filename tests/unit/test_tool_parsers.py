"""Tool-call parser behaviour beyond the format conformance suite (test_parser_conformance.py): forced
calls, malformed sections, call ids, schema-typed XML values, the registry."""
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


@pytest.mark.parametrize("make_parser,text,content,expected", FORCED)
def test_forced_outputs_whole_and_cut_everywhere(make_parser, text, content, expected):
    _check(make_parser, text, content, expected)


def test_every_required_parser_is_registered():
    assert {"hermes", "llama3_json", "mistral", "pythonic", "granite", "deepseek_v3", "qwen3_coder", "llama4_pythonic",
            "deepseek_v31", "kimi_k2", "glm45", "openai", "minimax_m2", "jamba", "internlm", "xlam", "phi4_mini_json",
            "seed_oss", "gigachat3", "hunyuan_a13b", "step3"} <= set(TOOL_PARSERS.names())
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; choose one of: deepseek_v3, deepseek_v31, "):
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


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "days": {"type": "integer"}, "metric": {"type": "boolean"}, "filter": {"type": "object"},
    "ratio": {"type": ["number", "null"]}, "city": {"type": "string"}}}}}


def _qwen3_coder_call(parameters: str, tools: list | None) -> dict:
    text = f"<tool_call>\n<function=get_weather>\n{parameters}</function>\n</tool_call>"
    delta = ToolCallStream(TOOL_PARSERS.get("qwen3_coder")(tools)).feed(text, final=True)
    return json.loads(delta.tool_calls[0].arguments)


def test_xml_values_follow_the_declared_types():
    parameters = ("<parameter=days>\n3\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n"
                  "<parameter=filter>\n{'tags': ['a'], 'ok': True}\n</parameter>\n<parameter=ratio>\nnull\n"
                  "</parameter>\n<parameter=city>\n42\n</parameter>\n")
    assert _qwen3_coder_call(parameters, [WEATHER]) == {
        "days": 3, "metric": False, "filter": {"tags": ["a"], "ok": True}, "ratio": None, "city": "42"}
    # Undeclared (no tools sent): every value stays the text the model wrote.
    assert _qwen3_coder_call(parameters, None) == {
        "days": "3", "metric": "False", "filter": "{'tags': ['a'], 'ok': True}", "ratio": "null", "city": "42"}
    # A value that does not read as its type is kept as written rather than dropped.
    assert _qwen3_coder_call("<parameter=days>\nthree\n</parameter>\n", [WEATHER]) == {"days": "three"}


def test_glm45_reads_undeclared_values_as_json():
    text = ("<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>note</arg_key>\n"
            "<arg_value>not json</arg_value>\n</tool_call>")
    delta = ToolCallStream(TOOL_PARSERS.get("glm45")()).feed(text, final=True)
    assert json.loads(delta.tool_calls[0].arguments) == {"days": 3, "note": "not json"}


def test_text_that_only_looks_like_an_xml_call_is_never_streamed_as_one():
    for name, text in [("qwen3_coder", "Write <function=name> then <parameter=key>."),
                       ("glm45", "The tag <tool_call>name\nopens a call.")]:
        stream = ToolCallStream(TOOL_PARSERS.get(name)())
        deltas = [stream.feed(ch) for ch in text] + [stream.feed("", final=True)]
        assert not any(delta.tool_calls for delta in deltas), name
        assert "".join(delta.content for delta in deltas) == text


def test_model_written_call_ids_are_kept():
    kimi = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    delta = ToolCallStream(TOOL_PARSERS.get("kimi_k2")()).feed(kimi, final=True)
    assert [(c.id, c.name) for c in delta.tool_calls] == [("functions.get_weather:0", "get_weather")]
    mistral = '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
    delta = ToolCallStream(TOOL_PARSERS.get("mistral")()).feed(mistral, final=True)
    assert [(c.id, c.name) for c in delta.tool_calls] == [("a1B2c3D4e", "get_weather")]


def test_formats_written_in_special_tokens_keep_them():
    keeping = {name for name in TOOL_PARSERS.names() if TOOL_PARSERS.get(name).keeps_special_tokens}
    assert {"openai", "kimi_k2", "mistral", "llama4_pythonic", "step3", "internlm", "gigachat3", "glm45"} <= keeping
    assert not {"qwen3_coder", "xlam", "phi4_mini_json"} & keeping
