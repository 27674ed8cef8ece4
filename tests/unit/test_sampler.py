"""Sampler semantics against hand-computed references and sampling statistics (CPU, a few seconds)."""
from __future__ import annotations

import math

import pytest
import torch

from vllmpy.sampling import (
    RowState,
    Sampler,
    SamplingMetadata,
    SamplingRowError,
    compute_logprobs,
    prompt_logprobs_for_chunk,
)
from vllmpy.sampling import sampler as sampler_module
from vllmpy.sampling.penalties import apply_penalties
from vllmpy.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 0


@pytest.fixture(autouse=True)
def _deterministic_default_generator() -> None:
    torch.manual_seed(1234)


def row(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    **params,
) -> RowState:
    return RowState(
        params=SamplingParams(**params),
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        eos_token_ids={EOS},
    )


def sample(logits: torch.Tensor, rows: list[RowState]):
    meta = SamplingMetadata.build(rows, logits.shape[1], CPU)
    return Sampler()(logits, meta)


def counts_of(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double()


def chi_square(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


# 5 tokens -> 4 degrees of freedom; P(chi2_4 > 25) ~ 5e-5, so a correct sampler essentially never fails.
CHI2_BOUND = 25.0
DIST_LOGITS = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.2])


# ---------------------------------------------------------------- greedy / random mix


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 100)
    out = sample(logits, [row(temperature=0.0) for _ in range(8)])
    assert out.sampled.dtype == torch.int64
    assert torch.equal(out.sampled, logits.argmax(dim=-1))
    assert out.logprobs == [None] * 8


def test_greedy_and_random_rows_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5, 0.1, 0.2]]).repeat(4, 1)
    rows = [row(temperature=0.0), row(temperature=1.0), row(temperature=0.0), row(temperature=1.0, top_k=2)]
    seen_random: set[int] = set()
    seen_top2: set[int] = set()
    for _ in range(300):
        out = sample(logits, rows)
        assert out.sampled[0] == 1 and out.sampled[2] == 1
        seen_random.add(int(out.sampled[1]))
        seen_top2.add(int(out.sampled[3]))
    assert len(seen_random) >= 4  # the random row really samples
    assert seen_top2 == {1, 2}  # its neighbour's top_k applies to it alone


def test_sampling_frequencies_match_softmax() -> None:
    n = 20_000
    out = sample(DIST_LOGITS.repeat(n, 1), [row(temperature=1.0) for _ in range(n)])
    assert chi_square(counts_of(out.sampled, 5), DIST_LOGITS.softmax(-1)) < CHI2_BOUND


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature: float) -> None:
    n = 20_000
    out = sample(DIST_LOGITS.repeat(n, 1), [row(temperature=temperature) for _ in range(n)])
    observed = counts_of(out.sampled, 5)
    assert chi_square(observed, (DIST_LOGITS / temperature).softmax(-1)) < CHI2_BOUND
    assert chi_square(observed, DIST_LOGITS.softmax(-1)) > 100  # temperature 1 would be clearly wrong


def test_top_k_one_equals_greedy() -> None:
    logits = torch.randn(32, 200)
    out = sample(logits, [row(temperature=1.5, top_k=1) for _ in range(32)])
    assert torch.equal(out.sampled, logits.argmax(dim=-1))


@pytest.mark.parametrize("top_p", [1e-6, 1e-9, 5e-324])  # 1 - 1e-9 rounds to 1.0 and 5e-324 to 0 in float32: the top token must survive
def test_tiny_top_p_equals_greedy(top_p: float) -> None:
    logits = torch.randn(32, 200)
    out = sample(logits, [row(temperature=1.5, top_p=top_p) for _ in range(32)])
    assert torch.equal(out.sampled, logits.argmax(dim=-1))


def test_top_k_top_p_per_row() -> None:
    # probs 0.4, 0.3, 0.2, 0.1 (descending): top_p 0.65 keeps {0, 1}; top_k 3 keeps {0, 1, 2}.
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 2_000
    logits = probs.log().repeat(3 * n, 1)
    rows = [row(top_p=0.65), row(top_k=3), row()] * n
    out = sample(logits, rows).sampled.view(n, 3)
    assert set(out[:, 0].tolist()) == {0, 1}
    assert set(out[:, 1].tolist()) == {0, 1, 2}
    assert set(out[:, 2].tolist()) == {0, 1, 2, 3}
    # renormalised over the kept set
    assert chi_square(counts_of(out[:, 1], 3), probs[:3] / probs[:3].sum()) < 20.0


