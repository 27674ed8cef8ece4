"""Per-step sampling tensors, built once from the rows' Python state so the sampler does no per-row work."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllmpy.sampling.penalties import Penalties, TokenCounts, build_penalties
from vllmpy.sampling_params import SamplingParams
from vllmpy.structured_output.bitmask import allocate_bitmask

if TYPE_CHECKING:
    from vllmpy.structured_output.grammar import Grammar


class SamplingRowError(ValueError):
    """Some rows cannot be sampled; `rows` names them so the runner can fail just those requests."""

    def __init__(self, rows: list[int], reason: str) -> None:
        super().__init__(f"sampling row(s) {rows}: {reason}")
        self.rows = rows


class TokenIdsView(Sequence[int]):
    """A read-only window on a token list the runner keeps growing: no copy per step, no way to edit."""

    __slots__ = ("_ids",)

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def __getitem__(self, index):  # an int, or a slice (a new list: the caller's to keep)
        return self._ids[index]

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __eq__(self, other: object) -> bool:  # equal to a list or tuple of the same ids
        if isinstance(other, TokenIdsView):
            other = other._ids
        return isinstance(other, (list, tuple)) and len(other) == len(self._ids) and all(
            a == b for a, b in zip(self._ids, other))

    __hash__ = None  # type: ignore[assignment]  # the ids still grow

    def __repr__(self) -> str:
        return f"TokenIdsView({self._ids!r})"


@dataclass(frozen=True)
class RowView:
    """What a logits processor sees of one row: the request's params and its tokens, read-only."""

    params: SamplingParams
    prompt_token_ids: TokenIdsView
    output_token_ids: TokenIdsView


