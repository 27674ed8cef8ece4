"""RMSNorm variants, computed in fp32 as the reference implementations do."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama-style: normalize in fp32, cast back, then scale by `weight`."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma-style: scale by (1 + weight) in fp32, then cast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(dtype)


class LayerNorm(nn.Module):
    """Mean-centred norm in fp32: (x - mean) / std * weight (+ bias).

    `shape` (heads, head_dim) gives each head its own weight (Cohere and StableLM q/k norm);
    `bias=False` drops the shift (Cohere); `affine=False` has no parameters (some OPT checkpoints).
    """

    def __init__(self, shape: int | tuple[int, ...], eps: float = 1e-5, bias: bool = True, affine: bool = True) -> None:
        super().__init__()
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False) if affine else None
        self.bias = nn.Parameter(torch.empty(shape), requires_grad=False) if affine and bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, dim = x.dtype, x.shape[-1:]
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        if w is None or w.dim() == 1:
            return torch.nn.functional.layer_norm(x.float(), dim, w, b, self.eps).to(dtype)
        x = torch.nn.functional.layer_norm(x.float(), dim, eps=self.eps) * w
        return (x if b is None else x + b).to(dtype)


class PerHeadLayerNorm(LayerNorm):
    """LayerNorm with one weight row per head; StableLM checkpoints store row h as `norms.{h}.weight`."""

    def __init__(self, shape: tuple[int, int], eps: float = 1e-5, bias: bool = False) -> None:
        super().__init__(shape, eps, bias)
        self.shard_offsets = {head: (head, 1) for head in range(shape[0])}

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> None:
        target = param.data if shard_id is None else param.data[shard_id]
        if target.shape != loaded.shape:
            raise ValueError(f"shape mismatch for head {shard_id}: parameter {tuple(target.shape)} "
                             f"vs checkpoint {tuple(loaded.shape)}")
        target.copy_(loaded)
