"""The report header: which code, model, weights, dtype, device, threads and KV pool a figure was measured on,
so a published number can be attributed to its configuration."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from vllmpy import __version__
from vllmpy.engine.core import EngineCore

# The engine lines of the header as labels of Prometheus info gauges (value 1) on the server's /metrics, so
# `vllm-bench serve` can attribute its figures as the offline modes do. vllm:cache_config_info keeps vLLM's
# label names (block_size, num_gpu_blocks, enable_prefix_caching, cache_dtype): a vLLM server fills those too.
INFO_METRICS = {
    "vllmpy:engine_config_info": {"weight_format": "Weight format", "dtype": "Dtype", "device": "Device",
                                  "threads": "Threads", "max_num_seqs": "Max num seqs",
                                  "max_num_batched_tokens": "Max num batched tokens",
                                  "max_model_len": "Max model len", "speculative_config": "Speculative decoding"},
    "vllm:cache_config_info": {"block_size": "Block size", "num_gpu_blocks": "KV blocks",
                               "enable_prefix_caching": "Prefix caching",
                               "cache_dtype": "KV cache dtype (requested)",
                               "kv_cache_dtype_resolved": "KV cache dtype (resolved storage)"},
}


def git_commit() -> str:
    """Short commit of the checkout vllmpy is imported from, marked when the tree has uncommitted changes."""
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"
    return f"{commit} + uncommitted changes" if dirty else commit


def version_line() -> str:
    return f"{__version__} (commit {git_commit()})"


def threads_line() -> str:
    """The intra-op thread count torch actually uses, beside what was asked for and the cores there are."""
    asked = os.environ.get("OMP_NUM_THREADS", "unset")
    return f"{torch.get_num_threads()} (OMP_NUM_THREADS={asked}, {os.cpu_count()} cores)"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_format(core: EngineCore) -> str:
    """The checkpoint's storage format and what the loader turned it into (GGUF blocks kept packed on the
    CPU when the block kernels are available, else dequantized)."""
    ckpt = core.checkpoint
    held = dtype_name(core.dtype)
    if ckpt.format == "gguf":
        import gguf

        from vllmpy.loader.gguf.file import read_gguf

        file_type = read_gguf(ckpt.path)[0].get("general.file_type")
        name = "file type unset" if file_type is None else gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_")
        if any(getattr(module, "packed", None) is not None for module in core.model.modules()):
            return f"gguf {name}, quantized blocks kept packed (other tensors {held})"
        return f"gguf {name}, dequantized to {held} at load"
    declared = ckpt.config.get("torch_dtype") or ckpt.config.get("dtype") or "dtype undeclared"
    return f"{ckpt.format} {declared}, loaded as {held}"


def engine_header(core: EngineCore) -> dict[str, str]:
    config = core.config
    spec = config.model.speculative_config
    head_dim = core.model.attention_layers()[0].spec.head_dim
    return {
        "vllmpy version": version_line(),
        "Model": core.checkpoint.path,
        "Weight format": weight_format(core),
        "Dtype": dtype_name(core.dtype),
        "Device": str(core.device),
        "Threads": threads_line(),
        "Max num seqs": str(config.scheduler.max_num_seqs),
        "Max num batched tokens": str(config.scheduler.max_num_batched_tokens),
        "Max model len": str(core.max_model_len),
        "Speculative decoding": "off" if spec is None else spec.describe(),
        "Block size": str(config.cache.block_size),
        "KV blocks": str(core.num_blocks),
        "Prefix caching": "on" if config.cache.enable_prefix_caching else "off",
        "KV cache dtype (requested)": core.kv_cache_dtype.requested,
        "KV cache dtype (resolved storage)": core.kv_cache_dtype.describe(head_dim),
    }


def info_metrics(core: EngineCore) -> dict[str, dict[str, str]]:
    """{info gauge name: its labels}: engine_header's values under INFO_METRICS' label names."""
    header = engine_header(core)
    return {name: {label: header[line] for label, line in labels.items()} for name, labels in INFO_METRICS.items()}