@dataclass
class RowState:
    """What the sampler needs to know about one sampling row (one request); the runner's, not user code's
    (logits processors get `view`)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # the seeded request's own generator; None = default generator
    eos_token_ids: set[int]
    grammar: Grammar | None = None  # the request's structured-output matcher, advanced by the runner
    counts: TokenCounts | None = None  # penalty statistics, kept across steps (penalties.py)
    view: RowView = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.view = RowView(self.params, TokenIdsView(self.prompt_token_ids), TokenIdsView(self.output_token_ids))


@dataclass
class RandomRows:
    """Controls for the rows that sample randomly; tensors are indexed within this subset.

    A filter is None when no random row uses it, so the sampler skips it.
    """

    rows: torch.Tensor | None  # int64 batch indices of these rows; None = every row of the batch
    temperature: torch.Tensor  # [R, 1] float32
    top_k: torch.Tensor | None  # [R] int64, disabled rows hold vocab_size
    top_p: torch.Tensor | None  # [R] float32, disabled rows hold 1.0
    min_p: torch.Tensor | None  # [R] float32, disabled rows hold 0.0
    generators: dict[int, torch.Generator]  # subset index -> the seeded request's generator


@dataclass
class SamplingMetadata:
    """Everything the sampler reads for one step; each optional part is None when no row needs it."""

    num_rows: int
    vocab_size: int
    random: RandomRows | None  # None when every row is greedy
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    min_tokens_block: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) forced to -inf
    penalties: Penalties | None
    num_logprobs: list[int | None]  # per row; -1 = whole vocabulary
    logprob_rows: torch.Tensor | None  # int64 indices of rows with num_logprobs set
    rows: list[RowView]  # what custom logits processors read
    processor_rows: list[int]  # rows with per-request logits processors
    grammar_bitmask: tuple[torch.Tensor | None, torch.Tensor] | None  # (rows, None = all; int32 [R, W])

    @property
    def adjusts_logits(self) -> bool:
        return (self.logit_bias is not None or self.min_tokens_block is not None or self.penalties is not None
                or self.grammar_bitmask is not None or bool(self.processor_rows))

    @classmethod
    def build(cls, rows: list[RowState], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        greedy = [r.params.greedy for r in rows]
        num_logprobs = [r.params.logprobs for r in rows]
        lp_rows = [i for i, k in enumerate(num_logprobs) if k is not None]
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            random=_build_random(rows, greedy, vocab_size, device),
            logit_bias=_build_logit_bias(rows, vocab_size, device),
            min_tokens_block=_build_min_tokens(rows, vocab_size, device),
            penalties=build_penalties(rows, vocab_size, device),
            num_logprobs=num_logprobs,
            logprob_rows=torch.tensor(lp_rows, dtype=torch.int64, device=device) if lp_rows else None,
            rows=[r.view for r in rows],
            processor_rows=[i for i, r in enumerate(rows) if r.params.logits_processors],
            grammar_bitmask=_build_grammar_bitmask(rows, device),
        )


def _build_random(
    rows: list[RowState], greedy: list[bool], vocab_size: int, device: torch.device
) -> RandomRows | None:
    picked = [i for i, g in enumerate(greedy) if not g]
    if not picked:
        return None
    params = [rows[i].params for i in picked]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    return RandomRows(
        rows=None if len(picked) == len(rows) else torch.tensor(picked, dtype=torch.int64, device=device),
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device).unsqueeze(1),
        top_k=_tensor_if(any(k < vocab_size for k in top_k), top_k, torch.int64, device),
        top_p=_tensor_if(any(p < 1.0 for p in top_p), top_p, torch.float32, device),
        min_p=_tensor_if(any(p > 0.0 for p in min_p), min_p, torch.float32, device),
        generators={j: g for j, i in enumerate(picked) if (g := rows[i].generator) is not None},
    )


def _build_logit_bias(
    rows: list[RowState], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Out-of-vocabulary ids are the request's error (vLLM rejects them), so they name their row."""
    row_idx: list[int] = []
    tok_ids: list[int] = []
    values: list[float] = []
    bad: list[int] = []
    for i, r in enumerate(rows):
        bias = r.params.logit_bias
        if not bias:
            continue
        if any(not 0 <= t < vocab_size for t in bias):
            bad.append(i)
        row_idx += [i] * len(bias)
        tok_ids += bias.keys()
        values += bias.values()
    if bad:
        raise SamplingRowError(bad, f"logit_bias has token ids outside the vocabulary [0, {vocab_size})")
    if not row_idx:
        return None
    return (
        torch.tensor(row_idx, dtype=torch.int64, device=device),
        torch.tensor(tok_ids, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _build_min_tokens(
    rows: list[RowState], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Like vLLM, min_tokens blocks every stop token id: stop_token_ids, plus EOS unless ignore_eos."""
    row_idx: list[int] = []
    tok_ids: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            continue
        blocked = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            blocked |= r.eos_token_ids
        ids = [t for t in blocked if 0 <= t < vocab_size]  # an id the model cannot emit needs no mask
        row_idx += [i] * len(ids)
        tok_ids += ids
    if not row_idx:
        return None
    return (
        torch.tensor(row_idx, dtype=torch.int64, device=device),
        torch.tensor(tok_ids, dtype=torch.int64, device=device),
    )


def _build_grammar_bitmask(
    rows: list[RowState], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """Masks for the constrained rows only, each filled by its matcher (native code, no vocabulary loop)."""
    picked = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not picked:
        return None
    bitmask = allocate_bitmask(len(picked), rows[picked[0]].grammar.vocab_size)
    failed = []
    for j, i in enumerate(picked):
        grammar = rows[i].grammar
        grammar.fill_bitmask(bitmask, j)
        if grammar.error is not None:
            failed.append(i)
    if failed:
        raise SamplingRowError(failed, f"structured output: {rows[failed[0]].grammar.error}")
    index = None if len(picked) == len(rows) else torch.tensor(picked, dtype=torch.int64, device=device)
    return index, bitmask


def _tensor_if(used: bool, values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return torch.tensor(values, dtype=dtype, device=device) if used else None
