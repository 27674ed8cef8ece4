"""Custom logits processors: per-request callables (vLLM v0) and batch-level objects (vLLM v1 style).

Per request: `SamplingParams(logits_processors=[fn])`, `fn(output_token_ids, logits[V]) -> logits[V]`,
or `fn(prompt_token_ids, output_token_ids, logits[V])`; the ids are read-only sequences (TokenIdsView:
len, indexing, slicing, iteration) over the runner's own lists, so no copy is made per step and no
processor can change what the runner appends to. Per engine: `LLM(model, logits_processors=[obj])`,
where `obj.apply(logits[B, V], rows) -> logits[B, V]` sees every sampled row of each step. Both run on
the raw logits before the grammar mask and the built-in processors; logprobs stay raw.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vllmpy.sampling.metadata import RowView, SamplingRowError


class LogitsProcessor:
    """A batch-level processor; subclass it, or pass any object with this `apply`.

    `rows[i]` describes logits row i (a frozen RowView): `.params` (SamplingParams), `.prompt_token_ids`,
    `.output_token_ids` (read-only sequences); return the (possibly in-place) processed logits.
    """

    def apply(self, logits: torch.Tensor, rows: Sequence[RowView]) -> torch.Tensor:
        raise NotImplementedError


def resolve_logits_processors(specs: Sequence[Any]) -> list[LogitsProcessor]:
    """Instances as given; a class is instantiated with no arguments. Anything else is refused."""
    resolved = []
    for spec in specs:
        processor = spec() if isinstance(spec, type) else spec
        if not callable(getattr(processor, "apply", None)):
            raise ValueError(f"logits_processors: {spec!r} has no apply(logits, rows) method")
        resolved.append(processor)
    return resolved


def apply_request_processors(logits: torch.Tensor, rows: Sequence[RowView], indices: list[int]) -> None:
    """Run each listed row's own processors on its logits row, in place; a processor that raises fails
    only its own row."""
    failed: dict[int, str] = {}
    for i in indices:
        row = rows[i]
        try:
            for fn in row.params.logits_processors:
                args = (row.output_token_ids, logits[i])
                logits[i] = fn(row.prompt_token_ids, *args) if _arity(fn) == 3 else fn(*args)
        except Exception as exc:  # user code: any failure is that request's error, not the batch's
            failed[i] = f"{type(exc).__name__}: {exc}"
    if failed:
        raise SamplingRowError(list(failed), f"logits processor failed: {'; '.join(set(failed.values()))}")


def apply_batch_processors(logits: torch.Tensor, rows: Sequence[RowView],
                           processors: Sequence[LogitsProcessor]) -> torch.Tensor:
    """An engine-level processor sees the whole batch, so its failure fails every row of the step."""
    everyone, shape = list(range(len(rows))), logits.shape
    for processor in processors:
        try:
            logits = processor.apply(logits, rows)
        except Exception as exc:  # user code, as above
            raise SamplingRowError(everyone, f"logits processor {processor!r} failed: {type(exc).__name__}: {exc}")
        if not isinstance(logits, torch.Tensor) or logits.shape != shape:
            raise SamplingRowError(everyone, f"logits processor {processor!r} did not return [rows, vocab] logits")
    return logits


def _arity(fn: Callable) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: take the documented 2-argument form
        return 2
