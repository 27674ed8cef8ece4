"""llguidance glue: a constraint becomes grammar text; a request's Grammar wraps its matcher.

llguidance (not xgrammar) because it refuses JSON-schema keywords it cannot enforce instead of ignoring
them, parses llama.cpp GBNF as written (json.gbnf, `.`) and Rust regexes (\\p{L}, (?i), named groups),
and needs no torch/triton; its per-token cost (~10-40 us a row here) is far below a model step.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from vllmpy.structured_output.params import StructuredOutputsParams, json_object
from vllmpy.structured_output.strict import forbid_additional_properties

if TYPE_CHECKING:  # imported on the first constrained request: most engines never see one
    import llguidance

# llguidance echoes the Lark it wrapped a regex in ("   1 | start: /.../"); the user never wrote that.
_LARK_ECHO = re.compile(r"\n\s*\d+ \| .*", re.DOTALL)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint; ValueError names the field when its text cannot be read."""
    import llguidance

    kind = params.kind
    json_options = {"whitespace_flexible": not params.disable_any_whitespace}
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=json_options)
    if kind == "json":
        schema = json_object(params.json, "structured_outputs.json", "the schema")
        if params.disable_additional_properties:
            schema = forbid_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", params.choice)
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # GBNF, or Lark as vLLM's guidance backend
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: invalid grammar: {exc}") from None


def describe_error(params: StructuredOutputsParams, message: str) -> str:
    """A compile error, prefixed with the field and kind the user set."""
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice list", "grammar": "grammar",
            "json_object": "JSON object grammar"}[params.kind]
    return f"structured_outputs.{params.kind}: invalid {what}: {_LARK_ECHO.sub('', message).strip()}"


class Grammar:
    """One request's matcher: which tokens may come next, and whether the constraint is complete."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # ids its bitmask row covers (the tokenizer's size when that is larger)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits (1 = allowed, bit j of word k is token 32k+j) into bitmask[row]."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def accept(self, token_ids: list[int]) -> bool:
        """Advance past sampled tokens; False means one was not allowed (the matcher is then in error)."""
        return self._matcher.consume_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts walked to compute their masks)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """No token but EOS may follow: the constraint is met and the request should stop."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None
