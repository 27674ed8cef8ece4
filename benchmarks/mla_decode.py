"""One MLA layer's decode step on a DeepSeek-V2-Lite shape (16 heads, latent 512 + rope 64, nope 128,
v 128; fp32): the absorbed form that ships (MQA over the latent cache), the non-absorbed form over the
same latent cache (kv_b_proj up-projects the context every step), and plain MHA over an expanded K/V
cache (what the latent saves; V padded to 192 so the same kernel serves it). Best of 3 rounds: the dev
host is shared. Also prints the KV bytes per token and layer of the real MLA models, latent vs expanded.

    python benchmarks/mla_decode.py [--threads 1] [--context 2048]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from vllmpy.attention.backends import BACKENDS, AttentionBackend
from vllmpy.attention.base import AttentionMetadata, AttentionSpec, GroupInputs, StepLayout
from vllmpy.attention.kv_storage import PagedKVCache
from vllmpy.attention.layer import PagedAttention
from vllmpy.attention.mla import MLAAttention, MLAAttentionSpec
from vllmpy.attention.torch_paged import _gather_seq
from vllmpy.engine.kv_cache_spec import FullAttentionSpec, KVCacheSpec
from vllmpy.layers.linear import Linear

HEADS, LORA, ROPE, NOPE, V, BS = 16, 512, 64, 128, 128, 16
# name -> (heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
MODELS = {"DeepSeek-V3 / Kimi K2": (128, 512, 64, 128, 128), "DeepSeek-V2-Lite": (16, 512, 64, 128, 128),
          "GLM-4.7-Flash": (20, 512, 64, 192, 256), "MiniCPM3-4B": (40, 256, 32, 64, 64)}


def kv_bytes() -> None:
    for name, (heads, lora, rope, nope, v) in MODELS.items():
        latent = MLAAttentionSpec(1, 1, lora + rope, torch.bfloat16).page_bytes
        expanded = heads * (nope + rope + v) * 2
        print(f"{name}: {latent} B/token/layer latent vs {expanded} expanded K+V (bf16): {expanded / latent:.1f}x")


def step(backend: AttentionBackend, spec: KVCacheSpec, rows: int, context: int) -> tuple[AttentionMetadata, object]:
    """Metadata for `rows` sequences each adding one token after `context` cached ones, and a random cache."""
    per_row = -(-(context + 1) // BS)
    tables = torch.arange(rows * per_row).view(rows, per_row)
    slots = tables[:, context // BS] * BS + context % BS
    layout = StepLayout(list(range(rows + 1)), [context + 1] * rows, [0] * rows, BS)
    meta = backend.build_metadata(layout, [GroupInputs(slots, tables, frozenset({(None, None)}))])[0]
    buffer = torch.randn(spec.page_bytes * rows * per_row // 4).view(torch.uint8)
    return meta, spec.view(buffer, rows * per_row)


def expanded(layer: MLAAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: PagedKVCache,
             meta: AttentionMetadata, kv_b: Linear) -> None:
    """The non-absorbed form: each row's context latents gathered and up-projected, as a prefill row is."""
    for row, seq_len in enumerate(meta.seq_lens.tolist()):
        context = _gather_seq(cache, meta, row, 0, seq_len, q_nope.dtype)[0][:, 0]
        layer._expanded(q_nope[row:row + 1], q_pe[row:row + 1], context, seq_len, kv_b)


def best_ms(fn: Callable[[], object], rounds: int = 3, iters: int = 3) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - start) / iters)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--context", type=int, default=2048)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    kv_bytes()
    layer = MLAAttention(HEADS, LORA, NOPE, ROPE, V, scale=(NOPE + ROPE) ** -0.5)
    kv_b = Linear(LORA, HEADS * (NOPE + V))
    kv_b.weight.data = torch.randn(HEADS * (NOPE + V), LORA) * LORA ** -0.5
    layer.absorb(kv_b.weight.data)
    mha = PagedAttention(AttentionSpec(HEADS, HEADS, NOPE + ROPE, (NOPE + ROPE) ** -0.5))
    for rows in (1, 16):
        results = {}
        for name, backend_cls in BACKENDS.items():
            backend = backend_cls()
            q_nope, q_pe = torch.randn(rows, HEADS, NOPE), torch.randn(rows, HEADS, ROPE)
            latent = torch.randn(rows, LORA + ROPE)
            meta, cache = step(backend, layer.kv_cache_spec(BS, torch.float32), rows, args.context)
            results[f"absorbed [{name}]"] = best_ms(lambda: layer(q_nope, q_pe, latent, cache, meta, kv_b))
            if name == "cpu":  # the expanded path is the same torch code on every backend
                results[f"expanded from the latent [{name}]"] = best_ms(
                    lambda: expanded(layer, q_nope, q_pe, cache, meta, kv_b))
            meta, cache = step(backend, FullAttentionSpec(BS, HEADS, NOPE + ROPE, torch.float32), rows, args.context)
            q, k = torch.randn(rows, HEADS, NOPE + ROPE), torch.randn(rows, HEADS, NOPE + ROPE)
            results[f"MHA over an expanded cache [{name}]"] = best_ms(lambda: mha(q, k, k, cache, meta))
        print(f"{rows} row(s) x {args.context} context, {args.threads} thread(s): "
              + ", ".join(f"{form} {ms:.1f} ms" for form, ms in results.items()))


if __name__ == "__main__":
    main()