def test_min_p_filters_low_probability_tokens() -> None:
    # min_p 0.1 of max prob 0.5 -> threshold 0.05: tokens 3 (0.04) and 4 (0.01) must never appear.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    n = 2_000
    out = sample(probs.log().repeat(n, 1), [row(min_p=0.1) for _ in range(n)])
    assert set(out.sampled.tolist()) == {0, 1, 2}
    unfiltered = sample(probs.log().repeat(n, 1), [row() for _ in range(n)])
    assert 3 in set(unfiltered.sampled.tolist())  # the crafted distribution would emit token 3


def _reference_filters(logits: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kept set, each token's mass ranked above it) by one full descending sort: the definition the topk
    paths must match."""
    order = logits.argsort(descending=True)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[order[:top_k]] = True
    probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)[order]
    above = torch.empty_like(probs)
    above[order] = probs.cumsum(-1) - probs
    if top_p < 1.0:  # 1.0 is off (a cumulative sum rounding up to 1 must not cut)
        keep &= above < top_p
    return keep, above


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaked rows cut among 256 candidates; flat rows go further
def test_top_k_top_p_match_a_full_sort(scale: float) -> None:
    vocab = 20_000
    logits = torch.randn(5, vocab) * scale
    settings = [(50, 1.0), (vocab, 0.9), (300, 0.8), (vocab, 1.0), (vocab, 0.3)]
    rows = [row(top_k=k if k < vocab else 0, top_p=p) for k, p in settings]
    meta = SamplingMetadata.build(rows, vocab, CPU)
    kept = sampler_module.random_probs(logits, meta.random) > 0
    for i, (k, p) in enumerate(settings):
        expected, above = _reference_filters(logits[i], k, p)
        differ = kept[i] != expected  # only where float sums in another order land on the other side of p
        assert int(differ.sum()) <= 2 and bool(((above[differ] - p).abs() < 1e-5).all()), settings[i]
    assert int(kept[4].sum()) > (256 if scale < 1 else 0)  # the flat case really passes the first candidates


@pytest.mark.parametrize("kernel", [True, False])
def test_categorical_frequencies_and_zero_weights(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unnormalised weights on a long row, at the C kernel's 64-entry chunk edges: zero weights never come
    out, the rest at their share (kernel=False: the exponential race every other device takes)."""
    if not kernel:
        monkeypatch.setattr(sampler_module, "layer_kernels", lambda: None)
    vocab, n = 4_099, 20_000
    picks = torch.tensor([0, 63, 64, 2_000, vocab - 1])
    weights = torch.zeros(n, vocab)
    weights[:, picks] = torch.tensor([3.0, 0.5, 1.0, 2.0, 1.5])
    out = sampler_module.categorical(weights, {})
    assert set(out.tolist()) <= set(picks.tolist())
    observed = counts_of(torch.searchsorted(picks, out), 5)
    assert chi_square(observed, weights[0, picks] / weights[0, picks].sum()) < CHI2_BOUND


def test_categorical_seeded_rows_repeat_and_empty_rows_return_zero() -> None:
    weights = torch.rand(3, 1000)
    weights[2] = 0.0
    draws = [sampler_module.categorical(weights, {0: torch.Generator().manual_seed(5)}) for _ in range(2)]
    assert int(draws[0][0]) == int(draws[1][0]) and int(draws[0][2]) == 0


# ---------------------------------------------------------------- seeds


def _seeded_run(position: int, companions: list[RowState], steps_logits: list[torch.Tensor]) -> list[int]:
    """Sample 20 steps with the seeded row at `position` among `companions` (fresh generator, seed 42)."""
    generator = torch.Generator(device=CPU).manual_seed(42)
    tokens: list[int] = []
    for step_logits in steps_logits:
        seeded = row(output=list(tokens), generator=generator, seed=42, top_k=30, temperature=0.9)
        rows = companions[:position] + [seeded] + companions[position:]
        logits = torch.randn(len(rows), step_logits.shape[0])
        logits[position] = step_logits
        tokens.append(int(sample(logits, rows).sampled[position]))
    return tokens


def test_seeded_row_is_independent_of_batch_and_position() -> None:
    vocab = 50
    steps_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(7 + s)) * 0.3 for s in range(20)]
    alone = _seeded_run(0, [], steps_logits)
    other_seed = torch.Generator().manual_seed(99)
    mixed = [row(), row(temperature=0.0), row(generator=other_seed, seed=99), row(top_p=0.5)]
    assert _seeded_run(2, mixed, steps_logits) == alone
    assert _seeded_run(1, [row(min_p=0.2), row(temperature=0.0)], steps_logits) == alone
    assert _seeded_run(4, mixed, steps_logits) == alone
    assert len(set(alone)) > 5  # it really samples


