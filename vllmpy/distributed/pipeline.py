"""Pipeline-parallel stages: a model's decoder layers split over the ranks (vLLM's get_pp_indices split),
the embedding on the first stage, the final norm and LM head on the last.

`split_stage` edits the meta-device model before it is materialized, so a rank only ever allocates and
loads its own layers: the other layers are dropped, the kept ones renumbered from 0 (checkpoint names
are renumbered as they load), and the stage boundaries become modules that move the hidden state:
- a later stage's embedding step is `StageInput` (it receives the previous stage's hidden state, so a
  family's embedding scale is applied once, on the first stage);
- an earlier stage's final norm is `StageOutput` (it sends the hidden state on and returns an empty
  [tokens, 0] tensor the runner indexes as usual);
- the logits: the last stage computes them and sends them to the driver (rank 0), whose
  `compute_logits` receives them; a middle stage has none.
The shared decoder (models/llama.py's DecoderModel) runs unchanged on each stage's layers. The hidden
state is the whole residual stream there (each layer returns x + branch), so nothing else crosses.
The KV pool is the whole model's: the scheduler's cache groups are formed over every layer (so a block
id means the same group on every stage) and each stage allocates the pages of its own layers only
(`stage_cache_config`).
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from vllmpy.attention.layer import PagedAttention
from vllmpy.distributed.parallel_state import PPGroup
from vllmpy.engine.kv_cache_spec import KVCacheConfig, KVCacheGroup, KVCacheLayout
from vllmpy.errors import UnsupportedCheckpointError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
Weights = Iterable[tuple[str, object]]


def stage_layers(num_layers: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of stage `rank`'s layers: an even split, the remainder going one each to the stages
    just before the last (which also holds the norm and the LM head), as vLLM splits them; or the counts
    VLLM_PP_LAYER_PARTITION names ("12,6": vLLM's variable, e.g. to lighten a last stage whose LM head
    is large)."""
    if num_layers < size:
        raise UnsupportedCheckpointError(f"--pipeline-parallel-size {size}: the model has {num_layers} decoder "
                                         f"layers; choose at most {num_layers} stages")
    counts = [num_layers // size] * size
    for i in range(num_layers % size):
        counts[size - 2 - i] += 1
    if os.environ.get(PARTITION_ENV):
        counts = _partition(os.environ[PARTITION_ENV], num_layers, size)
    start = sum(counts[:rank])
    return start, start + counts[rank]


def _partition(value: str, num_layers: int, size: int) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",")]
    except ValueError:
        counts = []
    if len(counts) != size or sum(counts) != num_layers or min(counts) < 1:
        raise ValueError(f"{PARTITION_ENV}={value!r}: give {size} comma-separated layer counts, each >= 1, "
                         f"summing to the model's {num_layers} layers")
    return counts


def check_stageable(model: nn.Module, size: int) -> None:
    """Refuse by name a model the stage split does not cover: only the shared decoder's own loop (a list of
    layers with one attention each, token embedding in, norm out) is split so far."""
    from vllmpy.models.llama import DecoderModel

    arch = type(model).__name__
    decoder = getattr(model, "model", None)
    if not isinstance(decoder, DecoderModel) or type(decoder).forward is not DecoderModel.forward:
        raise UnsupportedCheckpointError(f"{arch}: pipeline parallel splits only the shared decoder's layer loop "
                                         f"(Llama-style families) so far; run it with --pipeline-parallel-size 1")
    if decoder.embed_positions is not None or hasattr(model, "encode_images"):
        raise UnsupportedCheckpointError(f"{arch}: learned positions and vision towers are not split by pipeline "
                                         f"parallel yet; run it with --pipeline-parallel-size 1")
    stateful = model.stateful_layers()
    if len(stateful) != len(decoder.layers) or not all(isinstance(m, PagedAttention) for m in stateful):
        raise UnsupportedCheckpointError(f"{arch}: pipeline parallel needs one attention layer per decoder layer "
                                         f"(no recurrent layers); run it with --pipeline-parallel-size 1")
    stage_layers(len(decoder.layers), 0, size)


class StageInput(nn.Module):
    """A later stage's embedding: the previous stage's hidden state for the batch's tokens."""

    def __init__(self, group: PPGroup, hidden_size: int) -> None:
        super().__init__()
        self.group, self.hidden_size = group, hidden_size
        self.register_buffer("probe", torch.empty(0), persistent=False)  # follows the model's device and dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.group.recv_hidden((input_ids.shape[0], self.hidden_size), self.probe.dtype)


