"""DeepSeek's routing (layers/moe_routing.py) against a per-token reference written from the definition,
over random logits: softmax / sigmoid, correction bias, group-limited top-k (best-one and best-two group
scores), renormalization and the routed scaling factor; refusals name the config key."""
from __future__ import annotations

import pytest
import torch

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.moe_routing import Router, Routing, route

E, T = 16, 40


def _reference(logits: torch.Tensor, r: Routing, bias: torch.Tensor | None) -> list[dict[int, float]]:
    """Per token: {expert: weight}, one token and one group at a time."""
    out = []
    per_group = r.num_experts // r.n_group
    for row in logits.double():
        scores = torch.softmax(row, 0) if r.scoring == "softmax" else torch.sigmoid(row)
        choice = (scores + bias.double() if bias is not None else scores).tolist()
        groups = [choice[g * per_group:(g + 1) * per_group] for g in range(r.n_group)]
        rank = [sum(sorted(g)[-2:]) if r.group_by_top2 else max(g) for g in groups]
        kept = sorted(range(r.n_group), key=lambda g: rank[g], reverse=True)[:r.topk_group]
        allowed = [e for e in range(r.num_experts) if e // per_group in kept]
        chosen = sorted(allowed, key=lambda e: choice[e], reverse=True)[:r.top_k]
        weights = {e: float(scores[e]) for e in chosen}
        total = sum(weights.values())
        out.append({e: w / (total if r.renormalize else 1.0) * r.scaling_factor for e, w in weights.items()})
    return out


ROUTINGS = {
    "v2-greedy": (Routing(E, 4, "softmax", scaling_factor=1.5), False),
    "v2-group-limited": (Routing(E, 4, "softmax", n_group=4, topk_group=2, renormalize=True), False),
    "v3-noaux": (Routing(E, 6, "sigmoid", n_group=4, topk_group=2, renormalize=True, scaling_factor=2.5,
                         group_by_top2=True), True),
    "glm-one-group": (Routing(E, 4, "sigmoid", renormalize=True, scaling_factor=1.8, group_by_top2=True), True),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_route_matches_per_token_reference(name):
    routing, with_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=gen) * 2
    bias = torch.randn(E, generator=gen) * 0.5 if with_bias else None
    weights, ids = route(logits, routing, bias)
    assert weights.dtype == torch.float32 and ids.shape == (T, routing.top_k)
    for t, expected in enumerate(_reference(logits, routing, bias)):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert got.keys() == expected.keys(), f"token {t}"
        for e, w in expected.items():
            assert got[e] == pytest.approx(w, abs=1e-6)


def test_bias_chooses_but_does_not_weigh():
    """A large bias on expert 0 forces it in; its weight is still its own unbiased score."""
    routing = Routing(E, 2, "sigmoid", group_by_top2=True)
    logits = torch.randn(T, E)
    bias = torch.zeros(E)
    bias[0] = 100.0
    weights, ids = route(logits, routing, bias)
    assert (ids == 0).any(dim=-1).all()
    picked = weights[ids == 0]
    torch.testing.assert_close(picked, torch.sigmoid(logits[:, 0]))


def test_router_module_routes_its_logits():
    router = Router(8, Routing(E, 3, "sigmoid", n_group=4, topk_group=2, group_by_top2=True), correction_bias=True)
    router.weight.data.normal_()
    router.e_score_correction_bias.data.normal_()
    x = torch.randn(5, 8)
    weights, ids = router.route(x)
    expected_w, expected_ids = route(x @ router.weight.T, router.routing, router.e_score_correction_bias)
    assert torch.equal(ids, expected_ids) and torch.allclose(weights, expected_w)


@pytest.mark.parametrize("kwargs, message", [
    ({"scoring": "tanh"}, "scoring_func='tanh'"),
    ({"top_k": 17}, "num_experts_per_tok=17"),
    ({"n_group": 3}, "n_group=3 must be >= 1 and divide n_routed_experts=16"),
    ({"n_group": 4, "topk_group": 5}, "topk_group=5 must be between 1 and n_group=4"),
    ({"n_group": 8, "topk_group": 1, "top_k": 4}, "must hold num_experts_per_tok=4"),
])
def test_bad_routing_config_is_refused_by_key(kwargs, message):
    with pytest.raises(UnsupportedCheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Routing(**{"num_experts": E, "top_k": 2, **kwargs})
