"""Every registered tool-call and reasoning parser, on recorded outputs in its family's documented format:
the non-streamed result is the one written here by hand, and the streamed deltas, however the output is
cut (in two at every character, one character at a time, in chunks of 2, 3 and 7, in token-like pieces
that keep markers whole, with and without a trailing empty final delta), concatenate to exactly the
non-streamed content, reasoning content and each call's name and argument text, byte for byte.

The outputs carry arguments with quotes, backslashes, unicode, nested JSON and the format's own markers
inside strings. A parser registered without cases here fails test_every_parser_has_cases.
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from vllmpy.entrypoints.openai.reasoning import REASONING_PARSERS, ReasoningStream
from vllmpy.entrypoints.openai.serving_chat import ChatOutputParser
from vllmpy.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStream

# The request's tools: the XML formats type each bare-text value by its parameter's schema.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "filter": {"type": "object"}, "hours": {"type": "array"}, "ratio": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time"}},
]

# Arguments that stress a parser: quotes, a backslash, braces and brackets in a string, unicode, nesting.
RICH = {"city": 'Tōkyō 東京 🌸, "the capital" \\ {not: json} ]', "days": 3,
        "filter": {"tags": ["a", {"b": None, "c": [1.5, -2e3]}], "ok": True}}
RICH_JSON = json.dumps(RICH, ensure_ascii=False)


def rich(marker: str) -> dict[str, Any]:
    """RICH with the format's own marker inside a string value, where it must stay data."""
    return {**RICH, "city": f"{RICH['city']} {marker}"}


def rich_json(marker: str) -> str:
    return json.dumps(rich(marker), ensure_ascii=False)


DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                   "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        "<|tool_calls_section_end|>")
STEP = ("<｜tool_calls_begin｜>", "<｜tool_call_begin｜>", "<｜tool_sep｜>", "<｜tool_call_end｜>", "<｜tool_calls_end｜>")

