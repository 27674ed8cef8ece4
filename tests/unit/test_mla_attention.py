"""MLA's cache layer on random weights: decode rows in the absorbed form (MQA over the latent, W_UK / W_UV
folded in) equal the same rows attended expanded, and both equal a dense float64 reference that
up-projects every latent, on both backends and every cache dtype; the latent cache's layout and size."""
from __future__ import annotations

import math

import pytest
import torch

from vllmpy.attention.backends import BACKENDS
from vllmpy.attention.mla import MLAAttention, MLAAttentionSpec, mla_softmax_scale
from vllmpy.attention.torch_paged import _decode_kernel
from vllmpy.layers.linear import Linear
from tests.attention.step_metadata import one_group

BS, HEADS, LORA, NOPE, ROPE, V = 4, 4, 32, 16, 8, 24
# (cached context, new tokens) per row: decode rows around a chunked prefill and a fresh prefill.
ROWS = [(9, 1), (30, 1), (0, 6), (17, 5), (1, 1)]
CACHE_DTYPES = [torch.float32, torch.float8_e4m3fn, torch.int8]


def _layer(gen: torch.Generator) -> tuple[MLAAttention, Linear]:
    layer = MLAAttention(HEADS, LORA, NOPE, ROPE, V, scale=(NOPE + ROPE) ** -0.5)
    kv_b = Linear(LORA, HEADS * (NOPE + V))
    kv_b.weight.data = torch.randn(HEADS * (NOPE + V), LORA, generator=gen) * LORA ** -0.5
    layer.absorb(kv_b.weight.data)
    return layer, kv_b


def _reference(q_nope, q_pe, latents, cached, kv_b_weight, scale) -> torch.Tensor:
    """Dense causal attention of the new queries over every position's up-projected K / V, in float64."""
    kv = (latents[:, :LORA].double() @ kv_b_weight.double().T).view(-1, HEADS, NOPE + V)
    keys = torch.cat((kv[..., :NOPE], latents[:, None, LORA:].double().expand(-1, HEADS, -1)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).double()
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    visible = torch.arange(latents.shape[0])[None, :] <= torch.arange(cached, cached + q.shape[0])[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, kv[..., NOPE:])


def _step(backend, dtype: torch.dtype, seed: int = 0):
    """One mixed step on a fresh latent cache: the layer's output (decode rows absorbed), every row attended
    expanded over the latents as the cache holds them, and the float64 reference; and the metadata."""
    gen = torch.Generator().manual_seed(seed)
    layer, kv_b = _layer(gen)
    lengths = [cached + new for cached, new in ROWS]
    num_blocks = sum(-(-n // BS) for n in lengths) + 1
    spec = layer.kv_cache_spec(BS, dtype)
    cache = spec.view(torch.zeros(spec.page_bytes * num_blocks, dtype=torch.uint8), num_blocks)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, slots, q_nope, q_pe, latents, used = [], [], [], [], [], 0
    for (cached, new), n in zip(ROWS, lengths):
        table = ids[used:used + -(-n // BS)]
        used += len(table)
        tables.append(table)
        positions = [table[p // BS] * BS + p % BS for p in range(n)]
        latent = torch.randn(n, LORA + ROPE, generator=gen)
        if cached:  # the context a previous step wrote
            cache.write(latent[:cached, None], latent[:cached, None], torch.tensor(positions[:cached]))
        slots += positions[cached:]
        q_nope.append(torch.randn(new, HEADS, NOPE, generator=gen))
        q_pe.append(torch.randn(new, HEADS, ROPE, generator=gen))
        latents.append(latent[cached:])
    width = max(len(t) for t in tables)
    meta = one_group(backend, ROWS, torch.tensor([t + [0] * (width - len(t)) for t in tables]), torch.tensor(slots),
                     BS, views=[layer.spec.decode_view])
    out = layer(torch.cat(q_nope), torch.cat(q_pe), torch.cat(latents), cache, meta, kv_b)
    # The reference reads the latents as the cache holds them (quantized dtypes round them).
    stored = [cache.gather(torch.tensor(t), torch.float32)[0].reshape(-1, LORA + ROPE)[:n]
              for t, n in zip(tables, lengths)]
    expanded = torch.cat([layer._expanded(qn, qp, s, n, kv_b) for qn, qp, s, n in zip(q_nope, q_pe, stored, lengths)])
    reference = torch.cat([_reference(qn, qp, s, cached, kv_b.weight.data, layer.spec.scale)
                           for qn, qp, s, (cached, _) in zip(q_nope, q_pe, stored, ROWS)])
    return out, expanded, reference, meta


@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=["f32", "e4m3", "int8"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_absorbed_decode_equals_expanded_attention(backend, dtype):
    out, expanded, reference, meta = _step(BACKENDS[backend](), dtype)
    decoding = [row for row, (cached, new) in enumerate(ROWS) if cached and new == 1]
    assert meta.decode.token_idx.tolist() == [sum(new for _, new in ROWS[:row]) for row in decoding]
    torch.testing.assert_close(out, expanded, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)


def test_backends_agree_on_absorbed_decode():
    outs = [_step(cls(), torch.float32)[0] for cls in BACKENDS.values()]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_latent_cache_is_one_plane_read_by_the_c_kernel():
    """K and V views share the latent's memory, a page holds one latent per position, and the CPU
    backend's decode kernel accepts the view (each plane dense)."""
    spec = MLAAttentionSpec(BS, 1, LORA + ROPE, torch.float32)
    assert spec.page_bytes == BS * (LORA + ROPE) * 4
    assert MLAAttentionSpec(16, 1, 576, torch.bfloat16).page_bytes == 16 * 576 * 2  # DeepSeek-V3: 1152 B/token
    assert MLAAttentionSpec(16, 1, 576, torch.int8).page_bytes == 16 * 576 * (1 + 2 / 32)
    cache = spec.view(torch.zeros(spec.page_bytes * 3, dtype=torch.uint8), 3)
    cache.write(torch.ones(1, 1, LORA + ROPE), torch.ones(1, 1, LORA + ROPE), torch.tensor([5]))
    assert cache.data[0].data_ptr() == cache.data[1].data_ptr()
    assert cache.data[1, 1, 1].eq(1).all() and cache.data[0].sum() == LORA + ROPE
    assert _decode_kernel(torch.zeros(1, HEADS, LORA + ROPE), cache) is not None


def test_softmax_scale_takes_yarn_mscale_all_dim_squared():
    config = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}
    mscale = 0.1 * math.log(40.0) + 1.0
    assert mla_softmax_scale(config) == pytest.approx(192 ** -0.5 * mscale ** 2)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    assert mla_softmax_scale(config) == pytest.approx(192 ** -0.5)