class StageOutput(nn.Module):
    """An earlier stage's final norm: send the hidden state to the next stage, hand the runner no columns."""

    def __init__(self, group: PPGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.group.send_hidden(x)
        return x.new_empty((x.shape[0], 0))


def split_stage(model: nn.Module, group: PPGroup) -> None:
    """Keep this rank's layers (and its ends of the model) on the meta-device `model`, refusing a model
    the split does not cover."""
    check_stageable(model, group.world_size)
    decoder = model.model
    start, end = stage_layers(len(decoder.layers), group.rank, group.world_size)
    every_attention = model.attention_layers()  # meta modules, kept for the whole model's cache specs
    model.kv_cache_specs = lambda block_size, dtype, ssm_dtype=torch.float32: [
        attention.kv_cache_spec(block_size, dtype) for attention in every_attention]
    model.pipeline_stage = (start, end)
    decoder.layers = nn.ModuleList(list(decoder.layers)[start:end])
    tied = model.tie_word_embeddings
    model.tie_word_embeddings = False  # a tied head is loaded from the embedding rows on the last stage
    if not group.is_driver:
        decoder.embed_tokens = None
        decoder.stage_input = StageInput(group, model.config["hidden_size"])
        decoder.embed = decoder.stage_input.forward  # replaces the family's embed (and its scaling)
    if not group.is_last:
        decoder.norm = StageOutput(group)
        model.lm_head = None
    model.compute_logits = _stage_logits(model.compute_logits, group, model.config["vocab_size"])
    load = model.load_weights
    renames = model.checkpoint_renames
    model.load_weights = lambda weights: load(_stage_weights(weights, start, end, group, tied, renames))


def _stage_logits(compute: Callable[[torch.Tensor], torch.Tensor], group: PPGroup,
                  vocab: int) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """The driver receives the last stage's logits for the rows it asks for; the last stage computes and
    sends them; a middle stage has none (None: nothing to sample, as a tensor-parallel worker)."""
    if group.is_driver:
        return lambda hidden: group.recv_logits(hidden.shape[0], vocab)

    def last(hidden: torch.Tensor) -> None:
        group.send_logits(compute(hidden))

    return last if group.is_last else lambda hidden: None


def _stage_weights(weights: Weights, start: int, end: int, group: PPGroup, tied: bool,
                   renames: tuple[tuple[str, str], ...]) -> Iterator[tuple[str, object]]:
    """The checkpoint tensors this stage holds, its layers renumbered from 0; a tied head's rows come from
    the embedding. A tensor is placed by its name after the family's renames (our names) and handed on
    under its own name (load_weights renames it)."""
    for name, tensor in weights:
        ours = name
        for pattern, replacement in renames:
            ours = re.sub(pattern, replacement, ours)
        layer = _LAYER.match(ours)
        if layer is not None:
            index = int(layer[1])
            if start <= index < end:
                yield re.sub(rf"(^|\.)layers\.{index}\.", rf"\g<1>layers.{index - start}.", name, count=1), tensor
        elif ours.startswith("model.embed_tokens."):
            if group.is_driver:
                yield name, tensor
            if group.is_last and tied:
                yield "lm_head." + ours.removeprefix("model.embed_tokens."), tensor
        elif ours.startswith(("model.norm.", "lm_head.")):
            if group.is_last and not (tied and ours.startswith("lm_head.")):
                yield name, tensor
        else:
            yield name, tensor


def stage_cache_config(whole: KVCacheConfig, model: nn.Module) -> KVCacheConfig:
    """The whole model's pool over this stage's layers: the same blocks and groups (a chunk's block ids per
    group mean the same on every stage), each group holding only this stage's layers, renumbered as the
    stage's model numbers them. A model that is not a pipeline stage keeps `whole`."""
    if not hasattr(model, "pipeline_stage"):
        return whole
    start, end = model.pipeline_stage
    groups = tuple(KVCacheGroup(g.spec, tuple(i - start for i in g.layers if start <= i < end)) for g in whole.groups)
    return dataclasses.replace(whole, layout=KVCacheLayout(groups, whole.layout.recurrent))
