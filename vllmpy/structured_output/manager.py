"""Compiles constraints once per distinct spec and hands each request its own Grammar."""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from vllmpy.structured_output.bitmask import allocate_bitmask
from vllmpy.structured_output.config import StructuredOutputsConfig
from vllmpy.structured_output.grammar import Grammar, describe_error, grammar_text
from vllmpy.structured_output.params import StructuredOutputsParams
from vllmpy.tokenizer import Tokenizer

if TYPE_CHECKING:  # imported on the first constrained request: most engines never see one
    import llguidance

# Compiled specs kept; a server with many one-off schemas must not grow without bound.
CACHE_SIZE = 256


class StructuredOutputManager:
    """Owned by the runner; the engine core calls `validate` when a request is added.

    The llguidance tokenizer (~0.3 s for a 49k vocabulary) is built on the first constrained request,
    so engines that never see one pay nothing. `config` holds the engine-wide defaults each request gets.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int],
                 config: StructuredOutputsConfig | None = None) -> None:
        self._config = config or StructuredOutputsConfig()
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile (or find) the constraint now, so a bad spec is refused before the request is queued."""
        self._template(params)

    def new_grammar(self, params: StructuredOutputsParams, output_token_ids: list[int]) -> Grammar:
        """A fresh matcher advanced past `output_token_ids` (a request resumed after preemption)."""
        grammar = Grammar(self._template(params).deep_copy(), self.bitmask_vocab_size)
        if output_token_ids and not grammar.accept(output_token_ids):
            raise ValueError(f"structured outputs: the request's output so far breaks its grammar ({grammar.error})")
        return grammar

    @property
    def bitmask_vocab_size(self) -> int:
        """Ids the masks cover: the model's logits, or more when the tokenizer is larger."""
        return max(self._vocab_size, self._tokenizer.vocab_size)

    def _template(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled, never-advanced matcher for this spec; requests get deep copies (~10 us)."""
        params = self._config.apply(params)
        key = params.key()
        matcher = self._compiled.get(key)
        if matcher is not None:
            self._compiled.move_to_end(key)
            return matcher
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_text(params), log_level=0)
        if matcher.is_error():
            raise ValueError(describe_error(params, matcher.get_error()))
        problem = _unproducible(matcher, self.bitmask_vocab_size)
        if problem is not None:
            raise ValueError(describe_error(params, problem))
        self._compiled[key] = matcher
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return matcher

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            import llguidance

            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.bitmask_vocab_size,
                eos_token=self._eos_token_ids or None)
        return self._ll_tokenizer


# Forced steps (exactly one token allowed) walked at validation; a literal longer than this is unusual.
_FORCED_STEPS_CHECKED = 64


def _unproducible(matcher: llguidance.LLMatcher, vocab_size: int) -> str | None:
    """Why no output could satisfy the grammar, found before the request is queued; None when it can start.

    No token, EOS included, may start an empty language. And where the grammar forces its text, each forced
    step must be a token the matcher then accepts: a vocabulary without some byte (SmolLM2 has no token for
    0xF1, the lead byte of many 4-byte characters) cannot write a literal that needs it, and llguidance's
    mask at that point offers a token its own parser then rejects. The walk runs on a copy (~1 ms a step on
    a 49k vocabulary) and stops at the first real choice.
    """
    probe = matcher.deep_copy()
    mask = allocate_bitmask(1, vocab_size)
    for step in range(_FORCED_STEPS_CHECKED):
        mask.zero_()
        probe.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        allowed = 0 if probe.is_error() else _allowed_count(mask)
        if allowed == 0 and step == 0:
            return "it matches no text at all (its language is empty), so no output could satisfy it"
        if allowed == 0:
            return "it forces text that this model's vocabulary cannot write, so no output could satisfy it"
        if allowed > 1 or probe.is_stopped():
            return None
        token = _only_allowed(mask)
        if not probe.consume_tokens([token]) or probe.is_error():
            return ("it forces text that this model's vocabulary cannot write (no token produces one of its "
                    "bytes), so no output could satisfy it")
        if probe.is_stopped():
            return None
    return None


def _allowed_count(mask: torch.Tensor) -> int:
    """Allowed tokens in a one-row bitmask, counted up to 2 (all the walk needs to know)."""
    words = mask[0]
    nonzero = torch.nonzero(words).flatten()
    if len(nonzero) == 0:
        return 0
    if len(nonzero) > 1:
        return 2
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    return 1 if word & (word - 1) == 0 else 2


def _only_allowed(mask: torch.Tensor) -> int:
    """The one token a single-bit mask allows."""
    index = int(torch.nonzero(mask[0]).flatten()[0])
    word = int(mask[0, index]) & 0xFFFFFFFF
    return index * 32 + word.bit_length() - 1
