"""Packed experts in one C call (layers/packed_experts.py): bit-identical to one packed_linear per expert."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.gguf.test_packed_kernels import random_blocks
from vllmpy.layers.moe import Experts
from vllmpy.layers.packed_experts import MAX_ROWS, PackedExperts, takes_rows
from vllmpy.layers.quantized import PackedTensor, packed_linear

EXPERTS, HIDDEN, INTER = 8, 256, 256


def _packed(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> PackedTensor:
    return PackedTensor.from_numpy(random_blocks(qtype, rows, cols, rng), int(qtype), (rows, cols))


def _experts(gate_up: Q, down: Q, seed: int = 0) -> Experts:
    """Experts whose stacks are packed per expert, as ExpertLinear.finish_loading leaves GGUF stacks."""
    rng = np.random.default_rng(seed)
    experts = Experts(EXPERTS, HIDDEN, INTER, "silu")
    for linear, qtype, (rows, cols) in ((experts.gate_up_proj, gate_up, (2 * INTER, HIDDEN)),
                                        (experts.down_proj, down, (HIDDEN, INTER))):
        linear.packed = [[_packed(qtype, rows, cols, rng)] for _ in range(EXPERTS)]
        linear.packed_experts = PackedExperts.build(linear.packed)
    return experts


@pytest.mark.parametrize(("gate_up", "down"), [(Q.Q8_0, Q.Q8_0), (Q.Q5_0, Q.Q6_K), (Q.Q4_K, Q.Q4_0)],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2, 3])
def test_one_call_equals_the_per_expert_loop(gate_up, down, tokens):
    experts = _experts(gate_up, down)
    assert experts.gate_up_proj.packed_experts is not None and experts.down_proj.packed_experts is not None
    torch.manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN)
    weights, ids = torch.rand(tokens, 4).softmax(-1), torch.stack([torch.randperm(EXPERTS)[:4] for _ in range(tokens)])
    one_call = experts(x, weights, ids)
    experts.gate_up_proj.packed_experts = experts.down_proj.packed_experts = None
    loop = experts(x, weights, ids)
    assert torch.equal(one_call, loop)
    assert one_call.abs().sum() > 0


def test_matmul_takes_each_experts_rows_and_declines_past_max_rows():
    rng = np.random.default_rng(1)
    weights = [_packed(Q.Q8_0, 64, HIDDEN, rng) for _ in range(4)]
    table = PackedExperts.build([[w] for w in weights])
    counts = torch.tensor([2, 0, 1, MAX_ROWS])
    x = torch.randn(int(counts.sum()), HIDDEN)
    y = table.matmul(x, counts)
    starts = [0, *counts.cumsum(0).tolist()]
    for e, w in enumerate(weights):
        rows = x[starts[e]:starts[e + 1]]
        if len(rows):
            assert torch.equal(y[starts[e]:starts[e + 1]], packed_linear(rows, w))
    assert table.matmul(torch.randn(MAX_ROWS + 1, HIDDEN), torch.tensor([MAX_ROWS + 1, 0, 0, 0])) is None
    assert takes_rows(x, counts) and not takes_rows(torch.randn(MAX_ROWS + 1, HIDDEN), torch.tensor([MAX_ROWS + 1]))


def test_no_table_where_the_loop_would_take_another_path():
    rng = np.random.default_rng(2)
    same = [[_packed(Q.Q8_0, 64, HIDDEN, rng)] for _ in range(2)]
    assert PackedExperts.build(same) is not None
    assert PackedExperts.build([*same, [_packed(Q.Q8_0, 32, HIDDEN, rng)]]) is None  # another shape
    assert PackedExperts.build([[_packed(Q.Q8_0, 32, HIDDEN, rng)] * 2]) is None  # two segments
    assert PackedExperts.build([[_packed(Q.F16, 64, HIDDEN, rng)]]) is None  # few rows go to block_fma.c