def test_unseeded_rows_differ_across_runs() -> None:
    logits = torch.zeros(1, 50)
    runs = [[int(sample(logits, [row()]).sampled[0]) for _ in range(20)] for _ in range(2)]
    assert runs[0] != runs[1]


# ---------------------------------------------------------------- logit adjustments


def test_penalties_match_hand_computed_reference() -> None:
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, -0.5, 3.0, 1.0],
            [2.0, -1.0, 0.5, -0.5, 3.0, 1.0],
        ]
    )
    rows = [
        # prompt has token 1, output has 2, 2, 3; token 4 and 5 unseen.
        row(prompt=[1, 1], output=[2, 2, 3], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[1], output=[2]),  # no penalties: unchanged
    ]
    meta = SamplingMetadata.build(rows, 6, CPU)
    assert meta.penalties is not None
    got = apply_penalties(logits, meta.penalties)
    expected_0 = [
        2.0,  # unseen
        -1.0 * 2.0,  # prompt token, negative -> multiplied; prompt does not count for freq/presence
        0.5 / 2.0 - 0.5 * 2 - 0.25,  # output twice: repetition, then frequency * 2 + presence
        -0.5 * 2.0 - 0.5 * 1 - 0.25,  # output once, negative
        3.0,
        1.0,
    ]
    assert torch.allclose(got[0], torch.tensor(expected_0))
    assert torch.equal(got[1], logits[1])


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0]])
    assert sample(logits, [row(temperature=0.0)]).sampled.item() == 1
    assert sample(logits, [row(output=[1], temperature=0.0, repetition_penalty=2.0)]).sampled.item() == 2
    assert sample(logits, [row(output=[1], temperature=0.0, presence_penalty=1.5)]).sampled.item() == 2


def test_logit_bias() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0], [0.0, 3.0, 2.0, 0.0]])
    out = sample(logits, [row(temperature=0.0, logit_bias={3: 3.5}), row(temperature=0.0)])
    assert out.sampled.tolist() == [3, 1]
    meta = SamplingMetadata.build([row(logit_bias={2: -2.0, 1: 1.0})], 4, CPU)
    assert meta.logit_bias is not None
    rows_i, ids, values = meta.logit_bias
    assert rows_i.tolist() == [0, 0] and sorted(zip(ids.tolist(), values.tolist())) == [(1, 1.0), (2, -2.0)]


def test_logit_bias_out_of_vocab_names_the_row() -> None:
    with pytest.raises(SamplingRowError) as err:
        SamplingMetadata.build([row(), row(logit_bias={10: 1.0})], 4, CPU)
    assert err.value.rows == [1]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    # EOS (0) and stop id 2 dominate; token 3 is next best.
    logits = torch.tensor([[9.0, 1.0, 8.0, 5.0]])
    blocked = row(output=[1], temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [blocked]).sampled.item() == 3
    reached = row(output=[1, 1], temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [reached]).sampled.item() == EOS
    n = 500
    random_rows = [row(output=[], min_tokens=3, stop_token_ids=[2]) for _ in range(n)]
    assert not {0, 2} & set(sample(logits.repeat(n, 1), random_rows).sampled.tolist())
    # ignore_eos: EOS is not a stop token, so only the stop id is blocked.
    ignoring = row(output=[], temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert sample(logits, [ignoring]).sampled.item() == EOS


def test_plain_batch_skips_optional_work() -> None:
    meta = SamplingMetadata.build([row(temperature=0.0), row(temperature=0.0, min_tokens=1, output=[5])], 8, CPU)
    assert meta.random is None and not meta.adjusts_logits and meta.logprob_rows is None
    meta = SamplingMetadata.build([row(), row()], 8, CPU)
    assert meta.random is not None and meta.random.rows is None
    assert meta.random.top_k is None and meta.random.top_p is None and meta.random.min_p is None


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 10)
    before = logits.clone()
    sample(logits, [row(output=[1], repetition_penalty=1.3, logit_bias={2: 1.0}, min_tokens=3), row(top_k=2)])
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- invalid state


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_row_raises_naming_the_row(bad: float) -> None:
    logits = torch.randn(3, 10)
    logits[1, 4] = bad
    with pytest.raises(ValueError, match=r"\[1\]") as err:
        sample(logits, [row(), row(), row(temperature=0.0)])
    assert isinstance(err.value, SamplingRowError) and err.value.rows == [1]


