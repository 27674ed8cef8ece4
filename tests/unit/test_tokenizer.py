"""vllmpy.tokenizer against transformers (the oracle) on real Gemma 3 and SmolLM2 vocabularies.

The HF directories are written by transformers' own GGUF conversion, so both loaders are checked
on the same vocabulary: Tokenizer.from_pretrained(dir) and Tokenizer.from_gguf_metadata(md).
"""

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.loader.gguf.file import read_gguf
from vllmpy.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "Hello, world!",
    "  leading spaces and\ttabs",
    "line one\nline two\n\n\nthree",
    "Numbers 12345 and 3.14159, x=2024",
    "Unicode: café naïve 日本語のテキスト 你好世界 😀🚀👍🏽 🧑‍🤝‍🧑",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<|im_start|>system\nYou are helpful<|im_end|>\n",
    "don't I'm we're they've",
    "",
    " ",
    "a  b   c",
    "<bos>text<eos><|endoftext|>",
]
# Rare characters: Gemma spells them with <0xNN> byte-fallback tokens, SmolLM2 with byte-level pieces.
STREAM_TEXT = "Hi 𓀀𓁐 ok 🫠🧑‍🤝‍🧑 日本語 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done."


def _metadata(path: str) -> Mapping[str, Any]:
    """The file's metadata as the loader passes it: its vocabulary arrays decoded only on a cache miss."""
    metadata, _ = read_gguf(path)
    return metadata


def _build(name: str, gguf_path: str, directory: str) -> tuple:
    """(name, Tokenizer from the HF dir, Tokenizer from GGUF metadata, HF oracle, HF dir)."""
    oracle = transformers.AutoTokenizer.from_pretrained(directory)
    return (name, Tokenizer.from_pretrained(directory), Tokenizer.from_gguf_metadata(_metadata(gguf_path)), oracle,
            Path(directory))


@pytest.fixture(scope="session")
def gemma3(gemma3_gguf_path, gemma3_tokenizer_dir):
    return _build("gemma3", gemma3_gguf_path, gemma3_tokenizer_dir)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path, smollm2_tokenizer_dir):
    return _build("smollm2", smollm2_gguf_path, smollm2_tokenizer_dir)


@pytest.fixture(params=["gemma3", "smollm2"])
def model(request):
    return request.getfixturevalue(request.param)


# --- encode / decode equal transformers ------------------------------------------------------


@pytest.mark.parametrize("loader", ["dir", "gguf"])
def test_encode_decode_match_transformers(model, loader):
    name, from_dir, from_gguf, oracle, _ = model
    tok = from_dir if loader == "dir" else from_gguf
    for prompt in PROMPTS:
        expected = oracle.encode(prompt)
        assert tok.encode(prompt) == expected, (name, loader, prompt)
        assert tok.encode(prompt, add_special_tokens=False) == oracle.encode(prompt, add_special_tokens=False)
        for skip in (True, False):
            assert tok.decode(expected, skip_special_tokens=skip) == oracle.decode(expected, skip_special_tokens=skip)


@pytest.mark.parametrize("loader", ["dir", "gguf"])
def test_special_ids_match_transformers(model, loader):
    _, from_dir, from_gguf, oracle, _ = model
    tok = from_dir if loader == "dir" else from_gguf
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        oracle.bos_token_id,
        oracle.eos_token_id,
        oracle.pad_token_id,
    )
    assert tok.vocab_size == len(oracle)
    assert set(oracle.all_special_ids) <= tok.all_special_ids
    assert tok.id_to_token(tok.eos_token_id) == oracle.eos_token
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.id_to_token(tok.vocab_size + 10)


def test_gemma3_adds_bos_and_smollm2_does_not(model):
    name, from_dir, from_gguf, _, _ = model
    for tok in (from_dir, from_gguf):
        starts_with_bos = tok.encode("hi")[0] == tok.bos_token_id
        assert starts_with_bos == (name == "gemma3")


def test_smollm_gguf_splits_every_number_char(smollm2):
    """llama.cpp's "smollm" pre-tokenizer isolates each digit (\\p{N}), so " ½" is " " then "½"."""
    _, _, from_gguf, _, _ = smollm2
    assert [from_gguf.id_to_token(i) for i in from_gguf.encode(" ½")] == ["Ġ", "Â½"]


