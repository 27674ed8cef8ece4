"""Resolve `--model` to a checkpoint (HF directory, .gguf file, hub repo or the default) and build
the model on the meta device, then fill it in place."""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from tqdm import tqdm

from vllmpy.config import ModelConfig
from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.kernels import block_kernels
from vllmpy.layers.quantized import PackedTensor
from vllmpy.loader.default_model import default_model_path
from vllmpy.loader.heap import return_freed_heap
from vllmpy.loader.hub import looks_like_repo_id, resolve_repo
from vllmpy.models.base import CausalLM
from vllmpy.models.registry import resolve_model_class
from vllmpy.tokenizer import Tokenizer

if TYPE_CHECKING:
    from vllmpy.distributed.parallel_state import RankGroup

logger = logging.getLogger("vllmpy")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Checkpoint:
    path: str
    format: str  # "safetensors" | "gguf"
    config: dict
    tokenizer: Tokenizer
    weights: Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor]]]
    num_tensors: int
    generation_config: dict = field(default_factory=dict)
    # GGUF and quantized safetensors: the same stream with block-quantized 2-D tensors left packed
    # (see layers/quantized.py).
    packed_weights: Callable[[torch.dtype], Iterator[tuple[str, torch.Tensor | PackedTensor]]] | None = None
    # GGUF: called once the weights are in, to drop the file pages the model copied from RSS
    release_pages: Callable[[], None] | None = None

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.generation_config.get("eos_token_id", self.config.get("eos_token_id"))
        ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def max_model_len(self) -> int:
        return int(self.config.get("max_position_embeddings") or self.config.get("n_positions") or 2048)


def resolve_model_path(config: ModelConfig) -> str:
    if config.model is None:
        return default_model_path()
    if looks_like_repo_id(config.model):
        return resolve_repo(config.model, config.revision, config.download_dir)
    if not os.path.exists(config.model):
        raise FileNotFoundError(f"--model {config.model!r}: no such file or directory")
    return config.model


def open_checkpoint(config: ModelConfig) -> Checkpoint:
    path = resolve_model_path(config)
    if path.endswith(".gguf") and os.path.isfile(path):
        checkpoint = _open_gguf(path)
    elif os.path.isdir(path):
        checkpoint = _open_hf_dir(path, config.tokenizer)
    else:
        raise UnsupportedCheckpointError(f"--model {path!r}: expected a Hugging Face directory or a .gguf file")
    # Building a 262k-token tokenizer leaves ~270 MB of freed parse heap; give it back before the
    # weights load, or it adds to their peak.
    return_freed_heap()
    return checkpoint


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _open_hf_dir(path: str, tokenizer_path: str | None) -> Checkpoint:
    from vllmpy.loader.quantization import QuantizedSafetensors, parse_quantization_config
    from vllmpy.loader.safetensors import SafetensorsWeights

    config = _read_json(os.path.join(path, "config.json"))
    if not config:
        raise UnsupportedCheckpointError(f"{path}: no config.json")
    if isinstance(config.get("text_config"), dict):  # vision-language: the engine reads the LM's sizes at the top
        config = {**config["text_config"], **config}
    quant = parse_quantization_config(config["quantization_config"] or {}) if "quantization_config" in config else None
    resolve_model_class(config)  # refuse an unknown architecture before touching weights
    generation = _read_json(os.path.join(path, "generation_config.json"))
    if quant is not None:
        packed = QuantizedSafetensors(path, quant)
        return Checkpoint(path=path, format="safetensors", config=config,
                          tokenizer=Tokenizer.from_pretrained(tokenizer_path or path), weights=packed.dense,
                          num_tensors=packed.num_tensors, generation_config=generation, packed_weights=packed.iterate)
    weights = SafetensorsWeights(path)
    return Checkpoint(path=path, format="safetensors", config=config,
                      tokenizer=Tokenizer.from_pretrained(tokenizer_path or path), weights=weights.iterate,
                      num_tensors=weights.num_tensors, generation_config=generation)


def _open_gguf(path: str) -> Checkpoint:
    from vllmpy.loader.gguf import GGUFCheckpoint

    ckpt = GGUFCheckpoint(path)
    config = ckpt.config
    resolve_model_class(config)
    generation = {"eos_token_id": config.get("eos_token_id")}
    return Checkpoint(path=path, format="gguf", config=config, tokenizer=Tokenizer.from_gguf_metadata(ckpt.metadata),
                      weights=ckpt.weights, num_tensors=ckpt.num_tensors, generation_config=generation,
                      packed_weights=functools.partial(ckpt.weights, keep_packed=True), release_pages=ckpt.release_pages)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was requested but CUDA is not available here; use --device cpu or auto")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on accelerators, fp32 on the CPU. Why fp32 even where the CPU computes bf16 natively:
    on the default model (Gemma 3 270M Q4_K_M, packed) A/B interleaved on an Intel Xeon with AVX512-BF16 and
    AMX-BF16 (2 shared cores, 2026-12-01; README "what auto picks"), bf16 was ~2x faster on 256-token prefill
    but 5-12% slower on batch-1 and batch-16 decode, where generation spends its time; dense weights go
    through torch's bf16 GEMMs, ~2x slower than fp32 on the tiny gate models there."""
    if name != "auto":
        return _DTYPES[name]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def _empty_on(model: CausalLM, device: torch.device) -> CausalLM:
    """Module.to_empty, uninitialised storage for every meta tensor, without empty_like: its meta path imports
    sympy on first use (~1/6 of a warm `LLM()`), and nothing else at start needs it."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def build_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device, task: str = "auto",
                max_model_len: int | None = None, tp_group: RankGroup | None = None,
                keep_mtp: bool = False) -> CausalLM:
    """Construct on the meta device (no memory), materialize empty, then copy weights in place.

    On the CPU, GGUF blocks (and quantized safetensors weights, repacked into blocks) stay packed when the
    block kernels are available (VLLMPY_GGUF_KEEP_QUANT=0 opts out); elsewhere they are dequantized to
    `dtype` as they load. tp_group: this rank keeps only its tensor-parallel shard of every weight (a
    PPGroup: only its pipeline stage's layers). keep_mtp: the model sets its MTP blocks' tensors aside in
    `model.mtp_weights` rather than dropping them (MTP speculation builds its draft from them, models/mtp.py).
    """
    model_cls = resolve_model_class(ckpt.config, task)
    with torch.device("meta"):
        model = model_cls(ckpt.config)
    if tp_group is not None:
        tp_group.partition(model)
    if max_model_len is not None:
        model.set_max_model_len(max_model_len)
    model = _empty_on(model, device).to(dtype)
    model.tie_weights()
    if keep_mtp:
        model.mtp_weights = []
    keep_packed = (ckpt.packed_weights is not None and device.type == "cpu"
                   and os.environ.get("VLLMPY_GGUF_KEEP_QUANT", "1") != "0" and block_kernels() is not None)
    stream = ckpt.packed_weights(dtype) if keep_packed else ckpt.weights(dtype)
    weights = tqdm(stream, total=ckpt.num_tensors, desc="Loading weights", unit="tensor",
                   disable=None, leave=False)
    model.load_weights(weights)
    if ckpt.release_pages is not None:
        ckpt.release_pages()
    return_freed_heap()
    return model.eval()

