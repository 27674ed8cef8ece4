"""RMSNorm variants, computed in fp32 as the reference implementations do."""
from __future__ import annotations

import torch
from torch import nn

from vllmpy.kernels import layer_kernels


def _rms_norm_kernel(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The C kernel's float32 RMSNorm on CPU (one call instead of seven torch ops; it rounds the mean
    of squares once, so it can differ from torch's float sum in the last bit), else None."""
    lib = layer_kernels()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or scale.dtype != torch.float32
            or scale.shape != x.shape[-1:]):
        return None
    x = x.contiguous()
    y = torch.empty_like(x)
    dim = x.shape[-1]
    lib.vq_rms_norm(x.data_ptr(), scale.data_ptr(), y.data_ptr(), x.numel() // dim, dim, eps, torch.get_num_threads())
    return y


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in float32: the torch path both variants scale afterwards."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Llama-style: normalize in fp32, cast back, then scale by `weight`."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _rms_norm_kernel(x, self.weight, self.eps)
        if y is not None:
            return y
        return self.weight * _normalized(x, self.eps).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma-style: scale by (1 + weight) in fp32, then cast. The fp32 scale is computed once the
    weight is loaded (`finish_loading`)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        self.register_buffer("scale", None, persistent=False)

    def finish_loading(self) -> None:
        self.scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
        y = _rms_norm_kernel(x, scale, self.eps)
        if y is not None:
            return y
        return (_normalized(x, self.eps) * scale).to(x.dtype)


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
