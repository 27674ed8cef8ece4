"""The GGUF tokenizer cache: a warm start reads the built tokenizer.json instead of rebuilding it, keyed by
the tokenizer metadata, and a corrupt entry is rebuilt rather than trusted."""
from __future__ import annotations

import pytest

from tests.unit.test_tokenizer import SPM_METADATA
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


def test_warm_start_reads_the_cache(cache, monkeypatch):
    cold = Tokenizer.from_gguf_metadata(_metadata())
    assert len(list(cache.glob("*.json"))) == 1
    _forbid_building(monkeypatch)
    warm = Tokenizer.from_gguf_metadata(_metadata())
    assert warm.encode("hi hié") == cold.encode("hi hié") == [1, 7, 7, 8, 9]
    assert warm.chat_template == cold.chat_template
    assert warm.eos_token_id == cold.eos_token_id == 2


def test_different_metadata_misses(cache):
    Tokenizer.from_gguf_metadata(_metadata())
    other = Tokenizer.from_gguf_metadata(_metadata(**{"tokenizer.ggml.add_bos_token": False}))
    assert other.encode("hi") == [7]  # no BOS: not the first entry's tokenizer
    assert len(list(cache.glob("*.json"))) == 2
    assert gguf_cache.metadata_key(_metadata()) != gguf_cache.metadata_key(
        _metadata(**{"tokenizer.ggml.scores": [0, 0, 0, -1, -2, -3, -4, -6, 0, 0]}))


def test_corrupt_entry_is_rebuilt(cache):
    Tokenizer.from_gguf_metadata(_metadata())
    (entry,) = cache.glob("*.json")
    entry.write_text("{not json", encoding="utf-8")
    assert Tokenizer.from_gguf_metadata(_metadata()).encode("hi hié") == [1, 7, 7, 8, 9]
    assert entry.read_text(encoding="utf-8").startswith("{\"tokenizer_json\"")