# (parser, model output, content, [(name, arguments)]): written from each family's chat template / model card.
TOOL_CASES: list[tuple[str, str, str, list[tuple[str, dict[str, Any]]]]] = [
    # Hermes 2 Pro / Qwen 2.5 / Qwen 3
    ("hermes", ('<tool_call>\n{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
                '"unit": "fahrenheit"}}\n</tool_call>'),
     "", [("get_current_weather", {"location": "San Francisco, CA", "unit": "fahrenheit"})]),
    ("hermes", (f"I'll check both cities.\n\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": "
                f"\"Paris\"}}}}\n</tool_call>\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": "
                f"{rich_json('<tool_call> </tool_call>')}}}\n</tool_call>"),
     "I'll check both cities.",
     [("get_weather", {"city": "Paris"}), ("get_weather", rich("<tool_call> </tool_call>"))]),
    ("hermes", '<tool_call>\n{"arguments": {"query": "vllm", "top_k": 10}, "name": "search"}\n</tool_call>',
     "", [("search", {"query": "vllm", "top_k": 10})]),
    ("hermes", '<tool_call>\n{"name": "get_time"}\n</tool_call>', "", [("get_time", {})]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"n": -1.5e3, "ok": true, "x": null}}', "",
     [("f", {"n": -1.5e3, "ok": True, "x": None})]),  # stopped before </tool_call>
    ("hermes", "The capital of France is Paris. <b>Bold</b> and a < b < c.\n",
     "The capital of France is Paris. <b>Bold</b> and a < b < c.\n", []),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n</tool_call>", []),
    # Llama 3.1 / 3.2 JSON
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris, France"}}', "",
     [("get_weather", {"location": "Paris, France"})]),
    ("llama3_json", (f'{{"name": "get_weather", "parameters": {rich_json("<|python_tag|> ;")}}}; {{"name": '
                     f'"get_time", "parameters": {{"timezone": "Europe/Paris"}}}}'), "",
     [("get_weather", rich("<|python_tag|> ;")), ("get_time", {"timezone": "Europe/Paris"})]),
    ("llama3_json", "Sure! The weather in Paris is {unknown} today.", "Sure! The weather in Paris is {unknown} today.",
     []),
    ("llama3_json", '{"answer": 42, "reason": "not a call"}', '{"answer": 42, "reason": "not a call"}', []),
    # Mistral: pre-v11 JSON array; v11 name[ARGS]{...}, with [CALL_ID] when written; name{...}
    ("mistral", ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "multiply", '
                 '"arguments": {"a": 2, "b": 7}}]'), "",
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 2, "b": 7})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "CET"}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("mistral", f"Let me look that up.[TOOL_CALLS]search[ARGS]{rich_json('[TOOL_CALLS] [ARGS]')}",
     "Let me look that up.", [("search", rich("[TOOL_CALLS] [ARGS]"))]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', "",
     [("get_weather", {"city": "Paris"})]),
    ("mistral", "Bonjour ! [Note] il n'y a rien à appeler.", "Bonjour ! [Note] il n'y a rien à appeler.", []),
    # Pythonic (Llama 3.2, ToolACE) and Llama 4's pythonic calls
    ("pythonic", "[get_weather(city='San Francisco', metric=False), get_time(timezone=\"America/Los_Angeles\")]",
     "", [("get_weather", {"city": "San Francisco", "metric": False}),
          ("get_time", {"timezone": "America/Los_Angeles"})]),
    ("pythonic", ('<|python_start|>[search(query="a (nested) ]string[ \\"q\\" 東京", limit=5, filters={"lang": '
                  '["en", "fr"]}, exact=True, offset=None)]<|python_end|>'), "",
     [("search", {"query": 'a (nested) ]string[ "q" 東京', "limit": 5, "filters": {"lang": ["en", "fr"]},
                  "exact": True, "offset": None})]),
    ("pythonic", "[get_time()]", "", [("get_time", {})]),
    ("pythonic", "[1, 2, 3] are the first numbers.", "[1, 2, 3] are the first numbers.", []),
    ("pythonic", 'The call would be [get_weather(city="x")].', 'The call would be [get_weather(city="x")].', []),
    ("llama4_pythonic", ('<|python_start|>[get_weather(city="Tōkyō <|python_end|>", days=3), get_time()]'
                         '<|python_end|>'), "", [("get_weather", {"city": "Tōkyō <|python_end|>", "days": 3}),
                                                 ("get_time", {})]),
    ("llama4_pythonic", "I can answer that directly: 42.", "I can answer that directly: 42.", []),
    # Granite 3.0 (<|tool_call|>) and 3.1+ (<tool_call>)
    ("granite", '<|tool_call|>[{"name": "get_current_weather", "arguments": {"city": "Boston"}}]', "",
     [("get_current_weather", {"city": "Boston"})]),
    ("granite", f' <tool_call>[{{"name": "a", "arguments": {{}}}}, {{"name": "b", "arguments": '
                f'{rich_json("<|tool_call|>")}}}]', "", [("a", {}), ("b", rich("<|tool_call|>"))]),
    ("granite", "I cannot call a tool for that.", "I cannot call a tool for that.", []),
    # DeepSeek V3 / R1-0528
    ("deepseek_v3", (f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
                     f'{{"location": "Tokyo"}}\n```{DS_END}{DS_CALLS_END}'), "",
     [("get_weather", {"location": "Tokyo"})]),
    ("deepseek_v3", (f"Checking both.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n"
                     f'{rich_json(DS_END + " ```")}\n```{DS_END}\n{DS_CALL}function{DS_SEP}get_time\n```json\n'
                     f'{{"tz": "Asia/Tokyo"}}\n```{DS_END}{DS_CALLS_END}'), "Checking both.",
     [("get_weather", rich(DS_END + " ```")), ("get_time", {"tz": "Asia/Tokyo"})]),
    ("deepseek_v3", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    # DeepSeek V3.1
    ("deepseek_v31", f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Hangzhou"}}{DS_END}{DS_CALLS_END}', "",
     [("get_weather", {"city": "Hangzhou"})]),
    ("deepseek_v31", (f"Let me check.\n\n{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{rich_json(DS_SEP + DS_END)}{DS_END}"
                      f'{DS_CALL}get_time{DS_SEP}{{}}{DS_END}{DS_CALLS_END}'), "Let me check.",
     [("get_weather", rich(DS_SEP + DS_END)), ("get_time", {})]),
    ("deepseek_v31", "Hello! How can I help you today?", "Hello! How can I help you today?", []),
    # Kimi K2
    ("kimi_k2", (f"I'll look it up.{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{rich_json(KIMI[3])}{KIMI[3]}"
                 f'{KIMI[1]}functions.get_time:1{KIMI[2]}{{"tz": "UTC"}}{KIMI[3]}{KIMI[4]}'), "I'll look it up.",
     [("get_weather", rich(KIMI[3])), ("get_time", {"tz": "UTC"})]),
    ("kimi_k2", "Plain answer, no tools.", "Plain answer, no tools.", []),
    # GLM-4.5 / 4.6 (typed by the tools; undeclared values read as JSON) and 4.7 (no newline after the name)
    ("glm45", ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Tōkyō \"東京\" </tool_call"
               "></arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>filter</arg_key>\n"
               f"<arg_value>{json.dumps(RICH['filter'])}</arg_value>\n<arg_key>extra</arg_key>\n<arg_value>[1, 2]"
               "</arg_value>\n</tool_call>"), "Checking.",
     [("get_weather", {"city": 'Tōkyō "東京" </tool_call>', "days": 3, "filter": RICH["filter"], "extra": [1, 2]})]),
    ("glm45", ("<tool_call>search<arg_key>query</arg_key><arg_value>007</arg_value><arg_key>limit</arg_key>"
               "<arg_value>5</arg_value></tool_call><tool_call>get_time</tool_call>"), "",
     [("search", {"query": "007", "limit": 5}), ("get_time", {})]),
    ("glm45", "No call: <b>bold</b>.", "No call: <b>bold</b>.", []),
    # Qwen3-Coder
    ("qwen3_coder", ("I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nTōkyō \"東京\"\n"
                     "<function=x> {\"not\": json}\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>"
                     "\nTrue\n</parameter>\n<parameter=filter>\n" + json.dumps(RICH["filter"]) + "\n</parameter>\n"
                     "<parameter=hours>\n[6, 12]\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n"
                     "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"), "I'll check.",
     [("get_weather", {"city": 'Tōkyō "東京"\n<function=x> {"not": json}', "days": 3, "metric": True,
                       "filter": RICH["filter"], "hours": [6, 12], "ratio": 0.5}), ("get_time", {})]),
    ("qwen3_coder", ("<tool_call>\n<function=search>\n<parameter=query>\n  two\nlines  \n</parameter>\n"
                     "<parameter=limit>\nnull\n</parameter>\n<parameter=undeclared>\n42\n</parameter>\n</function>"),
     "", [("search", {"query": "  two\nlines  ", "limit": None, "undeclared": "42"})]),
    ("qwen3_coder", "Use <function=name> tags to call.", "Use <function=name> tags to call.", []),
    # Seed-OSS
    ("seed_oss", ("Let me see.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Tōkyō </seed:tool_call>"
                  "</parameter>\n<parameter=days>7</parameter>\n</function>\n</seed:tool_call>"), "Let me see.",
     [("get_weather", {"city": "Tōkyō </seed:tool_call>", "days": 7})]),
    ("seed_oss", "Nothing to call.", "Nothing to call.", []),
    # MiniMax-M2
    ("minimax_m2", ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Tōkyō "東京" '
                    '<invoke name="x"></parameter>\n<parameter name="filter">'
                    + json.dumps(RICH["filter"], ensure_ascii=False) + '</parameter>\n</invoke>\n<invoke name="search">'
                    '\n<parameter name="query">vLLM &amp; co</parameter>\n</invoke>\n</minimax:tool_call>'), "",
     [("get_weather", {"city": 'Tōkyō "東京" <invoke name="x">', "filter": RICH["filter"]}),
      ("search", {"query": "vLLM &amp; co"})]),
    ("minimax_m2", "The answer is 4.", "The answer is 4.", []),
    # Step-3
    ("step3", (f'Sure.{STEP[0]}{STEP[1]}function{STEP[2]}<steptml:invoke name="get_weather"><steptml:parameter '
               f'name="city">Tōkyō {STEP[3]}</steptml:parameter><steptml:parameter name="days">2</steptml:parameter>'
               f'</steptml:invoke>{STEP[3]}{STEP[1]}function{STEP[2]}<steptml:invoke name="get_time">'
               f"</steptml:invoke>{STEP[3]}{STEP[4]}"), "Sure.",
     [("get_weather", {"city": f"Tōkyō {STEP[3]}", "days": 2}), ("get_time", {})]),
    ("step3", "No tool needed.", "No tool needed.", []),
    # Jamba
    ("jamba", f'<tool_calls>[{{"name": "get_weather", "arguments": {rich_json("</tool_calls>")}}}]</tool_calls>', "",
     [("get_weather", rich("</tool_calls>"))]),
    ("jamba", "Here you go <b>.</b>", "Here you go <b>.</b>", []),
    # Hunyuan-A13B
    ("hunyuan_a13b", ('I will call it.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "深圳"}}, '
                      '{"name": "get_time", "arguments": {}}]</tool_calls>'), "I will call it.",
     [("get_weather", {"city": "深圳"}), ("get_time", {})]),
    ("hunyuan_a13b", "直接回答：42。", "直接回答：42。", []),
    # InternLM 2 / 2.5
    ("internlm", (f'Let me search.<|action_start|><|plugin|>\n{{"name": "search", "parameters": '
                  f'{rich_json("<|action_end|>")}}}<|action_end|>'), "Let me search.",
     [("search", rich("<|action_end|>"))]),
    ("internlm", "No plugin needed.", "No plugin needed.", []),
    # xLAM: a bare array, or one in a ```json fence after content
    ("xlam", f'[{{"name": "get_weather", "arguments": {rich_json("```json [")}}}, {{"name": "get_time", '
             f'"arguments": {{}}}}]', "", [("get_weather", rich("```json [")), ("get_time", {})]),
    ("xlam", ('I will check the weather.\n```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}]\n```'),
     "I will check the weather.", [("get_weather", {"city": "Paris"})]),
    ("xlam", "See [1] for details.", "See [1] for details.", []),
    # Phi-4-mini
    ("phi4_mini_json", (f'functools[{{"name": "get_weather", "arguments": {rich_json("functools[")}}}, '
                        f'{{"name": "get_time", "parameters": {{"tz": "UTC"}}}}]'), "",
     [("get_weather", rich("functools[")), ("get_time", {"tz": "UTC"})]),
    ("phi4_mini_json", "Functools are handy.", "Functools are handy.", []),
    # GigaChat 3
    ("gigachat3", (f'Сейчас проверю.<|message_sep|>\n\nfunction call<|role_sep|>\n{{"name": "get_weather", '
                   f'"arguments": {rich_json("<|message_sep|>")}}}'), "Сейчас проверю.",
     [("get_weather", rich("<|message_sep|>"))]),
    ("gigachat3", "Привет! Чем помочь?", "Привет! Чем помочь?", []),
    # gpt-oss (harmony): analysis is dropped here (the reasoning parser's), preamble and final are content
    ("openai", ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                f"to=functions.get_weather <|constrain|>json<|message|>{RICH_JSON}<|call|>"), "",
     [("get_weather", RICH)]),
    ("openai", ("<|channel|>commentary<|message|>Checking the time.<|end|><|start|>assistant to=functions.get_time"
                '<|channel|>commentary json<|message|>{"tz": "Europe/Paris"}<|call|>'), "Checking the time.",
     [("get_time", {"tz": "Europe/Paris"})]),
    ("openai", ("<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>"
                "2 + 2 = **4** <|return|>"), "2 + 2 = **4** ", []),
]