def test_config_add_bos_token_ignored_with_tokenizer_json_like_transformers(smollm2, tmp_path):
    directory = smollm2[4]
    variant = Path(shutil.copytree(directory, tmp_path / "variant"))
    config = json.loads((variant / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (variant / "tokenizer_config.json").write_text(json.dumps(config))
    oracle = transformers.AutoTokenizer.from_pretrained(str(variant))
    assert Tokenizer.from_pretrained(variant).encode("hi there") == oracle.encode("hi there")


def test_named_chat_templates_take_default(smollm2, tmp_path):
    directory = smollm2[4]
    variant = Path(shutil.copytree(directory, tmp_path / "variant"))
    (variant / "chat_template.jinja").unlink()
    config = json.loads((variant / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (variant / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_pretrained(variant).chat_template == "D"


# A llama-style (SentencePiece) GGUF vocabulary without add_bos_token / add_space_prefix keys.
SPM_METADATA = {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>", "▁", "h", "i", "▁h", "▁hi", "<0xC3>", "<0xA9>"],
    "tokenizer.ggml.scores": [0, 0, 0, -1, -2, -3, -4, -5, 0, 0],
    "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1, 1, 1, 6, 6],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.unknown_token_id": 0,
}


def test_gguf_sentencepiece_with_space_prefix():
    """A llama-style file without add_bos_token/add_space_prefix keys gets both, as llama.cpp does."""
    tok = Tokenizer.from_gguf_metadata(dict(SPM_METADATA))
    assert tok.encode("hi hié") == [1, 7, 7, 8, 9]
    assert tok.decode([1, 7, 7, 8, 9]) == "hi hié"
    assert tok.encode("hi", add_special_tokens=False) == [7]


# --- streaming detokenization ----------------------------------------------------------------


@pytest.mark.parametrize("loader", ["dir", "gguf"])
def test_streaming_one_id_at_a_time_equals_decode(model, loader):
    _, from_dir, from_gguf, _, _ = model
    tok = from_dir if loader == "dir" else from_gguf
    ids = tok.encode(STREAM_TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    assert "\ufffd" not in full
    assert any("\ufffd" in tok.decode([i]) for i in ids), "text must split a character across ids"
    stream = IncrementalDetokenizer(tok, [])
    deltas = [stream.add_tokens([i]) for i in ids]
    assert "".join(deltas) == full == stream.output_text
    assert not any("\ufffd" in d for d in deltas)


def test_streaming_after_prompt_and_special_tokens(model):
    _, _, from_gguf, _, _ = model
    tok = from_gguf
    prompt = tok.encode("Translate: 你好")
    generated = tok.encode(" 𓀀 fine", add_special_tokens=False) + [tok.eos_token_id]
    for skip in (True, False):
        stream = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        for i in generated:
            stream.add_tokens([i])
        whole, head = tok.decode(prompt + generated, skip), tok.decode(prompt, skip)
        assert stream.output_text == whole[len(head) :]


# --- merges naming a missing token are refused -------------------------------------------------


@pytest.mark.parametrize(
    ("merges", "token", "rank"),
    [(["a b", "c b"], "c", 1), ([["a", "b"], ["a", "z"]], "z", 1), (["b a"], "ba", 0)],
)
def test_tokenizer_json_merge_with_missing_token_is_refused(tmp_path, merges, token, rank):
    spec = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": None,
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": merges},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(
        ValueError, match=rf'^tokenizer: merge token "{token}" at merge rank {rank}\b.*not in the vocabulary'
    ):
        Tokenizer.from_pretrained(tmp_path)


def test_gguf_merge_with_missing_token_is_refused():
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "abb"],
        "tokenizer.ggml.merges": ["a b", "ab b", "abb q"],
    }
    with pytest.raises(ValueError, match=r'^tokenizer: merge token "q" at merge rank 2\b.*not in the vocabulary'):
        Tokenizer.from_gguf_metadata(md)


O200K_TEXTS = ["HelloWorld IPhone McDonald's DON'T don't", "1234567 and 12.5%", "a/b\n/c !!/\n/", *PROMPTS]


@pytest.mark.parametrize("pre", ["gpt-4o", "llama4"])
def test_gguf_o200k_pre_tokenizer_matches_transformers(smollm2_gguf_path, tmp_path, pre):
    """gpt-oss's and Llama 4's GGUFs name tiktoken's o200k split: SmolLM2's vocabulary under that name encodes
    as transformers' GGUF tokenizer does, and unlike under SmolLM2's own split (a split mapped wrong fails)."""
    import gguf
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    md = {**_metadata(smollm2_gguf_path), "tokenizer.ggml.pre": pre}
    w = gguf.GGUFWriter(str(tmp_path / "vocab.gguf"), "llama")
    for key in ("model", "tokens", "token_type", "merges"):
        value = md[f"tokenizer.ggml.{key}"]
        {"model": w.add_tokenizer_model, "tokens": w.add_token_list, "token_type": w.add_token_types,
         "merges": w.add_token_merges}[key](value if isinstance(value, str) else list(value))
    w.add_tokenizer_pre(pre)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    oracle, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(str(tmp_path / "vocab.gguf"))[:2])
    ours, smollm = Tokenizer.from_gguf_metadata(md), Tokenizer.from_gguf_metadata(_metadata(smollm2_gguf_path))
    for text in O200K_TEXTS:
        assert ours.encode(text, add_special_tokens=False) == oracle.encode(text, add_special_tokens=False).ids, text
    assert any(ours.encode(t) != smollm.encode(t) for t in O200K_TEXTS)


def test_gguf_unknown_pre_tokenizer_is_refused():
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(UnsupportedCheckpointError, match="no-such-pre"):
        Tokenizer.from_gguf_metadata(md)


# --- chat templates ------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2? Answer with ünïcödé."},
]


@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]])
def test_smollm2_template_matches_transformers(smollm2, messages):
    _, from_dir, from_gguf, oracle, _ = smollm2
    expected = oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert from_dir.apply_chat_template(messages) == expected
    assert from_gguf.apply_chat_template(messages) == expected
    assert expected.endswith("<|im_start|>assistant\n")


