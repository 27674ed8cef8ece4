"""The official openai client against the server: the shapes it parses, and greedy text equal to LLM.generate."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    from vllmpy import LLM

    return LLM(tiny_llama_dir, num_blocks=64, max_model_len=256)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["model"]
    assert models.data[0].max_model_len == 256


def test_greedy_completion_equals_llm_generate(client, llm):
    from vllmpy import SamplingParams

    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    got = client.completions.create(model="model", prompt=PROMPT, max_tokens=16, temperature=0.0)
    assert got.choices[0].text == expected.outputs[0].text
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == 16 and got.choices[0].finish_reason == "length"


def test_greedy_chat_equals_llm_chat(client, llm):
    from vllmpy import SamplingParams

    expected = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    got = client.chat.completions.create(model="model", messages=MESSAGES, max_completion_tokens=12, temperature=0)
    assert got.choices[0].message.content == expected.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_completion_n_echo_logprobs(client):
    many = client.completions.create(model="model", prompt=[PROMPT, "Once upon a time"], n=2, max_tokens=4, seed=7)
    assert sorted(c.index for c in many.choices) == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 16

    echoed = client.completions.create(model="model", prompt=PROMPT, echo=True, max_tokens=3, temperature=0,
                                       logprobs=2)
    choice = echoed.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    n_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs[1:])  # the chosen token plus the top 2
    assert lp.text_offset == sorted(lp.text_offset)


def test_completion_stop_string(client):
    full = client.completions.create(model="model", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(model="model", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completion_stream_adds_up(client):
    whole = client.completions.create(model="model", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    chunks = list(client.completions.create(model="model", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_stream_with_usage(client):
    whole = client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_logprobs(client):
    got = client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == 5
    joined = "".join(t.token for t in content)
    if "\ufffd" not in joined:  # a token holding part of a UTF-8 character reads as U+FFFD on its own
        assert joined == got.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob >= token.top_logprobs[-1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy picks rank 1
        assert bytes(token.bytes).decode() == token.token


def test_chat_extra_body_template_kwargs_and_prompt_logprobs(client):
    got = client.chat.completions.create(
        model="model", messages=MESSAGES, max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "prompt_logprobs": 2})
    prompt_lp = got.model_extra["prompt_logprobs"]
    assert len(prompt_lp) == got.usage.prompt_tokens and prompt_lp[0] is None
    for position in prompt_lp[1:]:
        ranks = sorted(entry["rank"] for entry in position.values())
        assert {1, 2} <= set(ranks) and len(position) <= 3
        assert all(entry["logprob"] <= 0 and "decoded_token" in entry for entry in position.values())


def test_chat_content_parts_tool_role_and_continue_final_message(client, tiny_server):
    import httpx

    def rendered(**body) -> str:
        tokens = httpx.post(f"{tiny_server.url}/tokenize", json=body).json()["tokens"]
        return httpx.post(f"{tiny_server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]

    parts = [{"role": "user", "content": [{"type": "text", "text": "Name"}, {"type": "text", "text": "a colour."}]}]
    assert rendered(messages=parts) == rendered(messages=[{"role": "user", "content": "Name\na colour."}])

    tools = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    got = client.chat.completions.create(model="model", messages=tools, max_tokens=2)
    assert got.usage.completion_tokens == 2
    assert "sunny" in rendered(messages=tools)

    partial = MESSAGES + [{"role": "assistant", "content": "My colour is"}]
    text = rendered(messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("My colour is")


def test_chat_n_seed_and_stop(client):
    def sample(**kw):
        return client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=8, temperature=1.0,
                                              **kw)

    first, again = sample(n=2, seed=42), sample(n=2, seed=42)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]

    full = client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=12, temperature=0, stop=stop)
    assert cut.choices[0].message.content == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="model", messages=MESSAGES, max_tokens=12, temperature=0,
                                              stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.choices[0].message.content
