"""Per-request bounds outside the server: SamplingParams' top_k / stop_token_ids, --max-logprobs against
logprobs and prompt_logprobs (the vocabulary caps every setting), and the JSON body walk."""
from __future__ import annotations

import json

import pytest

from vllmpy.config import EngineConfig
from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.json_limits import MAX_JSON_DEPTH, check_json_body
from vllmpy.sampling_params import SamplingParams

VOCAB = 1000


@pytest.mark.parametrize("top_k,kept", [(-1, 0), (0, 0), (1, 1), (10**9, 10**9)])
def test_top_k_disable_values(top_k, kept):
    assert SamplingParams(top_k=top_k).top_k == kept


@pytest.mark.parametrize("kwargs,field", [({"top_k": -2}, "top_k"), ({"stop_token_ids": [3, -1]}, "stop_token_ids")])
def test_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("max_logprobs,asked,allowed", [
    (20, 20, True), (20, 21, False), (20, -1, False), (0, 0, True), (0, 1, False),
    (-1, -1, True), (-1, VOCAB, True), (-1, VOCAB + 1, False), (10**6, VOCAB + 1, False), (10**6, -1, True),
])
@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_max_logprobs(max_logprobs, asked, allowed, field):
    params = SamplingParams(**{field: asked})
    if allowed:
        params.check_logprobs_limit(max_logprobs, VOCAB)
    else:
        with pytest.raises(ValueError, match=f"^{field} "):
            params.check_logprobs_limit(max_logprobs, VOCAB)


def test_max_logprobs_config_default_and_range():
    assert EngineConfig.from_kwargs().model.max_logprobs == 20  # vLLM's default
    assert EngineConfig.from_kwargs(max_logprobs=-1).model.max_logprobs == -1
    with pytest.raises(ValueError, match="--max-logprobs"):
        EngineConfig.from_kwargs(max_logprobs=-2)


def _refusal(body: dict) -> RequestError:
    with pytest.raises(RequestError) as caught:
        check_json_body(body)
    return caught.value


def test_body_depth_bound():
    def nested(depth: int) -> list:
        value: list = []
        for _ in range(depth - 1):
            value = [value]
        return value

    check_json_body({"a": nested(MAX_JSON_DEPTH - 1)})  # the body is level 1
    error = _refusal({"ok": 1, "deep": {"x": nested(MAX_JSON_DEPTH)}})
    assert error.param == "deep" and str(MAX_JSON_DEPTH) in error.message


@pytest.mark.parametrize("body,param,where", [
    ({"prompt": "ok", "stop": ["a", "b\ud800"]}, "stop", "stop[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages",
     "messages[0].content[0].text"),
    ({"tools": [{"function": {"\ud800": 1}}]}, "tools", "a key in tools[0].function"),
    ({"\ud800": 1}, None, "a field name"),
])
def test_lone_surrogates_located(body, param, where):
    error = _refusal(body)
    assert error.param == param and error.message.startswith(f"{where} is not valid Unicode")
    json.dumps(error.message, ensure_ascii=False).encode("utf-8")  # the refusal itself is valid text


def test_valid_text_passes():
    check_json_body({"prompt": "caf\u00e9 \U0001F600", "ids": list(range(100)), "n": 1, "x": None})


def test_offline_engine_bounds_logprobs_at_add_request(tiny_llama_dir):
    """LLM(max_logprobs=...) bounds both fields before anything is queued; -1 there serves the vocabulary."""
    from vllmpy import LLM

    llm = LLM(model=tiny_llama_dir, num_blocks=32, max_model_len=64, max_logprobs=3)
    greedy = {"temperature": 0, "max_tokens": 1}
    with pytest.raises(ValueError, match=r"^logprobs asks for 4 .*--max-logprobs 3"):
        llm.generate([[5, 6]], SamplingParams(logprobs=4, **greedy), use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt_logprobs asks for the whole vocabulary"):
        llm.generate([[5, 6]], SamplingParams(prompt_logprobs=-1, **greedy), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6]], SamplingParams(logprobs=3, prompt_logprobs=3, **greedy), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 3 and len(out.prompt_logprobs[1]) >= 3

    whole = LLM(model=tiny_llama_dir, num_blocks=32, max_model_len=64, max_logprobs=-1)
    vocab = whole.engine.core.vocab_size
    out = whole.generate([[5, 6]], SamplingParams(prompt_logprobs=-1, **greedy), use_tqdm=False)[0]
    assert len(out.prompt_logprobs[1]) == vocab
    with pytest.raises(ValueError, match="vocabulary size"):
        whole.generate([[5, 6]], SamplingParams(logprobs=vocab + 1, **greedy), use_tqdm=False)
