"""Tool calling and reasoning end to end with the official openai client, on the tiny random Llama served with
a hermes-style chat template and --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3.

The model's text is random: "required" and named calls are forced by the grammar, so a valid call must come
back; for "auto" the tests check the plumbing (tools in the prompt, the parser on the output, finish_reason).
"""
from __future__ import annotations

import json

import pytest

from tests.server.conftest import ServerProcess

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

# SmolLM2's own template ignores tools; this one renders them the way Qwen 2.5's does.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}

# Tools
<tools>
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}</tools>
Call a function as <tool_call>
{"name": <name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}
"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a time zone",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["tz"], "properties": {
            "tz": {"type": "string", "maxLength": 8}}}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_time"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tool_server(tiny_llama_dir, tmp_path_factory):
    template = tmp_path_factory.mktemp("tools") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    server = ServerProcess("--model", tiny_llama_dir, "--served-model-name", "model", "--num-blocks", "128",
                           "--max-model-len", "1024", "--chat-template", str(template), "--enable-auto-tool-choice",
                           "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused", max_retries=0)


def _reassemble(chunks) -> tuple[str | None, str | None, list[tuple[str, str]], str]:
    """content, reasoning_content, [(name, arguments)] and finish_reason of a stream, as a client adds them up;
    each call's first piece must bring its id, type and name, later pieces argument text only."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        for call in choice.delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments
        finish = choice.finish_reason or finish
    return content or None, reasoning or None, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice,parallel", [("required", True), ("required", False), (NAMED, True)],
                         ids=["required", "required-one-call", "named"])
def test_forced_call_is_valid_whole_and_streamed(client, tool_choice, parallel):
    request = {"model": "model", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
               "parallel_tool_calls": parallel, "max_tokens": 100, "temperature": 1.0, "seed": 11}
    choice = client.chat.completions.create(**request).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert calls and len({c.id for c in choice.message.tool_calls}) == len(calls)
    if tool_choice == NAMED or not parallel:
        assert len(calls) == 1
    for name, arguments in calls:
        assert name == "get_time" or tool_choice != NAMED
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])

    streamed = _reassemble(client.chat.completions.create(**request, stream=True))
    assert streamed == (None, None, calls, "tool_calls")  # same seed, same tokens


def test_auto_renders_tools_and_reads_the_output(client, tool_server):
    tokens = httpx.post(f"{tool_server.url}/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(f"{tool_server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt

    request = {"model": "model", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 24, "temperature": 0}
    # The hermes parser keeps special tokens, so the unparsed reference does too.
    raw = client.chat.completions.create(**request, tool_choice="none",
                                         extra_body={**NO_THINKING, "skip_special_tokens": False}).choices[0]
    auto = client.chat.completions.create(**request, extra_body=NO_THINKING).choices[0]  # tools sent: auto
    assert "<tool_call>" not in raw.message.content  # random text holds no call, so it is all content
    assert auto.message.content == raw.message.content and not auto.message.tool_calls
    assert auto.finish_reason == raw.finish_reason == "length"
    streamed = client.chat.completions.create(**request, tool_choice="auto", stream=True, extra_body=NO_THINKING)
    assert _reassemble(streamed) == (auto.message.content, None, [], "length")


def test_tool_call_history_renders_and_continues(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    got = client.chat.completions.create(model="model", messages=history, tools=TOOLS, tool_choice=NAMED,
                                         max_tokens=60, seed=3)
    assert got.choices[0].message.tool_calls[0].function.name == "get_time"


def test_reasoning_split_follows_enable_thinking(client):
    request = {"model": "model", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    plain = client.chat.completions.create(**request, extra_body=NO_THINKING).choices[0].message
    thinking = client.chat.completions.create(**request).choices[0].message  # Qwen 3 thinks unless told not to
    assert getattr(plain, "reasoning_content", None) is None and plain.content
    assert thinking.reasoning_content == plain.content.strip() and thinking.content is None
    streamed = _reassemble(client.chat.completions.create(**request, stream=True))
    assert streamed == (None, thinking.reasoning_content, [], "length")


BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "nonsense"}}}}}


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [BAD_SCHEMA], "tool_choice": "required"}, "tools"),
])
def test_refusals_name_the_field(tool_server, body, param):
    got = httpx.post(f"{tool_server.url}/v1/chat/completions",
                     json={"model": "model", "messages": MESSAGES, "max_tokens": 2, **body})
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param


def test_auto_needs_the_server_flags(tiny_server):
    got = httpx.post(f"{tiny_server.url}/v1/chat/completions",
                     json={"model": "model", "messages": MESSAGES, "max_tokens": 2, "tools": TOOLS})
    assert got.status_code == 400 and got.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in got.json()["error"]["message"]
