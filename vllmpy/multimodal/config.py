"""The engine's image settings (ModelConfig fields, as vLLM keeps them): per-prompt limits and where the
server may read images from."""
from __future__ import annotations

from vllmpy.structured_output.params import json_object

MODALITIES = ("image",)


def parse_mm_limits(value: dict | str | None) -> dict[str, int]:
    """--limit-mm-per-prompt '{"image": N}' (JSON text or a dict) -> {"image": N}; None: no limit."""
    if value is None:
        return {}
    value = json_object(value, "--limit-mm-per-prompt", 'the value (such as \'{"image": 2}\')')
    limits = {}
    for key, count in value.items():
        if key not in MODALITIES:
            raise ValueError(f"--limit-mm-per-prompt: modality {key!r} is not supported; supported: "
                             f"{', '.join(MODALITIES)}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"--limit-mm-per-prompt: {key} must be an integer >= 0, got {count!r}")
        limits[key] = count
    return limits


def check_media_settings(fetch_timeout: float, max_bytes: int) -> None:
    if not fetch_timeout > 0:
        raise ValueError(f"--media-fetch-timeout must be > 0 seconds, got {fetch_timeout}")
    if max_bytes < 1:
        raise ValueError(f"--max-media-bytes must be >= 1, got {max_bytes}")
