"""The stop pass (engine/stop.py) on several new tokens per step, as speculative decoding will bring
them: the first stop among them wins and the tokens after it are dropped; every stop reason is checked
in that one place, stop strings on the tail of the text only."""
from __future__ import annotations

import pytest

from vllmpy.engine import stop
from vllmpy.engine.request import Request, RequestKind, RequestStatus
from vllmpy.sampling_params import SamplingParams
from vllmpy.tokenizer import IncrementalDetokenizer

EOS = 99
MAX_MODEL_LEN = 64


class LetterTokenizer:
    """Token id i decodes to chr(ord('a') + i); EOS decodes to nothing (a skipped special token)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if t == EOS else chr(ord("a") + t) for t in ids)


def make(prompt_len: int = 3, **params) -> Request:
    request = Request("r", list(range(prompt_len)), SamplingParams(**params), eos_token_ids={EOS})
    request.max_tokens = params.get("max_tokens") or MAX_MODEL_LEN - prompt_len
    request.detokenizer = IncrementalDetokenizer(LetterTokenizer(), request.prompt_token_ids)
    return request


def test_first_stop_among_new_tokens_wins_and_the_rest_are_dropped():
    request = make()
    assert stop.apply_new_tokens(request, [1, 2, EOS, 3, 4], MAX_MODEL_LEN) == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [1, 2, EOS] and request.stop_reason is None
    request = make(stop_token_ids=[7])
    assert stop.apply_new_tokens(request, [5, 7, 8], MAX_MODEL_LEN) == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [5, 7] and request.stop_reason == 7
    request = make()
    assert stop.apply_new_tokens(request, [1, 2, 3], MAX_MODEL_LEN) is None
    assert request.output_token_ids == [1, 2, 3] and request.all_token_ids[-3:] == [1, 2, 3]


def test_min_tokens_lets_an_early_eos_pass_within_one_step():
    request = make(min_tokens=3)
    assert stop.apply_new_tokens(request, [EOS, 1, EOS, 2], MAX_MODEL_LEN) == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [EOS, 1, EOS]
    request = make(ignore_eos=True)
    assert stop.apply_new_tokens(request, [EOS, EOS], MAX_MODEL_LEN) is None


def test_length_caps_cut_a_run_of_tokens():
    request = make(max_tokens=3)
    assert stop.apply_new_tokens(request, [1, 2, 3, 4, 5], MAX_MODEL_LEN) == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == [1, 2, 3]
    request = make(prompt_len=6)
    assert stop.apply_new_tokens(request, [1, 2, 3, 4], 8) == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.num_tokens == 8 and request.output_token_ids == [1, 2]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_cuts_the_text_and_drops_what_follows(include):
    request = make(stop=["zz", "cd"], include_stop_str_in_output=include)  # c = 2, d = 3
    assert stop.apply_new_tokens(request, [0, 1], MAX_MODEL_LEN) is None
    assert stop.apply_new_tokens(request, [2, 3, 4, 5], MAX_MODEL_LEN) == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [0, 1, 2, 3] and request.stop_reason == "cd"
    assert request.detokenizer.output_text[:request.output_text_len] == ("abcd" if include else "ab")


def test_stop_string_search_reads_only_the_tail(monkeypatch):
    """A match must end in the new text: the search starts len(stop) - 1 characters before it."""
    request = make(stop=["xyz"])
    stop.apply_new_tokens(request, list(range(20)), MAX_MODEL_LEN)
    starts = []
    real_find = str.find

    class Text(str):
        def find(self, sub, start=0, *rest):
            starts.append(start)
            return real_find(self, sub, start, *rest)

    detokenizer = request.detokenizer
    monkeypatch.setattr(type(detokenizer), "output_text", property(lambda self: Text(self._text)))
    assert stop.apply_new_tokens(request, [1], MAX_MODEL_LEN) is None
    assert starts == [20 - 2]


def test_stop_strings_wait_for_min_tokens_and_a_grammar_stops_at_once():
    request = make(stop=["b"], min_tokens=3)
    assert stop.apply_new_tokens(request, [1, 2, 1], MAX_MODEL_LEN) == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [1, 2, 1]
    request = make(min_tokens=5)
    assert stop.apply_new_tokens(request, [1, 2], MAX_MODEL_LEN, grammar_terminated=True) \
        == RequestStatus.FINISHED_STOPPED
    assert request.output_token_ids == [1, 2]


def test_a_stop_check_that_raises_fails_only_that_request(monkeypatch):
    def broken(*args):
        raise KeyError("boom")
    monkeypatch.setattr(stop, "check_stop", broken)
    request = make()
    assert stop.apply_new_tokens(request, [1], MAX_MODEL_LEN) == RequestStatus.FINISHED_ERROR
    assert request.error == "its stop check raised KeyError: 'boom'"


def test_request_kind_is_explicit():
    from vllmpy.pooling_params import PoolingParams

    assert make().kind is RequestKind.GENERATE
    pooled = Request("p", [1], None, pooling_params=PoolingParams())
    assert pooled.kind is RequestKind.POOL and pooled.is_pooling
    with pytest.raises(ValueError, match="exactly one"):
        Request("x", [1], None)
