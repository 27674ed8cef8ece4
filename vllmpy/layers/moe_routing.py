"""DeepSeek's expert routing (V2, V3, Kimi K2, GLM-4.7-Flash): scores, group-limited top-k, scaled weights.

- scoring: softmax over the experts (V2) or an independent sigmoid per expert (V3).
- e_score_correction_bias (V3's aux-loss-free balancing) is added to the scores only to *choose*
  experts; the weights are the unbiased scores of the chosen ones.
- group-limited: the experts form n_group equal groups; a group's score is its best expert (no bias)
  or the sum of its best two (with bias), and only the topk_group best groups may be chosen from.
- norm_topk_prob renormalizes the k weights to sum 1; routed_scaling_factor then scales them.
The result feeds `Experts.forward(x, weights, ids)`: all tensor ops over the batch, no loop per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllmpy.errors import UnsupportedCheckpointError
from vllmpy.layers.linear import Linear

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = False
    scaling_factor: float = 1.0
    # Group scores from the best two experts (V3's rule, used with the correction bias) instead of the best one.
    group_by_top2: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise UnsupportedCheckpointError(
                f"config scoring_func={self.scoring!r} is not supported; supported: {', '.join(SCORING_FUNCS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise UnsupportedCheckpointError(
                f"config num_experts_per_tok={self.top_k} must be between 1 and n_routed_experts={self.num_experts}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise UnsupportedCheckpointError(
                f"config n_group={self.n_group} must be >= 1 and divide n_routed_experts={self.num_experts}")
        per_group = self.num_experts // self.n_group
        if not 0 < self.topk_group <= self.n_group or self.top_k > self.topk_group * per_group:
            raise UnsupportedCheckpointError(
                f"config topk_group={self.topk_group} must be between 1 and n_group={self.n_group}, and its groups "
                f"must hold num_experts_per_tok={self.top_k} experts ({per_group} per group)")


def route(logits: torch.Tensor, routing: Routing,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k])."""
    logits = logits.float()
    scores = logits.softmax(dim=-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if routing.topk_group < routing.n_group:
        grouped = choice.view(-1, routing.n_group, routing.num_experts // routing.n_group)
        best = grouped.topk(2, dim=-1).values.sum(-1) if routing.group_by_top2 else grouped.amax(-1)
        groups = best.topk(routing.topk_group, dim=-1).indices
        allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
        choice = grouped.masked_fill(~allowed[..., None], float("-inf")).view_as(choice)
    ids = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling_factor, ids


class Router(Linear):
    """The gate: `weight` [E, hidden] (checkpoint `mlp.gate.weight`) and, for V3, its
    `e_score_correction_bias` [E]; forward returns the routing of every token."""

    def __init__(self, hidden: int, routing: Routing, correction_bias: bool) -> None:
        super().__init__(hidden, routing.num_experts)
        self.routing = routing
        self.e_score_correction_bias = (nn.Parameter(torch.empty(routing.num_experts), requires_grad=False)
                                        if correction_bias else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(super().forward(x), self.routing, self.e_score_correction_bias)
