"""The GGUF tokenizer cache: a warm start reads the built tokenizer.json instead of rebuilding it, keyed by
the tokenizer metadata, without decoding the file's vocabulary; a corrupt entry is rebuilt rather than
trusted; vllm-cli's prefetch thread hands its entry over."""
from __future__ import annotations

import json

import pytest
import tokenizers

from tests.unit.test_tokenizer import PROMPTS, SPM_METADATA
from vllmpy.loader.gguf import file as gguf_file
from vllmpy.loader.gguf.file import read_gguf
from vllmpy.tokenizer import gguf_cache
from vllmpy.tokenizer.tokenizer import Tokenizer


def _metadata(**extra) -> dict:
    return {**SPM_METADATA, "tokenizer.chat_template": "{{ messages[0]['content'] }}", **extra}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLMPY_CACHE", str(tmp_path))
    return tmp_path / "tokenizers"


def _forbid_building(monkeypatch) -> None:
    def fail(md):
        raise AssertionError("the cached tokenizer was rebuilt")
    monkeypatch.setattr("vllmpy.tokenizer.tokenizer.tokenizer_from_gguf", fail)


def _forbid_decoding(monkeypatch) -> None:
    """Any read of a long metadata array (the vocabulary, its scores, types or merges) fails."""
    def fail(*args):
        raise AssertionError("a metadata array was decoded")
    monkeypatch.setattr(gguf_file._Cursor, "items", fail)


def test_warm_start_reads_the_cache(cache, monkeypatch):
    cold = Tokenizer.from_gguf_metadata(_metadata())
    assert len(list(cache.glob("*.tokenizer.json"))) == len(list(cache.glob("*.names.json"))) == 1
    _forbid_building(monkeypatch)
    warm = Tokenizer.from_gguf_metadata(_metadata())
    assert warm.encode("hi hié") == cold.encode("hi hié") == [1, 7, 7, 8, 9]
    assert warm.chat_template == cold.chat_template
    assert warm.eos_token_id == cold.eos_token_id == 2


def test_different_metadata_misses(cache):
    Tokenizer.from_gguf_metadata(_metadata())
    other = Tokenizer.from_gguf_metadata(_metadata(**{"tokenizer.ggml.add_bos_token": False}))
    assert other.encode("hi") == [7]  # no BOS: not the first entry's tokenizer
    assert len(list(cache.glob("*.names.json"))) == 2
    assert gguf_cache.metadata_key(_metadata()) != gguf_cache.metadata_key(
        _metadata(**{"tokenizer.ggml.scores": [0, 0, 0, -1, -2, -3, -4, -6, 0, 0]}))


@pytest.mark.parametrize("damage", ["tokenizer", "names"])
def test_corrupt_entry_is_rebuilt(cache, damage):
    Tokenizer.from_gguf_metadata(_metadata())
    (entry,) = cache.glob(f"*.{damage}.json")
    entry.write_text("{not json", encoding="utf-8")
    assert Tokenizer.from_gguf_metadata(_metadata()).encode("hi hié") == [1, 7, 7, 8, 9]
    json.loads(entry.read_text(encoding="utf-8"))  # rewritten whole


def test_merges_are_written_as_strings_unless_a_token_holds_a_space():
    """"left right" strings parse in `tokenizers` with half the transient memory; a token with a space in it
    would split wrong there, so such a vocabulary keeps [left, right] pairs. Both encode as their merges say."""
    vocab = {t: i for i, t in enumerate(["a", "b", " ", "ab", "a ", "a b"])}

    def text(merges):
        return gguf_cache.tokenizer_text({"version": "1.0", "model": {"type": "BPE", "vocab": vocab, "merges": merges}})
    plain, spaced = text([["a", "b"]]), text([["a", "b"], ["a", " "], ["a ", "b"]])
    assert json.loads(plain)["model"]["merges"] == ["a b"]
    assert json.loads(spaced)["model"]["merges"] == [["a", "b"], ["a", " "], ["a ", "b"]]
    assert tokenizers.Tokenizer.from_str(plain).encode("ab").ids == [3]
    assert tokenizers.Tokenizer.from_str(spaced).encode("a b").ids == [5]


def test_warm_gguf_start_does_not_decode_the_vocabulary(cache, monkeypatch, smollm2_gguf_path):
    cold = Tokenizer.from_gguf_metadata(read_gguf(smollm2_gguf_path)[0])
    metadata = read_gguf(smollm2_gguf_path)[0]
    _forbid_decoding(monkeypatch)
    _forbid_building(monkeypatch)
    warm = Tokenizer.from_gguf_metadata(metadata)
    for prompt in PROMPTS:
        assert warm.encode(prompt) == cold.encode(prompt), prompt
    assert warm.backend.get_vocab() == cold.backend.get_vocab()
    assert warm.chat_template == cold.chat_template and warm.eos_token_id == cold.eos_token_id


def test_prefetched_entry_is_taken(cache, monkeypatch, smollm2_gguf_path, gemma3_gguf_path):
    expected = Tokenizer.from_gguf_metadata(read_gguf(smollm2_gguf_path)[0]).encode(PROMPTS[0])
    gguf_cache.prefetch(gemma3_gguf_path)  # another file's: dropped (its entry is not in this cache either)
    gguf_cache.prefetch(smollm2_gguf_path)
    for thread in gguf_cache._prefetched:
        thread.join()

    def fail(*paths):
        raise AssertionError("the entry was read again")
    monkeypatch.setattr(gguf_cache, "_read", fail)
    assert Tokenizer.from_gguf_metadata(read_gguf(smollm2_gguf_path)[0]).encode(PROMPTS[0]) == expected
    assert gguf_cache._prefetched == []
