"""The n-gram and suffix draft proposers: exact drafts on hand-made sequences, and randomized checks that
the incremental indexes propose exactly what a brute-force count over the whole context proposes."""
from __future__ import annotations

import random

import pytest

from vllmpy.spec_decode.ngram import NgramProposer
from vllmpy.spec_decode.suffix import SuffixProposer

# ---------------------------------------------------------------- brute-force references


def ngram_reference(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """vLLM's prompt lookup, spelled out: the longest n that occurs earlier, its earliest occurrence."""
    for n in range(min(high, len(tokens)), low - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def _continuations(seqs: list[list[int]], x: list[int]) -> tuple[int, dict[int, int]]:
    """Occurrences of x, and how many of them each next token follows."""
    total, after = 0, {}
    for seq in seqs:
        for i in range(len(seq) - len(x) + 1):
            if seq[i:i + len(x)] == x:
                total += 1
                if i + len(x) < len(seq):
                    after[seq[i + len(x)]] = after.get(seq[i + len(x)], 0) + 1
    return total, after


def suffix_reference(seqs: list[list[int]], pattern: list[int], k: int, factor: float, min_prob: float,
                     depth: int) -> tuple[list[int], float]:
    """Suffix decoding over substrings of at most `depth` tokens, by counting them in `seqs` directly."""
    best, best_score = [], 0.0
    for m in range(1, len(pattern)):
        if _continuations(seqs, pattern[-m:])[0] == 0:
            break
        path, draft, prob, score = pattern[-m:], [], 1.0, 0.0
        while len(draft) < min(k, int(m * factor + 1e-6)) and len(path) < depth:
            total, after = _continuations(seqs, path)
            if not after:
                break
            token = min(after, key=lambda t: (-after[t], t))
            prob *= after[token] / total
            if prob < min_prob:
                break
            draft.append(token)
            score += prob
            path = path + [token]
        if score >= best_score:
            best, best_score = draft, score
    return best, best_score


def suffix_proposer_reference(local: list[int], cached: list[list[int]], k: int, depth: int, factor: float,
                              min_prob: float) -> list[int]:
    pattern = local[max(0, len(local) - depth):]
    draft, score = suffix_reference([local], pattern, k, factor, min_prob, depth)
    if cached:
        other, other_score = suffix_reference(cached, pattern, k, factor, min_prob, depth)
        if other_score > score:
            draft = other
    return draft


# ---------------------------------------------------------------- n-gram


@pytest.mark.parametrize("tokens, low, high, k, expected", [
    ([1, 2, 3, 4, 5], 2, 2, 2, []),  # no match
    ([1, 2, 3, 4, 1, 2, 3, 5, 6], 2, 2, 2, []),  # [5, 6] never occurred before
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 3, [4, 1, 2]),  # repetition
    ([1, 2, 3, 4, 1, 2, 3], 2, 2, 2, [4, 1]),  # k caps the draft
    ([1, 2, 3, 4, 1, 2, 3], 4, 4, 2, []),  # min n longer than any repeat
    ([1, 2, 3, 4, 1, 2, 3], 3, 4, 2, [4, 1]),  # no 4-gram, a 3-gram
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2, [1, 2]),  # the 4-gram wins over the 3-gram ([5, 1])
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),  # 3-gram wins over 2-gram ([5, 2])
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2, [100, 1]),  # earliest occurrence
    ([1, 3, 6, 2, 3, 4, 1, 2, 3], 1, 1, 2, [6, 2]),  # earliest occurrence of the 1-gram
    ([7, 7, 7, 7], 2, 2, 5, [7, 7]),  # overlaps the suffix; only 2 tokens follow the earliest match
    ([5, 6, 5, 6], 1, 3, 8, [5, 6]),  # the match may end where the suffix begins
    ([4], 1, 1, 3, []),  # nothing before the suffix
])
def test_ngram_drafts_match_vllm_semantics(tokens, low, high, k, expected):
    assert NgramProposer(low, high).propose("r", tokens, len(tokens), k) == expected
    assert ngram_reference(tokens, low, high, k) == expected


