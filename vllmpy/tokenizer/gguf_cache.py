"""A disk cache of the tokenizer.json built from a GGUF's vocabulary, so a warm start skips building it.

Deriving SentencePiece merges from a 262k-token vocabulary and checking them costs ~3 s on every start
(Gemma 3); the result depends only on the `tokenizer.ggml.*` metadata and the code that converts it, so
both key the entry (`$VLLMPY_CACHE/tokenizers`). An entry is two files: `<key>.tokenizer.json`, which
`tokenizers` reads itself, then `<key>.names.json` (the named tokens and chat template), written last so
its presence means the entry is whole. Both are written atomically; an unreadable or corrupt entry is
rebuilt, never trusted.

The warm path reads neither the vocabulary nor the JSON into Python: the key hashes the metadata's
bytes as the file stores them (`GGUFMetadata.encoded`), and `Tokenizer.from_file` parses the file in
Rust. The file spells merges as "left right" strings where no merged token holds a space: the
[left, right] pair form, which `tokenizers` buffers through serde before building, costs ~1.4x the
parse time and +400 MB instead of +190 MB of transient heap on Gemma 3's 515k merges.

That parse (~0.5 s) releases the GIL, so `prefetch(path)` can run it on a thread while the caller
imports torch; `load_or_build` then takes the result if its key matches.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import tokenizers

from vllmpy.loader.default_model import cache_dir
from vllmpy.tokenizer import gguf_vocab

logger = logging.getLogger("vllmpy")

_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template")


@dataclasses.dataclass(frozen=True)
class CachedTokenizer:
    """A GgufTokenizer's `tokenizers` backend (its merges checked when it was built) and its named tokens."""

    backend: tokenizers.Tokenizer
    names: dict[str, str | None]


def metadata_key(md: Mapping[str, Any]) -> str:
    """Hash of every tokenizer key in the metadata and of the converter's and this module's source."""
    digest = hashlib.sha256(Path(gguf_vocab.__file__).read_bytes() + Path(__file__).read_bytes())
    encoded = getattr(md, "encoded", None)  # a GGUFMetadata's stored bytes (loader/gguf/file.py): nothing decoded
    for key in sorted(k for k in md if k.startswith("tokenizer.")):
        digest.update(key.encode() + b"\0")
        digest.update(encoded(key) if encoded is not None else _value_bytes(md[key]))
        digest.update(b"\1")
    return digest.hexdigest()[:32]


def _value_bytes(value: Any) -> bytes:
    """A decoded value's fingerprint (metadata given as a plain dict)."""
    if isinstance(value, (list, tuple)):
        head = struct.pack("<q", len(value))
        if value and isinstance(value[0], str):
            return head + "\0".join(value).encode("utf-8", "surrogatepass")
        return head + repr(list(value)).encode()
    return repr(value).encode("utf-8", "surrogatepass")


class _Prefetch(threading.Thread):
    """Reads one GGUF file's cached entry: `found` is (key, entry) when the cache held it."""

    def __init__(self, path: str) -> None:
        super().__init__(name="vllmpy-tokenizer-prefetch", daemon=True)
        self.path = path
        self.found: tuple[str, CachedTokenizer] | None = None

    def run(self) -> None:
        from vllmpy.loader.gguf.file import read_gguf  # numpy and gguf's constants, not torch

        try:
            key = metadata_key(read_gguf(self.path)[0])
            entry = _read(*_entry_paths(key))
        except Exception:  # a miss or any fault: load_or_build reads or builds the entry itself, and reports
            return
        self.found = key, entry


_prefetched: list[_Prefetch] = []


def prefetch(path: str) -> None:
    """Start reading the cached tokenizer of the GGUF file at `path` on a thread, for `load_or_build`."""
    thread = _Prefetch(path)
    _prefetched.append(thread)
    thread.start()


def _take_prefetched(key: str) -> CachedTokenizer | None:
    """A prefetched entry of this key (waiting for its thread), else None; every other prefetch is dropped."""
    found = None
    while _prefetched:
        thread = _prefetched.pop()
        thread.join()
        if thread.found is not None and thread.found[0] == key:
            found = thread.found[1]
    return found


def _entry_paths(key: str) -> tuple[Path, Path]:
    directory = cache_dir() / "tokenizers"
    return directory / f"{key}.tokenizer.json", directory / f"{key}.names.json"


def load_or_build(md: Mapping[str, Any],
                  build: Callable[[Mapping[str, Any]], gguf_vocab.GgufTokenizer]) -> CachedTokenizer:
    """The cached entry for this metadata, else `build(md)` converted and stored for the next start."""
    key = metadata_key(md)
    prefetched = _take_prefetched(key)
    if prefetched is not None:
        return prefetched
    tokenizer_path, names_path = _entry_paths(key)
    try:
        return _read(tokenizer_path, names_path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("tokenizer cache entry %s is unreadable (%s); rebuilding it", tokenizer_path, exc)
    built = build(md)
    text = tokenizer_text(built.tokenizer_json)
    names = {k: getattr(built, k) for k in _NAMED}
    if _store(tokenizer_path, text):
        _store(names_path, json.dumps({"names": names}))
    return CachedTokenizer(tokenizers.Tokenizer.from_str(text), names)


def tokenizer_text(spec: dict[str, Any]) -> str:
    """tokenizer.json text for `spec`, with merges as "left right" strings unless a merged token holds a space."""
    model = spec["model"]
    merges = model.get("merges") or []
    if merges and all(" " not in left and " " not in right for left, right in merges):
        spec = {**spec, "model": {**model, "merges": [f"{left} {right}" for left, right in merges]}}
    return json.dumps(spec, ensure_ascii=False)


def _read(tokenizer_path: Path, names_path: Path) -> CachedTokenizer:
    names = json.loads(names_path.read_text(encoding="utf-8"))["names"]
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    except Exception as exc:  # tokenizers raises a bare Exception for a missing or malformed file
        raise ValueError(str(exc)) from None
    return CachedTokenizer(backend, {k: names.get(k) for k in _NAMED})


def _store(path: Path, text: str) -> bool:
    """Atomic replace; a read-only cache only costs the next start its rebuild."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        logger.warning("could not cache the tokenizer at %s: %s", path, exc)
        return False
