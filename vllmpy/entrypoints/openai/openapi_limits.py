"""The engine's own bounds written into /openapi.json, so that a request valid by the schema is served.

The request models are static; how many choices, how many logprobs, how far a prompt may be truncated and
which token ids a server takes depend on its flags and its vocabulary, so they are added to the generated
schema when it is first asked for. (prompt + max_tokens against max_model_len joins two fields and cannot
be said in a schema.)
"""
from __future__ import annotations

from typing import Any

_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
_TOKEN_FIELDS = ("prompt", "input")  # token-id arrays sit inside these (completions, embeddings, pooling)


def declare_engine_limits(schema: dict[str, Any], max_num_seqs: int, max_logprobs: int, vocab_size: int,
                          max_model_len: int) -> None:
    """Set `maximum` (and `minimum`) on every request property the engine bounds, in place."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        properties = component.get("properties", {})
        if "n" in properties:
            _bound_integers(properties["n"], None, max_num_seqs)
        if "truncate_prompt_tokens" in properties:
            _bound_integers(properties["truncate_prompt_tokens"], None, max_model_len)
        for name in _LOGPROB_FIELDS:
            if name in properties:  # -1 (the whole vocabulary) only where the operator allows it
                _bound_integers(properties[name], None if max_logprobs == -1 else 0,
                                vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size))
        for name in _TOKEN_FIELDS:
            if name in properties:
                _bound_integers(properties[name], None, vocab_size - 1, arrays_only=True)


def _bound_integers(node: Any, minimum: int | None, maximum: int, arrays_only: bool = False) -> None:
    """Bound each integer subschema reachable through anyOf / oneOf / items (inside arrays when arrays_only)."""
    if isinstance(node, list):
        for item in node:
            _bound_integers(item, minimum, maximum, arrays_only)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer" and not arrays_only:
        node["maximum"] = maximum
        if minimum is not None:
            node["minimum"] = minimum
    for key in ("anyOf", "oneOf"):
        _bound_integers(node.get(key), minimum, maximum, arrays_only)
    if "items" in node:
        _bound_integers(node["items"], minimum, maximum, False)
