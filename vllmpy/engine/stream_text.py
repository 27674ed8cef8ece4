"""Generated text for a served stream, made on the caller's side of AsyncLLM instead of in the engine loop.

The engine loop detokenizes only the requests its stop pass must read text for (stop strings,
`needs_engine_text`); for the others the text is built here, in the caller's event loop, as each output
is read. The loop thread then spends its time on steps, and this work overlaps the next step's C kernels
(which release the GIL) instead of lengthening every step. Tokens are fed one at a time, as the stop pass
feeds them, so the text is exactly the one the engine would have made.
"""
from __future__ import annotations

from vllmpy.outputs import RequestOutput
from vllmpy.sampling_params import SamplingParams
from vllmpy.tokenizer import IncrementalDetokenizer, Tokenizer


def needs_engine_text(params: SamplingParams) -> bool:
    """Whether the engine's stop pass reads this request's text: only stop strings are matched on it."""
    return bool(params.stop)


class StreamText:
    """One request's completion texts, per completion index, from its cumulative outputs' token ids."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._fed: dict[int, int] = {}  # output tokens each index's detokenizer has read

    def fill(self, output: RequestOutput) -> RequestOutput:
        """Set each completion's text (the engine left it empty) from the token ids not yet read."""
        for completion in output.outputs:
            detokenizer = self._detokenizers.get(completion.index)
            if detokenizer is None:
                detokenizer = self._detokenizers[completion.index] = IncrementalDetokenizer(
                    self._tokenizer, output.prompt_token_ids, self._skip_special_tokens)
            fed = self._fed.get(completion.index, 0)
            for token_id in completion.token_ids[fed:]:
                detokenizer.add_tokens([token_id])
            self._fed[completion.index] = len(completion.token_ids)
            completion.text = detokenizer.output_text
        return output