def test_all_masked_row_raises() -> None:
    logits = torch.randn(2, 4)
    logits[0] = float("-inf")
    logits[0, 0] = 5.0
    # the only finite token is EOS, which min_tokens masks -> nothing left to sample
    with pytest.raises(SamplingRowError) as err:
        sample(logits, [row(min_tokens=1, temperature=0.0), row()])
    assert err.value.rows == [0]


# ---------------------------------------------------------------- logprobs


def _rank(logprobs: torch.Tensor, token: int) -> int:
    return int((logprobs > logprobs[token]).sum()) + 1


def test_logprobs_come_from_raw_logits_with_rank() -> None:
    vocab = 30
    logits = torch.randn(4, vocab) * 2
    logits[2, 5], logits[2, 6] = 10.0, 9.5
    rows = [
        row(logprobs=3, temperature=0.5, repetition_penalty=1.5, output=[1, 2], logit_bias={7: 2.0}),
        row(),  # no logprobs
        row(logprobs=0, temperature=0.0, presence_penalty=1.0, output=[5]),
        row(logprobs=5, top_k=3),
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, k in ((0, 3), (2, 0), (3, 5)):
        entry = out.logprobs[i]
        assert entry is not None
        token = int(out.sampled[i])
        assert entry.token_ids[0] == token
        assert len(entry.token_ids) == len(entry.logprobs) == k + 1
        assert math.isclose(entry.logprobs[0], float(raw[i, token]), abs_tol=1e-5)
        assert entry.chosen_rank == _rank(raw[i], token)
        top = raw[i].topk(k)
        assert entry.token_ids[1:] == top.indices.tolist()
        assert torch.allclose(torch.tensor(entry.logprobs[1:]), top.values, atol=1e-5)
    # row 2's presence penalty moved the greedy choice off the raw argmax: rank shows it
    assert int(out.sampled[2]) == 6 and out.logprobs[2] is not None and out.logprobs[2].chosen_rank == 2


def test_logprobs_whole_vocabulary() -> None:
    vocab = 12
    logits = torch.randn(1, vocab)
    state = row(temperature=0.0)
    state.params.logprobs = -1  # vLLM's "whole vocabulary"
    entry = sample(logits, [state]).logprobs[0]
    assert entry is not None and entry.chosen_rank == 1
    assert len(entry.token_ids) == vocab + 1
    assert sorted(entry.token_ids[1:]) == list(range(vocab))
    raw = torch.log_softmax(logits[0], dim=-1)
    assert torch.allclose(torch.tensor(entry.logprobs[1:]), raw[entry.token_ids[1:]], atol=1e-6)


def test_compute_logprobs_mixed_k() -> None:
    logits = torch.randn(3, 8)
    tokens = torch.tensor([5, 0, 7])
    entries = compute_logprobs(logits, tokens, [2, -1, 0])
    assert [len(e.token_ids) for e in entries] == [3, 9, 1]
    raw = torch.log_softmax(logits, dim=-1)
    for i, e in enumerate(entries):
        assert e.token_ids[0] == int(tokens[i])
        assert e.chosen_rank == _rank(raw[i], int(tokens[i]))


def test_prompt_logprobs_for_chunk() -> None:
    vocab = 16
    logits = torch.randn(4, vocab)
    targets = [3, 9, 0, 15]
    raw = torch.log_softmax(logits, dim=-1)
    entries = prompt_logprobs_for_chunk(logits, targets, 2)
    assert len(entries) == 4
    for t, e in enumerate(entries):
        assert e.token_ids[0] == targets[t]
        assert math.isclose(e.logprobs[0], float(raw[t, targets[t]]), abs_tol=1e-5)
        assert e.chosen_rank == _rank(raw[t], targets[t])
        assert e.token_ids[1:] == raw[t].topk(2).indices.tolist()
    whole = prompt_logprobs_for_chunk(logits, targets, -1)
    assert all(len(e.token_ids) == vocab + 1 for e in whole)
    with pytest.raises(ValueError):
        prompt_logprobs_for_chunk(logits, targets[:3], 1)