def test_ngram_incremental_index_matches_a_full_rescan():
    """Steps of 1..4 new tokens (accepted drafts), small vocabularies (many repeats), several requests."""
    rnd = random.Random(0)
    for trial in range(40):
        low = rnd.randint(1, 3)
        high = low + rnd.randint(0, 3)
        proposer = NgramProposer(low, high)
        streams = {f"r{i}": [rnd.randrange(rnd.randint(2, 6)) for _ in range(60)] for i in range(3)}
        seen = {req: rnd.randint(0, 8) for req in streams}
        while any(seen[req] < len(s) for req, s in streams.items()):
            for req, stream in streams.items():
                seen[req] = min(len(stream), seen[req] + rnd.randint(1, 4))
                tokens, k = stream[:seen[req]], rnd.randint(1, 6)
                assert proposer.propose(req, tokens, 0, k) == ngram_reference(tokens, low, high, k), (trial, req)


def test_ngram_starts_over_when_tokens_are_not_an_extension():
    proposer = NgramProposer(2, 2)
    assert proposer.propose("r", [1, 2, 3, 1, 2], 3, 2) == [3, 1]
    assert proposer.propose("r", [9, 8, 7, 9, 8], 3, 2) == [7, 9]  # same id, other tokens: re-indexed
    proposer.on_request_finished("r", [9, 8, 7, 9, 8], 3)
    assert proposer.propose("r", [1, 2, 4, 5], 2, 2) == []  # a new request under a reused id


def test_ngram_refuses_bad_lookup_lengths():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(0, 2)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramProposer(3, 2)


# ---------------------------------------------------------------- suffix


def test_suffix_drafts_from_the_request_itself():
    prompt = list(range(10, 30))
    proposer = SuffixProposer(min_token_prob=0.1)
    # The last 3 tokens occurred once before (and once as the suffix itself): p = 1/2 per token; a match of
    # m tokens drafts at most m tokens (max_spec_factor 1).
    assert proposer.propose("r", prompt + [10, 11, 12], 20, 8) == [13, 14, 15]
    assert proposer.propose("r", prompt + [10, 11, 12, 13, 14], 20, 8) == [15, 16, 17, 18, 19]
    assert proposer.propose("r", prompt + [10, 11, 12, 13, 14], 20, 2) == [15, 16]  # k caps it
    assert proposer.propose("x", [1, 2, 3, 4], 4, 8) == []  # nothing repeats


def test_suffix_max_spec_factor_scales_the_draft_with_the_match():
    tokens = list(range(40)) + list(range(6))
    assert SuffixProposer(max_spec_factor=0.5).propose("r", tokens, 40, 16) == [6, 7, 8]
    assert SuffixProposer(max_spec_factor=2.0).propose("r", tokens, 40, 16) == list(range(6, 18))


def test_suffix_learns_from_earlier_requests_outputs():
    proposer = SuffixProposer()
    answer = list(range(100, 140))
    second_prompt = [7, 8, 9]
    assert proposer.propose("b0", second_prompt + answer[:6], 3, 8) == []  # nothing to learn from yet
    proposer.on_request_finished("b0", second_prompt + answer[:6], 3)
    proposer.propose("a", [1, 2, 3] + answer[:20], 3, 8)
    proposer.on_request_finished("a", [1, 2, 3] + answer, 3)
    assert proposer.num_cached_requests == 2
    # The new request's own context never had tokens 106..: only the global tree knows them.
    assert proposer.propose("b", second_prompt + answer[:6], 3, 8) == [106, 107, 108, 109, 110, 111]


