"""Our numpy GGUF parser reads exactly what gguf's GGUFReader reads (metadata, tensor types, shapes, bytes)."""
from __future__ import annotations

import gguf
import numpy as np

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
