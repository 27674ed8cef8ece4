"""A disk cache of the tokenizer.json built from a GGUF's vocabulary, so a warm start skips building it.

Deriving SentencePiece merges from a 262k-token vocabulary and checking them costs ~3 s on every start
(Gemma 3); the result depends only on the `tokenizer.ggml.*` metadata and the code that converts it, so
both key the entry (`$VLLMPY_CACHE/tokenizers`). Entries are written atomically; an unreadable or corrupt
entry is rebuilt, never trusted.

(Building the BPE model from Python lists of merges instead of parsing the JSON peaks ~80 MB lower but
takes 3 s instead of 1.1 s here: the parse stays, and the loader trims its freed heap afterwards.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import tokenizers

from vllmpy.loader.default_model import cache_dir
from vllmpy.tokenizer import gguf_vocab

logger = logging.getLogger("vllmpy")

_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template")


@dataclasses.dataclass(frozen=True)
class CachedTokenizer:
    """A GgufTokenizer as text: the tokenizer.json string (checked when it was built) and the named tokens."""

    tokenizer_json_text: str
    names: dict[str, str | None]

    def backend(self) -> tokenizers.Tokenizer:
        return tokenizers.Tokenizer.from_str(self.tokenizer_json_text)


def metadata_key(md: dict[str, Any]) -> str:
    """Hash of every tokenizer key in the metadata and of the converter's and this module's source."""
    digest = hashlib.sha256(Path(gguf_vocab.__file__).read_bytes() + Path(__file__).read_bytes())
    for key in sorted(k for k in md if k.startswith("tokenizer.")):
        value = md[key]
        digest.update(key.encode() + b"\0")
        if isinstance(value, (list, tuple)):
            digest.update(struct.pack("<q", len(value)))
            if value and isinstance(value[0], str):
                digest.update("\0".join(value).encode("utf-8", "surrogatepass"))
            else:
                digest.update(repr(list(value)).encode())
        else:
            digest.update(repr(value).encode("utf-8", "surrogatepass"))
        digest.update(b"\1")
    return digest.hexdigest()[:32]


def load_or_build(md: dict[str, Any], build: Callable[[dict[str, Any]], gguf_vocab.GgufTokenizer]) -> CachedTokenizer:
    """The cached entry for this metadata, else `build(md)` converted and stored for the next start."""
    path = cache_dir() / "tokenizers" / f"{metadata_key(md)}.json"
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        return CachedTokenizer(entry["tokenizer_json"], {k: entry["names"].get(k) for k in _NAMED})
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("tokenizer cache entry %s is unreadable (%s); rebuilding it", path, exc)
    built = build(md)
    result = CachedTokenizer(json.dumps(built.tokenizer_json), {k: getattr(built, k) for k in _NAMED})
    _store(path, {"tokenizer_json": result.tokenizer_json_text, "names": result.names})
    return result


def _store(path: Path, entry: dict[str, Any]) -> None:
    """Atomic replace; a read-only cache only costs the next start its rebuild."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(entry, handle)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache the tokenizer at %s: %s", path, exc)