def test_suffix_cache_evicts_the_oldest_outputs_past_its_bound():
    proposer = SuffixProposer(max_cached_requests=2)
    outputs = [[1000 * i + j for j in range(12)] for i in range(1, 4)]
    for i, output in enumerate(outputs):
        proposer.on_request_finished(f"r{i}", [0] + output, 1)
    assert proposer.num_cached_requests == 2
    assert proposer.propose("q", [5] + outputs[0][:4], 1, 4) == []  # the oldest is gone
    assert proposer.propose("q2", [5] + outputs[1][:4], 1, 4) == outputs[1][4:8]
    assert proposer.propose("q3", [5] + outputs[2][:4], 1, 4) == outputs[2][4:8]
    assert SuffixProposer(max_cached_requests=0).num_cached_requests == 0
    no_cache = SuffixProposer(max_cached_requests=0)
    no_cache.on_request_finished("r", [0] + outputs[0], 1)
    assert no_cache.num_cached_requests == 0
    assert no_cache.propose("q", [5] + outputs[0][:4], 1, 4) == []


def test_suffix_stops_where_the_continuation_probability_falls_below_the_threshold():
    # After [1, 2]: 3 then 4 in 3 of 5 outputs, 3 then 9 in 2 -> p(3) = 1, p(3, 4) = 0.6.
    cached = [[1, 2, 3, 4]] * 3 + [[1, 2, 3, 9]] * 2
    for min_prob, expected in ((0.5, [3, 4]), (0.7, [3])):
        proposer = SuffixProposer(min_token_prob=min_prob)
        for i, output in enumerate(cached):
            proposer.on_request_finished(f"c{i}", [0] + output, 1)
        assert proposer.propose("q", [50, 1, 2], 1, 2) == expected


def test_suffix_drafts_never_reach_past_the_tree_depth():
    periodic = [1, 2, 3, 4, 5] * 10
    # A match of m tokens drafts at most min(k, m, depth - m) tokens: depth / 2 at best.
    drafts = {depth: SuffixProposer(max_tree_depth=depth).propose("r", periodic, 5, 16) for depth in (4, 24, 40)}
    assert drafts[4] == [1, 2]
    assert drafts[24] == periodic[:12]
    assert len(drafts[40]) > 12 and drafts[40] == periodic[:len(drafts[40])]
    for depth, draft in drafts.items():
        assert draft == suffix_proposer_reference(periodic, [], 16, depth, 1.0, 0.1)


def test_suffix_starts_over_when_tokens_are_not_an_extension():
    proposer = SuffixProposer()
    assert proposer.propose("r", [1, 2, 3, 4, 1, 2], 4, 2) == [3, 4]
    assert proposer.propose("r", [5, 6, 7, 8, 5, 6], 4, 2) == [7, 8]


def test_suffix_incremental_trees_match_a_brute_force_count():
    """Requests grow by 1..4 tokens a step and finish in random order into a small LRU cache; every draft
    must equal the one counted from scratch over the request's tokens and the cached outputs."""
    rnd = random.Random(1)
    for trial in range(30):
        depth, vocab = rnd.randint(2, 7), rnd.randint(2, 5)
        factor, min_prob = rnd.choice([0.5, 1.0, 2.0]), rnd.choice([0.0, 0.1, 0.4])
        max_cached = rnd.randint(1, 3)
        proposer = SuffixProposer(depth, max_cached, factor, min_prob)
        cached: list[list[int]] = []
        for wave in range(3):
            streams = {f"t{trial}w{wave}r{i}": [rnd.randrange(vocab) for _ in range(rnd.randint(8, 24))]
                       for i in range(3)}
            prompts = {req: rnd.randint(1, 6) for req in streams}
            seen = dict(prompts)
            while streams:
                req = rnd.choice(sorted(streams))
                stream = streams[req]
                tokens, k = stream[:seen[req]], rnd.randint(1, 6)
                expected = suffix_proposer_reference(tokens, cached, k, depth, factor, min_prob)
                assert proposer.propose(req, tokens, prompts[req], k) == expected, (trial, req, tokens, cached)
                seen[req] += rnd.randint(1, 4)
                if seen[req] > len(stream):
                    proposer.on_request_finished(req, stream, prompts[req])
                    cached = (cached + [stream[prompts[req]:]])[-max_cached:]
                    del streams[req]
            assert proposer.num_cached_requests == len(cached)