# (parser, chat_template_kwargs, model output, reasoning, content)
REASONING_CASES: list[tuple[str, dict[str, Any], str, str, str]] = [
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
    # DeepSeek V3.1 hybrid: thinking only when the request turns it on
    ("deepseek_v3", {"thinking": True}, "The user greets me.</think>Hello — 你好!", "The user greets me.",
     "Hello — 你好!"),
    ("deepseek_v3", {}, "Hello! No </think> parsing here.", "", "Hello! No </think> parsing here."),
    # GLM-4.5
    ("glm45", {}, "<think>Which city? Paris.</think>\nParis is the capital of France.", "Which city? Paris.",
     "Paris is the capital of France."),
    ("glm45", {"enable_thinking": False}, "Paris. A </think> stays text.", "", "Paris. A </think> stays text."),
    # Magistral
    ("mistral", {}, "[THINK]Let me compute 17*3 = 51. Is [/THINK the end? No.[/THINK]**51**",
     "Let me compute 17*3 = 51. Is [/THINK the end? No.", "**51**"),
    ("mistral", {}, "Direct answer without thinking.", "", "Direct answer without thinking."),
    # Hunyuan-A13B: slow think, and fast think's empty block
    ("hunyuan_a13b", {}, "<think>\nThe user asks 1+1.\n</think>\n<answer>\n1+1 = 2. <answer> is a tag.\n</answer>",
     "The user asks 1+1.", "1+1 = 2. <answer> is a tag."),
    ("hunyuan_a13b", {}, "<think>\n\n</think>\n<answer>\n你好！\n</answer>", "", "你好！"),
    ("hunyuan_a13b", {}, "Plain answer.", "", "Plain answer."),
    # ERNIE-4.5 thinking: with and without the <response> tags
    ("ernie45", {}, "Compute.\n</think>\n\n<response>\nIt is 4.\n</response>\n", "Compute.", "It is 4."),
    ("ernie45", {}, "Short thought.\n</think>\nIt is 5.", "Short thought.", "It is 5."),
    # MiniMax-M2 and Step-3: the template opens <think>
    ("minimax_m2", {}, "The user wants a haiku.\n</think>\n\nAutumn moonlight—", "The user wants a haiku.",
     "Autumn moonlight—"),
    ("minimax_m2", {}, "Still reasoning when max_tokens hit </thi", "Still reasoning when max_tokens hit </thi", ""),
    ("step3", {}, "<think>Plan: answer briefly.</think>Brief answer.", "Plan: answer briefly.", "Brief answer."),
    ("step3", {}, "No end marker yet", "No end marker yet", ""),
    # Seed-OSS
    ("seed_oss", {}, "<seed:think>Budget is fine. </think> is not mine.</seed:think>\nDone.",
     "Budget is fine. </think> is not mine.", "Done."),
    ("seed_oss", {}, "Implicit start.</seed:think>Answer.", "Implicit start.", "Answer."),
    # gpt-oss (harmony), under both its names
    ("openai", {}, ("<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final"
                    "<|message|>2 + 2 = 4 — « quatre »."), "User asks 2+2. Easy.", "2 + 2 = 4 — « quatre »."),
    ("openai_gptoss", {}, ("<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis"
                           "<|message|>Second thought.<|end|><|start|>assistant<|channel|>final<|message|>Done."),
     "First thought.\nSecond thought.", "Done."),
]