def test_continue_final_message_leaves_it_open(smollm2):
    _, from_dir, _, oracle, _ = smollm2
    messages = [*CONVERSATION, {"role": "assistant", "content": "The answer is"}]
    rendered = from_dir.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("<|im_start|>assistant\nThe answer is")
    expected = oracle.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert rendered == expected
    # The generation prompt would come after the cut, so leaving it on changes nothing.
    assert from_dir.apply_chat_template(messages, continue_final_message=True) == rendered


def test_continue_final_message_with_trimming_template(smollm2):
    from_dir = smollm2[1]
    trimming = "{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}"
    messages = [{"role": "assistant", "content": "Hello there "}]
    out = from_dir.apply_chat_template(messages, chat_template=trimming, continue_final_message=True)
    assert out == "[Hello there"
    parts = "{% for m in messages %}[{{ m['content'][-1]['text'] }}]{% endfor %}"
    messages = [{"role": "assistant", "content": [{"type": "text", "text": "Hello there "}]}]
    out = from_dir.apply_chat_template(messages, chat_template=parts, continue_final_message=True)
    assert out == "[Hello there "


def test_unsent_kwargs_are_undefined(smollm2):
    from_dir = smollm2[1]
    template = "{% if enable_thinking is undefined %}U{% else %}D{% endif %}{% if tools is defined %}T{% endif %}"
    assert from_dir.apply_chat_template(CONVERSATION, chat_template=template) == "U"
    kwargs = {"enable_thinking": False}
    assert from_dir.apply_chat_template(CONVERSATION, chat_template=template, chat_template_kwargs=kwargs) == "D"
    assert from_dir.apply_chat_template(CONVERSATION, chat_template=template, tools=[]) == "UT"


@pytest.mark.parametrize(
    "key", ["messages", "tools", "chat_template", "tokenize", "add_generation_prompt", "continue_final_message"]
)
def test_reserved_kwarg_is_refused(smollm2, key):
    from_dir = smollm2[1]
    with pytest.raises(ChatTemplateError, match=key):
        from_dir.apply_chat_template(CONVERSATION, chat_template_kwargs={key: True})


def test_template_helpers_behave_like_transformers(smollm2):
    from_dir = smollm2[1]
    template = (
        "{{ bos_token }}|{{ tools | tojson }}|{{ strftime_now('%Y') | length }}{% generation %}|gen{% endgeneration %}"
    )
    tools = [{"name": "f", "description": "<é>"}]
    out = from_dir.apply_chat_template(CONVERSATION, chat_template=template, tools=tools)
    assert out == '<|im_start|>|[{"name": "f", "description": "<é>"}]|4|gen'
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        from_dir.apply_chat_template(CONVERSATION, chat_template="{{ raise_exception('roles must alternate') }}")


def test_model_without_template_is_refused(gemma3):
    _, from_dir, from_gguf, _, _ = gemma3
    for tok in (from_dir, from_gguf):
        with pytest.raises(ChatTemplateError, match="no chat template"):
            tok.apply_chat_template(CONVERSATION)
