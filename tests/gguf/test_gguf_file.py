"""Our numpy GGUF parser reads exactly what gguf's GGUFReader reads (metadata, tensor types, shapes, bytes)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from vllmpy.loader.gguf.file import read_gguf


def test_matches_gguf_reader(smollm2_gguf_path):
    metadata, tensors = read_gguf(smollm2_gguf_path)
    reader = gguf.GGUFReader(smollm2_gguf_path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert metadata == expected
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data.view(np.uint8), theirs.data.view(np.uint8))


def test_long_arrays_are_decoded_on_first_read(smollm2_gguf_path, monkeypatch):
    """The 49k-token vocabulary stays bytes until read: `in`, iteration and `encoded` never decode it."""
    from vllmpy.loader.gguf import file

    metadata, _ = read_gguf(smollm2_gguf_path)
    decode = file._Cursor.items
    monkeypatch.setattr(file._Cursor, "items", lambda *args: pytest.fail("decoded before it was read"))
    assert "tokenizer.ggml.tokens" in metadata and "tokenizer.ggml.tokens" in list(metadata)
    raw = metadata.encoded("tokenizer.ggml.tokens")
    assert int.from_bytes(raw[:4], "little") == gguf.GGUFValueType.ARRAY
    assert int.from_bytes(raw[8:16], "little") == 49152  # item count, after the item type
    monkeypatch.setattr(file._Cursor, "items", decode)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:2] == ["<|endoftext|>", "<|im_start|>"]
    assert metadata["tokenizer.ggml.tokens"] is tokens  # decoded once