# Reasoning then tool calls, as the chat route chains them:
# (reasoning parser, kwargs, tool parser, output, reasoning, content, calls)
CHAINED = [
    ("qwen3", {}, "hermes", ('<think>\nI need the weather. Call get_weather.\n</think>\n\nLet me check.\n<tool_call>\n'
                             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
     "I need the weather. Call get_weather.", "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("qwen3", {}, "qwen3_coder", ("<think>\nUse the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
     "Use the tool.", "", [("get_weather", {"days": 2})]),
    ("openai", {}, "openai", ("<|channel|>analysis<|message|>Need the weather in Tōkyō.<|end|><|start|>assistant"
                              "<|channel|>commentary<|message|>One moment.<|end|><|start|>assistant<|channel|>"
                              f"commentary to=functions.get_weather <|constrain|>json<|message|>{RICH_JSON}<|call|>"),
     "Need the weather in Tōkyō.", "One moment.", [("get_weather", RICH)]),
    ("deepseek_r1", {}, "deepseek_v31", (f"Weather needed.</think>{DS_CALLS}{DS_CALL}get_weather{DS_SEP}"
                                         f'{{"city": "Paris"}}{DS_END}{DS_CALLS_END}'),
     "Weather needed.", "", [("get_weather", {"city": "Paris"})]),
    ("glm45", {}, "glm45", ("<think>Call it.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
                            "Paris</arg_value>\n</tool_call>"), "Call it.", "", [("get_weather", {"city": "Paris"})]),
    ("minimax_m2", {}, "minimax_m2", ('Call it.</think>\n<minimax:tool_call>\n<invoke name="get_time">\n</invoke>\n'
                                      "</minimax:tool_call>"), "Call it.", "", [("get_time", {})]),
]

# Token-like pieces: markers whole, words whole, then single characters.
_TOKEN = re.compile(r"<[|｜][^<>|｜]{1,40}[|｜]>|\[/?[A-Z_]{2,12}\]|</?[\w:]+>?|\w+|\s+|.", re.DOTALL)


def _cuts(text: str) -> Iterator[tuple[str, list[str], bool]]:
    """(label, pieces, flush): every way a stream may deliver `text`; flush adds an empty final delta."""
    for cut in range(len(text) + 1):
        yield f"cut at {cut}", [text[:cut], text[cut:]], False
    for size in (1, 2, 3, 7):
        yield f"chunks of {size}", [text[i:i + size] for i in range(0, len(text), size)], size == 1
    tokens = _TOKEN.findall(text)
    assert "".join(tokens) == text
    yield "tokens", tokens, False
    yield "tokens, then an empty final delta", tokens, True


def _feeds(pieces: list[str], flush: bool) -> list[tuple[str, bool]]:
    if flush or not pieces:
        return [(piece, False) for piece in pieces] + [("", True)]
    return [(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def _tool_run(name: str, pieces: list[str], flush: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """Feed the pieces and reassemble the deltas as an OpenAI client does."""
    stream = ToolCallStream(TOOL_PARSERS.get(name)(TOOLS))
    content, calls = "", {}
    for piece, final in _feeds(pieces, flush):
        delta = stream.feed(piece, final)
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(calls) and call.name, "a call opens with its id and whole name, in order"
                calls[call.index] = [call.name, call.arguments]
            else:
                assert call.name is None and call.index in calls
                calls[call.index][1] += call.arguments
    assert stream.called == bool(calls)
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _reasoning_run(name: str, kwargs: dict[str, Any], pieces: list[str], flush: bool = False) -> tuple[str, str]:
    stream = ReasoningStream(REASONING_PARSERS.get(name)(kwargs))
    reasoning = content = ""
    for piece, final in _feeds(pieces, flush):
        split = stream.feed(piece, final)
        reasoning += split.reasoning
        content += split.content
    return reasoning, content


def _chained_run(reasoning: str, kwargs: dict[str, Any], tools: str, pieces: list[str],
                 flush: bool = False) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ChatOutputParser(REASONING_PARSERS.get(reasoning)(kwargs), TOOL_PARSERS.get(tools)(TOOLS))
    thought, content, calls = "", "", {}
    for piece, final in _feeds(pieces, flush):
        delta = parser.feed(piece, final)
        thought += delta.reasoning_content or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    return thought, content, [tuple(calls[i]) for i in sorted(calls)]


def _decoded(calls: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    return [(name, json.loads(arguments)) for name, arguments in calls]


def test_every_parser_has_cases():
    assert set(TOOL_PARSERS.names()) == {case[0] for case in TOOL_CASES}
    assert set(REASONING_PARSERS.names()) == {case[0] for case in REASONING_CASES}
    assert len(TOOL_PARSERS.names()) >= 20 and len(REASONING_PARSERS.names()) >= 10


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(TOOL_CASES)])
def test_tool_parser_streams_exactly_the_whole_result(name, text, content, calls):
    whole = _tool_run(name, [text])
    assert whole[0] == content
    assert _decoded(whole[1]) == calls
    for label, pieces, flush in _cuts(text):
        assert _tool_run(name, pieces, flush) == whole, label


@pytest.mark.parametrize("name,kwargs,text,reasoning,content", REASONING_CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(REASONING_CASES)])
def test_reasoning_parser_streams_exactly_the_whole_result(name, kwargs, text, reasoning, content):
    whole = _reasoning_run(name, kwargs, [text])
    assert whole == (reasoning, content)
    for label, pieces, flush in _cuts(text):
        assert _reasoning_run(name, kwargs, pieces, flush) == whole, label


@pytest.mark.parametrize("reasoning_name,kwargs,tools_name,text,reasoning,content,calls", CHAINED,
                         ids=[f"{case[0]}+{case[2]}" for case in CHAINED])
def test_reasoning_then_tools_streams_exactly_the_whole_result(reasoning_name, kwargs, tools_name, text, reasoning,
                                                               content, calls):
    whole = _chained_run(reasoning_name, kwargs, tools_name, [text])
    assert whole[:2] == (reasoning, content)
    assert _decoded(whole[2]) == calls
    for label, pieces, flush in _cuts(text):
        assert _chained_run(reasoning_name, kwargs, tools_name, pieces, flush) == whole, label
