"""`--model org/repo[:QUANT]` through the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE honoured)."""
from __future__ import annotations

import os
import re

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def looks_like_repo_id(model: str) -> bool:
    return not os.path.exists(model) and bool(_REPO_ID.match(model))


def resolve_repo(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """Return a local path: the snapshot directory, or the one GGUF file matching `:QUANT`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo_id, _, quant = model.partition(":")
    patterns = [f"*{quant}*.gguf", f"*{quant.lower()}*.gguf"] if quant else _PATTERNS
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise FileNotFoundError(
            f"--model {model!r}: not a local path and not found in the Hugging Face cache "
            f"(revision={revision or 'main'}, cache={download_dir or 'HF_HOME'}): {exc}") from None
    if not quant:
        return path
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf") and quant.lower() in f.lower())
    if not ggufs:
        raise FileNotFoundError(f"--model {model!r}: no .gguf file matching {quant!r} in {repo_id}")
    return os.path.join(path, ggufs[0])
